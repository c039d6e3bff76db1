"""pipeline on GPUs over NCCL (run with torchrun; not collected by pytest).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 tests/gpu/pipeline_equivalence.py      # pp2 (1F1B, interleaved)
    ... --nproc-per-node 4 ...                                         # + pp2 x dp2 under shard(stage=1|2|3)

Each schedule against the plain step accumulated over the same micro-batches (computed on every rank
alone, before any group work), fp32, relative error below 1e-5 required; then a bf16 run whose loss is
reported with the step time (at 4 ranks also pp2 x dp2 under shard stages 1 and 3, bf16, and fp16 with its
loss scale). Exits non-zero on a failure.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import zfunc as zf  # noqa: E402
from tests.models import TinyLM, lm_loss, make_batch  # noqa: E402
from zfunc.mesh import make_mesh  # noqa: E402
from zfunc.transforms import accumulate, mixed_precision, pipeline, shard  # noqa: E402

STEPS, BATCH, MICRO = 3, 16, 4


def build(device):
    torch.manual_seed(0)
    model = TinyLM(vocab=97, width=48, hidden=131, depth=8).to(device)
    apply_fn, params = zf.functional(model)
    loss_fn = lm_loss(apply_fn)

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    state = zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.sgd(0.05, momentum=0.9),
                                 ties=params.ties, blocks=params.blocks)
    return train_step, state


def batch(i, device, parts=1, part=0):
    return {k: v.chunk(parts)[part].to(device) for k, v in make_batch(BATCH, seed=i, vocab=97).items()}


def main() -> int:
    cuda = torch.cuda.is_available()  # (without GPUs: gloo on the CPU, to check the script itself)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    step, state = build(device)
    reference = accumulate(step, MICRO)
    for i in range(STEPS):
        state, _ = reference(state, batch(i, device))
    want = {k: v.clone() for k, v in state.params.items()}
    failures = 0
    cases = [("1F1B", 1, 1), ("interleaved", 1, 1)]
    if world == 4:
        cases += [("1F1B", 2, 1), ("1F1B", 2, 2), ("1F1B", 2, 3), ("interleaved", 2, 3)]
    for schedule, dp, zero in cases:
        pp = world // dp
        mesh = make_mesh(dp=dp, pp=pp)
        step, state = build(device)
        stepped = pipeline(step, schedule=schedule, micro_batches=MICRO // dp, mesh=mesh)
        if dp > 1:
            stepped = shard(stepped, stage=zero, mesh=mesh)
        state = stepped.init(state)
        for i in range(STEPS):
            state, metrics = stepped(state, batch(i, device, dp, mesh["dp"].get_local_rank()))
        got = stepped.gather(state)
        worst = max(float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)) for k, v in want.items())
        ok = worst < 1e-5
        failures += not ok
        if rank == 0:
            print(f"{schedule} pp{pp} x dp{dp}{f' (shard stage {zero})' if dp > 1 else ''}: max relative error {worst:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    # bf16 timing (a rough number: tiny model, dominated by launch and P2P latency)
    mesh = make_mesh(pp=world)
    step, state = build(device)
    stepped = pipeline(mixed_precision(step, "bf16"), micro_batches=MICRO, mesh=mesh)
    state = stepped.init(state)
    state, metrics = stepped(state, batch(0, device))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(10):
        state, metrics = stepped(state, batch(i, device))
    sync()
    if rank == 0:
        print(f"bf16 1F1B pp{world}: loss {float(metrics['loss']):.4f}, {(time.perf_counter() - start) / 10 * 1e3:.1f} "
              "ms/step", flush=True)
    if world == 4:  # pp2 x dp2: shard stages 1 and 3 around the pipeline, bf16, and fp16 (loss scale, skips)
        for zero, policy in ((1, "bf16"), (3, "bf16"), (3, "fp16")):
            mesh = make_mesh(dp=2, pp=2)
            step, state = build(device)
            stepped = shard(pipeline(mixed_precision(step, policy), micro_batches=MICRO // 2, mesh=mesh), stage=zero,
                            mesh=mesh)
            state = stepped.init(state)
            part = mesh["dp"].get_local_rank()
            state, metrics = stepped(state, batch(0, device, 2, part))
            sync()
            start = time.perf_counter()
            for i in range(10):
                state, metrics = stepped(state, batch(i, device, 2, part))
            sync()
            if rank == 0:
                extra = f", loss scale {float(metrics['loss_scale']):g}" if policy == "fp16" else ""
                print(f"{policy} 1F1B pp2 x dp2 under shard stage {zero}: loss {float(metrics['loss']):.4f}{extra}, "
                      f"{(time.perf_counter() - start) / 10 * 1e3:.1f} ms/step", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
