"""Benchmark: zfunc's flat-buffer AdamW against torch's fused kernels, on one GPU.

    python benchmarks/gpu_adam.py                              # 1e9 elements on cuda:0 (~30 GB of buffers)
    python benchmarks/gpu_adam.py --numel 200000000 --json out.json
    python benchmarks/gpu_adam.py --sweep                      # also try other Triton block/warp settings
    python benchmarks/gpu_adam.py --device cpu --numel 1000000 --backend torch   # smoke test, any machine

Every AdamW case updates the same ``--numel`` elements: torch's kernels as 100 tensors (views of
one flat buffer, the way a model's parameters come), ours as one flat buffer with three weight
decay segments. Times are CUDA-event medians of ``--repeats`` calls after ``--warmup`` calls,
taken in rounds that call every case once, so drifting clocks hit all cases alike.

"B/elem" is the memory traffic a case actually causes per element, counted from what it reads
and writes: AdamW over fp32 state reads p, g, m, v and writes p, m, v (28 bytes; 26 with 16-bit
grads); a bf16 copy of the new params adds 2 when written in the same pass, 6 as a separate cast
(read 4, write 2); upcasting bf16 grads first adds 6 (read 2, write 4). "GB/s" is that traffic per
second, "% copy" that rate against a device-to-device ``dst.copy_(src)`` of fp32 (8 bytes per
element: read + write), "vs fused" the speed against ``torch.optim.AdamW(fused=True)`` (time
ratio, > 1 is faster).

Before timing, a correctness check runs both kernels on a 16M-element slice for three steps and
prints the largest differences against torch's fused AdamW (expected on CUDA: 0, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

HP = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
N_TENSORS = 100


def import_gpu_adam():
    """``zfunc.kernels.gpu_adam`` (see `kernel_import`)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_import import import_kernel_module

    return import_kernel_module("gpu_adam")


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- timing

class Timer:
    """Times one call: CUDA events on a GPU, perf_counter (after the call returns) on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def tensor_sizes(n: int, k: int) -> list[int]:
    base = n // k
    return [base] * (k - 1) + [n - base * (k - 1)]


def segment_runs(n: int, wd: float) -> list[tuple[int, int, float]]:
    """Three runs like a model's: decayed matrices, undecayed norms/biases, decayed again."""
    a, b = n * 6 // 10, n * 6 // 10 + max(1, n // 100)
    return [(0, a, wd), (a, b - a, 0.0), (b, n - b, wd)]


def views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, sizes))


# ----------------------------------------------------------------------------- correctness

def correctness(ga, device, backend: str, n: int) -> dict:
    """Three steps of ours vs torch._fused_adamw_ (per segment) on n elements: max differences."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    runs = segment_runs(n, HP["weight_decay"])
    seg = ga.AdamSegments.build(runs, device)
    p0 = torch.randn(n, generator=gen).to(device)
    ours = [p0.clone(), torch.zeros(n, device=device), torch.zeros(n, device=device)]
    ref = [p0.clone(), torch.zeros(n, device=device), torch.zeros(n, device=device)]
    out = torch.empty(n, device=device, dtype=torch.bfloat16)
    lr = torch.tensor(HP["lr"], device=device)
    b1, b2 = HP["betas"]
    res = {}
    for grad_dtype in (torch.float32, torch.bfloat16):
        for t in range(1, 4):
            g = (torch.randn(n, generator=gen) * 1e-2).to(device=device, dtype=grad_dtype)
            step = torch.tensor(float(t), device=device)
            ga.adam_flat_(*ours[:1], g, *ours[1:], seg, lr=lr, step=step, beta1=b1, beta2=b2, eps=HP["eps"],
                          out_lowp=out, backend=backend)
            for s, k, wd in runs:
                torch._fused_adamw_([ref[0][s:s + k]], [g[s:s + k].float()], [ref[1][s:s + k]], [ref[2][s:s + k]],
                                    [], [step], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=HP["eps"],
                                    amsgrad=False, maximize=False)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref):
            d = (a - b).abs()
            res[f"{name} ({str(grad_dtype).split('.')[-1]} grads)"] = {
                "max_abs_diff": d.max().item(), "differing": int((a != b).sum()),
                "max_rel_diff": (d / b.abs().clamp_min(1e-30)).max().item()}
        want = ours[0].to(torch.bfloat16)
        res[f"bf16 copy ({str(grad_dtype).split('.')[-1]} grads)"] = {
            "max_abs_diff": (out.float() - want.float()).abs().max().item(),
            "differing": int((out.view(torch.int16) != want.view(torch.int16)).sum()), "max_rel_diff": 0.0}
        ref = [t.copy_(o) for t, o in zip(ref, ours)]  # restart the bf16 round from the same state
    return res


# ----------------------------------------------------------------------------- cases

def build_cases(ga, device, n: int, backend: str, chunk: int, sweep: bool) -> list[tuple]:
    """(name, bytes_per_elem, fn, group) for every case; buffers are shared where the kernels only
    need the same shapes (values drift a little over the repeats, which changes no timing)."""
    torch.manual_seed(1)
    f32 = {"device": device, "dtype": torch.float32}
    log(f"allocating {n:,} elements ({n * 32 / 2**30:.1f} GiB of buffers) ...")
    p = torch.randn(n, **f32)
    g = torch.randn(n, **f32).mul_(1e-2)
    m, v = torch.zeros(n, **f32), torch.zeros(n, **f32)
    g16 = g.to(torch.bfloat16)
    out16 = torch.empty(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty(n, **f32)
    sizes = tensor_sizes(n, N_TENSORS)
    lr_t = torch.tensor(HP["lr"], device=device)
    b1, b2 = HP["betas"]
    cases = [("copy: dst.copy_(src) fp32", 8, lambda: dst.copy_(g), "bandwidth")]

    # torch.optim.AdamW(fused=True) over 100 parameters that are views of p, with state views of m, v
    params = [torch.nn.Parameter(x) for x in views(p, sizes)]
    for q, gv in zip(params, views(g, sizes)):
        q.grad = gv
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)
    for q, mv, vv in zip(params, views(m, sizes), views(v, sizes)):
        opt.state[q] = {"step": torch.zeros((), **f32), "exp_avg": mv, "exp_avg_sq": vv}
    cases.append(("torch AdamW(fused=True).step()", 28, opt.step, "adam"))

    ps, gs, ms, vs = views(p, sizes), views(g, sizes), views(m, sizes), views(v, sizes)
    steps = [torch.ones((), **f32)] * len(ps)

    def fused_direct():
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=lr_t, beta1=b1, beta2=b2,
                            weight_decay=HP["weight_decay"], eps=HP["eps"], amsgrad=False, maximize=False)

    cases.append(("torch._fused_adamw_ direct", 28, fused_direct, "adam"))
    cases.append(("torch fused, then p.to(bf16)", 34, lambda: (opt.step(), p.to(torch.bfloat16)), "adam"))
    cases.append(("torch fused, then bf16_buf.copy_(p)", 34, lambda: (opt.step(), out16.copy_(p)), "adam"))
    g16s = views(g16, sizes)

    def torch_bf16_grads():  # what a bf16-grad step costs with torch's kernel: upcast, step, cast back
        for q, x in zip(params, g16s):
            q.grad = x.float()
        opt.step()
        out16.copy_(p)
        for q, x in zip(params, gs):
            q.grad = x

    cases.append(("torch: bf16 grads .float(), fused, copy_ to bf16", 40, torch_bf16_grads, "adam"))

    seg = ga.AdamSegments.build(segment_runs(n, HP["weight_decay"]), device, chunk=chunk)
    log(f"zfunc segments: {seg}")
    step_t = torch.ones((), **f32)

    def ours(grad, out=None, cfg=None):
        def run():
            saved = dict(ga.TRITON_CONFIG)
            if cfg:
                ga.TRITON_CONFIG.update(cfg)
            try:
                ga.adam_flat_(p, grad, m, v, seg, lr=lr_t, step=step_t, beta1=b1, beta2=b2, eps=HP["eps"],
                              out_lowp=out, backend=backend)
            finally:
                ga.TRITON_CONFIG.update(saved)
        return run

    cases.append((f"zfunc adam_flat_ fp32 grads [{backend}]", 28, ours(g), "adam"))
    cases.append((f"zfunc adam_flat_ fp32 grads + bf16 copy [{backend}]", 30, ours(g, out16), "adam"))
    cases.append((f"zfunc adam_flat_ bf16 grads + bf16 copy [{backend}]", 28, ours(g16, out16), "adam"))
    if backend != "torch" and (device.type == "cuda" or ga._interpreting()):
        # The fused update of a sharded state: 100 runs (a unit each, buffers of their own), one launch of
        # adam_runs_ reading the runs' addresses from a table, against adam_flat_ once per run.
        outs, g16v = views(out16, sizes), views(g16, sizes)
        table = ga.AdamRuns.build([(a.data_ptr(), b.data_ptr(), c.data_ptr(), o.data_ptr())
                                   for a, b, c, o in zip(ps, ms, vs, outs)],
                                  [[(0, k, HP["weight_decay"])] for k in sizes], sizes, device, out_dtype=torch.bfloat16)
        segs = [ga.AdamSegments.uniform(k, HP["weight_decay"], device) for k in sizes]
        grad_ptrs = [x.data_ptr() for x in g16v]

        def one_launch():
            ga.adam_runs_(table, grad_ptrs, torch.bfloat16, lr=lr_t, step=step_t, beta1=b1, beta2=b2, eps=HP["eps"])

        def per_run():
            for a, x, b, c, o, sg in zip(ps, g16v, ms, vs, outs, segs):
                ga.adam_flat_(a, x, b, c, sg, lr=lr_t, step=step_t, beta1=b1, beta2=b2, eps=HP["eps"], out_lowp=o,
                              backend=backend)

        cases.append((f"zfunc adam_runs_, {N_TENSORS} runs, 1 launch, bf16 grads + bf16 copy", 28, one_launch, "adam"))
        cases.append((f"zfunc adam_flat_ x{N_TENSORS} (a launch per run), bf16 grads + bf16 copy", 28, per_run,
                      "adam"))
    if sweep:
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8):
                cfg = {"adam_block": block, "adam_warps": warps}
                if cfg != {k: ga.TRITON_CONFIG[k] for k in cfg}:
                    cases.append((f"  sweep: fp32 grads, block {block}, {warps} warps", 28, ours(g, cfg=cfg),
                                  "sweep"))

    return cases


# ----------------------------------------------------------------------------- main

def machine_info(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001  (absent or broken: report it as absent)
        info["triton"] = None
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        info.update(gpu=prop.name, gpu_mem_gib=round(prop.total_memory / 2**30, 1),
                    sms=prop.multi_processor_count)
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=1e9, help="elements (default 1e9)")
    ap.add_argument("--device", default="cuda", help="device (default cuda; 'cpu' for a smoke test)")
    ap.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"), help="zfunc backend")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per case (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per case first")
    ap.add_argument("--chunk", type=int, default=None, help="AdamSegments chunk (default: AdamSegments.build's)")
    ap.add_argument("--check-numel", type=int, default=16 * 2**20, help="elements of the correctness check")
    ap.add_argument("--sweep", action="store_true", help="also time other Triton block / warp settings")
    ap.add_argument("--only", metavar="TEXT[,TEXT]", help="only cases whose name contains one of these "
                    "(the copy and torch fused rows always run)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    n = int(args.numel)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ga = import_gpu_adam()
    chunk = args.chunk
    info = machine_info(device)
    backend = ga.resolve_backend(args.backend, device)
    print(f"python {info['python']}  torch {info['torch']}  triton {info['triton'] or '-'}  "
          f"device {info.get('gpu', device)}  zfunc backend {backend}  config {ga.TRITON_CONFIG}  "
          f"chunk {chunk or 'auto'}")
    print(f"numel {n:,} ({N_TENSORS} tensors for torch, 1 flat buffer for zfunc)  repeats {args.repeats} "
          f"(+{args.warmup} warm-up)", flush=True)

    log("correctness check ...")
    check = correctness(ga, device, backend, min(n, args.check_numel))
    print(f"\ncorrectness vs torch._fused_adamw_ ({min(n, args.check_numel):,} elements, 3 steps):")
    for k, r in check.items():
        print(f"  {k:28s} max abs diff {r['max_abs_diff']:.3g}  max rel diff {r['max_rel_diff']:.3g}  "
              f"differing elements {r['differing']}")
    if device.type == "cuda":
        torch.cuda.empty_cache()

    only = [s.strip().lower() for s in args.only.split(",") if s.strip()] if args.only else None
    cases = [c for c in build_cases(ga, device, n, backend, chunk, args.sweep)
             if only is None or c[3] == "bandwidth" or c[0] == "torch AdamW(fused=True).step()"
             or any(s in c[0].lower() for s in only)]
    timer = Timer(device)
    live, times, first, notes = [], {}, {}, []
    for i, (name, nbytes, fn, group) in enumerate(cases):
        log(f"[{i + 1}/{len(cases)}] warm-up {name}")
        try:
            t0 = time.perf_counter()
            fn()
            timer.sync()
            first[name] = time.perf_counter() - t0  # includes Triton's compile on a cold cache
            for _ in range(args.warmup):
                fn()
            timer.sync()
        except Exception as e:  # noqa: BLE001
            notes.append(f"{name} failed: {type(e).__name__}: {e}")
            traceback.print_exc()
            continue
        live.append((name, nbytes, fn, group))
        times[name] = []
    for r in range(args.repeats):
        log(f"round {r + 1}/{args.repeats}")
        for name, _, fn, _ in live:
            times[name].append(timer(fn))

    rows = []
    for name, nbytes, _, group in live:
        ts = times[name]
        med = statistics.median(ts)
        rows.append({"case": name, "group": group, "bytes_per_elem": nbytes, "ms": med * 1e3,
                     "min_ms": min(ts) * 1e3, "gbps": n * nbytes / med / 1e9, "first_call_s": first[name],
                     "times_ms": [t * 1e3 for t in ts]})
    copy_bw = max([r["gbps"] for r in rows if r["group"] == "bandwidth"], default=float("nan"))
    fused = next((r for r in rows if r["case"] == "torch AdamW(fused=True).step()"), None)
    for r in rows:
        r["pct_copy_bw"] = 100 * r["gbps"] / copy_bw
        r["speedup_vs_torch"] = fused["ms"] / r["ms"] if fused else None

    print("\n| case | B/elem | ms | GB/s | % copy BW | vs torch fused |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        sp = f"{r['speedup_vs_torch']:.2f}x" if r["speedup_vs_torch"] else "-"
        print(f"| {r['case']} | {r['bytes_per_elem']} | {r['ms']:.2f} | {r['gbps']:.0f} | {r['pct_copy_bw']:.0f}% "
              f"| {sp} |")
    print(f"\ncopy bandwidth: {copy_bw:.0f} GB/s.")
    for note in notes:
        print("note:", note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "numel": n, "backend": backend, "config": dict(ga.TRITON_CONFIG),
                       "chunk": chunk, "repeats": args.repeats, "warmup": args.warmup, "correctness": check,
                       "copy_bw_gbps": copy_bw, "rows": rows, "notes": notes}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
