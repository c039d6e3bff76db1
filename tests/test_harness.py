"""Tests of the multi-process harness zfunc.testing.run_distributed."""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as tdist

from zfunc.testing import WORLD_SIZES, DistributedError, run_distributed, seed_everything

N = 10  # elements per rank


def _rank_tensor(rank, n=N):
    return torch.arange(n, dtype=torch.float32) + 100.0 * rank


# ---------------------------------------------------------------- collectives


def _all_reduce(op):
    x = _rank_tensor(tdist.get_rank())
    tdist.all_reduce(x, op=op)
    return x


def _all_gather_into_tensor():
    r, w = tdist.get_rank(), tdist.get_world_size()
    out = torch.empty(w * N)
    tdist.all_gather_into_tensor(out, _rank_tensor(r))
    return out


def _reduce_scatter_tensor(op):
    r, w = tdist.get_rank(), tdist.get_world_size()
    inp = torch.arange(w * N, dtype=torch.float32) * (r + 1)
    out = torch.empty(N)
    tdist.reduce_scatter_tensor(out, inp, op=op)
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_all_reduce(world_size, op):
    results = run_distributed(_all_reduce, world_size, getattr(tdist.ReduceOp, op))
    expected = sum(_rank_tensor(r) for r in range(world_size))
    if op == "AVG":
        expected = expected / world_size
    assert len(results) == world_size
    for res in results:
        assert isinstance(res, torch.Tensor)
        torch.testing.assert_close(res, expected)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_into_tensor(world_size):
    results = run_distributed(_all_gather_into_tensor, world_size)
    expected = torch.cat([_rank_tensor(r) for r in range(world_size)])
    for res in results:
        torch.testing.assert_close(res, expected, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_reduce_scatter_tensor(world_size, op):
    results = run_distributed(_reduce_scatter_tensor, world_size, getattr(tdist.ReduceOp, op))
    full = torch.arange(world_size * N, dtype=torch.float32) * sum(r + 1 for r in range(world_size))
    if op == "AVG":
        full = full / world_size
    for rank, res in enumerate(results):
        torch.testing.assert_close(res, full[rank * N : (rank + 1) * N])


# ------------------------------------------------------------ results and args


def test_results_by_rank_args_kwargs_and_closures():
    scale = 3.0  # captured by a local closure: nothing is pickled on the way in

    def fn(a, *, b):
        r = tdist.get_rank()
        return {
            "rank": r,
            "world": tdist.get_world_size(),
            "t": torch.full((2, 3), r * scale + a + b, dtype=torch.float64),
            "threads": torch.get_num_threads(),
        }

    results = run_distributed(fn, 4, 1.0, b=2.0)
    assert [res["rank"] for res in results] == [0, 1, 2, 3]
    assert all(res["world"] == 4 for res in results)
    assert all(res["threads"] == 1 for res in results)
    for r, res in enumerate(results):
        assert isinstance(res["t"], torch.Tensor) and res["t"].dtype == torch.float64
        torch.testing.assert_close(res["t"], torch.full((2, 3), r * 3.0 + 3.0, dtype=torch.float64))
    assert not tdist.is_initialized()  # the parent never gets a process group


def test_large_results_do_not_deadlock():
    # 8 MB per rank: far more than a pipe buffer.
    def fn():
        return torch.arange(2_000_000, dtype=torch.float32) + tdist.get_rank()

    results = run_distributed(fn, 2)
    for r, res in enumerate(results):
        assert res.shape == (2_000_000,) and res[0].item() == r and res[-1].item() == 1_999_999 + r


def test_fn_may_destroy_the_group_itself():
    def fn():
        x = torch.ones(3)
        tdist.all_reduce(x)
        tdist.destroy_process_group()
        return x

    results = run_distributed(fn, 2)
    torch.testing.assert_close(results[1], torch.full((3,), 2.0))


def test_system_exit_in_a_rank_is_reported():
    def fn():
        if tdist.get_rank() == 0:
            raise SystemExit(3)

    with pytest.raises(DistributedError, match="SystemExit: 3"):
        run_distributed(fn, 2, timeout=60)


def test_none_results_and_world_size_one_has_a_group():
    def fn():
        assert tdist.is_initialized() and tdist.get_backend() == "gloo"
        assert tdist.get_world_size() == 1

    assert run_distributed(fn, 1) == [None]


def test_refuses_when_parent_has_a_group(tmp_path):
    store = tdist.FileStore(str(tmp_path / "s"), 1)
    tdist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        with pytest.raises(RuntimeError, match="default process group"):
            run_distributed(lambda: None, 2)
    finally:
        tdist.destroy_process_group()


# ------------------------------------------------------------------ failures


def _raise_on_rank(bad_rank):
    if tdist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    x = torch.ones(4)
    tdist.all_reduce(x)  # the good ranks wait for the bad one: must not hang
    return x


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_error_is_reraised_with_traceback(world_size):
    bad = world_size - 1
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(_raise_on_rank, world_size, bad, timeout=60)
    assert time.monotonic() - t0 < 10
    err = info.value
    msg = str(err)
    assert err.first_rank == bad
    assert f"rank {bad} (first failure)" in msg
    assert "Traceback (most recent call last)" in msg
    assert f"ValueError: boom from rank {bad}" in msg
    assert "_raise_on_rank" in msg  # the frame of the user's function
    assert isinstance(err.exceptions[bad], ValueError)
    assert set(err.tracebacks) | set(err.killed) == set(range(world_size))
    assert multiprocessing.active_children() == []


def test_all_failing_ranks_are_reported():
    def fn():
        raise AssertionError(f"rank {tdist.get_rank()} disagrees")

    with pytest.raises(DistributedError) as info:
        run_distributed(fn, 4, timeout=60)
    assert sorted(info.value.tracebacks) == [0, 1, 2, 3]
    for r in range(4):
        assert f"AssertionError: rank {r} disagrees" in str(info.value)


def test_autograd_refused_after_fork_names_the_cause():
    # What a CUDA build of torch raises in a forked rank once the test process ran a backward pass (the CPU
    # build never does, so the rank raises the same message itself): the error says why and what to do.
    from zfunc.testing import AUTOGRAD_FORK_REFUSAL

    def fn():
        raise RuntimeError(f"Unable to handle {AUTOGRAD_FORK_REFUSAL}. It is recommended to use spawn.")

    with pytest.raises(DistributedError) as info:
        run_distributed(fn, 2, timeout=60)
    message = str(info.value)
    assert "this is a CUDA build of torch, and the calling process ran a backward pass" in message
    assert "run_distributed(fn, 1)" in message
    assert message.index("CUDA build") < message.index("----- rank")  # the cause first, then the tracebacks

    def other():
        raise RuntimeError("another failure")

    with pytest.raises(DistributedError) as info:
        run_distributed(other, 2, timeout=60)
    assert "CUDA build" not in str(info.value)


def test_rank_dying_without_report():
    def fn():
        if tdist.get_rank() == 1:
            os._exit(7)
        return 0

    with pytest.raises(DistributedError, match="exited with code 7"):
        run_distributed(fn, 2, timeout=60)


def test_unpicklable_result_is_an_error():
    with pytest.raises(DistributedError, match="(?i)pickle"):
        run_distributed(lambda: lambda: None, 1, timeout=60)


def _hang_on_rank(bad_rank):
    if tdist.get_rank() == bad_rank:
        time.sleep(3600)
    return tdist.get_rank()


def test_hanging_rank_times_out():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_distributed(_hang_on_rank, 2, 1, timeout=1.5)
    elapsed = time.monotonic() - t0
    assert elapsed < 6, elapsed
    msg = str(info.value)
    assert "rank(s) [1] did not return from _hang_on_rank" in msg
    assert "rank(s) [0] returned but did not get through the final barrier" in msg
    assert "_hang_on_rank" in msg  # faulthandler dump of the stuck rank
    assert multiprocessing.active_children() == []  # nothing left running


def test_collective_hang_times_out():
    # Rank 0 waits in a collective that rank 1 never joins.
    def fn():
        if tdist.get_rank() == 0:
            tdist.all_reduce(torch.ones(1))
        else:
            time.sleep(3600)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] did not return"):
        run_distributed(fn, 2, timeout=1.5)
    assert time.monotonic() - t0 < 6


# --------------------------------------------------------------- fork safety


def test_fork_after_parallel_work_in_parent():
    # Run OpenMP/MKL parallel regions in the parent, then fork: without the
    # harness's torch.set_num_threads(1) in the workers the first parallel op
    # in a worker hangs forever (libgomp is not fork-safe).
    a = torch.randn(512, 512)
    (a @ a).sum()
    (torch.randn(2_000_000).exp() + 1).sum()

    def fn():
        w = torch.randn(256, 256, requires_grad=True)
        y = (torch.randn(128, 256) @ w).tanh()
        y = torch.nn.functional.conv2d(y.view(1, 1, 128, 256), torch.randn(2, 1, 3, 3))
        y.sum().backward()
        big = (torch.randn(2_000_000).exp() + 1).sum()
        return torch.get_num_threads(), bool(torch.isfinite(w.grad).all() and torch.isfinite(big))

    assert run_distributed(fn, 2, timeout=30) == [(1, True), (1, True)]


@pytest.mark.slow  # numba import + parallel compile: ~2.5 s
def test_fork_after_numba_prange_in_parent():
    numba = pytest.importorskip("numba")
    import numpy as np

    @numba.njit(parallel=True)
    def twice_sum(x):
        s = 0.0
        for i in numba.prange(x.shape[0]):
            s += 2.0 * x[i]
        return s

    x = np.ones(100_000)
    assert twice_sum(x) == 200_000.0  # parent has now run a numba parallel region

    def fn():
        a = torch.randn(256, 256)
        (a @ a).sum()
        return twice_sum(x)

    assert run_distributed(fn, 2, timeout=30) == [200_000.0, 200_000.0]


def test_seed_everything_is_deterministic():
    def fn(seed):
        seed_everything(seed + tdist.get_rank())
        return torch.randn(5)

    a = run_distributed(fn, 2, 123)
    b = run_distributed(fn, 2, 123)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.equal(a[0], a[1])


def test_timing_report(capsys):
    """Wall time per run_distributed call after warm-up (printed with -s)."""

    def fn():
        x = torch.ones(N)
        tdist.all_reduce(x)
        return x

    lines = []
    for n in WORLD_SIZES:
        run_distributed(fn, n)  # warm-up
        reps = 3
        t0 = time.perf_counter()
        for _ in range(reps):
            run_distributed(fn, n)
        per_call = (time.perf_counter() - t0) / reps
        lines.append(f"run_distributed world_size={n}: {per_call * 1e3:.0f} ms/call")
        assert per_call < 2.0, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_dist_fixture(dist):
    assert dist is run_distributed
    assert dist(tdist.get_rank, 2) == [0, 1]
