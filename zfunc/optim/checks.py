"""Argument checks shared by the optimizers: every hyperparameter is refused, with a message that says
what to pass, unless it is a number the update can use (finite, in range, not a bool)."""

from __future__ import annotations

import math
from numbers import Real

import torch

# A rate or norm above this rounds to inf in float32, where the optimizer keeps its scalars.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def number(name: str, value, hint: str = "") -> float:
    """``value`` as a float; ValueError unless it is a finite real number (bools and tensors refused)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}" + (f"; {hint}" if hint else ""))
    if abs(float(value)) > FLOAT32_MAX:
        raise ValueError(f"{name} = {value!r} does not fit in float32 (max {FLOAT32_MAX:.3g}), where the optimizer "
                         "keeps it")
    return float(value)


def nonnegative(name: str, value, hint: str = "") -> float:
    """A finite number >= 0."""
    value = number(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}" + (f"; {hint}" if hint else ""))
    return value


def positive(name: str, value, hint: str = "") -> float:
    """A finite number > 0."""
    value = number(name, value, hint)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}" + (f"; {hint}" if hint else ""))
    return value


def beta(name: str, value) -> float:
    """A decay rate in [0, 1) (Adam's b1, b2)."""
    value = number(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value} (typical: b1=0.9, b2=0.999)")
    return value


def unit_interval(name: str, value) -> float:
    """A number in [0, 1]."""
    value = number(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def flag(name: str, value) -> bool:
    """True or False (not a truthy string or number)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def first_rate(lr, count: torch.Tensor) -> None:
    """Refuse a learning rate a schedule gave for the first update (``tx.init``) that is not a finite
    number >= 0: a negative rate ascends the loss, a NaN spreads into every parameter.

    Checked once, at ``init`` (one host read); later values are the schedule's responsibility (the
    built-in schedules cannot produce them). Skipped for meta tensors and while torch.compile traces.
    """
    if not isinstance(lr, torch.Tensor) or lr.is_meta or torch.compiler.is_compiling():
        return
    if lr.numel() != 1 or not lr.is_floating_point():
        raise ValueError(f"a learning-rate schedule must return a 0-d floating tensor (or a number); it returned "
                         f"{lr.dtype} of shape {tuple(lr.shape)} for count {int(count)}")
    value = float(lr)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"the learning-rate schedule returned {value} for count {int(count)} (the first update's rate): a "
            "rate must be a finite number >= 0 (to ascend instead of descend, negate the loss). Check the "
            "schedule's formula, or use a built-in one (zf.optim.warmup_cosine, ...), whose arguments are checked.")
