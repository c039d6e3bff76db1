"""DeepSpeed's ``optimizer`` section -> a `zf.optim` optimizer with DeepSpeed's semantics and defaults.

=======================================  =======================================================
DeepSpeed                                zfunc
=======================================  =======================================================
``Adam`` (``adam_w_mode`` true,          `zf.optim.adamw`: decoupled weight decay (DeepSpeed's
its default)                             FusedAdam / DeepSpeedCPUAdam in AdamW mode)
``Adam`` with ``adam_w_mode`` false      `zf.optim.adam`: L2 weight decay added to the gradient
``AdamW`` (``adam_w_mode`` ignored,      `zf.optim.adamw`
as in DeepSpeed)
``Lamb``                                 `deepspeed_lamb` below: DeepSpeed's FusedLamb, which is
                                         not `zf.optim.lamb` (see there)
``SGD`` (torch.optim.SGD)                `zf.optim.sgd`
=======================================  =======================================================

Defaults follow the class DeepSpeed builds: FusedAdam / DeepSpeedCPUAdam /
FusedLamb take ``weight_decay = 0``; with ``torch_adam: true`` DeepSpeed
builds ``torch.optim.AdamW`` (default ``weight_decay = 0.01``) or
``torch.optim.Adam`` (0). ``lr`` defaults to 1e-3 everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import torch

from zfunc import optim
from zfunc.deepspeed.report import DeepSpeedConfigError, Section
from zfunc.optim.base import GradientTransformation, Hyperparams, chain
from zfunc.optim.schedules import ScalarOrSchedule
from zfunc.optim.transforms import ScaleByAdamState, scale_by_learning_rate
from zfunc.tree import PyTree, tree_flatten, tree_leaves, tree_map, tree_unflatten, tree_zeros_like

Kind = Literal["adam", "adamw", "lamb", "sgd"]

_REFUSED_TYPES = {
    "onebitadam": "1-bit Adam compresses its communication, which zfunc does not do; use \"Adam\"",
    "zerooneadam": "0/1 Adam compresses its communication, which zfunc does not do; use \"Adam\"",
    "onebitlamb": "1-bit LAMB compresses its communication, which zfunc does not do; use \"Lamb\"",
    "adagrad": "zf.optim has no Adagrad",
    "lion": "zf.optim has no Lion",
    "muadam": "zf.optim has no muP optimizers",
    "muadamw": "zf.optim has no muP optimizers",
    "musgd": "zf.optim has no muP optimizers",
}
_DEEPSPEED_NAMES = {"adam", "adamw", "lamb", *_REFUSED_TYPES}   # matched case-insensitively, as DeepSpeed does

# Keys that change only how the update is computed (kernels, memory), never its result.
_PERFORMANCE_KEYS = {
    "foreach": "torch's multi-tensor implementation switch; zfunc picks its own kernels",
    "fused": "torch's fused-kernel switch; zfunc picks its own kernels",
    "capturable": "CUDA-graph capture support of torch's optimizer; not needed by zfunc",
    "differentiable": "autograd through torch's optimizer step; zfunc's update is not differentiated",
    "set_grad_none": "how FusedAdam clears gradients; zfunc's gradients are values, not .grad buffers",
}
_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "bias_correction", "amsgrad",
              "maximize", "fp32_optimizer_states", *_PERFORMANCE_KEYS}
_LAMB_KEYS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "eps_inside_sqrt", "max_coeff", "min_coeff",
              "amsgrad"}
_SGD_KEYS = {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", *_PERFORMANCE_KEYS}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """What the ``optimizer`` section asks for: ``kind`` and the hyperparameters other than the
    learning rate (``hyper``, keyword arguments of the builder; see `read_lr`). ``fused_adam``:
    DeepSpeed would build its FusedAdam, whose fp16 wrapper has its own loss-scaler defaults."""

    kind: Kind
    hyper: dict[str, Any]
    description: str
    fused_adam: bool = False

    @property
    def has_betas(self) -> bool:
        return self.kind != "sgd"


def read_optimizer(section: Section, *, zero_stage: int) -> OptimizerSpec | None:
    """Read and report the ``optimizer`` section, except ``params.lr``: a DeepSpeed scheduler may
    override it (see `read_lr`). None when the config has no optimizer."""
    if not section.data:
        return None
    name = section.value("type")
    if not isinstance(name, str):
        raise section.error("type", f"must be an optimizer name, got {name!r}")
    if name.lower() in _DEEPSPEED_NAMES:
        name = name.lower()
    if name in _REFUSED_TYPES:
        raise section.error("type", f"{name!r}: {_REFUSED_TYPES[name]}")
    params = section.section("params")
    section.ignored("legacy_fusion", "selects DeepSpeed's legacy fused kernels; no effect on the result")
    if "max_grad_norm" in params:
        raise params.error("max_grad_norm", "is not an optimizer parameter in DeepSpeed either (it refuses it); "
                                            "use the top-level \"gradient_clipping\" key")
    if name in ("adam", "adamw"):
        spec = _read_adam(name, params)
    elif name == "lamb":
        if zero_stage > 0:
            raise section.error("type", (
                "DeepSpeed's ZeRO runs LAMB on each rank's flat partition of the parameters, so its trust "
                "ratio is per partition (and changes with the world size); zfunc computes it per parameter. "
                "Use zero_optimization.stage 0, or build your own optimizer (zf.optim.lamb) without an "
                "optimizer section"))
        spec = _read_lamb(params)
    elif name == "SGD":
        spec = _read_sgd(params)
    else:
        raise section.error("type", f"{name!r} is not an optimizer zfunc maps; supported: Adam, AdamW, Lamb, SGD "
                                    "(or drop the section and pass your own zf.optim optimizer)")
    section.mapped("type", spec.description)
    return spec


def _number(params: Section, key: str, default: float) -> float:
    value = params.value(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise params.error(key, f"must be a finite number, got {value!r}")
    return float(value)


def _flag(params: Section, key: str, default: bool) -> bool:
    value = params.value(key, default)
    if not isinstance(value, bool):
        raise params.error(key, f"must be true or false, got {value!r}")
    return value


def _betas(params: Section) -> tuple[float, float]:
    betas = params.value("betas", [0.9, 0.999])
    if (not isinstance(betas, (list, tuple)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
        raise params.error("betas", f"must be a list of two numbers [beta1, beta2], got {betas!r}")
    return float(betas[0]), float(betas[1])


def _check_keys(params: Section, allowed: set[str], who: str) -> None:
    for key in params.keys():
        if key not in allowed:
            raise params.error(key, f"is not a parameter of {who}; remove it")


def _refuse_true(params: Section, key: str, why: str) -> None:
    if _flag(params, key, False):
        raise params.error(key, why)
    params.mapped(key, "false: as zfunc computes")


def _performance_keys(params: Section) -> None:
    for key, why in _PERFORMANCE_KEYS.items():
        params.ignored(key, why)


def _read_adam(name: str, params: Section) -> OptimizerSpec:
    torch_adam = _flag(params, "torch_adam", False)
    w_mode = _flag(params, "adam_w_mode", True)
    decoupled = name == "adamw" or w_mode
    if "adamw_mode" in params:
        raise params.error("adamw_mode", "is not a DeepSpeed optimizer parameter; write adam_w_mode")
    _check_keys(params, _ADAM_KEYS, f"DeepSpeed's {name!r}")
    kind: Kind = "adamw" if decoupled else "adam"
    built = (("torch.optim.AdamW" if decoupled else "torch.optim.Adam") if torch_adam
             else "DeepSpeed's FusedAdam / DeepSpeedCPUAdam")
    # torch.optim.AdamW defaults to weight_decay=0.01; DeepSpeed's own Adam kernels to 0.
    weight_decay = _number(params, "weight_decay", 0.01 if torch_adam and decoupled else 0.0)
    b1, b2 = _betas(params)
    hyper = {"b1": b1, "b2": b2, "eps": _number(params, "eps", 1e-8), "weight_decay": weight_decay}
    params.mapped("torch_adam", f"{torch_adam}: DeepSpeed would build {built}; zfunc computes the same update")
    if name == "adamw":
        params.mapped("adam_w_mode", "no effect with type AdamW (DeepSpeed uses AdamW whatever it says)")
    else:
        params.mapped("adam_w_mode", f"{w_mode}: {'decoupled (AdamW)' if w_mode else 'L2 (Adam)'} weight decay "
                                     f"-> zf.optim.{kind}")
    for key, what in (("betas", f"b1={b1}, b2={b2}"), ("eps", f"eps={hyper['eps']}"),
                      ("weight_decay", f"weight_decay={weight_decay}")):
        params.mapped(key, f"zf.optim.{kind}({what})")
    if not _flag(params, "bias_correction", True):
        raise params.error("bias_correction", "false (Adam without bias correction): zf.optim.adam/adamw always "
                                              "correct the moments' bias; remove the key or set it true")
    params.mapped("bias_correction", "true: zf.optim's Adam corrects the bias")
    _refuse_true(params, "amsgrad", "AMSGrad: zf.optim's Adam has no AMSGrad variant (DeepSpeed's FusedAdam "
                                    "refuses it too)")
    _refuse_true(params, "maximize", "maximize=true: negate your loss instead")
    if not _flag(params, "fp32_optimizer_states", True):
        raise params.error("fp32_optimizer_states", "false (optimizer state in 16 bits): zfunc keeps the "
                                                    "optimizer state in fp32; remove the key")
    params.mapped("fp32_optimizer_states", "true: zfunc keeps the optimizer state in fp32")
    _performance_keys(params)
    description = (f"zf.optim.{kind}: {'decoupled' if decoupled else 'L2'} weight decay, as DeepSpeed's "
                   f"{name!r}{' with adam_w_mode' if name == 'adam' and decoupled else ''}")
    return OptimizerSpec(kind, hyper, description, fused_adam=not torch_adam)


def _read_lamb(params: Section) -> OptimizerSpec:
    _check_keys(params, _LAMB_KEYS, "DeepSpeed's FusedLamb")
    b1, b2 = _betas(params)
    hyper = {"b1": b1, "b2": b2, "eps": _number(params, "eps", 1e-8),
             "weight_decay": _number(params, "weight_decay", 0.0),
             "bias_correction": _flag(params, "bias_correction", True),
             "eps_inside_sqrt": _flag(params, "eps_inside_sqrt", False),
             "max_coeff": _number(params, "max_coeff", 10.0), "min_coeff": _number(params, "min_coeff", 0.01)}
    for key in ("betas", "eps", "weight_decay", "bias_correction", "eps_inside_sqrt", "max_coeff", "min_coeff"):
        params.mapped(key, f"deepspeed_lamb({key}=...)")
    _refuse_true(params, "amsgrad", "AMSGrad: DeepSpeed's FusedLamb refuses it too")
    return OptimizerSpec("lamb", hyper, "zfunc.deepspeed.deepspeed_lamb: DeepSpeed's FusedLamb update")


def _read_sgd(params: Section) -> OptimizerSpec:
    _check_keys(params, _SGD_KEYS, "torch.optim.SGD")
    hyper = {"momentum": _number(params, "momentum", 0.0), "dampening": _number(params, "dampening", 0.0),
             "weight_decay": _number(params, "weight_decay", 0.0), "nesterov": _flag(params, "nesterov", False)}
    for key in ("momentum", "dampening", "weight_decay", "nesterov"):
        params.mapped(key, f"zf.optim.sgd({key}={hyper[key]})")
    _refuse_true(params, "maximize", "maximize=true: negate your loss instead")
    _performance_keys(params)
    return OptimizerSpec("sgd", hyper, "zf.optim.sgd (torch.optim.SGD's update)")


def read_lr(section: Section) -> float:
    """``optimizer.params.lr`` (DeepSpeed's default 1e-3), read only where something uses it."""
    return _number(section.section("params"), "lr", 1e-3)


def build_optimizer(spec: OptimizerSpec, lr: ScalarOrSchedule) -> GradientTransformation:
    """The zf.optim optimizer of ``spec`` with learning rate ``lr`` (a number or a schedule)."""
    try:
        if spec.kind == "adamw":
            return optim.adamw(lr, **spec.hyper)
        if spec.kind == "adam":
            return optim.adam(lr, **spec.hyper)
        if spec.kind == "sgd":
            return optim.sgd(lr, **spec.hyper)
        return deepspeed_lamb(lr, **spec.hyper)
    except ValueError as err:
        raise DeepSpeedConfigError("optimizer.params", str(err)) from None


# --------------------------------------------------------------------------
# DeepSpeed's LAMB


def deepspeed_lamb(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, bias_correction: bool = True, eps_inside_sqrt: bool = False,
                   max_coeff: float = 10.0, min_coeff: float = 0.01) -> GradientTransformation:
    """LAMB as DeepSpeed's FusedLamb computes it, per parameter tensor::

        m ← b1·m + (1 − b1)·g,   v ← b2·v + (1 − b2)·g²
        u ← m / (√v + eps) + wd·p                   (√(v + eps) with eps_inside_sqrt)
        c ← clamp(‖p‖ / ‖u‖, min_coeff, max_coeff)  (1 where ‖p‖ or ‖u‖ is 0)
        p ← p − lr · √(1 − b2ᵗ) / (1 − b1ᵗ) · c · u  (without the bias factor if not bias_correction)

    It differs from `zf.optim.lamb` (You et al.): the moments in ``u`` are
    not bias-corrected (the correction multiplies the step instead, so
    ``eps`` and the weight decay weigh differently), and the trust ratio is
    clamped. Norms are over whole parameters (`zfunc.primitives.psum` over
    shards). State: ``(ScaleByAdamState, ScaleByLearningRateState)``.
    """
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    for name, value in (("eps", eps), ("weight_decay", weight_decay), ("min_coeff", min_coeff)):
        if not 0.0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if not min_coeff <= max_coeff < math.inf:
        raise ValueError(f"max_coeff ({max_coeff}) must be finite and >= min_coeff ({min_coeff})")
    direction = _deepspeed_lamb_direction(b1, b2, eps, weight_decay, bias_correction, eps_inside_sqrt,
                                          max_coeff, min_coeff)
    descend = scale_by_learning_rate(lr)
    tx = chain(direction, descend)
    return GradientTransformation(tx.init, tx.update, Hyperparams(
        name="deepspeed_lamb", elementwise=False, learning_rate=lr, schedule=descend.hyperparams["schedule"],
        b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
        eps_inside_sqrt=eps_inside_sqrt, max_coeff=max_coeff, min_coeff=min_coeff,
        transforms=tx.hyperparams["transforms"]))


def _deepspeed_lamb_direction(b1, b2, eps, weight_decay, bias_correction, eps_inside_sqrt, max_coeff,
                              min_coeff) -> GradientTransformation:
    def init(params: PyTree) -> ScaleByAdamState:
        first = next(iter(tree_leaves(params)), None)
        count = torch.zeros((), dtype=torch.int64, device=None if first is None else first.device)
        return ScaleByAdamState(count, tree_zeros_like(params), tree_zeros_like(params))

    def update(updates: PyTree, state: ScaleByAdamState, params: PyTree = None):
        from zfunc.primitives import psum  # noqa: PLC0415 (interpret imports optim; see scale_by_trust_ratio)

        if params is None:
            raise ValueError("deepspeed_lamb needs params: call tx.update(updates, state, params)")
        count = state.count + 1
        mu = tree_map(lambda m, g: (b1 * m + (1 - b1) * g.to(m.dtype)), state.mu, updates)
        nu = tree_map(lambda v, g: (b2 * v + (1 - b2) * g.to(v.dtype) * g.to(v.dtype)), state.nu, updates)

        def raw_update(m: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
            return m / denom + weight_decay * p.to(m.dtype)

        directions = tree_map(raw_update, mu, nu, params)
        d_leaves, treedef = tree_flatten(directions)
        p_leaves = tree_leaves(params)
        if not d_leaves:
            return directions, ScaleByAdamState(count, mu, nu)
        squares = [x.float().square().sum() for x in p_leaves + d_leaves]
        norms = psum(torch.stack(squares)).sqrt()
        param_norms, update_norms = norms[: len(p_leaves)], norms[len(p_leaves):]
        coeff = (param_norms / update_norms).clamp(min_coeff, max_coeff)
        coeff = torch.where((param_norms == 0) | (update_norms == 0), 1.0, coeff)
        if bias_correction:
            t = count.to(torch.float64)
            coeff = coeff * ((1 - b2 ** t).sqrt() / (1 - b1 ** t)).to(coeff.dtype)
        scaled = [d * c.to(d.dtype) for d, c in zip(d_leaves, coeff.unbind())]
        return tree_unflatten(treedef, scaled), ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update, Hyperparams(name="deepspeed_lamb_direction", elementwise=False))
