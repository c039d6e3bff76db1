"""Peak live tensor memory of a ZeRO-3 step: eager, torch.compile, and zf.compile_step (the regather pass).

    PYTHONPATH=. python benchmarks/compile_memory.py [--backend aot_eager|inductor] [--blocks 6] [--width 256]
        [--world 2] [--pg fake|gloo]

The model is weight-heavy on purpose (wide square blocks, a short batch), so the
peak is dominated by parameters: an eager stage-3 step holds about one block's
gathered weights at a time (released after its forward, re-gathered for its
backward), while a step that keeps every gathered block until backward holds
them all. Contenders: "eager"; "compiled", ``torch.compile(step, fullgraph=True,
backend=...)`` (one graph: every block's gathered weights live from forward to
backward); "compile_step", `zfunc.compile_step` (Inductor with the regather
pass: each block gathered again for its backward; run with ``--backend
inductor``, the pass being Inductor's). How the peak is measured:
`zfunc.testing.memory.peak_cpu_bytes` (torch.profiler's allocation records: the
most bytes of live CPU tensors during one step, above those live before it).
Rank 0 reports; ``*_blocks`` is the peak in blocks' worth of fp32 weights.
``--pg fake`` (the default) runs rank 0 alone on torch's fake process group
(`zfunc.testing.memory.simulated_rank`: the same graph, collectives that move no
data, a deterministic peak); ``--pg gloo`` runs every rank on gloo, whose worker
threads hold collective buffers a while after their wait (a noisy peak).
``--device cuda`` (with ``--pg fake``) runs that rank on the GPU: the peak is
``torch.cuda.max_memory_allocated`` during the step, above what was allocated
before it (one GPU measures a rank of a larger world).

On gloo the eager step is not the bar it is on NCCL: gloo has no reduce-scatter,
so each unit's gradient is all-reduced at full size, and the eager step keeps
those buffers until its reductions are waited for at the end of backward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import zfunc as zf
from zfunc.testing import run_distributed
from zfunc.testing.memory import fake_group_copies, peak_cpu_bytes, simulated_rank
from zfunc.transforms import shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # (the tests' models)
from tests.models import Wide


def _compiler(contender: str, backend: str):
    if contender == "eager":
        return lambda step: step
    if contender == "compiled":
        return lambda step: torch.compile(step, fullgraph=True, backend=backend)
    return zf.compile_step


def peak_bytes(fn, device: str) -> int:
    """The peak of live tensor bytes on ``device`` while ``fn()`` runs, above what was live before."""
    if device == "cpu":
        return peak_cpu_bytes(fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def contender_peak(contender: str, width: int, blocks: int, backend: str, steps: int, device: str) -> int | str:
    """One contender's peak over one step of stage 3, after ``steps`` warm-up steps (an error as text)."""
    rank = torch.distributed.get_rank()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Wide(width, blocks).to(device)
    apply_fn, params = zf.functional(model)

    def loss_fn(p, batch):
        return F.mse_loss(apply_fn(p, batch["x"]), batch["y"])

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    # (verify compares the units the ranks ran over a gloo group it makes beside a GPU group: there is
    # no other rank to make it with when one GPU simulates a world)
    step = shard(train_step, stage=3, verify=device == "cpu")
    state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-3)))
    apply_fn.release_module_params()
    run = _compiler(contender, backend)(step)
    g = torch.Generator().manual_seed(rank)
    batch = {"x": torch.randn(4, width, generator=g).to(device), "y": torch.randn(4, 1, generator=g).to(device)}
    box = {"state": state}

    def one():
        box["state"], _ = run(box["state"], batch)

    try:
        for _ in range(steps):  # warm up (compiles)
            one()
        return peak_bytes(one, device)
    except Exception as err:  # noqa: BLE001 (one contender failing keeps the others' figures)
        return f"{type(err).__name__}: {err}"[:300]


def worker(width: int, blocks: int, contenders: list[str], backend: str, steps: int, device: str = "cpu") -> dict:
    out = {c: contender_peak(c, width, blocks, backend, steps, device) for c in contenders}
    out["block_bytes"] = width * (width + 1) * 4
    return out


def simulated(world: int, device: str, *work) -> dict:
    with simulated_rank(world, device):
        # (where the fake group leaves gathers unwritten, steps compute on uninitialized memory: a
        # contender may then stop on a non-finite loss, and its figure reads as an error)
        return {**worker(*work, device=device), "fake_group_copies": fake_group_copies(device)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--pg", choices=("fake", "gloo"), default="fake")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    if args.device == "cuda" and args.pg != "fake":
        p.error("--device cuda runs one simulated rank: --pg fake")
    contenders = ["eager", "compiled"] + (["compile_step"] if args.backend == "inductor" else [])
    work = (args.width, args.blocks, contenders, args.backend, args.steps)
    if args.pg == "gloo":
        r = run_distributed(worker, args.world, *work, timeout=1200)[0]
    else:
        r = (simulated(args.world, "cuda", *work) if args.device == "cuda"  # (no fork after CUDA is used)
             else run_distributed(simulated, 1, args.world, "cpu", *work, timeout=1200)[0])
    r = {**r, **{f"{c}_blocks": round(r[c] / r["block_bytes"], 2) for c in contenders if isinstance(r[c], int)},
         "args": vars(args)}
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
