"""Optimizers as pure pytree functions (optax's design, torch tensors).

    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0),
    zf.optim.adamw(zf.optim.warmup_cosine(3e-4, 100, 10_000), weight_decay=0.1))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = zf.optim.apply_updates(params, updates)
    zf.optim.learning_rate(opt_state)       # the rate of that update, a float32 0-d tensor

Files: `base` (protocol, chain, apply_updates), `transforms` (building
blocks), `aliases` (sgd, adam, adamw, lamb), `schedules` (count -> lr);
`cuda_graphed(tx)` runs a fused update on one GPU as a CUDA graph's replay
(`update_graph`).
"""

from zfunc.optim.aliases import adam, adamw, lamb, sgd
from zfunc.optim.base import EmptyState, GradientTransformation, Hyperparams, apply_updates, chain, identity
from zfunc.optim.schedules import (
    Schedule,
    as_schedule,
    constant,
    linear_one_cycle,
    lr_range_test,
    one_cycle,
    warmup,
    warmup_cosine,
    warmup_cosine_ratio,
    warmup_decay,
)
from zfunc.optim.transforms import (
    ScaleByAdamState,
    ScaleByLearningRateState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    decay_mask,
    learning_rate,
    parameter_name,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_trust_ratio,
    trace,
)
from zfunc.optim.update_graph import cuda_graphed

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "Hyperparams",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "Schedule",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "as_schedule",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cuda_graphed",
    "decay_mask",
    "identity",
    "lamb",
    "learning_rate",
    "linear_one_cycle",
    "lr_range_test",
    "one_cycle",
    "parameter_name",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_trust_ratio",
    "sgd",
    "trace",
    "warmup",
    "warmup_cosine",
    "warmup_cosine_ratio",
    "warmup_decay",
]
