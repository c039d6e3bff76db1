"""Peak live tensor memory of a ZeRO-3 step, eager vs torch.compile, on CPU with 2 gloo ranks.

    python benchmarks/compile_memory.py [--backend aot_eager|inductor] [--blocks 6] [--width 256]

The model is weight-heavy on purpose (wide square blocks, a short batch), so the
peak is dominated by parameters: an eager stage-3 step holds about one block's
gathered weights at a time (released after its forward, re-gathered for its
backward), while a step that keeps every gathered block until backward holds
them all. How the peak is measured: torch.profiler with ``profile_memory=True``
records every CPU allocation and free with its size; the running sum over the
events in time order is the bytes of live tensors, and its maximum over the
step (relative to the bytes live before it) is the peak. Rank 0 reports.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from zfunc.testing import run_distributed
from zfunc.transforms import shard


class Wide(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def peak_bytes(fn) -> int:
    """Peak of live CPU tensor bytes while ``fn()`` runs, above what was live before (see above)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.cpu_memory_usage
        peak = max(peak, live)
    return peak


def worker(width: int, blocks: int, backend: str, steps: int) -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Wide(width, blocks)
        apply_fn, params = zf.functional(model)

        def loss_fn(p, batch):
            return F.mse_loss(apply_fn(p, batch["x"]), batch["y"])

        def train_step(state, batch):
            loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
            return state.apply_gradients(grads), {"loss": loss}

        step = shard(train_step, stage=3)
        state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-3)))
        apply_fn.release_module_params()
        run = torch.compile(step, fullgraph=True, backend=backend) if compiled else step
        g = torch.Generator().manual_seed(rank)
        batch = {"x": torch.randn(4, width, generator=g), "y": torch.randn(4, 1, generator=g)}
        for _ in range(steps):  # warm up (compiles)
            state, _ = run(state, batch)
        box = {"state": state}

        def one():
            box["state"], _ = run(box["state"], batch)

        out["compiled" if compiled else "eager"] = peak_bytes(one)
    out["block_bytes"] = width * (width + 1) * 4
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    r = run_distributed(worker, 2, args.width, args.blocks, args.backend, args.steps, timeout=1200)[0]
    r = {**r, "eager_blocks": r["eager"] / r["block_bytes"], "compiled_blocks": r["compiled"] / r["block_bytes"],
         "args": vars(args)}
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
