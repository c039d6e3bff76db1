"""What a stack of transforms does, as its transforms declare it: one frozen `Facts` per stack.

Facts about the stack are computed once, when the stack is built (`zfunc.interpret.Stack`): each
transform declares what it does (`Transform.declare`), from the innermost out, into one `Facts`; no
transform looks another up by name or type, and the planner (`zfunc.plan`) reads all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from zfunc.compiled import init_fields, replaced

Tier = Literal["device", "host", "nvme"]


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a stack of transforms does, as its transforms declare it (see `Transform.declare`).

    Attributes:
      compute_dtype: the dtype the model computes in (`mixed_precision`; None: the params' own).
      master_dtype: the dtype of the master parameters the optimizer updates (None: the params').
      reduce_dtype: the dtype gradients are reduced in across ranks (None: the gradients' own).
      loss_scaling: "none", "static" or "dynamic" (fp16 `mixed_precision`).
      stage: the ZeRO stage of `shard` (0 without shard).
      optimizer_tier: where the optimizer state and its update live ("device", "host", "nvme"): the
        tier holding most of it.
      optimizer_split: the shares (device, host, nvme) of the optimizer state (master and moments),
        placed unit by unit (`shard` places them; the update runs where each unit lives).
      nvme_dir: the directory of the NVMe tier's files.
      params_tier: where parameter shards live between their uses (stage 3).
      fused_update: whether the optimizer may run as a fused in-place kernel (the stack owns the
        state's buffers, which the step consumes); False keeps the pure pytree update.
      micro_batches: forward/backward passes per update (`accumulate`).
      accumulates: whether `accumulate` sums the gradients in its own accumulator.
      accumulate_dtype: the dtype `accumulate` was asked to sum in (None: fp32 under a narrower compute
        dtype, else the compute dtype; `zfunc.transforms.grad_accumulator.accumulation_dtype`).
      recompute: whether the model's blocks are recomputed in backward (`checkpoint`, or stage 3
        with ``reshard="recompute"``): activations of one block, not of all.
      pp: the pipeline-parallel degree (`pipeline`): each rank holds the parameters of its stages only, and
        the loss exists on the last stage (which is why `pipeline` checks it for NaN itself).
      tp: the tensor-parallel degree (`tensor_parallel`): sharded parameters hold 1/tp of their elements.
    """

    compute_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    loss_scaling: Literal["none", "static", "dynamic"] = "none"
    stage: int = 0
    optimizer_tier: Tier = "device"
    optimizer_split: tuple[float, float, float] = (1.0, 0.0, 0.0)
    nvme_dir: str | None = None
    params_tier: Tier = "device"
    fused_update: bool | None = None  # None: nobody declared; the pure update
    micro_batches: int = 1
    accumulates: bool = False
    accumulate_dtype: torch.dtype | None = None
    recompute: bool = False
    pp: int = 1
    tp: int = 1

    def replace(self, **changes: Any) -> Facts:
        return replaced(self, _FIELDS, changes)  # (dataclasses.replace: see `zfunc.compiled.replaced`)


_FIELDS = init_fields(Facts)
