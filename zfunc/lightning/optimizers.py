"""``configure_optimizers`` as users write it, in zfunc's terms.

The torch optimizer the LightningModule returns stays what Lightning sees
(its ``param_groups``, its state dict, the LR scheduler stepping it); zfunc
never calls its ``step``. Its hyperparameters become the `zfunc.optim`
optimizer that updates the state:

======================================================  =====================================================
torch                                                   zfunc
======================================================  =====================================================
``Adam(lr, betas, eps, weight_decay)``                  ``zf.optim.adam`` (L2 decay added to the gradient)
``Adam(..., decoupled_weight_decay=True)``, ``AdamW``    ``zf.optim.adamw``; groups with ``weight_decay=0``
                                                        become its ``mask``
``SGD(lr, momentum, dampening, weight_decay, nesterov)``  ``zf.optim.sgd``
DeepSpeed's ``DeepSpeedCPUAdam``, ``FusedAdam``        ``zf.optim.adamw`` (their default ``adamw_mode``), or
                                                        ``zf.optim.adam`` with ``adamw_mode=False``
``amsgrad``, ``maximize``, other optimizers             refused, naming them
``foreach``, ``fused``, ``capturable``, ``differentiable``  ignored: how torch runs its update, not what it computes
======================================================  =====================================================

The learning rate is *live*: each zfunc update reads ``param_groups[...]["lr"]``
of the torch optimizer as Lightning's scheduler left it (`LiveRate`), so every
LR scheduler (``StepLR``, ``CosineAnnealingLR``, ``LinearLR``, ``OneCycleLR``,
``LambdaLR``, ``SequentialLR`` warmups, ``ReduceLROnPlateau``, any interval and
frequency) gives exactly the rates it gives under Lightning, and resumes with
Lightning's own scheduler state. A scheduler that changes anything else
(``OneCycleLR``/``CyclicLR`` cycling momentum, a hand-edited ``betas``) is
refused: zfunc's optimizers take those as fixed numbers. That is checked
before training for the schedulers known to do it and before every update for
everything else.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from zfunc import optim

# Group keys that change how torch runs an update but not the numbers it computes.
_HOW_TORCH_RUNS = {"foreach", "fused", "capturable", "differentiable", "initial_lr", "lr", "params", "param_names",
                   "bias_correction"}
# DeepSpeed's Adam optimizers (mapped by name: deepspeed need not be installed) -> whether it is in AdamW mode.
_DEEPSPEED_ADAMS = {"DeepSpeedCPUAdam": lambda opt: bool(getattr(opt, "adam_w_mode", getattr(opt, "adamw_mode", True))),
                    "FusedAdam": lambda opt: bool(getattr(opt, "adam_w_mode", True))}
_REFUSED_FLAGS = {"amsgrad": "AMSGrad (a running max of the second moment) is not in zfunc's Adam",
                  "maximize": "zfunc minimises; negate the loss instead"}


class OptimizerMappingError(ValueError):
    """configure_optimizers returned something zfunc cannot train exactly as torch would."""


@dataclasses.dataclass
class LiveRate:
    """The learning rate of the next update, read from the torch optimizer Lightning's scheduler steps.

    ``schedule(count)`` is a zfunc schedule (``count -> float32 0-d tensor``)
    returning `value`, which `read` sets from the optimizer before each update;
    it reads a Python float from ``param_groups``: no device synchronisation.
    """

    optimizer: torch.optim.Optimizer
    fixed: list[dict[str, Any]]   # per group: the hyperparameters the zfunc optimizer was built with
    value: float = math.nan

    def schedule(self, count: torch.Tensor) -> torch.Tensor:
        return torch.full((), self.value, dtype=torch.float32, device=count.device)

    def read(self) -> float:
        """Take the current rate; refuse hyperparameters changed since the zfunc optimizer was built."""
        groups = self.optimizer.param_groups
        rates = {float(g["lr"]) for g in groups}
        if len(rates) > 1:
            raise OptimizerMappingError(
                f"the param groups of {type(self.optimizer).__name__} now have different learning rates "
                f"{sorted(rates)} (a scheduler with one rate per group?); zfunc's optimizer takes one learning "
                "rate for all parameters")
        for i, (group, fixed) in enumerate(zip(groups, self.fixed)):
            for key, value in fixed.items():
                if _normalised(group.get(key)) != _normalised(value):
                    raise OptimizerMappingError(
                        f"param group {i} of {type(self.optimizer).__name__} changed {key} from {value!r} to "
                        f"{group.get(key)!r} during training (a scheduler cycling momentum, e.g. OneCycleLR or "
                        "CyclicLR with cycle_momentum=True?); zfunc's optimizers take it as a fixed number: build "
                        "the scheduler with cycle_momentum=False")
        self.value = rates.pop()
        return self.value


def _normalised(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_normalised(v) for v in value]
    return value


def refuse_momentum_cycling(schedulers: list[Any]) -> None:
    """Refuse, before training, schedulers known to change hyperparameters other than the learning rate."""
    for scheduler in schedulers:
        inner = getattr(scheduler, "_schedulers", None) or [scheduler]   # SequentialLR / ChainedScheduler
        for s in inner:
            if getattr(s, "cycle_momentum", False) and type(s).__name__ in ("OneCycleLR", "CyclicLR"):
                raise OptimizerMappingError(
                    f"{type(s).__name__}(cycle_momentum=True) changes the optimizer's momentum/betas every step; "
                    f"zfunc's optimizers take them as fixed numbers. Build it with cycle_momentum=False")


def map_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                  trainable: set[str]) -> tuple[optim.GradientTransformation, LiveRate, str]:
    """The zfunc optimizer that computes what ``optimizer`` computes.

    Args:
      optimizer: the torch optimizer from ``configure_optimizers``.
      names: ``id(parameter) -> its key`` in zfunc's params.
      trainable: the keys zfunc trains (every parameter with ``requires_grad``).
    Returns:
      ``(tx, rate, description)``: the optimizer (its learning rate is ``rate.schedule``),
      the `LiveRate` to `read` before each update, and a line for the report.
    Raises:
      OptimizerMappingError: an optimizer, flag or param-group layout zfunc cannot reproduce, naming it.
    """
    kind = type(optimizer)
    name = f"torch.optim.{kind.__name__}" if kind.__module__.startswith("torch.optim") else kind.__qualname__
    deepspeed_adam = kind.__module__.startswith("deepspeed.") and kind.__name__ in _DEEPSPEED_ADAMS
    if deepspeed_adam:
        name = f"deepspeed's {kind.__name__}"
        if not all(g.get("bias_correction", True) for g in optimizer.param_groups):
            raise OptimizerMappingError(f"{name}(bias_correction=False): zfunc's Adam always corrects the bias")
        # DeepSpeed's CPU and fused Adam are AdamW unless built with adamw_mode / adam_w_mode=False.
        kind = torch.optim.AdamW if _DEEPSPEED_ADAMS[kind.__name__](optimizer) else torch.optim.Adam
    if kind not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        raise OptimizerMappingError(
            f"configure_optimizers returned {name}, which zfunc cannot map: it maps torch.optim.Adam, AdamW and "
            "SGD (exact subclasses only) to zf.optim.adam, adamw and sgd. Use one of those")
    groups = optimizer.param_groups
    _check_coverage(optimizer, name, names, trainable)
    for i, group in enumerate(groups):
        for flag, why in _REFUSED_FLAGS.items():
            if group.get(flag):
                raise OptimizerMappingError(f"{name}({flag}=True) in param group {i}: {why}")
    decoupled = kind is torch.optim.AdamW or bool(groups[0].get("decoupled_weight_decay", False))
    shared = ["betas", "eps"] if kind is not torch.optim.SGD else ["momentum", "dampening", "nesterov"]
    if kind is not torch.optim.SGD:
        shared.append("decoupled_weight_decay")
    if not decoupled:
        shared.append("weight_decay")   # L2 decay (Adam, SGD) takes no mask in zfunc
    for key in shared:
        values = {repr(_normalised(g.get(key))) for g in groups}
        if len(values) > 1:
            raise OptimizerMappingError(
                f"the param groups of {name} differ in {key} ({', '.join(sorted(values))}); zfunc's optimizer "
                f"takes one {key} for all parameters" + (" (only AdamW's weight_decay may be 0 in some groups)"
                                                         if key == "weight_decay" else ""))
    rates = {float(g["lr"]) for g in groups}
    if len(rates) > 1:
        raise OptimizerMappingError(f"the param groups of {name} have different learning rates {sorted(rates)}; "
                                    "zfunc's optimizer takes one learning rate for all parameters")
    fixed = [{k: g.get(k) for k in g if k not in _HOW_TORCH_RUNS} for g in groups]
    rate = LiveRate(optimizer, fixed, rates.pop())
    first = groups[0]
    if kind is torch.optim.SGD:
        tx = optim.sgd(rate.schedule, momentum=first["momentum"], nesterov=bool(first["nesterov"]),
                       weight_decay=first["weight_decay"], dampening=first["dampening"])
        what = (f"zf.optim.sgd(momentum={first['momentum']}, dampening={first['dampening']}, "
                f"nesterov={bool(first['nesterov'])}, weight_decay={first['weight_decay']})")
        return tx, rate, f"{name} -> {what}"
    b1, b2 = (float(b) for b in first["betas"])
    if not decoupled:
        tx = optim.adam(rate.schedule, b1=b1, b2=b2, eps=first["eps"], weight_decay=first["weight_decay"])
        what = f"zf.optim.adam(b1={b1}, b2={b2}, eps={first['eps']}, weight_decay={first['weight_decay']})"
        return tx, rate, f"{name} -> {what}"
    decays = {float(g["weight_decay"]) for g in groups} - {0.0}
    if len(decays) > 1:
        raise OptimizerMappingError(
            f"the param groups of {name} use weight decays {sorted(decays)}; zfunc's adamw takes one weight_decay "
            "and a mask of which parameters it applies to (groups with weight_decay=0 are fine)")
    decay = decays.pop() if decays else 0.0
    mask = None
    if decay and any(float(g["weight_decay"]) == 0.0 for g in groups):
        mask = {names[id(p)]: float(g["weight_decay"]) != 0.0 for g in groups for p in g["params"]
                if id(p) in names}
    tx = optim.adamw(rate.schedule, b1=b1, b2=b2, eps=first["eps"], weight_decay=decay, mask=mask)
    masked = f", mask: {sum(mask.values())} of {len(mask)} tensors decay" if mask else ""
    return tx, rate, f"{name} -> zf.optim.adamw(b1={b1}, b2={b2}, eps={first['eps']}, weight_decay={decay}{masked})"


def _check_coverage(optimizer: torch.optim.Optimizer, name: str, names: dict[int, str], trainable: set[str]) -> None:
    """Every parameter zfunc trains must be in exactly one param group (a trainable parameter torch would never
    update would silently train under zfunc)."""
    seen: dict[str, int] = {}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            key = names.get(id(p))
            if key is None:
                if p.requires_grad:
                    raise OptimizerMappingError(
                        f"param group {i} of {name} holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                        "of the LightningModule; zfunc trains the module's parameters only")
                continue
            if key in seen and seen[key] != i:
                raise OptimizerMappingError(f"{key} is in param groups {seen[key]} and {i} of {name}")
            seen[key] = i
    missing = sorted(trainable - set(seen))
    if missing:
        raise OptimizerMappingError(
            f"{len(missing)} trainable parameters are in no param group of {name}: {', '.join(missing[:6])}"
            f"{' ...' if len(missing) > 6 else ''}. torch would never update them and zfunc trains every parameter "
            "with requires_grad=True: freeze them (requires_grad_(False)) before training or add them to the "
            "optimizer")
