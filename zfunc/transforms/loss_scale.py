"""fp16 loss scaling for `mixed_precision`: the scaler's knobs, its update rule and the unscale-and-check pass.

DeepSpeed's ``fp16`` config and its DynamicLossScaler semantics; the knobs are
keyword arguments of `mixed_precision` (`LossScaler` holds them):

- the scale starts at ``2 ** initial_scale_power``; ``loss_scale > 0`` makes
  it static instead (never changes, no minimum);
- the differentiated loss is ``loss × scale``, so gradients come back scaled;
  before the update they are unscaled, ``g ← g / scale``, and checked
  (`unscale_and_check_`);
- a step whose unscaled gradients hold any inf/NaN is *skipped*: params,
  master, optimizer state and ``state.step`` stay as they were (``step``
  counts applied updates, so a schedule indexed by it, or by the optimizer's
  own count, does not advance on a skipped step, as DeepSpeed's lr scheduler
  does not). The count of non-finite elements goes through `zfunc.psum`, so
  under `shard` all ranks agree and skip together;
- overflow: if ``hysteresis_left > 1`` it is decremented (scale kept);
  otherwise the scale halves (not below ``min_loss_scale``) — and if the
  scale already *was* ``min_loss_scale`` a `FloatingPointError` is raised
  at the next use of the state the step returned (the step skipped);
- no overflow: ``good_steps`` counts good steps since the last overflow
  (before this one). When it is a positive multiple of
  ``loss_scale_window`` the scale doubles and ``hysteresis_left`` is
  refilled, i.e. the first doubling comes on the ``window + 1``-th
  consecutive good step, then every ``window`` steps (DeepSpeed's
  ``stable_interval`` rule); with ``consecutive_hysteresis=True`` every good
  step refills ``hysteresis_left``.

As arithmetic (`LossScaler.update`), with scale ``s``, good steps ``n``,
hysteresis left ``h``, the overflow flag ``o``, window ``W``, hysteresis
``H`` and minimum ``m``::

    drop   = o and h <= 1
    grow   = not o and n > 0 and n % W == 0
    s'     = max(s / 2, m) if drop else 2 s if grow else s
    h'     = (h if h <= 1 else h - 1) if o else H if (grow or consecutive_hysteresis) else h
    n'     = 0 if o else n + 1
    at_min = drop and s <= m          (the error above)

computed branch-free on the device (`torch.where`), so no step reads the
scaler on the host. bf16 and fp32 compute has no loss scale (mode ``"none"``:
fixed 1, nothing checked or skipped).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # (only its dtypes are read)
    from zfunc.transforms.mixed_precision_policy import Policy

ScalingMode = Literal["none", "static", "dynamic"]

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_MAX_SCALE_POWER = 127  # the largest power of two float32 holds


@dataclasses.dataclass(frozen=True)
class LossScaler:
    """The loss scaler's knobs (DeepSpeed's names and defaults) and its mode.

    ``mode``: ``"dynamic"`` (fp16, ``loss_scale == 0``), ``"static"`` (fp16, ``loss_scale > 0``) or
    ``"none"`` (bf16/fp32 compute). Build it with `for_policy`, which checks the knobs.
    """

    mode: ScalingMode = "none"
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False

    @classmethod
    def for_policy(cls, policy: Policy, *, loss_scale: float, initial_scale_power: int, loss_scale_window: int,
                   hysteresis: int, min_loss_scale: float, consecutive_hysteresis: bool) -> LossScaler:
        """The scaler of ``policy`` (fp16 compute scales, others do not), its knobs checked."""
        fp16 = policy.compute_dtype == "fp16"
        if not (isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool)
                and 0 <= loss_scale <= _FLOAT32_MAX):
            raise ValueError(f"loss_scale must be 0 (dynamic) or a positive number that float32 holds (the scale's "
                             f"dtype, at most {_FLOAT32_MAX:.3g}), got {loss_scale!r}")
        if loss_scale and not fp16:
            raise ValueError(f"loss_scale applies to fp16 compute only; policy {policy.short()!r} computes "
                             f"in {policy.compute_dtype} and needs no loss scaling")
        for knob, value, low in (("initial_scale_power", initial_scale_power, 0),
                                 ("loss_scale_window", loss_scale_window, 1), ("hysteresis", hysteresis, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{knob} must be an int >= {low}, got {value!r}")
        if initial_scale_power > _MAX_SCALE_POWER:
            # 2**128 is inf in float32: every step would overflow and be skipped, and inf / 2 never reaches
            # min_loss_scale, so nothing would ever say so.
            raise ValueError(f"initial_scale_power must be at most {_MAX_SCALE_POWER} (2**{_MAX_SCALE_POWER + 1} "
                             f"is inf in float32, the loss scale's dtype), got {initial_scale_power}; DeepSpeed's "
                             "default is 16")
        if not (isinstance(min_loss_scale, (int, float)) and not isinstance(min_loss_scale, bool)
                and 0 < min_loss_scale <= _FLOAT32_MAX):
            raise ValueError(f"min_loss_scale must be a positive finite number, got {min_loss_scale!r}")
        if not isinstance(consecutive_hysteresis, bool):
            raise ValueError(f"consecutive_hysteresis must be True or False, got {consecutive_hysteresis!r}")
        if fp16 and not loss_scale and 2.0 ** initial_scale_power < min_loss_scale:
            raise ValueError(f"2**initial_scale_power = {2.0 ** initial_scale_power} is below "
                             f"min_loss_scale = {min_loss_scale}")
        mode: ScalingMode = ("static" if loss_scale else "dynamic") if fp16 else "none"
        return cls(mode, float(loss_scale), initial_scale_power, loss_scale_window, hysteresis,
                   float(min_loss_scale), bool(consecutive_hysteresis))

    def initial(self) -> float:
        """The scale a fresh state starts with."""
        return {"dynamic": 2.0 ** self.initial_scale_power, "static": self.loss_scale, "none": 1.0}[self.mode]

    def settings(self) -> dict[str, Any]:
        """The knobs that matter in this mode, for the transform's ``repr``."""
        if self.mode == "static":
            return {"loss_scale": self.loss_scale}
        if self.mode != "dynamic":
            return {}
        out: dict[str, Any] = {"initial_scale_power": self.initial_scale_power,
                               "loss_scale_window": self.loss_scale_window, "hysteresis": self.hysteresis,
                               "min_loss_scale": self.min_loss_scale}
        if self.consecutive_hysteresis:
            out["consecutive_hysteresis"] = True
        return out

    def update(self, scale: torch.Tensor, good_steps: torch.Tensor, hysteresis_left: torch.Tensor,
               overflow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scaler after a step, branch-free (the module doc's arithmetic): ``(scale, good_steps,
        hysteresis_left, at_min)``, ``at_min`` set where an overflow hit the minimum scale. A static
        scaler stays as it is."""
        if self.mode == "static":
            return scale, good_steps, hysteresis_left, torch.zeros((), dtype=torch.bool, device=scale.device)
        exhausted = hysteresis_left <= 1
        drop = overflow & exhausted
        at_min = drop & (scale <= self.min_loss_scale)
        grow = ~overflow & (good_steps > 0) & (good_steps % self.loss_scale_window == 0)
        new_scale = torch.where(drop, torch.clamp(scale / 2, min=self.min_loss_scale),
                                torch.where(grow, scale * 2, scale))
        full = torch.full_like(hysteresis_left, self.hysteresis)
        on_overflow = torch.where(exhausted, hysteresis_left, hysteresis_left - 1)
        on_good = full if self.consecutive_hysteresis else torch.where(grow, full, hysteresis_left)
        new_hysteresis = torch.where(overflow, on_overflow, on_good)
        new_good = torch.where(overflow, torch.zeros_like(good_steps), good_steps + 1)
        return new_scale, new_good, new_hysteresis, at_min

    def at_min_message(self) -> str:
        """The error of an overflow at the minimum scale (raised at the next use of the state)."""
        return (f"mixed_precision: gradients overflowed (inf/NaN) at the minimum loss scale "
                f"{self.min_loss_scale:g}; the loss scale cannot drop further. fp16's range is too small "
                "for this run: use policy 'bf16' (same memory, fp32's exponent range), or lower "
                "min_loss_scale; a NaN at every step may also come from the model or the data "
                "(check the loss).")


def unscale_and_check_(grads: list[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """``g ← g / scale`` in place for every gradient; returns 1.0 if any element is inf/NaN, else 0.0.

    One multi-tensor pass per device and dtype (torch's fused
    ``_amp_foreach_non_finite_check_and_unscale_``, what GradScaler runs)
    instead of a division and a count per tensor.
    """
    found = torch.zeros((), dtype=torch.float32, device=scale.device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in groups.items():
        found_here = torch.zeros(1, dtype=torch.float32, device=device)
        inverse = (1.0 / scale.to(device=device, dtype=torch.float32)).reshape(1)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inverse)
        found = torch.maximum(found, found_here.to(found.device).reshape(()))
    return found
