"""On a GPU: no host reads in a steady-state step of any stack without offload (issue 25, item 1).

Run from the repository root: ``PYTHONPATH=. python tests/gpu/host_reads.py`` (one GPU) or
``PYTHONPATH=. torchrun --nproc-per-node 2 tests/gpu/host_reads.py`` (shard stacks at world 2, NCCL). Each stack runs two warm-up steps, then two steps under
``torch.cuda.set_sync_debug_mode("error")``: any call that makes the host wait for the GPU (``.item()``,
``.tolist()``, ``bool(t)``, a device-to-host copy into pageable memory, ``nonzero()``, ...) raises there.
Prints ``PASS`` or ``FAIL`` (with the error) per stack and exits non-zero on a failure. Then the NaN-loss
stop: a NaN loss in a counted step must not sync either, the state that step returns must equal the one
it was given, and the next call must raise naming the step. tests/test_host_reads.py counts the same
reads on the CPU.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.test_host_reads import SHARDED
from tests.test_host_reads import STACKS as CPU_STACKS
from tests.test_host_reads import _optimizer as optimizer
from zfunc.transforms import mixed_precision, offload, shard


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width + 1)
        self.down = nn.Linear(3 * width + 1, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 61, width: int = 34, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# The CPU test's stacks, shard's without verify, and the default shard (verify=True: at world >= 2 it compares
# the units each rank ran over a gloo group beside NCCL, which must not synchronise with the GPU either).
STACKS = {name: (lambda s, wrap=wrap: wrap(s, verify=False)) if name in SHARDED else wrap
          for name, wrap in CPU_STACKS.items()}
STACKS["shard3-verify"] = lambda s: shard(mixed_precision(s, "bf16"), stage=3)
STACKS["shard2-verify"] = lambda s: shard(mixed_precision(s, "bf16"), stage=2)
OFFLOAD = {  # may read for their host work: reported, not failed
    "offload": offload,
    "shard3-offload-bf16": lambda s: shard(offload(mixed_precision(s, "bf16")), stage=3, verify=False),
}


def build(wrap, kind: str):
    torch.manual_seed(0)
    model = TinyLM().cuda()
    apply_fn, params = zf.functional(model)

    def loss_fn(p, b):
        logits = apply_fn(p, b["x"])
        return F.cross_entropy(logits.flatten(0, 1).float(), b["y"].flatten()) * b["scale"].mean()

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = wrap(train_step)
    state = step.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, optimizer(kind)))
    return step, state


def batches(rank: int, count: int):
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(count):
        x = torch.randint(0, 61, (8, 16), generator=g)
        out.append({"x": x.cuda(), "y": torch.roll(x, 1, 1).cuda(), "scale": torch.ones(8, device="cuda")})
    return out


def steady_state(wrap, kind: str, rank: int) -> str | None:
    """None if two steps after two warm-up ones sync nowhere; else the error."""
    step, state = build(wrap, kind)
    data = batches(rank, 4)
    for b in data[:2]:
        state, _ = step(state, b)
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for b in data[2:]:
            state, _ = step(state, b)
    except RuntimeError:
        return traceback.format_exc(limit=-6)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return None


def nan_stop(wrap, rank: int, world: int) -> str | None:
    """A NaN loss (on the last rank) in a step under sync debug mode: no sync, the state kept, the next call
    raises naming the step."""
    step, state = build(wrap, "clip")
    data = batches(rank, 4)
    for b in data[:2]:
        state, _ = step(state, b)
    before = {k: v.clone() for k, v in step.gather(state).items()}
    poisoned = dict(data[2], scale=torch.full((8,), float("nan") if rank == world - 1 else 1.0, device="cuda"))
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        state, _ = step(state, poisoned)
    except RuntimeError:
        return "the NaN step synced: " + traceback.format_exc(limit=-6)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    try:
        step(state, data[3])
        return "the next call did not raise"
    except FloatingPointError as err:
        if "step=2" not in str(err):
            return f"the error does not name the step: {err}"
    after = step.gather(state)
    if not all(torch.equal(after[k], v) for k, v in before.items()):
        return "the state changed"
    state, _ = step(state, data[3])  # and the run goes on
    return None


def main() -> int:
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    failures = 0
    for name, wrap in STACKS.items():
        if world > 1 and not name.startswith("shard"):
            continue
        for kind in ("clip", "sgd"):
            error = steady_state(wrap, kind, rank)
            print(f"rank {rank} {name:36s} {kind:5s} {'PASS' if error is None else 'FAIL'}", flush=True)
            if error is not None:
                print(error, flush=True)
                failures += 1
    for name in ("mixed_precision-bf16", "shard2-bf16", "shard3-checkpoint-bf16"):
        if world > 1 and not name.startswith("shard"):
            continue
        error = nan_stop(STACKS[name], rank, world)
        print(f"rank {rank} nan-stop {name:27s} {'PASS' if error is None else 'FAIL'}", flush=True)
        if error is not None:
            print(error, flush=True)
            failures += 1
    for name, wrap in OFFLOAD.items():
        if world > 1 and not name.startswith("shard"):
            continue
        error = steady_state(wrap, "clip", rank)
        print(f"rank {rank} {name:36s} clip  {'no sync' if error is None else 'SYNCS (allowed: host work)'}",
              flush=True)
        if error is not None:
            print(error.splitlines()[-1], flush=True)
    if distributed:
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
