"""On a GPU: gradients leave the GPU as backward makes them (`offload` under `shard`, one micro-batch).

    NCCL_NVLS_ENABLE=0 python tests/gpu/grad_tiers.py [--width 2048 --depth 16]

One process, one GPU. ``shard(offload(checkpoint(mixed_precision(step, "bf16")), device_fraction=0), stage=3)``
keeps the whole optimizer state on the host. Each unit's gradient goes to the host as its backward ends (the
step's sink), so the GPU never holds the model's full gradient: the peak a step allocates above what the
state holds stays below the full gradient's bytes plus the activations and a few units. The control is the
same step with the sink switched off (the gradients kept on the GPU until the update streams them down).
Both must train to the same weights, element-wise; the script prints peaks and step times and exits
nonzero on a failure.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard
from zfunc.transforms.offload import offload as offload_cls


class Deep(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, 1000, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def run(args, sink: bool, k: int) -> dict:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Deep(args.width, args.depth)
    apply_fn, params = zf.functional(model, init="reset_parameters")

    def loss_fn(p, ids):
        return F.cross_entropy(apply_fn(p, ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())

    def train_step(state, ids):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, ids)
        return state.apply_gradients(grads), {"loss": loss}

    inner = mixed_precision(accumulate(train_step, k) if k > 1 else train_step, "bf16")
    step = shard(offload(checkpoint(inner), device_fraction=0.0), stage=3)
    start = offload_cls.start
    if not sink:
        offload_cls.start = lambda self, ctx, state: None
    try:
        state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-4, weight_decay=0.1)), init_device="cuda")
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 1000, (args.rows, 129), generator=g).cuda() for _ in range(args.steps)]
        times = []
        for i, ids in enumerate(batches):
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t = time.perf_counter()
            state, metrics = step(state, ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() - before
        weights = {key: v.float().cpu() for key, v in step.gather(state).items()}
    finally:
        offload_cls.start = start
    grad_bytes = 2 * sum(v.numel() for v in params.values())
    return {"peak": peak, "grad_bytes": grad_bytes, "step_s": sorted(times[1:])[len(times[1:]) // 2],
            "weights": weights}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    failures = []
    try:
        fed, held = run(args, True, 1), run(args, False, 1)
        print(f"one micro-batch: peak above the state {fed['peak'] / 2**30:.2f} GiB (gradients to the host as "
              f"made) vs {held['peak'] / 2**30:.2f} GiB (held on the GPU); full bf16 gradient "
              f"{fed['grad_bytes'] / 2**30:.2f} GiB; step {fed['step_s'] * 1e3:.0f} vs {held['step_s'] * 1e3:.0f} ms",
              flush=True)
        # (a unit's gradient is freed once its copy to the host has landed: on a model this small, whose backward
        # outruns the copies, several are in flight at once, so the bound is a quarter of the whole gradient)
        if not fed["peak"] + fed["grad_bytes"] / 4 < held["peak"]:
            failures.append("the sink did not keep the full gradient off the GPU")
        for key, w in held["weights"].items():
            if not torch.equal(fed["weights"][key], w):
                failures.append(f"{key} differs: max {(fed['weights'][key] - w).abs().max().item():.3g}")
                break
        two = run(args, True, 2)  # two micro-batches: fp32 sums on the host (HostAdder), kept buffers
        print(f"two micro-batches: peak above the state {two['peak'] / 2**30:.2f} GiB; step "
              f"{two['step_s'] * 1e3:.0f} ms", flush=True)
    finally:
        dist.destroy_process_group()
    print("\n".join(failures) or "grad_tiers: OK", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
