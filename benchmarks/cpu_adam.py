"""Benchmark: zfunc's numba CPU AdamW against torch (fused, foreach), DeepSpeed, and memory bandwidth.

    python benchmarks/cpu_adam.py                       # 100M fp32 elements (~9 GiB of buffers in all)
    python benchmarks/cpu_adam.py --numel 20000000      # small machine
    python benchmarks/cpu_adam.py --json out.json

Every candidate updates the same number of elements; times are the median of
``--repeats`` timed calls after ``--warmup`` untimed ones, taken in rounds that
call every case once (so a drifting machine load hits all cases alike). "GB/s" counts the
bytes an optimizer step must move: 28 per element for AdamW over fp32 state
(read param, grad, m, v; write param, m, v), +2 for the bf16 copy of the new
parameters, -2 when the grads are bf16.

Bandwidth references ("roofline"):
  * ``copy``: the best of ``dst.copy_(src)`` and a numba prange copy, counting
    read + write bytes (8 per fp32 element). A plain copy also pays a hidden
    read of every destination line (write-allocate) that it does not count, so
    an in-place optimizer, which has no such hidden traffic, can exceed 100%.
  * ``stream``: a numba prange loop with AdamW's exact access pattern (4 fp32
    streams read, 3 written back in place) and trivial arithmetic: the speed an
    AdamW step could reach on this machine if arithmetic were free.

Only torch, numba and numpy are required; tqdm and DeepSpeed are used when present.
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

import numba
import numpy as np
import torch
from numba import njit, prange

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)


def import_cpu_adam():
    """``zfunc.kernels.cpu_adam`` (see `kernel_import`)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_import import import_kernel_module

    return import_kernel_module("cpu_adam")


# ----------------------------------------------------------------------------- reference kernels

@njit(parallel=True, error_model="numpy")
def _numba_copy(dst, src, nchunks, chunk):
    n = src.size
    for c in prange(nchunks):
        lo = c * chunk
        hi = min(lo + chunk, n)
        for i in range(np.uint64(lo), np.uint64(hi)):
            dst[i] = src[i]


@njit(parallel=True, error_model="numpy")
def _numba_stream(p, g, m, v, nchunks, chunk):
    """AdamW's memory traffic (read p, g, m, v; write p, m, v) with trivial arithmetic."""
    n = p.size
    for c in prange(nchunks):
        lo = c * chunk
        hi = min(lo + chunk, n)
        for i in range(np.uint64(lo), np.uint64(hi)):
            gi = g[i]
            mi = m[i] + gi
            vi = v[i] + gi
            m[i] = mi
            v[i] = vi
            p[i] = p[i] + mi * vi


def _chunks(n, threads):
    nchunks = max(1, threads)
    chunk = -(-n // nchunks)
    chunk = -(-chunk // 16) * 16
    return nchunks, chunk


# ----------------------------------------------------------------------------- machine info

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_info(threads: int) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": _mem_total_gib(),
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba.get_num_threads(),
        "numba_threading_layer": None,
        "torch_cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")(),
        "threads": threads,
    }
    try:
        import deepspeed
        info["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001  (any failure: report it as absent)
        info["deepspeed"] = None
    return info


# ----------------------------------------------------------------------------- timing

class Progress:
    def __init__(self, total: int):
        self._bar = None
        if sys.stderr.isatty():  # a log file gets one plain line per case instead of a bar
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc="benchmark", unit="case", file=sys.stderr)
            except Exception:  # noqa: BLE001
                self._bar = None
        self._i, self._total = 0, total

    def step(self, name: str):
        self._i += 1
        if self._bar is not None:
            self._bar.set_postfix_str(name)
            self._bar.update(1)
        else:
            print(f"[{self._i}/{self._total}] {name}", file=sys.stderr, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()


# ----------------------------------------------------------------------------- candidates

HP = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def build_cases(n: int, threads: int, want_deepspeed: bool, notes: list) -> list[tuple]:
    """All cases as (name, bytes_per_element, fn, kind); their buffers stay alive together so the
    timed rounds can interleave them (~95 bytes per element in all: ~9 GiB at 100M)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).mul_(1e-2)
    m = torch.zeros(n)
    v = torch.zeros(n)
    g_bf16 = g.to(torch.bfloat16)
    out_bf16 = torch.empty(n, dtype=torch.bfloat16)
    nchunks, chunk = _chunks(n, threads)
    cases = []

    src, dst = torch.randn(n, generator=gen), torch.empty(n)
    cases.append(("copy: torch dst.copy_(src)", 8, lambda: dst.copy_(src), "bandwidth"))
    s, d = src.numpy(), dst.numpy()
    cases.append(("copy: numba prange", 8, lambda: _numba_copy(d, s, nchunks, chunk), "bandwidth"))
    a, b, c, e = (torch.rand(n, generator=gen).numpy() for _ in range(4))
    cases.append(("stream: numba 4 read / 3 write", 28, lambda: _numba_stream(a, b, c, e, nchunks, chunk), "stream"))

    adamw_ = import_cpu_adam().adamw_
    step = [0]

    def zf(grad, out=None):
        def run():
            step[0] += 1
            adamw_(p, grad, m, v, lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"],
                   weight_decay=HP["weight_decay"], step=step[0], out_lowp=out, num_threads=threads)
        return run

    cases.append(("zfunc numba AdamW (fp32)", 28, zf(g), "adam"))
    cases.append(("zfunc numba AdamW + bf16 copy (fused)", 30, zf(g, out_bf16), "adam"))
    cases.append(("zfunc numba AdamW, bf16 grads + bf16 copy", 28, zf(g_bf16, out_bf16), "adam"))

    def torch_opt(**kw):
        param = torch.nn.Parameter(p.clone())
        param.grad = g.clone()
        return param, torch.optim.AdamW([param], **HP, **kw)

    fparam, fopt = torch_opt(fused=True)
    cases.append(("torch AdamW(fused=True)", 28, fopt.step, "adam"))
    cases.append(("torch AdamW(fused=True) then .to(bf16)", 30,
                  lambda: (fopt.step(), fparam.detach().to(torch.bfloat16)), "adam"))
    cases.append(("torch AdamW(fused=True) then bf16_buf.copy_()", 30,
                  lambda: (fopt.step(), out_bf16.copy_(fparam)), "adam"))
    _, eopt = torch_opt(foreach=True)
    cases.append(("torch AdamW(foreach=True)", 28, eopt.step, "adam"))

    if want_deepspeed:
        ds = _deepspeed_case(p, g, notes)
        if ds is not None:
            cases.append(("DeepSpeedCPUAdam (adamw_mode)", 28, ds, "adam"))
    return cases


def _deepspeed_case(p, g, notes):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001
        notes.append(f"DeepSpeedCPUAdam skipped: cannot import deepspeed ({type(e).__name__}: {e})")
        return None
    try:
        param = torch.nn.Parameter(p.clone())
        param.grad = g.clone()
        opt = DeepSpeedCPUAdam([param], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                               weight_decay=HP["weight_decay"], adamw_mode=True)
        opt.step()  # JIT-builds the cpu_adam op on first use (ninja + a C++ compiler)
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        notes.append("DeepSpeedCPUAdam skipped: building/running its cpu_adam op failed "
                     f"({type(e).__name__}: {msg[-1] if msg else ''})")
        return None
    return opt.step


# ----------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=100_000_000, help="elements per buffer (default 100M)")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per case (median reported; min 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per case first")
    ap.add_argument("--threads", type=int, default=None, help="threads (default torch.get_num_threads())")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    ap.add_argument("--only", metavar="TEXT[,TEXT]",
                    help="run only the cases whose name contains one of these (the bandwidth rows always run)")
    ap.add_argument("--json", metavar="PATH", help="also write results as JSON")
    args = ap.parse_args(argv)
    repeats = max(5, args.repeats)

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    info = machine_info(threads)
    n = args.numel
    notes: list[str] = []

    print(f"python {info['python']}  torch {info['torch']}  numba {info['numba']}  numpy {info['numpy']}  "
          f"deepspeed {info['deepspeed'] or '-'}")
    print(f"cpu: {info['cpu']}  ({info['logical_cpus']} logical CPUs, {info['affinity_cpus']} usable, "
          f"{info['mem_total_gib']} GiB)  torch capability {info['torch_cpu_capability']}")
    print(f"threads: {threads} (torch {torch.get_num_threads()}, numba {numba.get_num_threads()})  "
          f"numel {n:,}  repeats {repeats} (+{args.warmup} warm-up)", flush=True)

    t0 = time.perf_counter()
    import_cpu_adam()  # import cost only: nothing is compiled before the first call
    info["zfunc_import_s"] = round(time.perf_counter() - t0, 3)

    only = [s.strip().lower() for s in args.only.split(",") if s.strip()] if args.only else None
    want_ds = not args.no_deepspeed and (only is None or any(s in "deepspeedcpuadam (adamw_mode)" for s in only))
    print("allocating buffers" + (" and building DeepSpeed's cpu_adam op" if want_ds else "") + " ...",
          file=sys.stderr, flush=True)
    cases = [c for c in build_cases(n, threads, want_ds, notes)
             if only is None or c[3] in ("bandwidth", "stream") or any(s in c[0].lower() for s in only)]

    # First call (compile / cache load / optimizer state), then warm-up, case by case; then the timed
    # calls in rounds, every case once per round, so drifting machine load hits all cases alike.
    bar = Progress(len(cases) + repeats)
    live, times, first = [], {}, {}
    try:
        for name, nbytes, fn, kind in cases:
            t0 = time.perf_counter()
            try:
                fn()
                first[name] = time.perf_counter() - t0
                for _ in range(args.warmup):
                    fn()
            except Exception as e:  # noqa: BLE001
                notes.append(f"{name} failed: {type(e).__name__}: {e}")
                traceback.print_exc()
            else:
                live.append((name, nbytes, fn, kind))
                times[name] = []
            bar.step(f"warm-up {name}")
        for r in range(repeats):
            for name, _, fn, _ in live:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            bar.step(f"round {r + 1}/{repeats}")
    finally:
        bar.close()

    rows = []
    for name, nbytes, _, kind in live:
        ts = times[name]
        med = statistics.median(ts)
        rows.append({"name": name, "kind": kind, "bytes_per_elem": nbytes, "median_s": med, "min_s": min(ts),
                         "times_s": ts, "first_call_s": first[name], "elems_per_s": n / med,
                         "gbps": n * nbytes / med / 1e9})

    copy_bw = max([r["gbps"] for r in rows if r["kind"] == "bandwidth"], default=float("nan"))
    stream_bw = max([r["gbps"] for r in rows if r["kind"] == "stream"], default=float("nan"))
    fused = next((r for r in rows if r["name"] == "torch AdamW(fused=True)"), None)
    for r in rows:
        r["pct_copy_bw"] = 100 * r["gbps"] / copy_bw
        r["pct_stream_bw"] = 100 * r["gbps"] / stream_bw
        r["speedup_vs_torch_fused"] = fused["median_s"] / r["median_s"] if fused else None

    hdr = (f"{'case':48s} {'B/el':>4s} {'median ms':>10s} {'min ms':>8s} {'Gelem/s':>8s} {'GB/s':>7s} "
           f"{'%copy':>6s} {'%stream':>7s} {'vs fused':>8s}")
    print()
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        sp = f"{r['speedup_vs_torch_fused']:.2f}x" if r["speedup_vs_torch_fused"] else "-"
        print(f"{r['name']:48s} {r['bytes_per_elem']:4d} {r['median_s'] * 1e3:10.2f} {r['min_s'] * 1e3:8.2f} "
              f"{r['elems_per_s'] / 1e9:8.3f} {r['gbps']:7.2f} {r['pct_copy_bw']:5.0f}% "
              f"{r['pct_stream_bw']:6.0f}% {sp:>8s}")
    print(f"\ncopy bandwidth (best copy row): {copy_bw:.2f} GB/s; AdamW-pattern stream: {stream_bw:.2f} GB/s")

    by = {r["name"]: r for r in rows}
    checks = {}
    zf32 = by.get("zfunc numba AdamW (fp32)")
    zfb = by.get("zfunc numba AdamW + bf16 copy (fused)")
    cast = by.get("torch AdamW(fused=True) then .to(bf16)")
    cast_pre = by.get("torch AdamW(fused=True) then bf16_buf.copy_()")
    if zf32 and fused:
        checks["numba >= torch fused"] = {"value": fused["median_s"] / zf32["median_s"], "target": ">= 1.0x"}
    if zf32:
        checks["numba % of stream roofline"] = {"value": zf32["pct_stream_bw"], "target": ">= 90%"}
        checks["numba % of copy bandwidth"] = {"value": zf32["pct_copy_bw"], "target": ">= 90%"}
    if zfb and cast:
        checks["fused bf16 copy vs fused-then-.to(bf16)"] = {"value": cast["median_s"] / zfb["median_s"],
                                                                 "target": ">= 1.3x"}
    if zfb and cast_pre:
        checks["fused bf16 copy vs fused-then-copy_ (prealloc)"] = {
            "value": cast_pre["median_s"] / zfb["median_s"], "target": ">= 1.3x"}
    if checks:
        print("\ntargets:")
        for k, c in checks.items():
            val = f"{c['value']:.2f}x" if c["target"].endswith("x") else f"{c['value']:.0f}%"
            print(f"  {k:48s} {val:>8s}   (target {c['target']})")
    for note in notes:
        print("note:", note)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "numel": n, "repeats": repeats, "warmup": args.warmup, "rows": rows,
                           "copy_bw_gbps": copy_bw, "stream_bw_gbps": stream_bw, "checks": checks, "notes": notes},
                      f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
