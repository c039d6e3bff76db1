"""zfunc.tiers: DiskStore round trips, errors, cleanup, stale directories; stream_units exactness and errors.

Every comparison is element-wise (torch.equal). Files live under pytest's tmp_path (a real
filesystem, so O_DIRECT is exercised where the filesystem allows it).
"""

import errno
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zfunc.tiers import (
    ALIGN,
    DiskIOError,
    DiskSpaceError,
    DiskStore,
    PipelineError,
    aligned_empty,
    find_stale,
    remove_stale,
    stream_units,
)
from zfunc.tiers import scratch
from zfunc.tiers.fileio import _chunks

ROOT = Path(__file__).resolve().parents[1]


def rand(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(-(2**7), 2**7 - 1, (n,), generator=g).to(dtype)


def in_child(fn):
    """``fn()`` in a forked child that ends with os._exit (no exit handlers run, as after a SIGKILL).

    Returns what ``fn`` returned (JSON-able, sent through a pipe). The child does file work only
    (no torch parallel regions), which is fork safe.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            out = json.dumps({"ok": fn()})
            code = 0
        except BaseException as e:  # noqa: BLE001
            out = json.dumps({"error": repr(e)})
        finally:
            os.write(w, out.encode())
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        reply = json.loads(f.read())
    os.waitpid(pid, 0)
    assert "ok" in reply, reply
    return reply["ok"]


def run_py(code, *args):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("direct", ["auto", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.bool])
def test_round_trip_sizes_dtypes(tmp_path, dtype, direct):
    sizes = [0, 1, 7, 1023, 1024, 1025, 4097, 3 * 4096 + 5, 300_001]
    with DiskStore(tmp_path, threads=3, chunk_bytes=4096, direct=direct) as store:
        data = {}
        for i, n in enumerate(sizes):
            x = rand(n, dtype, seed=i)
            name = f"t{i}"
            assert store.allocate(name, shape=(n,), dtype=dtype) == x.numel() * x.element_size()
            data[name] = x
        futures = [store.write(name, x) for name, x in data.items()]
        assert [f.result() for f in futures] == list(data.values())  # resolves to the tensor
        for name, x in data.items():
            for out in (torch.empty_like(x), aligned_empty(x.numel(), dtype)):
                out.zero_() if out.numel() else None
                assert store.read_into(name, out).result() is out
                assert torch.equal(out, x), name


def test_round_trip_shapes_and_aligned_buffers(tmp_path):
    with DiskStore(tmp_path, chunk_bytes=8192) as store:
        x = aligned_empty((64, 1000))  # aligned memory and offset 0: pieces go through O_DIRECT
        x.copy_(rand(64_000, torch.float32).view(64, 1000))
        assert x.data_ptr() % ALIGN == 0
        store.allocate("x", x.numel() * 4)
        store.write("x", x).result()
        y = torch.empty(64, 1000)
        store.read_into("x", y).result()
        assert torch.equal(x, y)
        assert store.nbytes("x") == 256_000 and "x" in store and store.names() == ["x"]


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_offsets(tmp_path, direct):
    whole = rand(50_000, torch.float32)
    with DiskStore(tmp_path, threads=2, chunk_bytes=4096, direct=direct) as store:
        store.allocate("w", whole.numel() * 4)
        cuts = [0, 1, 1024, 1025, 17_000, 33_333, 50_000]  # pieces at aligned and unaligned byte offsets
        fs = [store.write("w", whole[a:b], offset=4 * a) for a, b in zip(cuts, cuts[1:])]
        [f.result() for f in fs]
        out = aligned_empty(whole.numel())
        store.read_into("w", out).result()
        assert torch.equal(out, whole)
        for a, b in [(3, 9), (1024, 3072), (0, 50_000), (49_999, 50_000), (777, 40_000)]:
            part = torch.zeros(b - a)
            store.read_into("w", part, offset=4 * a).result()
            assert torch.equal(part, whole[a:b]), (a, b)
        raw = torch.zeros(10, dtype=torch.uint8)  # byte offsets need not be element aligned
        store.read_into("w", raw, offset=4 * 5 + 2).result()
        assert torch.equal(raw, whole.view(torch.uint8)[22:32])


def test_chunks_cover_exactly_and_direct_pieces_are_aligned():
    for addr in (0, 64, 4096 * 3, 4096 + 100):
        for offset in (0, 100, 4096, 8192 + (addr % 4096)):
            for n in (0, 1, 4095, 4096, 4097, 10 * 4096 + 17, 100_000):
                pieces = _chunks(addr, n, offset, 8192, direct=True)
                assert sum(p[1] for p in pieces) == n
                assert [p[0] for p in pieces] == [sum(q[1] for q in pieces[:i]) for i in range(len(pieces))]
                for start, length, direct in pieces:
                    assert length <= 8192
                    if direct:
                        assert (addr + start) % ALIGN == 0 and (offset + start) % ALIGN == 0
                        assert length % ALIGN == 0
                if (addr - offset) % ALIGN == 0 and n >= 3 * 4096:
                    assert any(p[2] for p in pieces)


def test_concurrent_reads_and_writes_from_threads(tmp_path):
    n_names, n = 12, 20_000
    with DiskStore(tmp_path, threads=4, chunk_bytes=4096) as store:
        for i in range(n_names):
            store.allocate(f"n{i}", n * 4)
        errors = []

        def worker(i):
            try:
                for r in range(5):
                    x = rand(n, torch.float32, seed=100 * i + r)
                    store.write(f"n{i}", x).result()
                    y = torch.empty(n)
                    store.read_into(f"n{i}", y).result()
                    assert torch.equal(x, y)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        store.flush()


# ----------------------------------------------------------------------------- bad input and I/O errors

def test_bad_requests_raise_at_once(tmp_path):
    with DiskStore(tmp_path) as store:
        store.allocate("a", 400)
        with pytest.raises(ValueError, match="do not fit in the 400 bytes"):
            store.read_into("a", torch.empty(101))  # 404 bytes: past the end
        with pytest.raises(ValueError, match="do not fit"):
            store.write("a", torch.empty(10), offset=380)
        with pytest.raises(ValueError, match="do not fit"):
            store.write("a", torch.empty(1), offset=-4)
        with pytest.raises(ValueError, match="not contiguous"):
            store.write("a", torch.empty(10, 10).t())
        with pytest.raises(TypeError, match="torch.Tensor"):
            store.write("a", [1.0])
        with pytest.raises(KeyError, match="'b' is not allocated.*'a'"):
            store.read_into("b", torch.empty(1))
        with pytest.raises(ValueError, match="already allocated"):
            store.allocate("a", 8)
        with pytest.raises(ValueError, match="nbytes, or shape= and dtype="):
            store.allocate("c", 8, shape=(2,), dtype=torch.float32)
        with pytest.raises(ValueError, match="non-empty str"):
            store.allocate("", 8)
    with pytest.raises(ValueError, match="is closed"):
        store.write("a", torch.empty(1))
    with pytest.raises(ValueError, match="is closed"):
        store.allocate("z", 8)


def test_short_read_names_file_and_offset(tmp_path):
    with DiskStore(tmp_path, chunk_bytes=4096, direct="off") as store:
        store.allocate("a", 40_000)
        store.write("a", torch.ones(10_000)).result()
        os.truncate(store.file_of("a"), 10_000)  # someone truncated it underneath
        f = store.read_into("a", torch.empty(10_000))
        with pytest.raises(DiskIOError, match=r"short read.*truncated") as info:
            f.result()
        assert info.value.filename == str(store.file_of("a"))
        assert "at offset" in str(info.value) and str(store.file_of("a")) in str(info.value)
        with pytest.raises(DiskIOError):
            store.flush()  # the failure is reported once more by flush ...
        store.flush()  # ... and only once


def test_file_deleted_underneath_keeps_working(tmp_path):
    """The store holds an open descriptor: an unlinked file stays readable (no error, no wrong data)."""
    with DiskStore(tmp_path) as store:
        store.allocate("a", 4000)
        x = rand(1000, torch.float32)
        store.write("a", x).result()
        path = store.file_of("a")
        path.unlink()
        y = torch.empty(1000)
        store.read_into("a", y).result()
        assert torch.equal(x, y)
        store.write("a", x * 2).result()
        store.read_into("a", y).result()
        assert torch.equal(x * 2, y)
        d = store.path
    assert not d.exists()


def test_enospc_during_write_comes_through_the_future(tmp_path, monkeypatch):
    real = os.pwrite

    def full(fd, buf, offset):
        if offset >= 8192:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, offset)

    with DiskStore(tmp_path, threads=2, chunk_bytes=4096, direct="off") as store:
        store.allocate("a", 40_000)
        monkeypatch.setattr(os, "pwrite", full)
        f = store.write("a", torch.ones(10_000))
        with pytest.raises(DiskIOError) as info:
            f.result()
        assert info.value.errno == errno.ENOSPC
        assert "No space left" in str(info.value) and str(store.file_of("a")) in str(info.value)
        assert "at offset" in str(info.value)
        monkeypatch.setattr(os, "pwrite", real)
        store.write("a", torch.ones(10_000)).result()  # the store keeps working


def test_free_space_check_says_needed_and_free(tmp_path, monkeypatch):
    import shutil

    with DiskStore(tmp_path) as store:
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=3 << 30))
        with pytest.raises(DiskSpaceError, match=r"'big' needs 5.00 GiB .* has 3.00 GiB free") as e:
            store.allocate("big", 5 << 30)
        assert e.value.errno == errno.ENOSPC
        assert "big" not in store
        store.allocate("big", 1 << 20)  # the failed name can be allocated again
        with pytest.raises(DiskSpaceError):
            store.ensure_space(4 << 30)
    assert not any(tmp_path.iterdir())


def test_file_size_limit_fails_allocation_not_training(tmp_path):
    """RLIMIT_FSIZE (in a forked child): preallocation hits the limit inside allocate."""

    def child():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with DiskStore(tmp_path) as s:
            s.allocate("small", 1 << 19)
            try:
                s.allocate("big", 4 << 20)
            except OSError as e:
                return [e.errno, "big" in s]
        return None

    assert in_child(child) == [errno.EFBIG, False]
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- cleanup

def test_close_removes_only_its_files_and_warns_about_foreign(tmp_path):
    (tmp_path / "keep.txt").write_text("not zfunc's")
    store = DiskStore(tmp_path)
    store.allocate("a", 100)
    d = store.path
    assert (d / scratch.MARKER).exists() and d.name.startswith(f"zfunc-{os.getpid()}-")
    (d / "foreign.bin").write_text("someone else's")
    (d / "000099-lookalike.bin").write_text("matches zfunc's names but this store never made it")
    with pytest.warns(UserWarning, match="did not write.*000099-lookalike.bin, foreign.bin"):
        store.close()
    assert sorted(os.listdir(d)) == ["000099-lookalike.bin", "foreign.bin"]
    assert (tmp_path / "keep.txt").read_text() == "not zfunc's"
    store.close()  # idempotent


def test_context_manager_cleans_up_on_exception(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with DiskStore(tmp_path) as store:
            store.allocate("a", 1 << 16)
            store.write("a", torch.ones(1 << 14))  # still in flight: close waits for it
            raise RuntimeError("boom")
    assert store.closed and not any(tmp_path.iterdir())


@pytest.mark.slow  # a fresh interpreter (imports torch: ~4 s here)
def test_removed_at_interpreter_exit_not_by_a_forked_child(tmp_path):
    code = """
        import os, sys, torch
        from zfunc.tiers import DiskStore
        s = DiskStore(sys.argv[1])
        s.allocate("a", 1 << 20)
        s.write("a", torch.ones(1 << 18))  # left in flight on purpose
        pid = os.fork()
        if pid == 0:  # the child exits normally (running exit handlers); the parent's files must stay
            try:
                s.write("a", torch.ones(1))
            except RuntimeError as e:
                print("child refused:", "forked child" in str(e), flush=True)
            sys.exit(0)
        os.waitpid(pid, 0)
        print("after child:", os.path.isdir(s.path), os.path.exists(s.file_of("a")), flush=True)
        # no close(): the finalizer removes it at exit
    """
    r = run_py(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "child refused: True" in r.stdout and "after child: True True" in r.stdout, r.stdout
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- stale directories

def killed_store(parent):
    """A store whose process died without cleanup (os._exit skips finalizers, as SIGKILL would)."""

    alive = []  # a store that is garbage collected removes its files: keep it until os._exit

    def child():
        alive.append(DiskStore(parent, stale="ignore"))
        alive[0].allocate("unit0.m", 4096)
        return str(alive[0].path)

    return Path(in_child(child))


def test_stale_directories_are_reported_then_removed_on_request(tmp_path, caplog):
    dead = killed_store(tmp_path)
    assert dead.is_dir() and (dead / "000000-unit0.m.bin").exists()
    live = DiskStore(tmp_path, stale="ignore")  # this process's own: never stale
    unmarked = tmp_path / "zfunc-1-0123abcd"
    unmarked.mkdir()  # looks like ours but has no marker: never touched
    (tmp_path / "other").mkdir()
    assert [s.path for s in find_stale(tmp_path)] == [dead]
    with caplog.at_level(logging.WARNING, logger="zfunc.tiers"):
        with DiskStore(tmp_path) as s:
            assert [x.path for x in s.stale] == [dead]
    assert str(dead) in caplog.text and "remove_stale" in caplog.text
    assert dead.is_dir()  # warned, not removed
    with DiskStore(tmp_path, stale="remove") as s:
        assert s.stale == []
    assert not dead.exists()
    assert unmarked.is_dir() and (tmp_path / "other").is_dir() and live.path.is_dir()
    live.close()


def test_stale_directory_with_foreign_files_keeps_them(tmp_path):
    dead = killed_store(tmp_path)
    (dead / "notes.txt").write_text("mine")
    [s] = find_stale(tmp_path)
    assert s.foreign == ("notes.txt",)
    with pytest.warns(UserWarning, match="notes.txt"):
        assert remove_stale(tmp_path) == []
    assert sorted(os.listdir(dead)) == ["notes.txt"]


def test_liveness_rules():
    me = scratch.this_process()
    assert scratch.liveness(me, me) == "alive"
    assert scratch.liveness(replace(me, boot_id="rebooted since"), me) == "dead"
    assert scratch.liveness(replace(me, host="elsewhere"), me) == "unknown"
    assert scratch.liveness(replace(me, pid_ns="pid:[1]"), me) == "unknown"  # another container's pid
    assert scratch.liveness(replace(me, start_ticks=me.start_ticks + 1), me) == "dead"  # pid reused
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert scratch.liveness(replace(me, pid=p.pid), me) == "dead"


def test_marker_records_owner(tmp_path):
    with DiskStore(tmp_path) as s:
        rec = json.loads((s.path / scratch.MARKER).read_text())
        assert rec["pid"] == os.getpid() and rec["zfunc_scratch"] == 1
        assert scratch.read_owner(s.path) == scratch.this_process()


def test_unsuitable_filesystems_warn(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with pytest.warns(UserWarning, match="keeps files in RAM"):
        DiskStore("/dev/shm").close()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DiskStore(tmp_path / "missing")


# ----------------------------------------------------------------------------- the pipeline

def disk_units(tmp_path, n_units, numel, **kw):
    store = DiskStore(tmp_path, threads=3, chunk_bytes=8192, **kw)
    init = {}
    for k in range(n_units):
        for x in "pmv":
            t = rand(numel + k, torch.float32, seed=10 * k + ord(x))
            t = t.abs() if x == "v" else t
            store.allocate(f"{k}.{x}", t.numel() * 4)
            store.write(f"{k}.{x}", t).result()
            init[f"{k}.{x}"] = t
    return store, init


def io_fns(store, jitter=0.0):
    g = torch.Generator().manual_seed(1)

    def pause():
        if jitter:
            time.sleep(jitter * float(torch.rand((), generator=g)))

    def load(k, b):
        pause()
        return [store.read_into(f"{k}.{x}", b[x][:store.nbytes(f"{k}.{x}") // 4]) for x in "pmv"]

    def save(k, b):
        pause()
        return [store.write(f"{k}.{x}", b[x][:store.nbytes(f"{k}.{x}") // 4]) for x in "pmv"]

    return load, save


def read_all(store, init):
    out = {}
    for name, t in init.items():
        out[name] = torch.empty_like(t)
        store.read_into(name, out[name]).result()
    return out


@pytest.mark.parametrize("nbuf", [1, 2, 3])
def test_pipeline_equals_serial_loop_in_place_op(tmp_path, nbuf):
    n_units, numel = 7, 5000
    store, init = disk_units(tmp_path, n_units, numel)
    with store:
        bufs = [{x: aligned_empty(numel + n_units) for x in "pmv"} for _ in range(nbuf)]
        load, save = io_fns(store, jitter=0.003)
        seen = []

        def compute(k, b):
            n = numel + k
            seen.append(torch.equal(b["p"][:n], init[f"{k}.p"]))  # exactly the loaded data
            b["p"][:n].mul_(1.5).add_(b["m"][:n]).sub_(k)
            b["m"][:n].mul_(0.5)
            time.sleep(0.002)

        tl = stream_units(range(n_units), load, compute, save, buffers=bufs)
        assert seen == [True] * n_units
        got = read_all(store, init)
        for k in range(n_units):
            p, m, v = (init[f"{k}.{x}"].clone() for x in "pmv")
            p.mul_(1.5).add_(m).sub_(k)
            m.mul_(0.5)
            assert torch.equal(got[f"{k}.p"], p) and torch.equal(got[f"{k}.m"], m)
            assert torch.equal(got[f"{k}.v"], v)
        assert len(tl.units) == n_units and tl.wall > 0 and tl.compute > 0 and tl.read > 0 and tl.write > 0
        assert all(u.load[1] <= u.compute[0] and u.compute[1] <= u.store[0] for u in tl.units)
        assert "units in" in tl.summary()


@pytest.mark.parametrize("nbuf", [2, 3])
def test_pipeline_equals_serial_loop_numba_adamw(tmp_path, nbuf):
    from zfunc.kernels.cpu_adam import adamw_

    n_units, numel = 5, 4096 + 3
    store, init = disk_units(tmp_path, n_units, numel)
    grads = [rand(numel + k, torch.bfloat16, seed=99 + k) for k in range(n_units)]
    hyper = dict(lr=1e-3, weight_decay=0.1, num_threads=2)
    with store:
        bufs = [{x: aligned_empty(numel + n_units) for x in "pmv"} for _ in range(nbuf)]
        load, save = io_fns(store)
        for step in (1, 2):
            def compute(k, b, step=step):
                n = numel + k
                adamw_(b["p"][:n], grads[k], b["m"][:n], b["v"][:n], step=step, **hyper)

            stream_units(range(n_units), load, compute, save, buffers=bufs)
        got = read_all(store, init)
    for k in range(n_units):
        p, m, v = (init[f"{k}.{x}"].clone() for x in "pmv")
        for step in (1, 2):
            adamw_(p, grads[k], m, v, step=step, **hyper)
        for x, want in zip("pmv", (p, m, v)):
            assert torch.equal(got[f"{k}.{x}"], want), (k, x)


def test_pipeline_schedule_invariants():
    """load(k) starts after store(k - B) ended, compute(k) after load(k), store(k) after compute(k)."""
    log, lock, nbuf, n = [], threading.Lock(), 3, 12
    g = torch.Generator().manual_seed(3)
    delays = (torch.rand(3, n, generator=g) * 0.004).tolist()

    def ev(what, k):
        with lock:
            log.append((what, k))

    def phase(name, k):
        ev(name + "<", k)
        time.sleep(delays["lcs".index(name[0])][k])
        ev(name + ">", k)

    stream_units(range(n), lambda k, b: phase("load", k), lambda k, b: phase("compute", k),
                 lambda k, b: phase("store", k), buffers=[None] * nbuf)
    at = {e: i for i, e in enumerate(log)}
    for k in range(n):
        assert at[("load>", k)] < at[("compute<", k)] < at[("compute>", k)] < at[("store<", k)]
        if k >= nbuf:
            assert at[("store>", k - nbuf)] < at[("load<", k)]
    assert len(log) == 6 * n


def test_pipeline_overlaps():
    """With 3 buffers, I/O of neighbours runs during compute: wall well under the serial sum."""
    d = 0.03
    tl = stream_units(range(6), lambda k, b: time.sleep(d), lambda k, b: time.sleep(d),
                      lambda k, b: time.sleep(d), buffers=[0, 1, 2])
    assert tl.wall < 0.75 * tl.serial, tl.summary()
    assert tl.overlap > 1.3


@pytest.mark.parametrize("nbuf", [1, 3])
def test_compute_error_stops_and_states_the_files(tmp_path, nbuf):
    n_units, numel = 6, 3000
    store, init = disk_units(tmp_path, n_units, numel)
    with store:
        bufs = [{x: torch.empty(numel + n_units) for x in "pmv"} for _ in range(nbuf)]
        load, save = io_fns(store)

        def compute(k, b):
            if k == 3:
                raise ValueError("bad unit")
            b["p"].add_(1)

        with pytest.raises(PipelineError, match=r"compute of unit 3 .*ValueError: bad unit.*#0\.\.#2 were "
                                                r"stored.*units #3\.\. keep their previous") as info:
            stream_units(range(n_units), load, compute, save, buffers=bufs)
        e = info.value
        assert (e.phase, e.index, e.stored, e.torn) == ("compute", 3, 3, None)
        assert isinstance(e.__cause__, ValueError)
        got = read_all(store, init)
        for k in range(n_units):
            want = init[f"{k}.p"] + 1 if k < 3 else init[f"{k}.p"]
            assert torch.equal(got[f"{k}.p"], want), k
        store.flush()


def test_load_error_read_past_end(tmp_path):
    with DiskStore(tmp_path) as store:
        for k in range(4):
            store.allocate(str(k), 400 if k != 2 else 40)  # unit 2 is too small for the buffer
            store.write(str(k), torch.full((100 if k != 2 else 10,), float(k))).result()
        done = []
        with pytest.raises(PipelineError, match="load of unit 2") as info:
            stream_units(range(4), lambda k, b: store.read_into(str(k), b), lambda k, b: done.append(k),
                         lambda k, b: store.write(str(k), b), buffers=[torch.empty(100) for _ in range(3)])
        # compute stops at the failure (it may not have reached units 0 and 1 yet); what it did is stored
        assert done == list(range(len(done))) and len(done) <= 2 and info.value.stored == len(done)
        out = torch.empty(100)
        for k in range(4):
            if k != 2:
                store.read_into(str(k), out).result()
                assert torch.equal(out, torch.full((100,), float(k))), k  # loaded, stored unchanged
        assert isinstance(info.value.__cause__, ValueError)


def test_store_error_reports_the_torn_unit(tmp_path, monkeypatch):
    n_units, numel = 5, 2000
    store, init = disk_units(tmp_path, n_units, numel, direct="off")
    with store:
        bad = str(store.file_of("2.m"))
        bad_fds = {int(fd) for fd in os.listdir("/proc/self/fd")  # the store's descriptor(s) of 2.m
                   if os.path.realpath(f"/proc/self/fd/{fd}") == bad}
        real_pwrite = os.pwrite

        def failing_pwrite(fd, buf, offset):
            if fd in bad_fds:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_pwrite(fd, buf, offset)

        assert bad_fds
        monkeypatch.setattr(os, "pwrite", failing_pwrite)
        bufs = [{x: torch.empty(numel + n_units) for x in "pmv"} for _ in range(3)]
        load, save = io_fns(store)
        with pytest.raises(PipelineError, match=r"store of unit 2 .*Input/output error") as info:
            stream_units(range(n_units), load, lambda k, b: b["p"].add_(1), save, buffers=bufs)
        e = info.value
        assert (e.phase, e.stored, e.torn) == ("store", 2, 2)
        assert "unit #2's file is partly written" in str(e) and "units #3.. keep" in str(e)
        assert isinstance(e.__cause__, DiskIOError) and e.__cause__.filename == bad
        monkeypatch.setattr(os, "pwrite", real_pwrite)
        got = read_all(store, init)
        for k in (0, 1):
            assert torch.equal(got[f"{k}.p"], init[f"{k}.p"] + 1)
        for k in (3, 4):
            assert torch.equal(got[f"{k}.p"], init[f"{k}.p"])
        with pytest.raises(DiskIOError):
            store.flush()


def test_keyboard_interrupt_is_reraised_as_is():
    stored = []

    def compute(k, b):
        if k == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stream_units(range(5), lambda k, b: None, compute, lambda k, b: stored.append(k), buffers=[0, 1])
    assert stored == [0, 1]  # what was computed is stored before returning
    assert not [t for t in threading.enumerate() if t.name.startswith("zfunc-stream")]


def test_pipeline_input_checks():
    with pytest.raises(ValueError, match="at least one buffer"):
        stream_units(range(3), lambda k, b: None, lambda k, b: None, buffers=[])
    with pytest.raises(PipelineError, match="must return None, a Future"):
        stream_units(range(3), lambda k, b: 5, lambda k, b: None, buffers=[0])
    tl = stream_units([], lambda k, b: None, lambda k, b: None, buffers=[0])
    assert tl.units == [] and tl.wall >= 0
    seen = []
    stream_units("abc", lambda k, b: None, lambda k, b: seen.append((k, b)), buffers=["x", "y"])  # store=None
    assert seen == [("a", "x"), ("b", "y"), ("c", "x")]
