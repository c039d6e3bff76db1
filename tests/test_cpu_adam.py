"""zfunc.kernels.cpu_adam / zfunc.kernels.bits against torch, element by element.

Bitwise equality with torch's fused CPU Adam holds where torch dispatches its FMA
(AVX2/AVX512) kernels; elsewhere the comparison falls back to rtol=1e-6.
"""

import subprocess
import sys

import numpy as np
import pytest
import torch

from zfunc.kernels import bits
from zfunc.kernels.cpu_adam import adam_, adamw_

EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8


def assert_same(got, want, what=""):
    if torch.equal(got, want):
        return
    if EXACT:
        bad = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
        assert not bool(bad.any()), (
            f"{what}: {int(bad.sum())} of {got.numel()} elements differ, first at "
            f"{int(bad.nonzero()[0])}: {got[bad][:4].tolist()} vs {want[bad][:4].tolist()}")
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=what)


def lowp_bits(t):
    return t.view(torch.int16)


# ----------------------------------------------------------------------------- vs torch.optim

@pytest.mark.parametrize("n", [1, 7, 8, 17, 1000003])
@pytest.mark.parametrize("mode", ["adamw", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_fused_optimizer(n, mode, wd):
    gen = torch.Generator().manual_seed(n)
    ref = torch.nn.Parameter(torch.randn(n, generator=gen))
    cls = torch.optim.AdamW if mode == "adamw" else torch.optim.Adam
    opt = cls([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=wd, fused=True)
    p = ref.detach().clone()
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 11):
        g = torch.randn(n, generator=gen)
        ref.grad = g.clone()
        opt.step()
        adamw_(p, g, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=wd,
               step=step, mode=mode)
        st = opt.state[ref]
        assert_same(p, ref.detach(), f"param, step {step}")
        assert_same(m, st["exp_avg"], f"exp_avg, step {step}")
        assert_same(v, st["exp_avg_sq"], f"exp_avg_sq, step {step}")


def _fused_ref(P, G, M, V, step, mode, wd, grad_scale=None, beta1=BETAS[0]):
    fn = torch._fused_adamw_ if mode == "adamw" else torch._fused_adam_
    fn([P], [G], [M], [V], [], [torch.tensor(float(step))], lr=LR, beta1=beta1, beta2=BETAS[1],
       weight_decay=wd, eps=EPS, amsgrad=False, maximize=False,
       grad_scale=None if grad_scale is None else torch.tensor(grad_scale))


LOWP = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("gdtype, out_dtype, n", [
    *[(gd, od, 100003) for gd in LOWP for od in (None, torch.bfloat16, torch.float16)],
    (torch.bfloat16, torch.bfloat16, 1000003),
    (torch.float16, torch.float16, 1000003),
])
def test_lowp_grads_grad_scale_and_lowp_copy(gdtype, out_dtype, n):
    scale = 1024.0
    gen = torch.Generator().manual_seed(1)
    P = torch.randn(n, generator=gen)
    P[:5] = torch.tensor([0.0, -0.0, 1e-30, 70000.0, -70000.0])  # zero signs, fp16 underflow/overflow
    M, V = torch.zeros(n), torch.zeros(n)
    p, m, v = P.clone(), M.clone(), V.clone()
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    for step in range(1, 11):
        g = (torch.randn(n, generator=gen) * scale).to(gdtype)
        _fused_ref(P, g.float().clone(), M, V, step, "adamw", 0.1, grad_scale=scale)  # torch unscales in place
        adamw_(p, g, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1, step=step,
               grad_scale=scale, out_lowp=out)
        assert_same(p, P, f"param, step {step}")
        assert_same(m, M, f"exp_avg, step {step}")
        assert_same(v, V, f"exp_avg_sq, step {step}")
        if out is not None:
            assert torch.equal(lowp_bits(out), lowp_bits(p.to(out_dtype))), f"out_lowp, step {step}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowp_copy_unaligned_and_odd_sizes(dtype):
    """out_lowp not 64-byte aligned (plain stores) and sizes around the streaming block edges."""
    for n, offset in ((2048 * 3 + 31, 1), (4096 + 40, 0), (33, 0), (100003, 3)):
        gen = torch.Generator().manual_seed(n)
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v = torch.zeros(n), torch.zeros(n)
        out = torch.full((n + offset,), float("nan"), dtype=dtype)[offset:]
        adamw_(p, g, m, v, lr=LR, weight_decay=0.1, step=1, out_lowp=out)
        assert torch.equal(lowp_bits(out), lowp_bits(p.to(dtype))), (n, offset)


def test_grad_untouched_and_lerp_branch_and_tensor_scalars():
    n = 4099
    gen = torch.Generator().manual_seed(2)
    P = torch.randn(n, generator=gen)
    M, V = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    p, m, v = P.clone(), M.clone(), V.clone()
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    g0 = g.clone()
    for step in (1, 2, 3):
        # beta1 = 0.3 -> 1 - beta1 >= 0.5: torch's lerp takes its other branch
        _fused_ref(P, g.float(), M, V, step, "adam", 0.05, beta1=0.3)
        adam_(p, g, m, v, lr=torch.tensor(LR, dtype=torch.float64), beta1=0.3, beta2=BETAS[1], eps=EPS, weight_decay=0.05,
              step=torch.tensor(step))
        assert_same(p, P, "param")
        assert_same(m, M, "exp_avg")
        assert_same(v, V, "exp_avg_sq")
    assert torch.equal(g.view(torch.int16), g0.view(torch.int16))


def test_num_threads_same_result_and_restored():
    import numba

    n = 100003
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(n, generator=gen) for _ in range(3)]
    base[2].abs_()
    g = torch.randn(n, generator=gen)
    before = numba.get_num_threads()
    results = []
    for threads in (1, 2, 64):
        p, m, v = (t.clone() for t in base)
        adamw_(p, g, m, v, lr=LR, weight_decay=0.1, step=5, num_threads=threads)
        assert numba.get_num_threads() == before
        results.append((p, m, v))
    for r in results[1:]:
        for a, b in zip(r, results[0]):
            assert torch.equal(a, b)


def test_param_requires_grad_and_2d_contiguous_ok():
    w = torch.nn.Parameter(torch.randn(3, 5))
    g, m, v = torch.randn(3, 5), torch.zeros(3, 5), torch.zeros(15)
    before = w.detach().clone()
    assert adamw_(w, g, m, v, lr=LR, step=1) is w
    assert not torch.equal(w.detach(), before)


def test_empty_is_noop():
    e = torch.empty(0)
    adamw_(e, e.clone(), e.clone(), e.clone(), lr=LR, step=1)


# ----------------------------------------------------------------------------- bad inputs

def _bufs(n=8):
    return [torch.zeros(n) for _ in range(4)]


@pytest.mark.parametrize("case, match", [
    ("noncontig", "not contiguous"),
    ("param_dtype", "param has dtype torch.float64"),
    ("grad_dtype", "grad has dtype torch.int32"),
    ("size", "exp_avg_sq has 7 elements, param has 8"),
    ("device", "meta.*CPU tensors"),
    ("out_dtype", "out_lowp has dtype torch.float32"),
    ("out_size", "out_lowp has 9 elements"),
    ("alias", "share memory"),
    ("mode", "mode must be"),
    ("step", "step must be >= 1"),
    ("not_tensor", "grad must be a torch.Tensor"),
])
def test_bad_inputs_raise_valueerror(case, match):
    p, g, m, v = _bufs()
    kw = {"lr": LR, "step": 1}
    if case == "noncontig":
        g = torch.zeros(16)[::2]
    elif case == "param_dtype":
        p = p.double()
    elif case == "grad_dtype":
        g = g.int()
    elif case == "size":
        v = torch.zeros(7)
    elif case == "device":
        m = torch.zeros(8, device="meta")
    elif case == "out_dtype":
        kw["out_lowp"] = torch.zeros(8)
    elif case == "out_size":
        kw["out_lowp"] = torch.zeros(9, dtype=torch.bfloat16)
    elif case == "alias":
        m = p
    elif case == "mode":
        kw["mode"] = "sgd"
    elif case == "step":
        kw["step"] = 0
    elif case == "not_tensor":
        g = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match=match):
        adamw_(p, g, m, v, **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_rejected():
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match="cuda.*CPU tensors"):
        adamw_(p, g.cuda(), m, v, lr=LR, step=1)


def test_import_compiles_nothing():
    code = ("import time; t = time.perf_counter(); import zfunc.kernels.cpu_adam as c; "
            "dt = time.perf_counter() - t; "
            "assert not c._adam_kernel.signatures and not c._adam_kernel.overloads; print(dt)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------- bit conversions

ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _torch_from_bits(h, dtype):
    return torch.from_numpy(h.view(np.int16).copy()).view(dtype)


def _check_to_lowp(x_f32, dtype):
    conv = bits.f32_to_bf16_bits_array if dtype == torch.bfloat16 else bits.f32_to_fp16_bits_array
    got = conv(x_f32)
    want_t = torch.from_numpy(x_f32).to(dtype)
    want = want_t.view(torch.int16).numpy().view(np.uint16)
    nan = torch.isnan(want_t).numpy()
    got_nan = torch.isnan(_torch_from_bits(got, dtype)).numpy()
    np.testing.assert_array_equal(got_nan, nan)
    bad = (got != want) & ~nan
    assert not bad.any(), (f"{dtype}: {int(bad.sum())} mismatches, e.g. f32 bits "
                           f"{[hex(b) for b in x_f32.view(np.uint32)[bad][:4]]}: got "
                           f"{[hex(b) for b in got[bad][:4]]}, want {[hex(b) for b in want[bad][:4]]}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_16bit_patterns_widen_and_round_trip(dtype):
    widen = bits.bf16_bits_to_f32_array if dtype == torch.bfloat16 else bits.fp16_bits_to_f32_array
    for view in (ALL16, ALL16.view(np.int16)):
        got = widen(view)
        want = _torch_from_bits(ALL16, dtype).float().numpy()
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    # narrowing the widened value gives back the same pattern (NaN stays NaN)
    _check_to_lowp(widen(ALL16), dtype)
    conv = bits.f32_to_bf16_bits_array if dtype == torch.bfloat16 else bits.f32_to_fp16_bits_array
    back = conv(widen(ALL16))
    np.testing.assert_array_equal(back[~nan], ALL16[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_f32_patterns_and_specials(dtype):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1 << 32, 10_000_000, dtype=np.uint64).astype(np.uint32)
    # half of them drawn from the exponent range where float16/bfloat16 rounding is interesting
    x[: len(x) // 2] = (x[: len(x) // 2] & np.uint32(0x807FFFFF)) | (
        rng.integers(90, 150, len(x) // 2, dtype=np.uint32) << np.uint32(23))
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                         0x7FBFFFFF, 0xFFFFFFFF, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF,
                         0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0xC77FF000,
                         0x33000000, 0x33000001, 0x32FFFFFF, 0x33800000, 0x33C00000, 0x38800000,
                         0x387FFFFF, 0x387FE000, 0x387FF000, 0x3F808000, 0x3F818000, 0x7F7F8000],
                        dtype=np.uint32)
    x[: len(specials)] = specials
    _check_to_lowp(x.view(np.float32), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_ties_and_neighbours(dtype):
    """Every midpoint between adjacent finite 16-bit values (ties to even), one float32 ulp either
    side of it, and the values themselves: covers subnormals, the overflow edge and both signs."""
    vals = _torch_from_bits(ALL16, dtype).float().numpy()
    vals = np.sort(np.unique(vals[np.isfinite(vals)].astype(np.float64)))
    mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)  # exact in float32
    assert np.array_equal(mids.astype(np.float64), (vals[:-1] + vals[1:]) / 2)
    top = vals[-1] + (vals[-1] - vals[-2]) / 2  # halfway to the next power: rounds to inf
    mids = np.concatenate([mids, np.float32([top, -top])])
    u = mids.view(np.uint32)
    x = np.concatenate([u, u + np.uint32(1), u - np.uint32(1), vals.astype(np.float32).view(np.uint32)])
    _check_to_lowp(x.view(np.float32), dtype)
