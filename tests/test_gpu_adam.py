"""zfunc.kernels.gpu_adam: adam_flat_ / AdamSegments, both backends.

The torch backend runs here on the CPU and is checked against torch.optim.AdamW/Adam(fused=True)
element by element. The Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
the ``interpret`` fixture before the kernels are first jitted; nothing else in the suite imports
triton) on small buffers whose chunks cross run boundaries and end off the block grid, and are
checked against a numpy emulation of the math of torch's CUDA kernel and against the torch
backend. On a CUDA machine, ``test_cuda_*`` compare the compiled kernels with torch's fused
CUDA kernel bit for bit.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from zfunc.kernels import gpu_adam as ga
from zfunc.kernels.gpu_adam import AdamSegments, adam_flat_

BETAS, EPS = (0.9, 0.999), 1e-8
LR = 1e-3
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = ""):
    """Bitwise equal, except that a NaN only has to be a NaN (torch's own NaN bits differ
    between its CPU and CUDA casts)."""
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), f"{what}: NaN positions differ"
    bad = (bits(got) != bits(want)) & ~nan
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {got.numel()} differ, first at "
                                 f"{int(bad.nonzero()[0])}: {got[bad][:4].tolist()} vs {want[bad][:4].tolist()}")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def step_args(t, device="cpu", lr=LR):
    return {"lr": torch.tensor(lr, device=device), "step": torch.tensor(float(t), device=device),
            "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS}


# ----------------------------------------------------------------------------- segments

def test_segments_build_chunks_and_merges():
    seg = AdamSegments.build([(500, 300, 0.1), (3, 200, 0.0), (203, 297, 0.0), (900, 5, 0.1)], "cpu", chunk=64)
    # sorted, adjacent equal-decay runs merged, the 5-element run kept
    assert seg.runs == ((3, 497, 0.0), (500, 300, 0.1), (900, 5, 0.1))
    assert seg.end == 905 and seg.numel == 802
    starts, lengths, wds = seg.starts.tolist(), seg.lengths.tolist(), seg.weight_decays.tolist()
    # the chunks tile the runs exactly, none longer than chunk
    covered = sorted(i for s, n in zip(starts, lengths) for i in range(s, s + n))
    assert covered == [i for s, n, _ in seg.runs for i in range(s, s + n)]
    assert max(lengths) <= 64
    # every chunk is either aligned at both ends or a short head/tail piece of a run
    for s, n in zip(starts, lengths):
        assert (s % ga.ALIGN == 0 and n % ga.ALIGN == 0) or n < 2 * ga.ALIGN
    assert wds == [0.0 if s < 500 else pytest.approx(0.1) for s in starts]
    assert seg.weight_decays.dtype == torch.float32 and seg.starts.dtype == torch.int64


def test_segments_from_views_and_uniform():
    flat = torch.zeros(100)
    views = [(flat[0:30].view(5, 6), 0.1), (flat[30:31], 0.0), (flat[40:100], 0.1), (flat[31:31], 0.5)]
    seg = AdamSegments.from_views(flat, views)
    assert seg.runs == ((0, 30, 0.1), (30, 1, 0.0), (40, 60, 0.1))
    assert AdamSegments.uniform(10, 0.0, "cpu").runs == ((0, 10, 0.0),)
    assert AdamSegments.build([], "cpu").num_chunks == 0


@pytest.mark.parametrize("runs, match", [
    ([(0, 10, 0.0), (5, 10, 0.0)], "overlap"),
    ([(-1, 10, 0.0)], ">= 0"),
    ([(0, 10)], "start: int"),
    ([(0.5, 10, 0.0)], "start: int"),
    ([(0, 10, float("nan"))], "finite"),
])
def test_segments_bad_runs(runs, match):
    with pytest.raises(ValueError, match=match):
        AdamSegments.build(runs, "cpu")


def test_segments_bad_chunk_and_views():
    with pytest.raises(ValueError, match="multiple of"):
        AdamSegments.build([(0, 10, 0.0)], "cpu", chunk=100)
    flat = torch.zeros(10)
    with pytest.raises(ValueError, match="inside flat"):
        AdamSegments.from_views(flat, [(torch.zeros(3), 0.0)])
    with pytest.raises(ValueError, match="contiguous"):
        AdamSegments.from_views(flat, [(flat.view(2, 5)[:, 1], 0.0)])


# ----------------------------------------------------------------------------- torch backend vs torch.optim

RUNS = [(0, 700, 0.1), (700, 301, 0.0), (1001, 40, 0.1), (1100, 900, 0.05)]  # 1041..1100 is a gap
N = 2003  # and so are the last 3 elements


def reference(p0, runs, mode, lr=LR):
    cls = torch.optim.AdamW if mode == "adamw" else torch.optim.Adam
    params = [torch.nn.Parameter(p0[s:s + n].clone()) for s, n, _ in runs]
    groups = [{"params": [q], "weight_decay": wd} for q, (_, _, wd) in zip(params, runs)]
    return params, cls(groups, lr=torch.tensor(lr), betas=BETAS, eps=EPS, fused=True)


@pytest.mark.parametrize("mode", ["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaled", [False, True])
def test_torch_backend_matches_fused_optimizer(mode, grad_dtype, scaled):
    p0 = torch.randn(N, generator=gen(0))
    ref, opt = reference(p0, RUNS, mode)
    seg = AdamSegments.build(RUNS, "cpu")
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    out = torch.full((N,), 7.0, dtype=torch.bfloat16)
    scale = torch.tensor(3.0) if scaled else None
    for t in range(1, 6):
        g = torch.randn(N, generator=gen(t)).to(grad_dtype)
        g_before = g.clone()
        for q, (s, n, _) in zip(ref, RUNS):
            q.grad = g[s:s + n].float() / scale if scaled else g[s:s + n].float()
        opt.step()
        adam_flat_(p, g, m, v, seg, **step_args(t), mode=mode, grad_scale=scale, out_lowp=out, backend="torch")
        assert torch.equal(g, g_before), "grads must stay untouched"
        for q, (s, n, _) in zip(ref, RUNS):
            st = opt.state[q]
            assert_bits_equal(p[s:s + n], q.detach(), f"param, step {t}")
            assert_bits_equal(m[s:s + n], st["exp_avg"], f"exp_avg, step {t}")
            assert_bits_equal(v[s:s + n], st["exp_avg_sq"], f"exp_avg_sq, step {t}")
            assert_bits_equal(out[s:s + n], p[s:s + n].to(torch.bfloat16), "out_lowp")
    gaps = torch.cat([torch.arange(1041, 1100), torch.arange(2000, N)])
    assert torch.equal(p[gaps], p0[gaps]) and not m[gaps].any() and not v[gaps].any()
    assert (out[gaps] == 7.0).all()


def test_torch_backend_found_inf_skips_everything():
    seg = AdamSegments.uniform(100, 0.1, "cpu")
    p0 = torch.randn(100, generator=gen(1))
    p, m, v = p0.clone(), torch.zeros(100), torch.zeros(100)
    out = torch.zeros(100, dtype=torch.float16)
    adam_flat_(p, torch.ones(100), m, v, seg, **step_args(1), out_lowp=out, found_inf=torch.tensor(1.0),
               backend="torch")
    assert torch.equal(p, p0) and not m.any() and not v.any() and not out.any()
    adam_flat_(p, torch.ones(100), m, v, seg, **step_args(1), out_lowp=out, found_inf=torch.tensor(0.0),
               backend="torch")
    assert not torch.equal(p, p0) and torch.equal(out, p.half())


# ----------------------------------------------------------------------------- numpy emulation of torch's CUDA kernel

def cuda_adam_reference(p, g, m, v, runs, *, lr, t, mode, scale=None, fused=True):
    """The kernel's math, in numpy float32: torch's fused_adam_utils.cuh ``adam_math`` for fp32
    params, except that the bias corrections 1 - β^t, the step size lr / (1 - β1^t) and
    sqrt(1 - β2^t) are formed in float64 and rounded once.

    ``fused=False`` computes every fma as a rounded multiply and a rounded add, and powf via
    float64 exp2/log2, which is what the Triton interpreter does: the interpreted kernel must
    then agree bit for bit. (``fused=True``: fma through float64, exact product, the sum rounded
    twice, which differs from a true fma only in rare ties.)
    """
    f = np.float32

    def _fma(a, b, c):
        if fused:
            return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(f)
        return a * b + c

    p, m, v = p.copy(), m.copy(), v.copy()
    b1, b2, eps, lr = f(BETAS[0]), f(BETAS[1]), f(EPS), f(lr)
    tf = np.float64(f(t))
    b1t = np.exp2(tf * np.log2(np.float64(b1))) if not fused else np.float64(b1) ** tf
    b2t = np.exp2(tf * np.log2(np.float64(b2))) if not fused else np.float64(b2) ** tf
    step_size = f(np.float64(lr) / (1 - b1t))  # bias corrections in float64, as the kernel forms them
    bc2s = f(np.sqrt(1 - b2t))
    for s, n, wd in runs:
        sl = slice(s, s + n)
        wd = f(wd)
        pp, gg, mm, vv = p[sl], g[sl].astype(f), m[sl], v[sl]
        if scale is not None:
            gg = gg / f(scale)
        if wd != 0:
            if mode == "adamw":
                pp = _fma(np.full_like(pp, -(lr * wd)), pp, pp)
            else:
                gg = _fma(pp, np.full_like(pp, wd), gg)
        mm = _fma(np.full_like(mm, b1), mm, _fma(np.full_like(gg, -b1), gg, gg))
        g2 = gg * gg
        vv = _fma(np.full_like(vv, b2), vv, _fma(np.full_like(g2, -b2), g2, g2))
        denom = np.sqrt(vv) / bc2s + eps
        p[sl] = pp - (step_size * mm) / denom
        m[sl], v[sl] = mm, vv
    return p, m, v


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 ulps (monotone integer mapping of the bit patterns)."""
    def key(x):
        i = x.astype(np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(key(a) - key(b))


def adam_float64(p0, grads, runs, *, mode, lr, scale=None):
    """Adam/AdamW in float64 over ``grads`` (one per step), hyperparameters rounded to float32
    first (the values the kernels compute with): the exact result the float32 kernels round."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    b1, b2, eps, lr = f32(BETAS[0]), f32(BETAS[1]), f32(EPS), f32(lr)
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    wd = torch.zeros_like(p)
    for s, n, w in runs:
        wd[s:s + n] = f32(w)
    for t, g in enumerate(grads, 1):
        g = g.double() / (1.0 if scale is None else f32(scale))
        if mode == "adamw":
            p = p - lr * wd * p
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1 ** t) * m / (v.sqrt() / (1 - b2 ** t) ** 0.5 + eps)
    return p, m, v


# ----------------------------------------------------------------------------- triton, interpreted

# the interpreter's numpy ops warn about the inf/NaN/overflow the tests feed them on purpose
quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def interpret(monkeypatch):
    """Triton in its interpreter, with blocks small enough that chunks span several of them."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(ga.TRITON_CONFIG, "adam_block", 32)
    monkeypatch.setitem(ga.TRITON_CONFIG, "stats_block", 64)
    monkeypatch.setitem(ga.TRITON_CONFIG, "stats_iters", 2)


# runs start and end off the 16-element grid, chunks (96) end mid-run and are not multiples of
# the block (32) ... and one run is shorter than ALIGN
T_RUNS = [(5, 300, 0.1), (305, 190, 0.0), (520, 7, 0.1), (560, 437, 0.02)]
T_N = 1000


@pytest.mark.parametrize("mode, grad_dtype, scaled", [
    ("adamw", torch.float32, False), ("adamw", torch.bfloat16, True), ("adam", torch.float16, True),
])
def test_triton_interpreted_matches_cuda_math_and_torch(interpret, mode, grad_dtype, scaled):
    seg = AdamSegments.build(T_RUNS, "cpu", chunk=96)
    p0 = torch.randn(T_N, generator=gen(2))
    tp, tm, tv = p0.clone(), torch.zeros(T_N), torch.zeros(T_N)  # triton
    rp, rm, rv = p0.clone(), torch.zeros(T_N), torch.zeros(T_N)  # torch backend
    ep, em, ev = p0.numpy().copy(), np.zeros(T_N, np.float32), np.zeros(T_N, np.float32)  # emulation
    out = torch.zeros(T_N, dtype=torch.bfloat16)
    scale = torch.tensor(4.0) if scaled else None
    worst = {"torch": 0.0}
    covered = torch.cat([torch.arange(s, s + n) for s, n, _ in T_RUNS])
    for t in range(1, 4):
        g = (torch.randn(T_N, generator=gen(10 + t)) * 2.0 ** -t).to(grad_dtype)
        adam_flat_(tp, g, tm, tv, seg, **step_args(t), mode=mode, grad_scale=scale, out_lowp=out, backend="triton")
        adam_flat_(rp, g, rm, rv, seg, **step_args(t), mode=mode, grad_scale=scale, backend="torch")
        ep, em, ev = cuda_adam_reference(ep, g.float().numpy(), em, ev, T_RUNS, lr=LR, t=t, mode=mode,
                                         scale=None if scale is None else 4.0, fused=False)
        for got, want, what in ((tp, ep, "param"), (tm, em, "exp_avg"), (tv, ev, "exp_avg_sq")):
            assert_bits_equal(got, torch.from_numpy(want), f"{what} vs emulation, step {t}")
        # vs torch's CPU kernel, relative to |p| + lr. Two causes, both expected: the CPU kernel weighs
        # g*g by float32(1 - 0.999) = 1e-3 but CUDA's math by 1 - float32(0.999) = 0.99998713e-3 (and
        # corrects bias in float64), ~2e-6 with true fmas; and the interpreter's unfused fma, which
        # loses ~3 digits of fma(-b2, g*g, g*g) to cancellation: ~1e-5 here.
        err = ((tp - rp).abs() / (rp.abs() + LR)).max().item()
        worst["torch"] = max(worst["torch"], err)
        assert_bits_equal(out[covered], tp[covered].to(torch.bfloat16), f"bf16 copy, step {t}")
    print(f"\ntriton (interpreted) vs torch CPU backend, {mode} {grad_dtype}: max |dp| / (|p| + lr) "
          f"{worst['torch']:.2e}")
    assert worst["torch"] < 5e-5
    gaps = np.setdiff1d(np.arange(T_N), np.concatenate([np.arange(s, s + n) for s, n, _ in T_RUNS]))
    assert torch.equal(tp[gaps], p0[gaps]) and not tm[gaps].any() and not out[gaps].any()


def special_values(dtype):
    """float32 values around every rounding hazard of a cast to ``dtype``."""
    f = np.float32
    info = torch.finfo(dtype)
    nmant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, np.finfo(f).max, -np.finfo(f).max,
            np.finfo(f).tiny, np.finfo(f).tiny / 8, -np.finfo(f).tiny / 3, 1e-45, info.max, -info.max,
            info.tiny, info.tiny / 4, info.tiny / 2 ** (nmant + 2), float(info.max) * (1 + 2.0 ** -12),
            float(info.max) * (1 + 2.0 ** -(nmant + 1))]
    out = np.array(vals, dtype=f)
    # exact ties and near-ties of the mantissa cut, at several exponents
    keep = 23 - nmant
    base = np.random.default_rng(0).integers(0x00800000, 0x7F000000, 256, dtype=np.uint32)
    base &= ~np.uint32((1 << keep) - 1)
    half = np.uint32(1 << (keep - 1))
    cuts = np.concatenate([base | half, (base | half) - 1, (base | half) + 1, base | (half << 1) | half])
    cuts = np.concatenate([cuts, cuts | np.uint32(0x80000000)]).view(f)
    nan_payloads = np.array([0x7F800001, 0xFFC00001, 0x7FBFFFFF], np.uint32).view(f)
    rand = np.random.default_rng(1).integers(0, 2 ** 32, 2000, dtype=np.uint64).astype(np.uint32).view(f)
    return torch.from_numpy(np.concatenate([out, cuts, nan_payloads, rand]))


@quiet
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_lowp_copy_bit_exact(interpret, dtype):
    # lr = 0 and zero grads/moments leave every param as it is (NaN, inf and subnormals included),
    # so the copy-out sees exactly these values
    p0 = special_values(dtype)
    n = p0.numel()
    seg = AdamSegments.build([(0, 37, 0.0), (37, n - 37, 0.0)], "cpu", chunk=512)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.zeros(n, dtype=dtype)
    adam_flat_(p, torch.zeros(n, dtype=dtype), m, v, seg, **step_args(1, lr=0.0), out_lowp=out, backend="triton")
    assert_bits_equal(p, p0, "params with lr=0")
    assert_bits_equal(out, p0.to(dtype), f"{dtype} copy")
    if dtype == torch.bfloat16:  # every NaN becomes CUDA's canonical bf16 NaN
        assert (bits(out)[torch.isnan(p0)] == 0x7FFF).all()


@quiet
def test_triton_found_inf_and_adam_without_decay(interpret):
    seg = AdamSegments.build([(0, 50, 0.0), (50, 50, 0.3)], "cpu", chunk=64)
    p0 = torch.randn(100, generator=gen(3))
    p, m, v = p0.clone(), torch.zeros(100), torch.zeros(100)
    out = torch.zeros(100, dtype=torch.bfloat16)
    args = step_args(1)
    adam_flat_(p, torch.ones(100), m, v, seg, **args, out_lowp=out, found_inf=torch.tensor(1.0), backend="triton")
    assert torch.equal(p, p0) and not m.any() and not v.any() and not out.any()
    # wd == 0 must not touch an inf param (p*0 would make it NaN); elsewhere an ordinary step
    p[0] = float("inf")
    rp = p.clone()
    rm, rv = m.clone(), v.clone()
    for mode in ("adam", "adamw"):
        adam_flat_(p, torch.ones(100), m, v, seg, **args, mode=mode, found_inf=torch.tensor(0.0), backend="triton")
        adam_flat_(rp, torch.ones(100), rm, rv, seg, **args, mode=mode, backend="torch")
        assert p[0] == float("inf")
        torch.testing.assert_close(p[1:], rp[1:], rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- bad inputs

def test_adam_flat_bad_inputs():
    n = 64
    seg = AdamSegments.uniform(n, 0.0, "cpu")
    ok = {"param": torch.zeros(n), "grad": torch.zeros(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}

    def call(**kw):
        a = {**ok, **{k: v for k, v in kw.items() if k in ok}}
        extra = {k: v for k, v in kw.items() if k not in ok}
        args = {**step_args(1), "segments": seg, "backend": "torch", **extra}
        adam_flat_(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], **args)

    call()
    cases = [
        ({"param": torch.zeros(n, dtype=torch.float64)}, "param has dtype"),
        ({"grad": torch.zeros(n, dtype=torch.int32)}, "grad has dtype"),
        ({"exp_avg": torch.zeros(n, dtype=torch.bfloat16)}, "exp_avg has dtype"),
        ({"exp_avg_sq": torch.zeros(n + 1)}, "exp_avg_sq has 65 elements"),
        ({"grad": torch.zeros(8, 8)}, "1-D contiguous"),
        ({"param": torch.zeros(2 * n)[::2]}, "1-D contiguous"),
        ({"out_lowp": torch.zeros(n)}, "out_lowp has dtype"),
        ({"out_lowp": torch.zeros(n - 1, dtype=torch.bfloat16)}, "out_lowp has 63"),
        ({"mode": "sgd"}, "mode must be"),
        ({"backend": "cuda"}, "backend must be"),
        ({"lr": 1e-3}, "lr must be a 1-element tensor"),
        ({"step": torch.tensor([1.0, 2.0])}, "step must have 1 element"),
        ({"lr": torch.tensor(1e-3, device="meta")}, "lr is on meta"),
        ({"grad_scale": torch.tensor(True)}, "grad_scale has dtype"),
        ({"beta1": torch.tensor(0.9)}, "beta1 must be a Python number"),
        ({"segments": [(0, n, 0.0)]}, "segments must be an AdamSegments"),
        ({"segments": AdamSegments.uniform(n + 1, 0.0, "cpu")}, "reach element 65"),
        ({"segments": AdamSegments.uniform(n, 0.0, "meta")}, "segments are on meta"),
        ({"grad": torch.zeros(n, device="meta")}, "grad is on meta"),
        ({"exp_avg": ok["param"]}, "share memory"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**kw)


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seg = AdamSegments.uniform(4, 0.0, "cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        adam_flat_(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), seg, **step_args(1),
                   backend="triton")


def test_without_triton(monkeypatch):
    monkeypatch.setattr(ga, "_triton", lambda: None)
    seg = AdamSegments.uniform(4, 0.0, "cpu")
    args = (torch.zeros(4), torch.ones(4), torch.zeros(4), torch.zeros(4), seg)
    with pytest.raises(ImportError, match="triton does not import"):
        adam_flat_(*args, **step_args(1), backend="triton")
    adam_flat_(*args, **step_args(1), backend="auto")  # the torch backend
    assert args[0].ne(0).all()
    assert not ga.triton_available()


# ----------------------------------------------------------------------------- CUDA (compiled kernels)

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ga.triton_available()), reason="needs CUDA + triton")


@cuda
@pytest.mark.parametrize("mode", ["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_torch_fused(mode, grad_dtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = "cuda"
    n = 3_000_017
    runs = [(3, 1_000_000, 0.1), (1_000_003, 999_997, 0.0), (2_000_000, 1_000_010, 0.05)]
    seg = AdamSegments.build(runs, dev)
    p0 = torch.randn(n, device=dev)
    tp, tm, tv = p0.clone(), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    rp, rm, rv = p0.clone(), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    out = torch.empty(n, device=dev, dtype=torch.bfloat16)
    scale = torch.tensor(3.0, device=dev)
    grads = []
    for t in range(1, 4):
        g = torch.randn(n, device=dev).to(grad_dtype)
        grads.append(g)
        adam_flat_(tp, g, tm, tv, seg, **step_args(t, dev), mode=mode, grad_scale=scale, out_lowp=out,
                   backend="triton")
        adam_flat_(rp, g, rm, rv, seg, **step_args(t, dev), mode=mode, grad_scale=scale, backend="torch")
    # Judged against the exact math (float64, with the float32 values of the hyperparameters that
    # both kernels use), not bit for bit against torch: torch 2.11's CUDA kernel mixes double
    # hyperparameters into its float32 math, so the two differ by an ulp in ~23% of parameters
    # (benchmarks/gpu_adam.py on an H200). Ours must be within a few float32 ulps of what was
    # added (|p| before and after, and the t updates of at most ~lr each) and no worse than torch's.
    covered = torch.cat([torch.arange(s, s + k) for s, k, _ in runs]).to(dev)
    ref_p, ref_m, ref_v = adam_float64(p0, grads, runs, mode=mode, lr=LR, scale=3.0)
    eps32 = torch.finfo(torch.float32).eps
    for what, ours, theirs, ref in (("param", tp, rp, ref_p), ("exp_avg", tm, rm, ref_m),
                                    ("exp_avg_sq", tv, rv, ref_v)):
        ours, theirs, ref = ours[covered], theirs[covered], ref[covered]
        scale = (p0[covered].double().abs() + ref.abs() + 3 * LR) if what == "param" else ref.abs().max().expand_as(ref)
        bound = 8 * eps32 * scale
        worst = ((ours.double() - ref).abs() / bound).max().item()
        worst_torch = ((theirs.double() - ref).abs() / bound).max().item()
        print(f"{what}: worst element, in units of the bound: zfunc {worst:.3f}, torch fused {worst_torch:.3f}")
        assert worst <= max(1.0, worst_torch), f"{what}: worst element {worst:.2f}x the few-ulp bound"
    assert_bits_equal(out[covered].cpu(), tp[covered].to(torch.bfloat16).cpu(), "bf16 copy")


@cuda
@pytest.mark.parametrize("grad_dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, None),
                                                   (torch.float16, torch.float16)])
def test_cuda_one_launch_matches_per_run_kernel(grad_dtype, out_dtype, monkeypatch):
    """adam_runs_ (one launch over runs with buffers of their own, addresses read from a table) against
    adam_flat_ once per run, bit for bit: runs of uneven sizes, one of them off the 16-byte grid (the
    scalar path), decays that change inside a run, a skipped step."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = "cuda"
    lens = [1_000_003, 17, 524_288, 300_001]
    segs = [[(0, 500_000, 0.1), (500_000, 500_003, 0.0)], [(0, 17, 0.1)], [(0, 524_288, 0.05)], [(5, 299_990, 0.1)]]

    def buffers(seed):
        torch.manual_seed(seed)
        out = []
        for i, n in enumerate(lens):
            p = torch.randn(n + 1, device=dev)[1:] if i == 3 else torch.randn(n, device=dev)  # (i == 3: unaligned)
            o = torch.zeros(n, device=dev, dtype=out_dtype) if out_dtype is not None else None
            out.append((p, torch.zeros(n, device=dev), torch.zeros(n, device=dev), o))
        return out

    ours, theirs = buffers(0), buffers(0)
    table = ga.AdamRuns.build([(p.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if o is None else o.data_ptr())
                               for p, m, v, o in ours], segs, lens, dev, out_dtype=out_dtype)
    for t in range(1, 4):
        grads = [torch.randn(n, device=dev).to(grad_dtype) for n in lens]
        skip = torch.tensor(t == 2, device=dev)
        args = step_args(t, dev)
        ga.adam_runs_(table, [g.data_ptr() for g in grads], grad_dtype, **args, grad_scale=torch.tensor(2.0, device=dev),
                      found_inf=skip)
        for (p, m, v, o), sg, g in zip(theirs, segs, grads):
            adam_flat_(p, g, m, v, AdamSegments.build(sg, dev), **args, grad_scale=torch.tensor(2.0, device=dev),
                       out_lowp=o, found_inf=skip.float(), backend="triton")
    for a, b in zip(ours, theirs):
        for x, y, what in zip(a, b, ("param", "exp_avg", "exp_avg_sq", "copy")):
            if x is not None:
                assert_bits_equal(x.cpu(), y.cpu(), what)


def test_one_launch_kernel_compiles_for_sm90_with_vector_access():
    """The one-launch kernel compiled for an H100/H200 (sm_90), on any machine: its aligned path moves
    16 bytes per access (the alignment it states with multiple_of reaches the code), like adam_flat_'s."""
    pytest.importorskip("triton")
    if ga._interpreting():
        pytest.skip("TRITON_INTERPRET is set: the kernels were jitted for the interpreter")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton cannot compile ahead of time")
    from zfunc.kernels.triton_kernels import kernels

    sig = {"chunks_ptr": "*i64", "wd_ptr": "*fp32", "bases_ptr": "*i64", "grads_ptr": "*i64", "lr_ptr": "*fp32",
           "step_ptr": "*i64", "scale_ptr": "*fp32", "found_ptr": "*u8", "beta1": "fp32", "beta2": "fp32", "eps": "fp32"}
    const = dict(ADAMW=True, HAS_SCALE=True, HAS_FOUND=True, GRAD_KIND=1, OUT_KIND=1, GRADS_ALIGNED=True,
                 INTERPRET=False, PTX=True, BLOCK=1024, ITERS=64, ALIGN=16)
    sig.update(dict.fromkeys(const, "constexpr"))
    try:
        compiled = triton.compile(ASTSource(fn=kernels(False).adam_multi_kernel, signature=sig, constexprs=const),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except Exception as err:  # noqa: BLE001 (no CUDA toolchain in this triton: nothing to check here)
        if "ptxas" in str(err).lower() or "cuda" in str(err).lower() and "not found" in str(err).lower():
            pytest.skip(f"no CUDA toolchain: {err}")
        raise
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx  # fp32 param and moments
    assert "ld.global.v2.b32" in ptx and "st.global.v2.b32" in ptx  # bf16 gradients and copy: 4 x 2 bytes


# ----------------------------------------------------------------------------- benchmark smoke test

def test_benchmark_runs_on_cpu(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu_adam", os.path.join(REPO, "benchmarks", "gpu_adam.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    bench.main(["--device", "cpu", "--numel", "1000000", "--backend", "torch", "--repeats", "3", "--warmup", "1",
                "--json", str(out)])
    text = capsys.readouterr().out
    assert "| case" in text and "max abs diff" in text
    import json
    rows = json.loads(out.read_text())["rows"]
    assert any(r["case"].startswith("copy") for r in rows) and all(r["ms"] > 0 for r in rows)
