"""The NVMe tier's storage engine and pipeline: disk GB/s by I/O method, and the pipeline's overlap.

    python benchmarks/disk_tier.py                                 # 2 GiB file under $TMPDIR (or /tmp)
    python benchmarks/disk_tier.py --dir /nvme/scratch --size-gib 8 --threads 1,4,16 --chunk-mib 1,8,64
    python benchmarks/disk_tier.py --only pipeline --compute sleep:40,adam --json out.json

**Throughput** (one file of ``--size-gib``, one 4096-aligned host buffer):

- ``store``: `zfunc.tiers.DiskStore` (threaded ``pwrite``/``preadv`` pieces), for every
  ``--threads`` x ``--chunk-mib`` x ``--direct`` (``off``: page cache; ``on``: O_DIRECT);
- ``single``: one ``pwrite``/``preadv`` loop in the calling thread (no pool);
- ``numpy``: ``ndarray.tofile`` / ``np.fromfile`` plus the copy into the host buffer that
  ``fromfile``'s fresh array needs;
- ``kvikio``: ``kvikio.CuFile`` ``pwrite``/``pread`` on the host buffer, when importable.

Columns (GB = 10^9 bytes): ``write``: until the write resolved (for buffered I/O that is
mostly a memcpy into the page cache); ``write+sync``: until the data is on the device
(``fdatasync``), the sustained rate a tier bigger than RAM gets; ``read cold``: after the file's
pages were evicted (``fdatasync`` + ``posix_fadvise(DONTNEED)``, no root needed), i.e. from the
device; ``read warm``: again at once (page cache, if buffered). Reads are checked against the
data written (sampled pieces).

**Pipeline**: ``--units`` units of three fp32 buffers of ``--unit-mib`` MiB each (master,
exp_avg, exp_avg_sq) stored in a `DiskStore`; `zfunc.tiers.stream_units` loads, computes and
stores every unit with 1 (serial), 2 and 3 buffer sets. ``--compute``: ``sleep:<ms>`` (idle
CPU) or ``adam`` (the real numba AdamW on the unit, with a gradient kept in memory: the CPU
work competes with buffered I/O's copies). Pages are evicted before each run. Reported, in ms:
wall time and each phase's summed duration (phases slow down when they overlap); ``overlap``:
sum of phases / wall, the overlap efficiency (1x: none; 3x: reads, computes and writes all
side by side); ``comp%``: compute / wall, the share of the loop spent computing (near 100%
when the I/O is hidden, possible when compute is the longest phase); ``w+sync``: wall plus the
time to get the last writes onto the device (buffered writes can still sit in the page cache
when the loop ends, which would flatter buffered I/O); ``speedup``: the serial run's (1
buffer) w+sync over this one's; ``GB/s``: bytes read + written / w+sync, to hold against the
drive's own rates above (an I/O-bound loop is as good as it gets when they match); ``cache``:
page cache growth over the run (MiB), the host memory buffered I/O takes that O_DIRECT does
not.

Measured numbers and the choices they led to: see `zfunc.tiers`.

``--repeat`` runs every case that many times, round robin (a drifting machine load hits all
cases alike), and reports the median time of each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zfunc.tiers import DiskStore, aligned_empty, filesystem_type, stream_units  # noqa: E402

GB = 1e9
MiB = 1 << 20


def evict(path: str) -> None:
    """Write back and drop ``path``'s pages from the page cache, so the next read hits the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def page_cache_bytes() -> int:
    """The kernel's page cache size (``Cached`` in /proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def sync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def check_sample(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    n = got.numel()
    for start in np.linspace(0, max(0, n - MiB), 9).astype(np.int64):
        s = slice(int(start), int(start) + MiB)
        if not torch.equal(got[s], want[s]):
            raise AssertionError(f"{what}: data read back differs from the data written near byte {start}")


# ----------------------------------------------------------------------------- one method, one config

def run_store(base: Path, src, dst, threads: int, chunk: int, direct: str) -> dict:
    with DiskStore(base, threads=threads, chunk_bytes=chunk, direct=direct, stale="ignore") as store:
        store.allocate("data", src.numel())
        path = str(store.file_of("data"))
        evict(path)
        t = time.perf_counter()
        store.write("data", src).result()
        w = time.perf_counter() - t
        sync_file(path)
        ws = time.perf_counter() - t
        evict(path)
        dst.zero_()
        t = time.perf_counter()
        store.read_into("data", dst).result()
        rc = time.perf_counter() - t
        check_sample(dst, src, "store cold read")
        t = time.perf_counter()
        store.read_into("data", dst).result()
        rw = time.perf_counter() - t
    return {"write": w, "write+sync": ws, "read cold": rc, "read warm": rw}


def _loop(fd: int, buf: memoryview, reading: bool) -> None:
    done = 0
    while done < len(buf):
        piece = buf[done:done + (1 << 30)]
        done += os.preadv(fd, [piece], done) if reading else os.pwrite(fd, piece, done)


def run_single(base: Path, src, dst, direct: str) -> dict:
    path = str(base / f"zfunc-bench-single-{os.getpid()}.bin")
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct == "on" else 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, src.numel())
        evict(path)
        t = time.perf_counter()
        _loop(fd, memoryview(src.numpy()), reading=False)
        w = time.perf_counter() - t
        os.fdatasync(fd)
        ws = time.perf_counter() - t
        evict(path)
        dst.zero_()
        t = time.perf_counter()
        _loop(fd, memoryview(dst.numpy()), reading=True)
        rc = time.perf_counter() - t
        check_sample(dst, src, "single cold read")
        t = time.perf_counter()
        _loop(fd, memoryview(dst.numpy()), reading=True)
        rw = time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(path)
    return {"write": w, "write+sync": ws, "read cold": rc, "read warm": rw}


def run_numpy(base: Path, src, dst) -> dict:
    path = str(base / f"zfunc-bench-numpy-{os.getpid()}.bin")
    a, b = src.numpy(), dst.numpy()
    try:
        t = time.perf_counter()
        a.tofile(path)
        w = time.perf_counter() - t
        sync_file(path)
        ws = time.perf_counter() - t
        evict(path)
        times = []
        for _ in range(2):  # cold, then warm
            t = time.perf_counter()
            b[:] = np.fromfile(path, dtype=np.uint8)
            times.append(time.perf_counter() - t)
        check_sample(dst, src, "numpy read")
    finally:
        os.unlink(path)
    return {"write": w, "write+sync": ws, "read cold": times[0], "read warm": times[1]}


def run_kvikio(base: Path, src, dst) -> dict | None:
    try:
        import kvikio  # noqa: PLC0415
    except ImportError:
        return None
    path = str(base / f"zfunc-bench-kvikio-{os.getpid()}.bin")
    try:
        with kvikio.CuFile(path, "w+") as f:
            t = time.perf_counter()
            f.pwrite(src.numpy()).get()
            w = time.perf_counter() - t
            sync_file(path)
            ws = time.perf_counter() - t
            evict(path)
            times = []
            for _ in range(2):
                t = time.perf_counter()
                f.pread(dst.numpy()).get()
                times.append(time.perf_counter() - t)
        check_sample(dst, src, "kvikio read")
    finally:
        os.unlink(path)
    return {"write": w, "write+sync": ws, "read cold": times[0], "read warm": times[1]}


# ----------------------------------------------------------------------------- the pipeline

def run_pipeline(base: Path, units: int, unit_bytes: int, compute: str, nbuf: int, direct: str,
                 threads: int, chunk: int) -> dict:
    numel = unit_bytes // 4
    names = ("p", "m", "v")
    with DiskStore(base, threads=threads, chunk_bytes=chunk, direct=direct, stale="ignore") as store:
        fill = aligned_empty(numel)
        for k in range(units):
            for x in names:
                store.allocate(f"{k}.{x}", unit_bytes)
                fill.uniform_(0.5, 1.0)
                store.write(f"{k}.{x}", fill).result()
        for k in range(units):
            for x in names:
                evict(str(store.file_of(f"{k}.{x}")))
        bufs = [{x: aligned_empty(numel) for x in names} for _ in range(nbuf)]
        grad = torch.randn(numel) if compute == "adam" else None

        def load(k, b):
            return [store.read_into(f"{k}.{x}", b[x]) for x in names]

        def store_unit(k, b):
            return [store.write(f"{k}.{x}", b[x]) for x in names]

        if compute == "adam":
            from zfunc.kernels.cpu_adam import adamw_  # noqa: PLC0415

            adamw_(fill, grad, fill.clone(), fill.clone(), lr=1e-3, step=1)  # compile (or load) it untimed

            def work(k, b):
                adamw_(b["p"], grad, b["m"], b["v"], lr=1e-3, weight_decay=0.1, step=1)
        else:
            seconds = float(compute.split(":")[1]) / 1e3

            def work(k, b):
                time.sleep(seconds)

        cached = page_cache_bytes()
        tl = stream_units(range(units), load, work, store_unit, buffers=bufs)
        cached = page_cache_bytes() - cached
        t = time.perf_counter()  # buffered writes may still sit dirty in the page cache: flush them
        for k in range(units):
            for x in names:
                sync_file(str(store.file_of(f"{k}.{x}")))
        synced = tl.wall + time.perf_counter() - t
    return {"page_cache_growth": cached, "wall+sync": synced, "wall": tl.wall, "read": tl.read,
            "compute": tl.compute, "write": tl.write, "serial": tl.serial, "overlap": tl.overlap,
            "compute_fraction": tl.compute_fraction, "read_wait": tl.read_wait, "buffer_wait": tl.buffer_wait,
            "write_wait": tl.write_wait}


# ----------------------------------------------------------------------------- driver

def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def plan(args, size: int) -> list[tuple]:
    """The cases: (kind, threads or compute, chunk bytes or buffers, direct)."""
    directs = [d for d in args.direct.split(",") if d]
    cases = []
    if args.only != "pipeline":
        cases += [("store", t, c * MiB, d)
                  for d in directs for t in ints(args.threads) for c in ints(args.chunk_mib)]
        cases += [("single", 1, size, d) for d in directs]
        cases += [("numpy", 1, size, "off"), ("kvikio", 1, 0, "off")]
    if args.only != "throughput":
        cases += [("pipeline", c, nb, d) for c in args.compute.split(",") for d in ("auto", "off")
                  for nb in (1, 2, 3)]
    return cases


def run_case(case: tuple, args, base: Path, src, dst) -> dict | None:
    kind, a, b, d = case
    if kind == "store":
        return run_store(base, src, dst, a, b, d)
    if kind == "single":
        return run_single(base, src, dst, d)
    if kind == "numpy":
        return run_numpy(base, src, dst)
    if kind == "kvikio":
        return run_kvikio(base, src, dst)
    return run_pipeline(base, args.units, args.unit_mib * MiB, a, b, d, args.pipe_threads,
                        args.pipe_chunk_mib * MiB)


def print_throughput(rows: list[dict], size: int) -> None:
    print(f"\nthroughput, {size / 2**30:.2f} GiB file (GB/s, 10^9 bytes; median)")
    print(f"{'method':<8}{'direct':>7}{'threads':>8}{'chunk':>8}{'write':>8}{'w+sync':>8}{'r cold':>8}"
          f"{'r warm':>8}")
    for r in rows:
        if r["kind"] == "pipeline":
            continue
        gbs = r["gb_per_s"] = {k: size / v / GB for k, v in r["seconds"].items()}
        chunk = f"{r['chunk'] // MiB}M" if r["kind"] == "store" else "-"
        print(f"{r['kind']:<8}{r['direct']:>7}{r['threads']:>8}{chunk:>8}{gbs['write']:>8.2f}"
              f"{gbs['write+sync']:>8.2f}{gbs['read cold']:>8.2f}{gbs['read warm']:>8.2f}")


def print_pipeline(rows: list[dict], args) -> None:
    moved = 2 * 3 * args.units * args.unit_mib * MiB
    print(f"\npipeline: {args.units} units x 3 x {args.unit_mib} MiB, store threads {args.pipe_threads}, "
          f"chunk {args.pipe_chunk_mib} MiB; times in ms (median)")
    print(f"{'compute':<10}{'direct':>7}{'bufs':>5}{'wall':>8}{'read':>8}{'compute':>8}{'write':>8}"
          f"{'sum':>8}{'overlap':>8}{'comp%':>6}{'w+sync':>8}{'speedup':>8}{'GB/s':>7}{'cache':>7}")
    serial = {}
    for r in rows:
        if r["kind"] != "pipeline":
            continue
        s = r["seconds"]
        key = (r["compute"], r["direct"])
        if r["buffers"] == 1:
            serial[key] = s["wall+sync"]
        r["speedup"] = serial.get(key, float("nan")) / s["wall+sync"]
        r["gb_per_s"] = moved / s["wall+sync"] / GB
        print(f"{r['compute']:<10}{r['direct']:>7}{r['buffers']:>5}" + "".join(
            f"{s[k] * 1e3:>8.0f}" for k in ("wall", "read", "compute", "write", "serial"))
            + f"{s['overlap']:>7.2f}x{s['compute_fraction']:>6.0%}{s['wall+sync'] * 1e3:>8.0f}"
            + f"{r['speedup']:>7.2f}x{r['gb_per_s']:>7.2f}"
            + f"{s['page_cache_growth'] / MiB:>7.0f}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the drive to measure")
    p.add_argument("--size-gib", type=float, default=2.0, help="throughput file size (GiB)")
    p.add_argument("--threads", default="1,2,4,8", help="thread counts for the store")
    p.add_argument("--chunk-mib", default="1,8,64", help="chunk sizes (MiB) for the store")
    p.add_argument("--direct", default="off,on", help="O_DIRECT settings to measure (off, on)")
    p.add_argument("--units", type=int, default=12, help="pipeline: units")
    p.add_argument("--unit-mib", type=int, default=32, help="pipeline: MiB of each of a unit's 3 buffers")
    p.add_argument("--compute", default="sleep:100,adam", help="pipeline computes: sleep:<ms> and/or adam")
    p.add_argument("--pipe-threads", type=int, default=4, help="pipeline: store threads")
    p.add_argument("--pipe-chunk-mib", type=int, default=8, help="pipeline: store chunk (MiB)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every case (median reported)")
    p.add_argument("--only", choices=["throughput", "pipeline"], default=None)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    from tqdm.auto import tqdm  # noqa: PLC0415

    base = Path(args.dir)
    size = int(args.size_gib * 2**30) // MiB * MiB
    pipe_bytes = 3 * args.units * args.unit_mib * MiB
    free = shutil.disk_usage(base).free
    need = max(size if args.only != "pipeline" else 0, pipe_bytes if args.only != "throughput" else 0)
    if need > free // 2:
        sys.exit(f"{base} has {free / 2**30:.1f} GiB free; this run needs {need / 2**30:.1f} GiB and keeps "
                 f"half the disk free: lower --size-gib or --units/--unit-mib")
    cases = plan(args, size)
    src = dst = None
    if args.only != "pipeline":
        src, dst = aligned_empty(size, torch.uint8), aligned_empty(size, torch.uint8)
        src.view(torch.float32).normal_()
    runs: dict[tuple, list[dict]] = {c: [] for c in cases}
    bar = tqdm(total=len(cases) * args.repeat, desc="disk tier", disable=args.no_progress)
    for _ in range(args.repeat):
        for case in cases:
            kind, a, b, d = case
            bar.set_postfix_str(f"{kind} {a} {b // MiB if kind != 'pipeline' else b} {d}")
            r = run_case(case, args, base, src, dst)
            if r is not None:
                runs[case].append(r)
            bar.update()
    bar.close()
    rows = []
    for (kind, a, b, d), rs in runs.items():
        if not rs:
            continue
        median = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        pipe = kind == "pipeline"
        rows.append({"kind": kind, "threads": args.pipe_threads if pipe else a,
                     "chunk": args.pipe_chunk_mib * MiB if pipe else b, "compute": a if pipe else None,
                     "buffers": b if pipe else None, "direct": d, "seconds": median, "runs": rs})

    print(f"\n{base} ({filesystem_type(base)}), {os.cpu_count()} CPUs, {platform.machine()}, "
          f"torch {torch.__version__}, {args.repeat} run(s) per case")
    if args.only != "pipeline":
        print_throughput(rows, size)
    if args.only != "throughput":
        print_pipeline(rows, args)
    result = {"dir": str(base), "filesystem": filesystem_type(base), "size_bytes": size,
              "cpus": os.cpu_count(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
