"""Learning-rate schedules: ``count (int64 0-d tensor) -> lr (float32 0-d tensor)``.

``count`` is the number of updates applied before this one, so the first
update uses ``schedule(0)``; this equals torch's ``LRScheduler.last_epoch``
when ``scheduler.step()`` is called after each ``optimizer.step()``. DeepSpeed's
schedulers are one update behind that: built before the first update, they
step after each one, so its update ``c`` runs at ``get_lr()`` of
``last_batch_iteration = c - 1`` (`zfunc.deepspeed` reproduces that timing;
each DeepSpeed-shaped schedule below says which one it follows).

Every schedule is built from tensor ops only (``torch.where``, ``clamp``,
``cos``, ``log``), never from Python branches on the value of ``count``: a
step compiled with ``torch.compile`` then sees one graph for all steps
instead of recompiling when a phase changes. Branches on the *arguments*
(fixed when the schedule is built) are fine.

Arithmetic is done in float64 and rounded to float32 once at the end, so the
result is the float32 rounding of what torch / DeepSpeed compute in Python
floats.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from numbers import Real

import torch

from zfunc.optim.checks import FLOAT32_MAX

Schedule = Callable[[torch.Tensor], torch.Tensor]
ScalarOrSchedule = float | Schedule

_F64 = torch.float64


def _check_nonnegative(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if value > FLOAT32_MAX:  # the rate is a float32: it would be inf
        raise ValueError(f"{name} = {value!r} does not fit in float32 (max {FLOAT32_MAX:.3g}), the dtype of the rate")
    return float(value)


def _check_steps(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (a number of steps), got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_min_le_peak(min_lr: float, peak_lr: float) -> None:
    if min_lr > peak_lr:
        raise ValueError(f"min_lr ({min_lr}) must not exceed peak_lr ({peak_lr}); swap them or lower min_lr")


def _to_lr(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def constant(lr: float) -> Schedule:
    """``lr(count) = lr`` for every count."""
    lr = _check_nonnegative("lr", lr)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        return torch.full((), lr, dtype=torch.float32, device=count.device)

    return schedule


def as_schedule(lr: ScalarOrSchedule) -> Schedule:
    """`constant(lr)` for a number; a callable as a schedule whose Python-number results become float32
    0-d tensors (``lambda count: 1e-3 * 0.99 ** float(count)`` works as written; tensors pass unchanged)."""
    if callable(lr):
        return lr if getattr(lr, "__module__", None) == __name__ else _tensor_rates(lr)
    return constant(lr)


def tensor_ops_only(schedule: Schedule) -> Schedule:
    """Mark a schedule made of tensor operations only, as this module's are (no host reads, no Python branch
    on the count): a CUDA graph may then capture it (`zfunc.optim.update_graph`). Returns ``schedule``."""
    schedule.tensor_ops_only = True
    return schedule


def user_callable(schedule: Schedule) -> bool:
    """Whether ``schedule`` is a user's callable (wrapped by `as_schedule`, or not made here at all, and not
    marked `tensor_ops_only`) rather than one of this module's schedules, which are tensor operations only
    (module docstring): a user's may read the count on the host (``float(count)``), so it cannot be captured
    in a CUDA graph and `zfunc.optim.update_graph` evaluates it on the host instead."""
    if getattr(schedule, "tensor_ops_only", False):
        return False
    return getattr(schedule, "__module__", None) != __name__ or hasattr(schedule, "__wrapped__")


def _tensor_rates(fn: Callable) -> Schedule:
    @functools.wraps(fn)
    def schedule(count: torch.Tensor) -> torch.Tensor:
        lr = fn(count)
        if isinstance(lr, torch.Tensor):
            return lr
        if isinstance(lr, Real) and not isinstance(lr, bool):
            return torch.full((), float(lr), dtype=torch.float32, device=count.device)
        raise TypeError(f"the learning-rate schedule {getattr(fn, '__name__', fn)!r} returned "
                        f"{type(lr).__name__}; a schedule maps the step count (an int64 0-d tensor) to a rate: "
                        "a number or a 0-d float tensor")

    schedule.__module__ = __name__  # wrapped once: as_schedule passes it through
    return schedule


def _deepspeed_warmup_gamma(c: torch.Tensor, warmup: int, warmup_type: str) -> torch.Tensor:
    """Fraction γ ∈ [0, 1) of (peak - min) reached at count c < warmup (DeepSpeed's WarmupLR)."""
    if warmup_type == "log":
        return torch.log(c + 1) / math.log(warmup)
    return c / warmup


def _check_warmup_type(warmup_type: str) -> None:
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


def warmup(peak_lr: float, warmup_steps: int, min_lr: float = 0.0, warmup_type: str = "log") -> Schedule:
    """DeepSpeed's ``WarmupLR``: from ``min_lr`` up to ``peak_lr``, then constant.

    With ``W = max(2, warmup_steps)`` (DeepSpeed never warms up over fewer
    than 2 steps) and ``c = count``::

        lr(c) = min_lr + (peak_lr - min_lr) * γ(c)
        γ(c)  = log(c + 1) / log(W)   if c < W and warmup_type == 'log'
                c / W                 if c < W and warmup_type == 'linear'
                1                     if c >= W

    so the first update uses ``min_lr``. ``lr(c)`` equals DeepSpeed's
    ``get_lr()`` at ``last_batch_iteration = c``.
    """
    peak_lr = _check_nonnegative("peak_lr", peak_lr)
    min_lr = _check_nonnegative("min_lr", min_lr)
    _check_min_le_peak(min_lr, peak_lr)
    warmup_steps = _check_steps("warmup_steps", warmup_steps)
    _check_warmup_type(warmup_type)
    w = max(2, warmup_steps)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = count.to(_F64)
        gamma = torch.where(c < w, _deepspeed_warmup_gamma(c, w, warmup_type), 1.0)
        return _to_lr(min_lr + (peak_lr - min_lr) * gamma)

    return schedule


def warmup_decay(peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
                 warmup_type: str = "log") -> Schedule:
    """DeepSpeed's ``WarmupDecayLR``: `warmup`, then linear decay to ``min_lr`` at ``total_steps``.

    With ``W = max(2, warmup_steps)``, ``T = total_steps``, ``c = count``::

        lr(c) = min_lr + (peak_lr - min_lr) * γ(c)
        γ(c)  = as in `warmup`                          if c < W
                max(0, (T - c) / max(1, T - W))        if c >= W

    so ``lr = min_lr`` from ``c = T`` on.
    """
    peak_lr = _check_nonnegative("peak_lr", peak_lr)
    min_lr = _check_nonnegative("min_lr", min_lr)
    _check_min_le_peak(min_lr, peak_lr)
    warmup_steps = _check_steps("warmup_steps", warmup_steps)
    total_steps = _check_steps("total_steps", total_steps, minimum=1)
    if total_steps < warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")
    _check_warmup_type(warmup_type)
    w = max(2, warmup_steps)
    decay_span = float(max(1, total_steps - w))

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = count.to(_F64)
        decay = ((total_steps - c) / decay_span).clamp(min=0.0)
        gamma = torch.where(c < w, _deepspeed_warmup_gamma(c, w, warmup_type), decay)
        return _to_lr(min_lr + (peak_lr - min_lr) * gamma)

    return schedule


def warmup_cosine(peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> Schedule:
    """Linear warmup from 0 to ``peak_lr``, then half a cosine down to ``min_lr``.

    With ``W = warmup_steps``, ``T = total_steps``, ``c = count``::

        lr(c) = peak_lr * c / W                                           if c < W
                min_lr + (peak_lr - min_lr) * (1 + cos(π p)) / 2,
                    p = min(1, (c - W) / max(1, T - W))                   if c >= W

    i.e. ``peak_lr`` at ``c = W`` and ``min_lr`` from ``c = T`` on (the
    Hugging Face ``get_cosine_schedule_with_warmup`` shape, with a floor).
    """
    peak_lr = _check_nonnegative("peak_lr", peak_lr)
    min_lr = _check_nonnegative("min_lr", min_lr)
    _check_min_le_peak(min_lr, peak_lr)
    warmup_steps = _check_steps("warmup_steps", warmup_steps)
    total_steps = _check_steps("total_steps", total_steps, minimum=1)
    if total_steps < warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must be >= warmup_steps ({warmup_steps})")
    decay_span = float(max(1, total_steps - warmup_steps))

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = count.to(_F64)
        # max(W, 1) only avoids 0/0 when W == 0; that branch is then never selected.
        warm = peak_lr * c / max(warmup_steps, 1)
        progress = ((c - warmup_steps) / decay_span).clamp(0.0, 1.0)
        cosine = min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + torch.cos(math.pi * progress))
        return _to_lr(torch.where(c < warmup_steps, warm, cosine))

    return schedule


def one_cycle(max_lr: float, total_steps: int, pct_start: float = 0.3, div_factor: float = 25.0,
              final_div_factor: float = 1e4) -> Schedule:
    """The learning rate of ``torch.optim.lr_scheduler.OneCycleLR`` (cos annealing, two phases).

    With ``lr0 = max_lr / div_factor``, ``lr_min = lr0 / final_div_factor``,
    ``e1 = pct_start * total_steps - 1``, ``e2 = total_steps - 1``,
    ``anneal(a, b, p) = b + (a - b) * (1 + cos(π p)) / 2``::

        lr(c) = anneal(lr0, max_lr, c / e1)                  if c <= e1
                anneal(max_lr, lr_min, (c - e1) / (e2 - e1)) otherwise

    For ``c >= total_steps - 1`` it stays at ``lr_min`` (torch raises past
    ``total_steps`` instead). Momentum cycling is not part of this schedule.
    """
    max_lr = _check_nonnegative("max_lr", max_lr)
    total_steps = _check_steps("total_steps", total_steps, minimum=2)
    if isinstance(pct_start, bool) or not isinstance(pct_start, Real) or not 0 < pct_start < 1:
        raise ValueError(f"pct_start must be a number in (0, 1), got {pct_start!r}")
    for name, value in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
        if _check_nonnegative(name, value) == 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    end_warm = float(pct_start * total_steps) - 1
    end = float(total_steps - 1)
    if end_warm <= 0 or end_warm >= end:
        raise ValueError(
            f"pct_start * total_steps = {pct_start * total_steps} leaves an empty phase; "
            f"it must lie in (1, total_steps): raise total_steps or change pct_start")
    initial_lr = max_lr / div_factor
    min_lr = initial_lr / final_div_factor

    def anneal(start: float, stop: float, pct: torch.Tensor) -> torch.Tensor:
        return stop + (start - stop) / 2.0 * (torch.cos(math.pi * pct) + 1)

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = count.to(_F64).clamp(max=end)
        up = anneal(initial_lr, max_lr, c / end_warm)
        down = anneal(max_lr, min_lr, (c - end_warm) / (end - end_warm))
        return _to_lr(torch.where(c <= end_warm, up, down))

    return schedule


def warmup_cosine_ratio(peak_lr: float, warmup_steps: int, total_steps: int, warmup_min_ratio: float = 0.0,
                        cos_min_ratio: float = 1e-4, warmup_type: str = "log") -> Schedule:
    """DeepSpeed's ``WarmupCosineLR``: a warmup in ratios of ``peak_lr``, then a cosine.

    Unlike `warmup_cosine` (linear from 0, then a cosine clamped at the end),
    every value is ``peak_lr × ratio(c)``; with ``W = max(2, warmup_steps)``,
    ``T = total_steps``, ``c = count`` and ``γ`` as in `warmup`::

        ratio(c) = warmup_min_ratio + (1 - warmup_min_ratio) · γ(c)                  if c < W
                   max(0, cos_min_ratio + (1 - cos_min_ratio) · (1 + cos(π p)) / 2),
                       p = (c - W + 1) / (T - W)                                     if c >= W

    ``p`` is not clamped, as in DeepSpeed: past ``T`` the cosine rises again.
    ``lr(c)`` equals DeepSpeed's ``get_lr()`` at ``last_batch_iteration = c``
    (its update ``c + 1`` runs at ``lr(c)``; see `zfunc.deepspeed` for the
    first update).
    """
    peak_lr = _check_nonnegative("peak_lr", peak_lr)
    warmup_min_ratio = _check_nonnegative("warmup_min_ratio", warmup_min_ratio)
    cos_min_ratio = _check_nonnegative("cos_min_ratio", cos_min_ratio)
    warmup_steps = _check_steps("warmup_steps", warmup_steps)
    total_steps = _check_steps("total_steps", total_steps, minimum=1)
    _check_warmup_type(warmup_type)
    w = max(2, warmup_steps)
    if total_steps <= w:
        raise ValueError(f"total_steps ({total_steps}) must exceed max(2, warmup_steps) = {w}: the cosine "
                         "phase divides by total_steps - warmup_steps")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = count.to(_F64)
        warm = warmup_min_ratio + (1.0 - warmup_min_ratio) * _deepspeed_warmup_gamma(c.clamp(max=w - 1), w,
                                                                                       warmup_type)
        cosine = (1 + torch.cos(math.pi * (c - w + 1) / (total_steps - w))) / 2
        decay = (cos_min_ratio + (1.0 - cos_min_ratio) * cosine).clamp(min=0.0)
        return _to_lr(peak_lr * torch.where(c < w, warm, decay))

    return schedule


def linear_one_cycle(min_lr: float, max_lr: float, first_steps: int, second_steps: int | None = None,
                     decay_rate: float = 0.0, decay_steps: int = 0) -> Schedule:
    """DeepSpeed's ``OneCycle`` learning rate: Smith's 1cycle with linear phases, then a decay.

    Up from ``min_lr`` to ``max_lr`` in ``first_steps`` updates, back down to
    ``min_lr`` in ``second_steps`` (default ``first_steps``), then
    ``min_lr / (1 + decay_rate · (c - S) / decay_steps)`` (or ``min_lr``
    when ``decay_rate`` or ``decay_steps`` is 0). With ``S = first_steps +
    second_steps``, ``r = first_steps / S``, ``x = c / S``::

        lr(c) = min_lr + (max_lr - min_lr) · x / r                  if c < S and x <= r
                min_lr + (max_lr - min_lr) · (x - 1) / (r - 1)      if c < S and x > r
                min_lr / (1 + decay_rate · (c - S) / decay_steps)   if c >= S

    ``lr(c)`` is the rate DeepSpeed's OneCycle gives update ``c`` (counting
    from 0: its scheduler starts at ``min_lr`` and steps after each update).
    Momentum cycling is not part of this schedule; `one_cycle` is torch's
    OneCycleLR (cosine phases), a different shape.
    """
    min_lr = _check_nonnegative("min_lr", min_lr)
    max_lr = _check_nonnegative("max_lr", max_lr)
    first_steps = _check_steps("first_steps", first_steps, minimum=1)
    second_steps = first_steps if second_steps is None else _check_steps("second_steps", second_steps, minimum=1)
    decay_rate = _check_nonnegative("decay_rate", decay_rate)
    decay_steps = _check_steps("decay_steps", decay_steps)
    total = float(first_steps + second_steps)
    ratio = first_steps / total
    decays = decay_rate != 0 and decay_steps != 0

    def schedule(count: torch.Tensor) -> torch.Tensor:
        c = count.to(_F64)
        x = (1.0 + c / total) - 1.0   # DeepSpeed's own rounding of the cycle position
        scale = torch.where(x <= ratio, x / ratio, (x - 1) / (ratio - 1))
        cycle = min_lr + (max_lr - min_lr) * scale
        if decays:
            decay = min_lr / (1 + decay_rate * ((c - total).clamp(min=0.0) / decay_steps))
        else:
            decay = torch.full_like(c, min_lr)
        return _to_lr(torch.where(c < total, cycle, decay))

    return schedule


def lr_range_test(min_lr: float, step_size: int, step_rate: float = 1.0, staircase: bool = False) -> Schedule:
    """DeepSpeed's ``LRRangeTest``: a rate that grows linearly (or in stairs) from ``min_lr``.

    With ``c = count``::

        lr(c) = min_lr · (1 + step_rate · c / step_size)            (continuous)
                min_lr · (1 + step_rate · ⌊c / step_size⌋)          (staircase)

    ``lr(c)`` is the rate DeepSpeed's LRRangeTest gives update ``c`` (counting
    from 0: its scheduler starts at ``min_lr`` and steps after each update).
    Train a few hundred steps with it and read where the loss stops falling
    to choose the peak rate of another schedule.
    """
    min_lr = _check_nonnegative("min_lr", min_lr)
    step_size = _check_steps("step_size", step_size, minimum=1)
    step_rate = _check_nonnegative("step_rate", step_rate)
    if not isinstance(staircase, bool):
        raise TypeError(f"staircase must be True or False, got {staircase!r}")

    def schedule(count: torch.Tensor) -> torch.Tensor:
        interval = count.to(_F64) / step_size
        if staircase:
            interval = torch.floor(interval)
        return _to_lr(min_lr * (1 + step_rate * interval))

    return schedule
