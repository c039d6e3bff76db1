"""On a GPU: a NaN loss skips the step's update on the device; the next call raises, the state kept.

Run: ``torchrun --nproc-per-node N tests/gpu/nonfinite_loss.py`` (N = 1 or 2). Prints ``ok`` per stack
and exits non-zero on a failure. CPU tests cover the same semantics (tests/test_adversarial_nonfinite.py);
this covers the GPU route, where the count of non-finite losses is the update kernel's skip flag and
reaches the host behind a CUDA event, read at the next call (`zfunc.donation.Pending`).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from zfunc.transforms import accumulate, mixed_precision, shard


def main() -> int:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    failures = 0
    for name, wrap in {"bf16": lambda s: mixed_precision(s, "bf16"),
                       "s2-bf16": lambda s: shard(mixed_precision(s, "bf16"), stage=2),
                       "s3-accumulate": lambda s: shard(accumulate(s, 2), stage=3)}.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
        apply_fn, params = zf.functional(model)

        def step(state, batch):
            loss, grads = zf.value_and_grad(lambda p, b: F.mse_loss(apply_fn(p, b[0]), b[1]) * b[2].mean())(
                state.params, batch)
            return state.apply_gradients(grads), {"loss": loss}

        stepped = wrap(step)
        state = stepped.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.adamw(1e-2)))
        x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
        good = torch.ones(8, device="cuda")
        state, _ = stepped(state, (x, y, good))
        before = stepped.gather(state)
        # Under shard the last rank's loss alone is NaN and every rank must stop; unsharded, each process is its
        # own run: all of them get the NaN.
        poisoned = name == "bf16" or rank == dist.get_world_size() - 1
        bad = torch.full((8,), float("nan") if poisoned else 1.0, device="cuda")
        state, _ = stepped(state, (x, y, bad))  # skipped on the device, no host wait; the next call raises
        try:
            stepped(state, (x, y, good))
            ok, why = False, "no error"
        except FloatingPointError as err:
            after = stepped.gather(state)
            ok = all(torch.equal(after[k], v) for k, v in before.items())
            why = "state changed" if not ok else str(err)[:80]
            state, _ = stepped(state, (x, y, good))  # and the run goes on
            ok = ok and all(torch.isfinite(v).all() for v in stepped.gather(state).values())
        print(f"rank {rank} {name:14s} {'ok' if ok else 'FAIL'}  {why}", flush=True)
        failures += not ok
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
