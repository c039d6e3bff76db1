"""The shard equivalence matrix on GPUs over NCCL (run with torchrun; not collected by pytest).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 tests/gpu/nccl_equivalence.py

Every stage x {plain, offload, accumulate, offload+accumulate, checkpoint, checkpoint+accumulate} x {fp32, bf16}
against the unsharded step on the concatenated batch (fp32: relative error
below 1e-5 required; bf16 against the unsharded bf16 step, reported, with a
loose bound since bf16 reductions in another order round differently).
Exits non-zero on a failure.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import zfunc as zf  # noqa: E402
from tests.models import TinyLM, lm_loss, make_batch  # noqa: E402
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard  # noqa: E402

STEPS, BATCH = 3, 8


def build(device, dtype):
    torch.manual_seed(0)
    model = TinyLM(vocab=97, width=48, hidden=131, depth=4).to(device)
    apply_fn, params = zf.functional(model)
    loss_fn = lm_loss(apply_fn)

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = mixed_precision(train_step, "bf16") if dtype == "bf16" else train_step
    opt = zf.optim.adamw(zf.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1)
    return step, zf.TrainState.create({k: v.clone() for k, v in params.items()}, opt)


def batch_for(i, device, rank=0, world=1):
    b = make_batch(BATCH, seq=7, vocab=97, seed=i)
    return {k: v.chunk(world)[rank].to(device) for k, v in b.items()}


def main():
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = 0
    variants = {
        "plain": lambda s: s,
        "offload": offload,
        "accumulate": lambda s: accumulate(s, micro_batches=2),
        "offload+accumulate": lambda s: offload(accumulate(s, micro_batches=2)),
        "checkpoint": checkpoint,  # every block's reductions issued inside a nested (recompute) backward
        "checkpoint+accumulate": lambda s: checkpoint(accumulate(s, micro_batches=2)),
        # The tiers: part of the optimizer state on the GPU, part on NVMe, parameters on the host.
        "offload-device-half": lambda s: offload(s, device_fraction=0.5),
        "offload-nvme-half": lambda s: offload(checkpoint(s), nvme_fraction=0.5, nvme_dir=nvme_dir),
        "offload-params-host": lambda s: offload(accumulate(s, micro_batches=2), params="host"),
    }
    nvme_dir = tempfile.mkdtemp(prefix="zfunc-nvme-")
    finals = {}
    for dtype in ("fp32", "bf16"):
        step, state = build(device, dtype)
        state = zf.init(step, state)
        for i in range(STEPS):
            state, _ = step(state, batch_for(i, device))
        ref = {k: v.float() for k, v in zf.gather(step, state).items()}
        for stage in (1, 2, 3):
            for name, wrap in variants.items():
                if name == "offload-params-host" and stage != 3:
                    continue
                step, state = build(device, dtype)
                sharded = shard(wrap(step), stage=stage)
                state = sharded.init(state)
                for i in range(STEPS):
                    state, metrics = sharded(state, batch_for(i, device, rank, world))
                full = sharded.gather(state)
                finals[(dtype, stage, name)] = full
                err = max(((full[k].float().to(device) - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
                bound = 2e-5 if dtype == "fp32" else 5e-2
                ok = err < bound
                failures += not ok
                if rank == 0:
                    print(f"{dtype} stage {stage} {name:22s} max rel err {err:.2e} {'ok' if ok else 'FAIL'} "
                          f"comm {metrics['comm_elements']}", flush=True)
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(nvme_dir) for f in files]
    if leftovers:
        print(f"FAIL: the NVMe tier left {leftovers} in {nvme_dir}", flush=True)
        failures += 1
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
