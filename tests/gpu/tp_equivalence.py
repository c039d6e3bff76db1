"""tensor_parallel on GPUs over NCCL (run with torchrun; not collected by pytest).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 4 tests/gpu/tp_equivalence.py        # tp2 x dp2 (2 GPUs: tp2)

For tiny GPT-2, Llama and BERT (tests/tp_cases.py, on the GPU): the plain step, and
shard(tensor_parallel(checkpoint(step)), stage=3, mesh) on tp=2 x dp=world/2, two steps each in fp32;
the largest difference of the gathered parameters is printed and must stay below 2e-5 (Adam's
rounding: a wrong split moves weights by the learning rate, 1e-2). Then the step time of a
GPT-2-small-shaped model (12 layers, width 768) at tp2 x dp, bf16, for a throughput line.
Exits non-zero on a failure.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import zfunc as zf  # noqa: E402
from tests.tp_cases import batch, make_step  # noqa: E402
from zfunc.mesh import make_mesh  # noqa: E402
from zfunc.transforms import checkpoint, mixed_precision, shard, tensor_parallel, tp_plan  # noqa: E402


def on(device, tree):
    return {k: v.to(device) for k, v in tree.items()}


def build(kind, device):
    apply_fn, step, state = make_step(kind)
    apply_fn.model.to(device)
    params = {k: v.to(device) for k, v in state.params.items()}
    return apply_fn, step, zf.TrainState.create(params, state.tx, ties=dict(state.ties), blocks=state.blocks)


def main() -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dp = world // 2
    mesh = make_mesh(dp=dp, tp=2)
    dp_rank = mesh["dp"].get_local_rank()
    failed = False
    for kind in ("gpt2", "llama", "bert"):
        _, step, state = build(kind, device)
        for i in range(2):
            state, _ = step(state, on(device, batch(i)))
        ref = {k: v.detach().clone() for k, v in state.params.items()}
        apply_fn, step, state = build(kind, device)
        stacked = shard(tensor_parallel(checkpoint(step), tp_plan(apply_fn), mesh), stage=3, mesh=mesh)
        state = stacked.init(state)
        for i in range(2):
            state, _ = stacked(state, on(device, batch(i, dp_rank, dp)))
        full = stacked.gather(state)
        worst = max((full[k].float() - ref[k].float()).abs().max().item() for k in ref)
        ok = worst < 2e-5
        failed |= not ok
        if rank == 0:
            print(f"{kind}: tp2 x dp{dp} stage 3 + checkpoint vs plain, max |diff| {worst:.2e} {'ok' if ok else 'FAIL'}")
    throughput(mesh, dp, dp_rank, device, rank)
    dist.destroy_process_group()
    return 1 if failed else 0


def throughput(mesh, dp, dp_rank, device, rank) -> None:
    import torch.nn.functional as F
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, n_positions=1024,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model = transformers.GPT2LMHeadModel(cfg).to(device)
    apply_fn, params = zf.functional(model)

    def loss_fn(p, b):
        logits = apply_fn(p, input_ids=b["x"], use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), b["y"].flatten())

    def train_step(state, b):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, b)
        return state.apply_gradients(grads), {"loss": loss}

    stacked = shard(tensor_parallel(mixed_precision(train_step, "bf16"), tp_plan(apply_fn), mesh), stage=3,
                    mesh=mesh)
    state = stacked.init(zf.TrainState.create(params, zf.optim.adamw(3e-4)))
    g = torch.Generator(device="cpu").manual_seed(dp_rank)
    x = torch.randint(0, 50304, (8, 1024), generator=g).to(device)
    b = {"x": x, "y": torch.roll(x, -1, 1)}
    for _ in range(3):
        state, m = stacked(state, b)
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 10
    for _ in range(n):
        state, m = stacked(state, b)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / n
    if rank == 0:
        tokens = 8 * 1024 * dp
        print(f"GPT-2 124M-shaped, bf16, tp2 x dp{dp}, 8x1024 tokens per dp rank: {seconds * 1e3:.1f} ms/step, "
              f"{tokens / seconds:.0f} tokens/s, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB/rank")


if __name__ == "__main__":
    sys.exit(main())
