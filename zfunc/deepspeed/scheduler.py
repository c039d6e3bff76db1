"""DeepSpeed's ``scheduler`` section -> a schedule giving each update the rate DeepSpeed would.

DeepSpeed's schedulers set the first update's rate when they are built
(``last_batch_iteration = -1``) and step once after every applied update
(not after an update skipped for an fp16 overflow), so update ``c`` (from 0)
runs at ``get_lr()`` evaluated at ``last_batch_iteration = c - 1``. zfunc's
schedules take ``count`` = updates applied before this one (also not
counting skipped ones), so the mapping is exact:

=================  ========================================================================
DeepSpeed          rate of update ``c``
=================  ========================================================================
WarmupLR           ``warmup_min_lr`` if c = 0, else ``zf.optim.warmup(...)(c - 1)``: the
                   first two updates both run at ``warmup_min_lr``
WarmupDecayLR      likewise with ``zf.optim.warmup_decay``
WarmupCosineLR     0 if c = 0 (DeepSpeed's scheduler has no rate before it starts), else
                   ``zf.optim.warmup_cosine_ratio(optimizer lr, ...)(c - 1)``
OneCycle           ``zf.optim.linear_one_cycle(...)(c)`` (its formula counts from 1 already)
LRRangeTest        ``zf.optim.lr_range_test(...)(c)`` (likewise)
=================  ========================================================================
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from zfunc import optim
from zfunc.deepspeed.optimizer import OptimizerSpec
from zfunc.deepspeed.report import DeepSpeedConfigError, Section
from zfunc.optim.schedules import Schedule, tensor_ops_only

_OTHER_SCHEDULERS = "build the schedule with zf.optim (constant, warmup, warmup_cosine, one_cycle, ...)"


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """The mapped scheduler: ``schedule`` (count -> rate), whether it scales the optimizer's own
    ``lr`` (WarmupCosineLR) and a description for the report."""

    schedule: Schedule
    uses_optimizer_lr: bool
    description: str


def deepspeed_timing(get_lr: Schedule, first_lr: float) -> Schedule:
    """``first_lr`` for update 0, ``get_lr(c - 1)`` for update ``c >= 1`` (see the module doc)."""

    def schedule(count: torch.Tensor) -> torch.Tensor:
        previous = get_lr((count - 1).clamp(min=0))
        return torch.where(count == 0, torch.full_like(previous, first_lr), previous)

    return tensor_ops_only(schedule)  # (a CUDA graph may capture it: `zfunc.optim.update_graph`)


def read_scheduler(section: Section, optimizer: OptimizerSpec | None,
                   optimizer_lr: Any) -> ScheduleSpec | None:
    """Read and report the ``scheduler`` section; None when the config has none.

    ``optimizer_lr``: a function returning the peak rate WarmupCosineLR scales
    (the optimizer's ``lr``), called only for that scheduler.
    """
    if not section.data:
        return None
    name = section.value("type")
    params = section.section("params")
    readers = {"WarmupLR": _warmup, "WarmupDecayLR": _warmup_decay, "WarmupCosineLR": _warmup_cosine,
               "OneCycle": _one_cycle, "LRRangeTest": _lr_range_test}
    if name not in readers:
        raise section.error("type", f"{name!r} is not a DeepSpeed scheduler zfunc maps (WarmupLR, WarmupDecayLR, "
                                    f"WarmupCosineLR, OneCycle, LRRangeTest); {_OTHER_SCHEDULERS}")
    last = params.value("last_batch_iteration", -1)
    if last != -1:
        raise params.error("last_batch_iteration", f"{last!r}: resuming a schedule mid-way; zfunc's schedule "
                                                   "follows the optimizer's own step count, which a zfunc "
                                                   "checkpoint restores. Remove the key")
    params.mapped("last_batch_iteration", "-1: the schedule starts at the first update")
    try:
        spec = readers[name](params, optimizer, optimizer_lr)
    except ValueError as err:
        if isinstance(err, DeepSpeedConfigError):
            raise
        raise DeepSpeedConfigError(params.path, str(err)) from None
    section.mapped("type", spec.description)
    return spec


def _number(params: Section, key: str, default: Any = ..., *, integer: bool = False) -> Any:
    value = params.value(key) if default is ... else params.value(key, default)
    if isinstance(value, (list, tuple)):
        raise params.error(key, f"{value!r}: one value per parameter group; zfunc has one learning rate for "
                                "all parameters, give a single number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise params.error(key, f"must be a finite number, got {value!r}")
    if integer:
        if value != int(value):
            raise params.error(key, f"must be a whole number of steps, got {value!r}")
        return int(value)
    return float(value)


def _warmup_type(params: Section) -> str:
    kind = params.value("warmup_type", "log")
    if kind not in ("log", "linear"):
        raise params.error("warmup_type", f"{kind!r}: must be 'log' or 'linear' (DeepSpeed would fall back to "
                                          "'log' with a warning; write that if you mean it)")
    return kind


def _report(params: Section, keys: tuple[str, ...], to: str) -> None:
    for key in keys:
        params.mapped(key, to)


def _warmup(params: Section, optimizer, optimizer_lr) -> ScheduleSpec:
    low, peak = _number(params, "warmup_min_lr", 0.0), _number(params, "warmup_max_lr", 0.001)
    steps, kind = _number(params, "warmup_num_steps", 1000, integer=True), _warmup_type(params)
    schedule = deepspeed_timing(optim.warmup(peak, steps, min_lr=low, warmup_type=kind), low)
    _report(params, ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
            "zf.optim.warmup(...), one update later as in DeepSpeed")
    return ScheduleSpec(schedule, False, f"WarmupLR: {kind} warmup {low:g} -> {peak:g} over {steps} updates")


def _warmup_decay(params: Section, optimizer, optimizer_lr) -> ScheduleSpec:
    low, peak = _number(params, "warmup_min_lr", 0.0), _number(params, "warmup_max_lr", 0.001)
    steps, kind = _number(params, "warmup_num_steps", 1000, integer=True), _warmup_type(params)
    total = _number(params, "total_num_steps", integer=True)
    get_lr = optim.warmup_decay(peak, steps, total, min_lr=low, warmup_type=kind)
    _report(params, ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
            "zf.optim.warmup_decay(...), one update later as in DeepSpeed")
    return ScheduleSpec(deepspeed_timing(get_lr, low), False,
                        f"WarmupDecayLR: {kind} warmup {low:g} -> {peak:g} over {steps}, linear decay to {total}")


def _warmup_cosine(params: Section, optimizer, optimizer_lr) -> ScheduleSpec:
    steps, kind = _number(params, "warmup_num_steps", 1000, integer=True), _warmup_type(params)
    total = _number(params, "total_num_steps", integer=True)
    low_ratio, end_ratio = _number(params, "warmup_min_ratio", 0.0), _number(params, "cos_min_ratio", 0.0001)
    peak = optimizer_lr()
    get_lr = optim.warmup_cosine_ratio(peak, steps, total, warmup_min_ratio=low_ratio, cos_min_ratio=end_ratio,
                                       warmup_type=kind)
    _report(params, ("warmup_num_steps", "warmup_type", "total_num_steps", "warmup_min_ratio", "cos_min_ratio"),
            "zf.optim.warmup_cosine_ratio(...), one update later as in DeepSpeed")
    return ScheduleSpec(deepspeed_timing(get_lr, 0.0), True,
                        f"WarmupCosineLR: {kind} warmup to {peak:g} over {steps}, cosine to {total}")


def _one_cycle(params: Section, optimizer: OptimizerSpec | None, optimizer_lr) -> ScheduleSpec:
    low, peak = _number(params, "cycle_min_lr"), _number(params, "cycle_max_lr")
    first = _number(params, "cycle_first_step_size", 2000, integer=True)
    second_raw = params.value("cycle_second_step_size", None)
    second = None if second_raw is None else _number(params, "cycle_second_step_size", integer=True)
    rate, every = _number(params, "decay_lr_rate", 0.0), _number(params, "decay_step_size", 0, integer=True)
    schedule = optim.linear_one_cycle(low, peak, first, second, decay_rate=rate, decay_steps=every)
    _report(params, ("cycle_min_lr", "cycle_max_lr", "cycle_first_step_size", "cycle_second_step_size",
                     "decay_lr_rate", "decay_step_size"), "zf.optim.linear_one_cycle(...)")
    for key in ("cycle_first_stair_count", "cycle_second_stair_count"):
        params.ignored(key, "DeepSpeed's OneCycle reads it but never uses it: the schedule is the same")
    _momentum(params, optimizer)
    return ScheduleSpec(schedule, False, f"OneCycle: {low:g} -> {peak:g} -> {low:g} over {first}+"
                                         f"{first if second is None else second} updates")


def _momentum(params: Section, optimizer: OptimizerSpec | None) -> None:
    """DeepSpeed's OneCycle also cycles beta1 (and sets beta2 to 0.99) of optimizers with betas,
    unless cycle_momentum is false; zfunc's optimizers take fixed betas."""
    cycles = params.value("cycle_momentum", True)
    knobs = ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate")
    if cycles and (optimizer is None or optimizer.has_betas):
        whose = "your optimizer's betas" if optimizer is None else f"the betas of {optimizer.kind}"
        raise params.error("cycle_momentum", (
            f"{'true (its default)' if 'cycle_momentum' not in params else 'true'}: DeepSpeed's OneCycle would "
            f"cycle beta1 of {whose} between cycle_min_mom and cycle_max_mom (and set beta2 to 0.99); zfunc's "
            "optimizers take fixed betas. Set \"cycle_momentum\": false"))
    if cycles:
        params.mapped("cycle_momentum", "true, no effect: DeepSpeed cycles only Adam-style betas, and SGD has none")
        why = "no effect: SGD has no betas to cycle (DeepSpeed skips it too)"
    else:
        params.mapped("cycle_momentum", "false: fixed momentum")
        why = "no effect with cycle_momentum false (in DeepSpeed too)"
    for key in knobs:
        params.ignored(key, why)


def _lr_range_test(params: Section, optimizer, optimizer_lr) -> ScheduleSpec:
    low = _number(params, "lr_range_test_min_lr", 1e-3)
    size = _number(params, "lr_range_test_step_size", 2000, integer=True)
    rate = _number(params, "lr_range_test_step_rate", 1.0)
    stairs = params.value("lr_range_test_staircase", False)
    if not isinstance(stairs, bool):
        raise params.error("lr_range_test_staircase", f"must be true or false, got {stairs!r}")
    schedule = optim.lr_range_test(low, size, rate, staircase=stairs)
    _report(params, ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                     "lr_range_test_staircase"), "zf.optim.lr_range_test(...)")
    return ScheduleSpec(schedule, False, f"LRRangeTest: {low:g} × (1 + {rate:g} × updates / {size})")
