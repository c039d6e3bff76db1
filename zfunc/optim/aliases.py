"""Ready-made optimizers: chains of `transforms`, matching torch.optim element-wise.

Each alias validates its arguments (ValueError saying what to change) and
returns a `GradientTransformation` whose ``hyperparams`` name it and carry
its arguments. For ``adam``/``adamw`` these are what a fused kernel needs::

    tx.hyperparams["name"]          "adam" | "adamw"
    tx.hyperparams["mode"]          "adam" (L2 added to the gradient) | "adamw" (decoupled decay)
    tx.hyperparams["schedule"]      count -> lr (float32 0-d); ["learning_rate"]: as passed
    tx.hyperparams["b1"], ["b2"], ["eps"], ["weight_decay"], ["mask"]

and their state is ``(EmptyState(), ScaleByAdamState(count, mu, nu),
ScaleByLearningRateState(count, learning_rate))`` for adam and
``(ScaleByAdamState(...), ScaleByLearningRateState(...))`` for adamw, the
same layout whatever the weight decay.
"""

from __future__ import annotations

from collections.abc import Mapping

from zfunc.optim.base import GradientTransformation, Hyperparams, chain, identity
from zfunc.optim.checks import beta as _beta
from zfunc.optim.checks import flag as _flag
from zfunc.optim.checks import nonnegative as _nonnegative
from zfunc.optim.checks import number as _number
from zfunc.optim.fused import AdamSpec
from zfunc.optim.schedules import ScalarOrSchedule
from zfunc.optim.transforms import (
    Mask,
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_trust_ratio,
    trace,
)


def _learning_rate(lr: ScalarOrSchedule) -> ScalarOrSchedule:
    if callable(lr):
        return lr
    return _nonnegative("lr", lr, "to ascend instead of descend, negate the loss")


def _mask(mask: Mask) -> Mask:
    if mask is not None and not callable(mask) and not isinstance(mask, Mapping):
        raise TypeError(f"mask must be None, a callable name -> bool or a dict name -> bool, "
                        f"got {type(mask).__name__}")
    return mask


def _named(tx: GradientTransformation, fused=None, **hyperparams) -> GradientTransformation:
    """``tx`` with ``hyperparams`` describing the alias (its parts stay under ``transforms``) and
    its fused form, if a kernel runs it."""
    return GradientTransformation(tx.init, tx.update,
                                  Hyperparams(**hyperparams, transforms=tx.hyperparams["transforms"]), fused)


def sgd(lr: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
        dampening: float = 0.0) -> GradientTransformation:
    """Stochastic gradient descent, as torch.optim.SGD::

        g ← g + wd·p                               (if weight_decay)
        b ← g on the first step, then b ← momentum·b + (1 − dampening)·g
        g ← g + momentum·b if nesterov else b      (if momentum)
        p ← p − lr·g

    State: ``(EmptyState(), TraceState(count, trace), ScaleByLearningRateState(count,
    learning_rate))``; without momentum the middle part is ``EmptyState()``.
    """
    lr = _learning_rate(lr)
    momentum = _nonnegative("momentum", momentum)
    weight_decay = _nonnegative("weight_decay", weight_decay)
    nesterov = _flag("nesterov", nesterov)
    dampening = _number("dampening", dampening)
    if not 0.0 <= dampening <= 1.0:
        raise ValueError(f"dampening must be in [0, 1], got {dampening}")
    if nesterov and (momentum == 0 or dampening != 0):
        raise ValueError("nesterov=True needs momentum > 0 and dampening = 0 (as torch.optim.SGD); "
                         f"got momentum={momentum}, dampening={dampening}")
    if dampening != 0 and momentum == 0:
        raise ValueError(f"dampening={dampening} has no effect without momentum; set momentum > 0 or drop it")
    descend = scale_by_learning_rate(lr)
    tx = chain(
        add_decayed_weights(weight_decay),
        trace(momentum, nesterov=nesterov, dampening=dampening) if momentum else identity(),
        descend,
    )
    return _named(tx, name="sgd", elementwise=True, learning_rate=lr,
                  schedule=descend.hyperparams["schedule"],
                  momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, dampening=dampening)


def _check_adam(lr, b1, b2, eps, weight_decay):
    return (_learning_rate(lr), _beta("b1", b1), _beta("b2", b2), _nonnegative("eps", eps),
            _nonnegative("weight_decay", weight_decay))


def adam(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         weight_decay: float = 0.0) -> GradientTransformation:
    """Adam with L2 regularization, as torch.optim.Adam::

        g ← g + wd·p
        m ← b1·m + (1 − b1)·g,   v ← b2·v + (1 − b2)·g²
        p ← p − lr · (m / (1 − b1ᵗ)) / (√v / √(1 − b2ᵗ) + eps)

    ``t`` is the 1-based step. See the module docstring for ``hyperparams`` and the state layout.
    """
    lr, b1, b2, eps, weight_decay = _check_adam(lr, b1, b2, eps, weight_decay)
    descend = scale_by_learning_rate(lr)
    tx = chain(add_decayed_weights(weight_decay), scale_by_adam(b1, b2, eps), descend)
    # State: (EmptyState, ScaleByAdamState, ScaleByLearningRateState).
    fused = AdamSpec("adam", b1, b2, eps, weight_decay, None, descend.hyperparams["schedule"], (1,), (2,))
    return _named(tx, fused, name="adam", mode="adam", elementwise=True, learning_rate=lr,
                  schedule=descend.hyperparams["schedule"],
                  b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=None)


def adamw(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.01, mask: Mask = None) -> GradientTransformation:
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW::

        m ← b1·m + (1 − b1)·g,   v ← b2·v + (1 − b2)·g²
        p ← p·(1 − lr·wd) − lr · (m / (1 − b1ᵗ)) / (√v / √(1 − b2ᵗ) + eps)

    ``mask`` (a callable ``name -> bool`` or a dict of bools keyed by
    parameter name) limits the decay to some parameters, e.g.
    ``mask=lambda name: not name.endswith("bias")``. It sees names, not
    shapes: under `shard` every leaf is a 1-D shard.
    See the module docstring for ``hyperparams`` and the state layout.
    """
    lr, b1, b2, eps, weight_decay = _check_adam(lr, b1, b2, eps, weight_decay)
    mask = _mask(mask)
    descend = scale_by_learning_rate(lr, decoupled_weight_decay=weight_decay, mask=mask)
    tx = chain(scale_by_adam(b1, b2, eps), descend)
    # State: (ScaleByAdamState, ScaleByLearningRateState).
    fused = AdamSpec("adamw", b1, b2, eps, weight_decay, mask, descend.hyperparams["schedule"], (0,), (1,))
    return _named(tx, fused, name="adamw", mode="adamw", elementwise=True, learning_rate=lr,
                  schedule=descend.hyperparams["schedule"],
                  b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)


def lamb(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         weight_decay: float = 0.0, mask: Mask = None) -> GradientTransformation:
    """LAMB (You et al., 2020), per parameter tensor (leaf)::

        m ← b1·m + (1 − b1)·g,   v ← b2·v + (1 − b2)·g²
        r ← (m / (1 − b1ᵗ)) / (√v / √(1 − b2ᵗ) + eps) + wd·p
        p ← p − lr · (‖p‖ / ‖r‖) · r        (ratio 1 where ‖p‖ or ‖r‖ is 0)

    Norms are over whole parameters (all shards). ``mask`` as in `adamw`.
    State: ``(ScaleByAdamState, EmptyState, EmptyState, ScaleByLearningRateState)``.
    """
    lr, b1, b2, eps, weight_decay = _check_adam(lr, b1, b2, eps, weight_decay)
    mask = _mask(mask)
    descend = scale_by_learning_rate(lr)
    tx = chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask), scale_by_trust_ratio(),
               descend)
    return _named(tx, name="lamb", elementwise=False, learning_rate=lr,
                  schedule=descend.hyperparams["schedule"],
                  b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
