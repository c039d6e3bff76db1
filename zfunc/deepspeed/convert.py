"""`from_config`: a DeepSpeed config -> the zfunc stack, optimizer and batch sizes it describes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as torch_dist

from zfunc import optim
from zfunc.deepspeed.auto import TrainingArgs, fill_auto, hidden_size_of
from zfunc.deepspeed.optimizer import OptimizerSpec, build_optimizer, read_lr, read_optimizer
from zfunc.deepspeed.report import DeepSpeedConfigError, Report, ReportBuilder, Section
from zfunc.deepspeed.scheduler import ScheduleSpec, read_scheduler
from zfunc.deepspeed.sections import (
    read_activation_checkpointing,
    read_batch,
    read_clipping,
    read_other,
    read_precision,
)
from zfunc.deepspeed.source import read_config
from zfunc.deepspeed.stack import ORDER, TransformCall, build_stack, check_order, constructor
from zfunc.deepspeed.zero import read_zero
from zfunc.optim.base import GradientTransformation
from zfunc.optim.schedules import Schedule


@dataclasses.dataclass(frozen=True)
class DeepSpeedSetup:
    """What a DeepSpeed config asks for, in zfunc's terms (returned by `from_config`).

    Fields:
      transforms: the transform stack as data, innermost first (`TransformCall`:
        name, keyword arguments, and the DeepSpeed key of each); `wrap` builds it.
      optimizer: the ``zf.optim`` optimizer (clipping first when
        ``gradient_clipping > 0``, the schedule inside), or None when the config
        has no ``optimizer`` section (bring your own; use ``schedule``).
      schedule: the learning-rate schedule of the ``scheduler`` section (already
        inside ``optimizer``), or None.
      micro_batch_size: examples per rank per forward/backward
        (``train_micro_batch_size_per_gpu``).
      micro_batches: micro-batches per update (``gradient_accumulation_steps``):
        each call of the wrapped step takes ``micro_batch_size × micro_batches``
        examples per rank and `accumulate` splits them.
      train_batch_size: examples per update over all ranks.
      world_size: the number of ranks the batch sizes were computed for.
      gradient_clipping: the global-norm clip (0: none).
      report: how each key of the config was mapped (`Report`; ``print`` it).
    """

    transforms: tuple[TransformCall, ...]
    optimizer: GradientTransformation | None
    schedule: Schedule | None
    micro_batch_size: int
    micro_batches: int
    train_batch_size: int
    world_size: int
    gradient_clipping: float
    report: Report = dataclasses.field(repr=False)

    def wrap(self, train_step: Callable) -> Callable:
        """``train_step`` inside the stack, in zfunc's order::

            shard(offload(checkpoint(mixed_precision(accumulate(step, micro_batches=k), policy, ...))), stage=s)

        (only the transforms the config asks for). Raises NotImplementedError
        naming the DeepSpeed key when the installed zfunc lacks a planned
        keyword (see `zfunc.deepspeed.stack`)."""
        return build_stack(self.transforms, train_step)

    def transform(self, name: str) -> TransformCall | None:
        """The planned call of transform ``name`` (e.g. ``"offload"``), or None if the stack has none."""
        return next((call for call in self.transforms if call.name == name), None)

    def __str__(self) -> str:
        stack = "train_step"
        for call in self.transforms:
            args = str(call)[len(call.name) + len("(step"):-1]
            stack = f"{call.name}({stack}{args})"
        lines = [f"stack:      {stack}",
                 f"optimizer:  {_describe_optimizer(self.optimizer)}",
                 f"batch:      {self.train_batch_size} per update = {self.micro_batch_size} per micro-batch × "
                 f"{self.micro_batches} micro-batches × {self.world_size} ranks",
                 str(self.report)]
        return "\n".join(lines)


def _describe_optimizer(tx: GradientTransformation | None) -> str:
    if tx is None:
        return "none in the config (bring your own)"
    names = [part.hyperparams["name"] for part in tx.hyperparams.get("transforms", (tx,))] \
        if tx.hyperparams and tx.hyperparams["name"] == "chain" else [tx.hyperparams["name"]]
    return " -> ".join(names)


def from_config(config: Mapping | str | os.PathLike, model: Any = None, *, world_size: int | None = None,
                training_args: Any = None, hidden_size: int | None = None, checkpoint_modules: Any = None,
                ignore: tuple[str, ...] | list[str] = (), **training_kwargs: Any) -> DeepSpeedSetup:
    """Translate a DeepSpeed config into the zfunc stack, optimizer and batch sizes it describes.

    Args:
      config: a dict, or the path of a JSON (or, with ``hjson`` installed, HJSON) file.
      model: the model (optional); its ``config.hidden_size`` fills Hugging Face's
        ``"auto"`` bucket sizes (which zfunc then ignores: it has no buckets).
      world_size: ranks of data parallelism; default: the initialized process
        group's size, else ``$WORLD_SIZE``, else 1.
      training_args: fills ``"auto"`` values: a Hugging Face ``TrainingArguments``,
        any object with those attribute names, or a dict (see `TrainingArgs`).
      hidden_size: instead of ``model``.
      checkpoint_modules: ``modules=`` of the `checkpoint` transform that an
        ``activation_checkpointing`` section turns on (default: the model's
        repeated blocks).
      ignore: dotted keys your own code reads (reported as ignored, not mapped).
      **training_kwargs: `TrainingArgs` fields (e.g. ``learning_rate=3e-4,
        max_steps=1000``), overriding ``training_args``.
    Returns:
      A `DeepSpeedSetup`: ``setup.wrap(train_step)``, ``setup.optimizer``,
      batch sizes, and ``setup.report`` (every key: mapped to what, or ignored
      and why).
    Raises:
      DeepSpeedConfigError: a key zfunc cannot honour (named, with what to do),
        an ``"auto"`` nothing fills, or inconsistent batch sizes.
    """
    raw = read_config(config)
    args = TrainingArgs.resolve(training_args, training_kwargs)
    world = _world_size(world_size)
    builder = ReportBuilder(raw, tuple(ignore))
    cfg = builder.without_ignored(raw)
    cfg, hints = fill_auto(cfg, args, hidden_size_of(model, hidden_size), world, builder)
    root = Section(cfg, "", builder, hints)

    batch = read_batch(root, world)
    stage, zero_calls = read_zero(root, world)
    opt_section = root.section("optimizer")
    spec = read_optimizer(opt_section, zero_stage=stage)
    precision = read_precision(root, stage, fused_adam=spec is not None and spec.fused_adam)
    checkpointing = read_activation_checkpointing(root, checkpoint_modules)
    clip = read_clipping(root)
    schedule = read_scheduler(root.section("scheduler"), spec, lambda: _peak_lr(opt_section, spec, args))
    optimizer = _optimizer(opt_section, spec, schedule, clip)
    read_other(root)
    report = builder.finish()

    accumulate = (TransformCall("accumulate", {"micro_batches": batch.accumulation},
                                {"micro_batches": "gradient_accumulation_steps"}),) if batch.accumulation > 1 else ()
    calls = tuple(c for c in (*accumulate, precision, checkpointing, *zero_calls) if c is not None)
    calls = tuple(sorted(calls, key=lambda c: ORDER.index(c.name)))
    check_order(calls)
    _validate(calls)
    return DeepSpeedSetup(calls, optimizer, None if schedule is None else schedule.schedule, batch.micro,
                          batch.accumulation, batch.train, world, clip, report)


def _world_size(world_size: int | None) -> int:
    if world_size is None:
        if torch_dist.is_available() and torch_dist.is_initialized():
            return torch_dist.get_world_size()
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _peak_lr(opt_section: Section, spec: OptimizerSpec | None, args: TrainingArgs) -> float:
    """The optimizer's own rate, which WarmupCosineLR scales."""
    if spec is not None:
        return read_lr(opt_section)
    if args.learning_rate is None:
        raise DeepSpeedConfigError("scheduler.type", "WarmupCosineLR scales the optimizer's own learning rate, "
                                                     "and the config has no optimizer section: pass "
                                                     "learning_rate= to from_config")
    return float(args.learning_rate)


def _optimizer(opt_section: Section, spec: OptimizerSpec | None, schedule: ScheduleSpec | None,
               clip: float) -> GradientTransformation | None:
    params = opt_section.section("params")
    if spec is None:
        return None
    if schedule is None:
        lr = read_lr(opt_section)
        params.mapped("lr", f"learning rate {lr:g} (no scheduler)")
    elif schedule.uses_optimizer_lr:
        lr = schedule.schedule
        params.mapped("lr", "the peak rate WarmupCosineLR scales")
    else:
        lr = schedule.schedule
        params.ignored("lr", "the scheduler sets the rate of every update (in DeepSpeed too)")
    tx = build_optimizer(spec, lr)
    return optim.chain(optim.clip_by_global_norm(clip), tx) if clip > 0 else tx


def _validate(calls: tuple[TransformCall, ...]) -> None:
    """Build every call the installed zfunc takes around a stand-in step, so bad values fail here,
    naming their keys. `offload` is left to `wrap`: its planned keywords may be newer than it."""
    for call in calls:
        if call.name == "offload":
            continue
        try:
            constructor(call.name)(_stand_in_step, **call.kwargs)
        except (ValueError, TypeError) as err:
            named = [source for keyword, source in call.sources.items() if keyword in str(err)]
            keys = named or list(call.sources.values())
            raise DeepSpeedConfigError(", ".join(dict.fromkeys(keys)), str(err)) from None


def _stand_in_step(state, batch):  # never called: only the transforms' argument checks run
    raise AssertionError("not a step")
