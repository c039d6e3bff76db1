"""Host-side cost of one `offload(mixed_precision(step, "bf16"))` update, by path.

    python benchmarks/offload_host.py --numel 20000000 [--repeats 5]

On the CPU the "device" is the host, so this times exactly the work offload
does on the host per step (no bus transfers): the optimizer update of the
fp32 master and moments from bf16 gradients, and the bf16 compute copy.

- ``fused``: what offload does: bf16 gradients go into the numba kernel as
  they are, and the kernel writes the bf16 compute copy in the same pass;
- ``unfused kernel``: the same kernel on fp32 gradients (a cast first) and a
  separate ``master.to(bfloat16)`` after: what the transform did before;
- ``pytree``: ``offload(..., optimizer="cpu-pytree")``: the optimizer's pure
  pytree update on host tensors (any optimizer takes this path);
- ``torch fused AdamW + casts``: torch.optim.AdamW(fused=True) with the same
  two casts, as the reference point.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

import zfunc as zf
from zfunc.transforms import mixed_precision, offload


def make_state(numel: int, pieces: int = 8):
    torch.manual_seed(0)
    sizes = [numel // pieces] * pieces
    params = {f"layer{i}.weight": torch.randn(n) * 0.02 for i, n in enumerate(sizes)}
    grads = {k: (torch.randn_like(v) * 1e-3).to(torch.bfloat16) for k, v in params.items()}
    return params, grads


def zfunc_update(params, grads, path: str):
    def step(state, g):
        return state.apply_gradients(g), {}

    stack = mixed_precision(step, "bf16")
    stack = offload(stack, optimizer="cpu-pytree" if path == "pytree" else "cpu")
    if path == "unfused kernel":
        stack._compute_dtype = lambda: None  # no fused compute copy
    state = stack.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.adamw(1e-3)))

    def run():
        nonlocal state
        g = {k: v.float() for k, v in grads.items()} if path == "unfused kernel" else grads
        state, _ = stack(state, g)

    return run


def torch_update(params, grads):
    master = [v.clone() for v in params.values()]
    opt = torch.optim.AdamW(master, lr=1e-3, fused=True)
    lowp = list(grads.values())

    def run():
        for m, g in zip(master, lowp):
            m.grad = g.float()
        opt.step()
        [m.to(torch.bfloat16) for m in master]

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=20_000_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    importlib.import_module("zfunc.kernels.cpu_adam")
    params, grads = make_state(args.numel)
    cases = {name: zfunc_update(params, grads, name) for name in ("fused", "unfused kernel", "pytree")}
    cases["torch fused AdamW + casts"] = torch_update(params, grads)
    print(f"{args.numel / 1e6:.0f}M parameters, bf16 grads, fp32 master + AdamW, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    times: dict[str, list[float]] = {name: [] for name in cases}
    for name, run in cases.items():  # warm-up (compiles the kernels)
        print(f"  warm-up {name} ...", flush=True)
        run()
        run()
    for r in range(args.repeats):
        print(f"  round {r + 1}/{args.repeats}", flush=True)
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["torch fused AdamW + casts"])
    print(f"\n{'path':28s} {'median ms':>10s} {'ns/param':>9s} {'vs torch+casts':>15s}")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"{name:28s} {1e3 * m:10.1f} {1e9 * m / args.numel:9.2f} {base / m:14.2f}x")


if __name__ == "__main__":
    main()
