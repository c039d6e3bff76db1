"""Building blocks of optimizers, each a `GradientTransformation` with its math.

Notation: ``u`` the incoming updates (gradients at the head of a chain),
``p`` the parameters, ``t`` the 1-based step number (``count + 1``).
Every function is pure: it builds new tensors and never writes into
``updates``, ``state`` or ``params``.

Where the order of floating-point operations is a choice, it follows
torch.optim (see each docstring), so that the aliases in `aliases` match
torch.optim element-wise to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from zfunc.interpret import psum, sum_of_squares
from zfunc.optim import checks
from zfunc.optim.base import EmptyState, GradientTransformation, Hyperparams, first_device
from zfunc.optim.schedules import ScalarOrSchedule, as_schedule
from zfunc.tree import (
    PyTree,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_map_with_path,
    tree_unflatten,
    tree_zeros_like,
)

Mask = Callable[[str], bool] | Mapping | None


def _zero_count(params: PyTree) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=first_device(params))


def _require_params(params: PyTree, who: str) -> None:
    if params is None:
        raise ValueError(f"{who} needs params: call tx.update(updates, state, params)")


# --------------------------------------------------------------------------
# Clipping


def global_norm(tree: PyTree) -> torch.Tensor:
    """‖tree‖₂ = sqrt(Σ_leaves Σ x²), over all shards when run under `shard` (`zfunc.psum`) and over
    the tp ranks under `tensor_parallel` (each replicated parameter counted once: `sum_of_squares`)."""
    return psum(sum_of_squares(tree)).sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates together so that their global L2 norm is at most ``max_norm``.

    ``n = ‖u‖₂`` over every element of every leaf (over all shards under
    `shard`, via `global_norm`), then ``u ← u · min(1, max_norm / (n + 1e-6))``,
    as ``torch.nn.utils.clip_grad_norm_``. No state.

    ``max_norm`` must be a finite number > 0 (NaN would turn every update into
    NaN, inf or 0 would clip nothing or everything); to clip nothing, leave
    the transformation out of the chain.
    """
    max_norm = checks.positive("max_norm", max_norm,
                               "to turn clipping off, leave clip_by_global_norm out of the chain")

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None):
        scale = (max_norm / (global_norm(updates) + 1e-6)).clamp(max=1.0)
        return tree_map(lambda u: u * scale.to(u.dtype), updates), state

    return GradientTransformation(init, update, Hyperparams(
        name="clip_by_global_norm", elementwise=True, max_norm=max_norm))


# --------------------------------------------------------------------------
# Adam


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # int64 0-d: updates applied so far
    mu: PyTree           # first moment m, like params
    nu: PyTree           # second moment v, like params


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction (Kingma & Ba), before the learning rate::

        m ← b1·m + (1 − b1)·u            (as torch: m.lerp(u, 1 − b1))
        v ← b2·v + (1 − b2)·u²
        u ← (m / (1 − b1ᵗ)) / (√v / √(1 − b2ᵗ) + eps)

    Bias corrections are computed in float64 from the tensor count.
    """
    b1, b2, eps = checks.beta("b1", b1), checks.beta("b2", b2), checks.nonnegative("eps", eps)

    def init(params: PyTree) -> ScaleByAdamState:
        return ScaleByAdamState(_zero_count(params), tree_zeros_like(params), tree_zeros_like(params))

    def update(updates: PyTree, state: ScaleByAdamState, params: PyTree = None):
        count = state.count + 1
        t = count.to(torch.float64)
        bias_correction1 = 1 - b1 ** t
        bias_correction2_sqrt = (1 - b2 ** t).sqrt()
        # Moments keep the parameters' dtype (as torch.optim); lerp needs u in that dtype too.
        mu = tree_map(lambda m, u: torch.lerp(m, u.to(m.dtype), 1 - b1), state.mu, updates)
        nu = tree_map(lambda v, u: (v * b2).addcmul(u, u, value=1 - b2).to(v.dtype), state.nu, updates)

        # The corrections are cast to the moments' dtype first, as torch casts its Python
        # floats (and so that a 0-d parameter does not promote to float64).
        def direction(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            denom = (v.sqrt() / bias_correction2_sqrt.to(v.dtype)) + eps
            return (m / bias_correction1.to(m.dtype)) / denom

        return tree_map(direction, mu, nu), ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update,
                                  Hyperparams(name="scale_by_adam", elementwise=True, b1=b1, b2=b2, eps=eps))


# --------------------------------------------------------------------------
# Weight decay


def parameter_name(path: tuple) -> str:
    """The name of a leaf from its key path: keys joined by '.' (a flat dict's key as is)."""
    return ".".join(str(key) for key in path)


def decay_mask(mask: Mask, params: PyTree) -> PyTree:
    """A tree of Python bools like ``params``: True where weight decay applies.

    ``mask`` is None (decay everything), a callable ``name -> bool`` or a
    mapping ``name -> bool`` that must name every parameter (see `parameter_name`).
    """
    if mask is None:
        return tree_map(lambda p: True, params)
    if callable(mask):
        def decides(name: str) -> bool:
            return bool(mask(name))
    elif isinstance(mask, Mapping):
        def decides(name: str) -> bool:
            if name not in mask:
                raise ValueError(f"weight decay mask has no entry for parameter {name!r}; "
                                 f"give every parameter a bool, or pass a callable name -> bool")
            return bool(mask[name])
    else:
        raise TypeError(f"mask must be None, a callable name -> bool or a dict name -> bool, "
                        f"got {type(mask).__name__}")
    if isinstance(params, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items()):
        # A flat dict of tensors (every state zfunc makes): its keys are the names. (Not through the paths of
        # `tree_map_with_path`, which under torch.compile's dynamo, in its polyfill of optree, are not the
        # keys: every name would be wrong, and a mask would silently decay nothing.)
        return {k: decides(k) for k in params}
    return tree_map_with_path(lambda path, p: decides(parameter_name(path)), params)


def add_decayed_weights(weight_decay: float, mask: Mask = None) -> GradientTransformation:
    """L2-style weight decay added to the updates: ``u ← u + wd·p`` where ``mask`` says so.

    Computed as torch.optim does (``u.add(p, alpha=wd)``). ``mask`` selects
    parameters by *name* (a callable ``name -> bool`` or a dict of bools; see
    `decay_mask`), never by shape or ndim: under `shard` every leaf is a 1-D
    shard, so "decay only matrices" must be written with names (e.g.
    ``lambda name: not name.endswith("bias")``). No state.
    """
    weight_decay = checks.nonnegative("weight_decay", weight_decay)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None):
        if weight_decay == 0:  # static: keeps the same state layout whatever the value
            return updates, state
        _require_params(params, "add_decayed_weights")
        selected = decay_mask(mask, params)
        decayed = tree_map(lambda u, p, on: u.add(p, alpha=weight_decay) if on else u,
                           updates, params, selected)
        return decayed, state

    return GradientTransformation(init, update, Hyperparams(
        name="add_decayed_weights", elementwise=True, weight_decay=weight_decay, mask=mask))


# --------------------------------------------------------------------------
# Learning rate


class ScaleByLearningRateState(NamedTuple):
    count: torch.Tensor          # int64 0-d: updates applied so far
    learning_rate: torch.Tensor  # float32 0-d: the rate of the latest update (before any: of the first)


def learning_rate(opt_state: Any) -> torch.Tensor:
    """The learning rate (float32 0-d tensor) held in an optimizer state.

    It is the ``learning_rate`` field of the one `ScaleByLearningRateState`
    inside ``opt_state``: the rate the most recent update used (before any
    update, the rate the first update will use). Raises ValueError if the
    state holds none or several.
    """
    found = [s for s in _walk_states(opt_state) if isinstance(s, ScaleByLearningRateState)]
    if len(found) != 1:
        raise ValueError(
            f"learning_rate() needs exactly one ScaleByLearningRateState in the optimizer state, found "
            f"{len(found)}; pass the opt_state of an optimizer built with scale_by_learning_rate "
            f"(sgd, adam, adamw, lamb)")
    return found[0].learning_rate


def _walk_states(state: Any):
    """Every NamedTuple state nested in tuples, lists and dicts (depth first)."""
    yield state
    if isinstance(state, (tuple, list)):
        for part in state:
            yield from _walk_states(part)
    elif isinstance(state, dict):
        for part in state.values():
            yield from _walk_states(part)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, decoupled_weight_decay: float = 0.0,
                           mask: Mask = None) -> GradientTransformation:
    """Descend: ``lr = schedule(count)``, then ``u ← −lr·u``.

    With ``decoupled_weight_decay = λ`` it also applies AdamW's decay to the
    parameters that ``mask`` selects (by name, as in `add_decayed_weights`)::

        u ← −lr·u − lr·λ·p

    How it is computed, when ``params`` are given: as the exact difference
    between the new parameter in torch.optim's order and the old one, ::

        p' = p·(1 − lr·λ) + (−lr)·u        (one fused multiply-add, as torch's p.add_(u, alpha=−lr))
        u  ← p' − p                         (exact whenever p' and p are within a factor 2)

    so that `apply_updates` (``p + u``) lands on torch's ``p'`` bit for bit
    in almost every element instead of rounding ``−lr·u`` first; without
    ``params`` it returns ``−lr·u`` (and refuses a decay).

    ``learning_rate`` is a number or a schedule (`zfunc.optim.schedules`).
    The state records the rate used, readable with `zfunc.optim.learning_rate`.
    """
    schedule = as_schedule(learning_rate)
    decoupled_weight_decay = checks.nonnegative("decoupled_weight_decay", decoupled_weight_decay)

    def init(params: PyTree) -> ScaleByLearningRateState:
        count = _zero_count(params)
        lr = schedule(count)
        checks.first_rate(lr, count)
        return ScaleByLearningRateState(count, lr)

    def update(updates: PyTree, state: ScaleByLearningRateState, params: PyTree = None):
        lr = schedule(state.count)
        neg_lr = -lr
        if params is None:
            if decoupled_weight_decay:
                raise ValueError("scale_by_learning_rate(decoupled_weight_decay=...) needs params: "
                                 "call tx.update(updates, state, params)")
            return tree_map(lambda u: neg_lr * u, updates), ScaleByLearningRateState(state.count + 1, lr)
        if decoupled_weight_decay:
            # 1 − lr·λ rounded once to fp32, like torch's Python-float factor.
            keep = (1 - lr.to(torch.float64) * decoupled_weight_decay).to(lr.dtype)
            selected = decay_mask(mask, params)
        else:
            keep, selected = None, tree_map(lambda p: False, params)

        def descend(u: torch.Tensor, p: torch.Tensor, decay: bool) -> torch.Tensor:
            start = p * keep if decay else p
            # addcmul with a 0-d tensor factor is the same fused multiply-add as add(alpha=...)
            # and, unlike alpha, takes a tensor lr (no recompiles).
            # (the cast only matters for 0-d leaves, which the fp32 0-d lr would otherwise promote)
            return (torch.addcmul(start, u, neg_lr) - p).to(torch.promote_types(u.dtype, p.dtype))

        descended = tree_map(descend, updates, params, selected)
        return descended, ScaleByLearningRateState(state.count + 1, lr)

    return GradientTransformation(init, update, Hyperparams(
        name="scale_by_learning_rate", elementwise=True, learning_rate=learning_rate, schedule=schedule,
        decoupled_weight_decay=decoupled_weight_decay, mask=mask))


# --------------------------------------------------------------------------
# Momentum


class TraceState(NamedTuple):
    count: torch.Tensor  # int64 0-d: updates applied so far
    trace: PyTree        # momentum buffer b, like params


def trace(momentum: float, nesterov: bool = False, dampening: float = 0.0) -> GradientTransformation:
    """Heavy-ball momentum with torch.optim.SGD's semantics::

        b ← u                                  on the first update
        b ← momentum·b + (1 − dampening)·u     afterwards
        u ← u + momentum·b   if nesterov   else   u ← b
    """
    momentum = checks.nonnegative("momentum", momentum)
    nesterov = checks.flag("nesterov", nesterov)
    dampening = checks.unit_interval("dampening", dampening)

    def init(params: PyTree) -> TraceState:
        return TraceState(_zero_count(params), tree_zeros_like(params))

    def update(updates: PyTree, state: TraceState, params: PyTree = None):
        def new_buffer(b: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            running = (b * momentum).add(u, alpha=1 - dampening).to(b.dtype)
            if dampening == 0:
                # From b = 0 the running formula gives exactly u on the first update.
                return running
            return torch.where(state.count == 0, u.to(b.dtype), running)

        buffers = tree_map(new_buffer, state.trace, updates)
        if nesterov:
            out = tree_map(lambda u, b: u.add(b, alpha=momentum), updates, buffers)
        else:
            out = buffers
        return out, TraceState(state.count + 1, buffers)

    return GradientTransformation(init, update, Hyperparams(
        name="trace", elementwise=True, momentum=momentum, nesterov=nesterov, dampening=dampening))


# --------------------------------------------------------------------------
# Trust ratio (LAMB)


def scale_by_trust_ratio(trust_coefficient: float = 1.0, eps: float = 0.0) -> GradientTransformation:
    """LAMB's layer-wise trust ratio, per leaf::

        r = trust_coefficient · ‖p‖₂ / (‖u‖₂ + eps),   r = 1 where ‖p‖ = 0 or ‖u‖ = 0
        u ← r · u

    The per-leaf sums of squares of ``p`` and ``u`` are stacked into one
    tensor and summed over shards by a single `zfunc.interpret.psum`, so
    under `shard` the norms are those of the whole parameters. Not
    elementwise (each leaf needs its own norms). No state.
    """
    trust_coefficient = checks.positive("trust_coefficient", trust_coefficient)
    eps = checks.nonnegative("eps", eps)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree = None):
        _require_params(params, "scale_by_trust_ratio")
        u_leaves, treedef = tree_flatten(updates)
        p_leaves = tree_leaves(params)
        if len(p_leaves) != len(u_leaves):
            raise ValueError(f"scale_by_trust_ratio: {len(u_leaves)} update leaves, {len(p_leaves)} params")
        if not u_leaves:
            return updates, state
        squares = [x.float().square().sum() for x in p_leaves + u_leaves]
        norms = psum(torch.stack(squares)).sqrt()
        param_norms, update_norms = norms[: len(p_leaves)], norms[len(p_leaves):]
        ratio = trust_coefficient * param_norms / (update_norms + eps)
        ratio = torch.where((param_norms == 0) | (update_norms == 0), 1.0, ratio)
        scaled = [u * r.to(u.dtype) for u, r in zip(u_leaves, ratio.unbind())]
        return tree_unflatten(treedef, scaled), state

    return GradientTransformation(init, update, Hyperparams(
        name="scale_by_trust_ratio", elementwise=False, trust_coefficient=trust_coefficient, eps=eps))
