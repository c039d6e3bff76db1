"""Peak memory of one gradient computation: zf.value_and_grad vs loss.backward() vs torch.func.grad.

Each method runs in a fresh process on the same MLP with large activations;
the figure is the growth of the process's peak resident memory (ru_maxrss)
over its resident memory just before the gradient call, so allocator and
import overheads cancel. The children run with MALLOC_MMAP_THRESHOLD_=65536
so every tensor is an mmap returned on free and RSS tracks live tensor bytes.

    python benchmarks/value_and_grad_memory.py [--depth 8 --width 2048 --batch 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(method: str, depth: int, width: int, batch: int) -> None:
    import torch
    from torch import nn

    import zfunc as zf

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
    x = torch.randn(batch, width)
    apply_fn, params = zf.functional(model)

    def loss_fn(p, inputs):
        return apply_fn(p, inputs).square().mean()

    if method == "backward":
        run = lambda: loss_fn_eager(model, x).backward()  # noqa: E731
    elif method == "zf.value_and_grad":
        run = lambda: zf.value_and_grad(loss_fn)(params, x)  # noqa: E731
    elif method == "torch.func.vjp":
        def run():
            loss, vjp_fn = torch.func.vjp(lambda p: loss_fn(p, x), params)
            return vjp_fn(torch.ones_like(loss), retain_graph=False, create_graph=False)
    else:
        run = lambda: torch.func.grad_and_value(loss_fn)(params, x)  # noqa: E731
    before = rss_bytes()
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del result
    print(json.dumps({"method": method, "peak_growth": peak - before, "seconds": elapsed}))


def loss_fn_eager(model, x):
    return model(x).square().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.depth, args.width, args.batch)
        return
    import torch

    methods = ["backward", "zf.value_and_grad", "torch.func.vjp", "torch.func.grad_and_value"]
    # glibc serves large allocations from the heap once its dynamic mmap
    # threshold has grown, and keeps freed heap pages: RSS then overstates
    # live memory depending on the allocation pattern. A fixed low threshold
    # makes every tensor an mmap that is returned on free.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    activation = args.depth * args.batch * args.width * 4 * 2  # two saved tensors per layer
    print(f"MLP depth {args.depth} width {args.width} batch {args.batch}: saved activations ~{activation / 2**20:.0f} MiB"
          f" | torch {torch.__version__} | {platform.processor() or platform.machine()} | python {platform.python_version()}")
    results = {}
    for method in methods:
        runs = []
        for r in range(args.repeats):
            print(f"  [{method}] run {r + 1}/{args.repeats} ...", flush=True)
            out = subprocess.run([sys.executable, __file__, "--child", method, "--depth", str(args.depth),
                                  "--width", str(args.width), "--batch", str(args.batch)],
                                 check=True, capture_output=True, text=True, env=env)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        results[method] = {"peak_growth": min(r["peak_growth"] for r in runs),
                           "seconds": min(r["seconds"] for r in runs)}
    base = results["backward"]
    print(f"\n{'method':28s} {'peak growth MiB':>16s} {'vs backward':>12s} {'time vs backward':>17s}")
    for method, r in results.items():
        print(f"{method:28s} {r['peak_growth'] / 2**20:16.0f} {r['peak_growth'] / base['peak_growth']:12.2f}x"
              f" {r['seconds'] / base['seconds']:16.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
