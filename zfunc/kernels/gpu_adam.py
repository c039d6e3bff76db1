"""Fused Adam/AdamW over many CUDA tensors in a few launches.

`adam_` runs torch's multi-tensor fused Adam/AdamW CUDA kernels
(``torch._fused_adam_``/``torch._fused_adamw_``, the kernels behind
``torch.optim.AdamW(fused=True)``) over lists of flat shards: one launch per
~dozens of tensors instead of a dozen elementwise launches per tensor in the
pytree path. The learning rate and step are device tensors, so nothing syncs
with the host and CUDA graphs stay valid.

Math (t = step, the 1-based update index; mode "adamw")::

    p ← p·(1 − lr·wd);  m ← b1·m + (1 − b1)·g;  v ← b2·v + (1 − b2)·g²
    p ← p − lr · (m / (1 − b1ᵗ)) / (√v / √(1 − b2ᵗ) + eps)

mode "adam" adds ``wd·p`` to ``g`` first instead of decaying ``p``.
"""

from __future__ import annotations

import torch


def adam_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
          exp_avg_sqs: list[torch.Tensor], *, lr: torch.Tensor, step: torch.Tensor, beta1: float,
          beta2: float, eps: float, weight_decay: float, mode: str = "adamw",
          grad_scale: torch.Tensor | None = None) -> None:
    """In-place fused update of fp32 CUDA tensors (all lists the same length and shapes).

    ``grad_scale``: gradients are divided by it first (a loss scale, or a
    gradient-clipping divisor), inside the same kernel.
    """
    if mode not in ("adam", "adamw"):
        raise ValueError(f"mode must be 'adam' or 'adamw', got {mode!r}")
    if not params:
        return
    for name, group in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if any(not t.is_cuda for t in group):
            raise ValueError(f"adam_: {name} must be CUDA tensors; use zfunc.kernels.cpu_adam on the host")
    device = params[0].device
    steps = [step.to(device=device, dtype=torch.float32)] * len(params)
    kernel = torch._fused_adamw_ if mode == "adamw" else torch._fused_adam_
    scale = None if grad_scale is None else grad_scale.to(device=device, dtype=torch.float32).reshape(())
    kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr.to(device=device, dtype=torch.float32),
           beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
           grad_scale=scale)
