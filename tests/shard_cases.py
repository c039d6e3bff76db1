"""Shared set-up of the shard tests: a step, its reference, and state accounting."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zfunc as zf
from tests.models import make_batch, tiny_lm_step

BATCH = 8
STEPS = 3


def optimizer(kind: str = "adamw"):
    if kind == "clip":
        return zf.optim.chain(zf.optim.clip_by_global_norm(0.05), zf.optim.adamw(1e-2, weight_decay=0.1))
    if kind == "clip+schedule":  # the usual recipe: clip, then AdamW on a schedule
        return zf.optim.chain(zf.optim.clip_by_global_norm(0.5),
                              zf.optim.adamw(zf.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1))
    if kind == "sgd":
        return zf.optim.sgd(0.1, momentum=0.9, nesterov=True)
    return zf.optim.adamw(zf.optim.warmup_cosine(2e-2, 1, 10), weight_decay=0.1)


def build(opt_kind: str = "adamw", dropout: float = 0.0):
    """A fresh (model-independent) train step and plain state, identical on every rank."""
    _, params, train_step = tiny_lm_step(dropout)
    params = {k: v.clone() for k, v in params.items()}  # steps may update in place: keep the model intact
    return train_step, zf.TrainState.create(params, optimizer(opt_kind))


def local_batch(i: int, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in make_batch(BATCH, seed=i).items()}


def reference_params(opt_kind: str = "adamw", steps: int = STEPS) -> dict:
    step, state = build(opt_kind)
    for i in range(steps):
        state, _ = step(state, make_batch(BATCH, seed=i))
    return {k: v.clone() for k, v in state.params.items()}


def rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def state_bytes(state) -> int:
    """Bytes of distinct tensor storage the state holds (views of one buffer counted once)."""
    seen, total = set(), 0
    for leaf in zf.tree.tree_leaves(state):
        if isinstance(leaf, torch.Tensor) and leaf.numel():
            storage = leaf.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def to_numpy(tree: dict) -> dict:
    return {k: v.detach().float().cpu().numpy().copy() for k, v in tree.items()}
