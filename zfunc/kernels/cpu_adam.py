"""In-place CPU Adam/AdamW over flat fp32 buffers: one numba ``prange`` pass.

This is the host-side optimizer of the ``offload`` transform: parameters,
gradients and both moments live in flat, contiguous float32 buffers in host
memory and one pass over them updates everything, optionally writing the
bf16/fp16 copy of the new parameters that goes back to the device in the same
pass (so it costs ~2 bytes per element of extra traffic instead of a second
28-byte pass).

Math (per element; every scalar constant is rounded to float32 first, every
operation is float32, exactly like ``torch.optim.AdamW(fused=True)`` /
``torch.optim.Adam(fused=True)`` on the CPU, i.e. ``torch._fused_adam[w]_``)::

    # host side, in float64 (torch: double), t = float(float32(step))
    bc1 = 1 - beta1**t ; bc2 = 1 - beta2**t
    step_size = lr / bc1 ; bc2_sqrt = sqrt(bc2)

    g = grad / grad_scale                            # float32 division (skipped when grad_scale == 1)
    adam  (L2):        g = fma(p, wd, g)              # g + wd*p            (only if wd != 0)
    adamw (decoupled): p = p * f32(1 - lr*wd)                               (only if wd != 0)
    m = fma(1-beta1, g - m, m)                       # m.lerp_(g, 1-beta1)  (|1-beta1| < 0.5;
                                                     #  else fma((1-beta1)-1, g - m, g))
    v = fma((1-beta2)*g, g, v*beta2)                 # beta2*v + (1-beta2)*g*g
    d = sqrt(v) / f32(bc2_sqrt) + eps
    p = p + (f32(-step_size) * m) / d
    out_lowp = round_to_nearest_even(p)              # optional bf16/fp16 copy

The FMAs are where GCC contracts torch's vector code (x86 builds, AVX2 and
AVX512 dispatch: verified bit for bit). torch's scalar remainder loop, which
handles the last ``numel % 8`` elements, contracts ``v`` the other way
(``fma(v, beta2, ((1-beta2)*g)*g)``); this kernel does the same for those
elements, so results are bitwise equal to torch's fused kernel for every size.
On torch builds without FMA dispatch (``get_cpu_capability() == "DEFAULT"``,
non-x86) results can differ from torch by an ulp per step.

Unlike torch, the unscaled gradient is *not* written back into ``grad`` (grads
may be bf16/fp16 here and are treated as read-only).

Memory traffic: 28 bytes per element (read p, g, m, v; write p, m, v), 26 with
bf16/fp16 grads, +2 for ``out_lowp``. The low-precision copy is computed into a
per-thread 2048-element scratch buffer (L1-resident) and streamed to
``out_lowp`` with non-temporal 64-byte stores when ``out_lowp`` is 64-byte
aligned (torch's CPU allocations and pinned buffers are), so it does not also
pay a read of every destination line. Measured (16-core Xeon, 100M elements):
fp32 step at 96-101% of a trivial-arithmetic loop with the same 7 streams and
1.04-1.05x torch's fused AdamW; with the bf16 copy +11% time, vs +90% for
fused AdamW followed by ``.to(torch.bfloat16)`` (benchmarks/cpu_adam.py).

Threads: ``torch.get_num_threads()`` unless ``num_threads=`` is given (capped
at ``numba.config.NUMBA_NUM_THREADS``); each thread takes one contiguous,
cache-line aligned chunk. numba runs its own thread pool (its "omp" layer uses
the system libgomp, torch its bundled one); the two pools take turns, they do
not nest. The kernel releases the GIL (``nogil=True``), so it can run in a
background Python thread while the main thread drives the GPU.

Compilation: lazy, on the first call of each (grad dtype, out dtype)
combination (up to 9), cached on disk next to this file (``cache=True``;
numba falls back to its user cache dir when that is read-only). A cold compile
of one combination took ~2.2 s on a 16-core Xeon (2-5 s on a loaded 2-core
VM); in a later process the first call loads it from the cache in ~10-50 ms
(plus numba's thread-pool start on the very first parallel call). Importing
this module costs the numba import (~0.2 s after torch) and compiles nothing.
"""

from __future__ import annotations

import itertools
import math

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from zfunc.kernels.bits import (
    LINE_BYTES,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    f32_to_fp16_bits,
    fma_f32,
    fp16_bits_to_f32,
    nt_store_line,
    store_fence,
)

__all__ = ["TORCH_SCALAR_TAIL", "adam_", "adamw_"]

# torch's fused CPU Adam handles the last ``numel % TORCH_SCALAR_TAIL`` elements in a
# scalar loop whose FMA contraction differs from the vector body (see module doc).
TORCH_SCALAR_TAIL = 8

# Chunks handed to threads are multiples of this many elements (a 64-byte line of the 16-bit copy).
_ALIGN = 32
# With a low-precision copy, each thread computes it _BLK elements at a time into a small scratch
# buffer that stays in L1, then streams the buffer out with non-temporal stores: the copy then costs
# its 2 bytes/element of writes and not also a read of every destination line (write-allocate).
_BLK = 2048

# The three element types data may have. Half-precision data are passed as raw bits:
# bf16 as a uint16 view, fp16 as an int16 view, so numba specializes on the dtype.
_HALF_VIEW = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}


# ----------------------------------------------------------------------------- typed element access

def _load_f32(a, i):  # pragma: no cover - replaced by the overload below inside njit code
    raise NotImplementedError


@overload(_load_f32)
def _ol_load_f32(a, i):
    dt = a.dtype
    if dt == types.float32:
        return lambda a, i: a[i]
    if dt == types.uint16:  # bfloat16 bits
        return lambda a, i: bf16_bits_to_f32(a[i])
    if dt == types.int16:  # float16 bits
        return lambda a, i: fp16_bits_to_f32(a[i])
    return None


def _store_lowp(a, i, x):  # pragma: no cover - replaced by the overload below inside njit code
    raise NotImplementedError


@overload(_store_lowp)
def _ol_store_lowp(a, i, x):
    dt = a.dtype
    if dt == types.float32:  # no low-precision copy requested (a is an empty placeholder)
        def impl(a, i, x):
            pass
        return impl
    if dt == types.uint16:  # bfloat16 bits
        def impl(a, i, x):
            a[i] = f32_to_bf16_bits(x)
        return impl
    if dt == types.int16:  # float16 bits
        def impl(a, i, x):
            a[i] = np.int16(f32_to_fp16_bits(x))
        return impl
    return None


# ----------------------------------------------------------------------------- the kernel

@njit(inline="always")
def _update(i, p, g, m, v, po, mo, vo, out, oi, use_gs, gs, l2, wd, decay, lerp_small, w, wm1, b2, c2, bc2s, eps, nss, tail):
    """One element; all scalars float32. ``tail`` selects torch's scalar-loop contraction of v."""
    pi = p[i]
    gi = _load_f32(g, i)
    if use_gs:
        gi = gi / gs
    if l2:
        gi = fma_f32(pi, wd, gi)
    pi = pi * decay
    mi = m[i]
    diff = gi - mi
    if lerp_small:
        mi = fma_f32(w, diff, mi)
    else:
        mi = fma_f32(wm1, diff, gi)
    if tail:
        vi = fma_f32(v[i], b2, (c2 * gi) * gi)
    else:
        vi = fma_f32(c2 * gi, gi, v[i] * b2)
    mo[i] = mi
    vo[i] = vi
    d = np.sqrt(vi) / bc2s + eps
    pi = pi + (nss * mi) / d
    po[i] = pi
    _store_lowp(out, oi, pi)


@njit(parallel=True, fastmath=False, cache=True, nogil=True, error_model="numpy")
def _adam_kernel(p, g, m, v, po, mo, vo, out, nchunks, chunk, n_main, stream_out,
                 use_gs, gs, l2, wd, decay, lerp_small, w, wm1, b2, c2, bc2s, eps, nss):
    """Update ``[0, n_main)`` in ``nchunks`` parallel chunks, then ``[n_main, n)`` serially
    with torch's scalar-tail contraction. Results go to ``po, mo, vo`` (which may be
    ``p, m, v`` themselves: in place). ``stream_out``: write ``out`` through an L1 scratch
    buffer and non-temporal stores (needs ``out`` 64-byte aligned)."""
    per_line = LINE_BYTES // out.itemsize
    for c in prange(nchunks):
        # unsigned indices: numba then skips its negative-index wraparound, so LLVM vectorizes
        lo = np.uint64(c * chunk)
        hi = np.uint64(min(c * chunk + chunk, n_main))
        if stream_out:
            scratch = np.empty(_BLK, out.dtype)
            b = lo
            while b < hi:
                e = min(b + np.uint64(_BLK), hi)
                for i in range(b, e):
                    _update(i, p, g, m, v, po, mo, vo, scratch, i - b, use_gs, gs, l2, wd, decay, lerp_small, w, wm1,
                            b2, c2, bc2s, eps, nss, False)
                cnt = e - b
                full = cnt - cnt % np.uint64(per_line)
                for k in range(np.uint64(0), full, np.uint64(per_line)):
                    nt_store_line(out, b + k, scratch, k)
                for k in range(full, cnt):
                    out[b + k] = scratch[k]
                b = e
            store_fence()
        else:
            for i in range(lo, hi):
                _update(i, p, g, m, v, po, mo, vo, out, i, use_gs, gs, l2, wd, decay, lerp_small, w, wm1, b2,
                        c2, bc2s, eps, nss, False)
    for i in range(np.uint64(n_main), np.uint64(p.size)):
        _update(i, p, g, m, v, po, mo, vo, out, i, use_gs, gs, l2, wd, decay, lerp_small, w, wm1, b2, c2, bc2s,
                eps, nss, True)


# ----------------------------------------------------------------------------- Python API

def _scalar(x, name) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(x.shape)}")
        return float(x.item())
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {type(x).__name__}") from None


def _as_array(t, name: str, numel: int | None, allowed: tuple, what: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on device {t.device}; the numba CPU Adam kernel needs CPU tensors "
            f"(move optimizer state to the host first, e.g. t.cpu() / pin_memory())")
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {what}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                         f"pass a flat contiguous buffer (e.g. t.contiguous())")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, param has {numel}")
    t = t.detach().reshape(-1)
    if t.dtype in _HALF_VIEW:
        t = t.view(_HALF_VIEW[t.dtype])
    return t.numpy()


def _check_no_overlap(named: dict) -> None:
    spans = []
    for name, a in named.items():
        if a is None or a.size == 0:
            continue
        lo = a.ctypes.data
        spans.append((lo, lo + a.nbytes, name))
    spans.sort()
    for (lo0, hi0, n0), (lo1, hi1, n1) in itertools.pairwise(spans):
        if lo1 < hi0:
            raise ValueError(f"{n0} and {n1} share memory; every buffer must be distinct")


_EMPTY_F32 = np.empty(0, np.float32)
_STREAM_OUT = True  # non-temporal stores for out_lowp (when it is 64-byte aligned)


def adamw_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
           weight_decay=0.0, step, mode="adamw", grad_scale=1.0, out_lowp=None, num_threads=None,
           into=None):
    """One Adam/AdamW step, in place (or into ``into``), over flat contiguous CPU buffers.

    Args:
        param, exp_avg, exp_avg_sq: float32 CPU tensors, contiguous, same numel (any shape;
            treated as flat). Updated in place.
        grad: float32, bfloat16 or float16 CPU tensor, contiguous, same numel. Read only.
        lr, beta1, beta2, eps, weight_decay: numbers (or 1-element tensors for ``lr``).
        step: the 1-based step number *after* incrementing (int or 0-d tensor); used only for
            the bias corrections ``1 - beta**step`` (computed in float64).
        mode: ``"adamw"`` (decoupled decay ``p *= 1 - lr*wd``, like ``torch.optim.AdamW``) or
            ``"adam"`` (L2: ``g += wd*p``, like ``torch.optim.Adam``).
        grad_scale: gradients are divided by it first (mixed-precision loss-scale unscaling);
            number or 1-element tensor; 1.0 means none.
        out_lowp: optional bfloat16/float16 CPU tensor (contiguous, same numel) that receives
            the updated parameters, rounded to nearest even, in the same pass.
        num_threads: threads to use; default ``torch.get_num_threads()``.
        into: optional ``(param, exp_avg, exp_avg_sq)`` float32 tensors (same numel) that receive
            the results instead; the inputs are then only read (`offload` updates ahead of
            time into spare buffers this way, so the state it read stays intact). Each input
            is read once and each output written once, but a write to a line not yet in cache
            first reads it (write-allocate): ~40 bytes per element instead of 28.

    Returns ``param``. Results equal ``torch.optim.AdamW(fused=True)`` / ``Adam(fused=True)``
    (with ``grad.float()`` for low-precision grads) bit for bit on x86 torch builds.
    """
    if mode not in ("adamw", "adam"):
        raise ValueError(f"mode must be 'adamw' or 'adam', got {mode!r}")
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"param must be a torch.Tensor, got {type(param).__name__}")  # noqa: TRY004
    n = param.numel()
    f32 = (torch.float32,)
    p = _as_array(param, "param", None, f32, "torch.float32")
    m = _as_array(exp_avg, "exp_avg", n, f32, "torch.float32")
    v = _as_array(exp_avg_sq, "exp_avg_sq", n, f32, "torch.float32")
    g = _as_array(grad, "grad", n, (torch.float32, torch.bfloat16, torch.float16),
                  "torch.float32, torch.bfloat16 or torch.float16")
    out = _EMPTY_F32
    if out_lowp is not None:
        out = _as_array(out_lowp, "out_lowp", n, (torch.bfloat16, torch.float16),
                        "torch.bfloat16 or torch.float16")
    po, mo, vo = p, m, v
    named = {"param": p, "grad": g, "exp_avg": m, "exp_avg_sq": v,
             "out_lowp": out if out_lowp is not None else None}
    if into is not None:
        if not isinstance(into, (tuple, list)) or len(into) != 3:
            raise ValueError("into must be a (param, exp_avg, exp_avg_sq) tuple of tensors")
        po, mo, vo = (_as_array(t, f"into[{i}]", n, f32, "torch.float32") for i, t in enumerate(into))
        # An output may be its own input (in place); otherwise it must not touch any buffer.
        named.update({f"into[{i}]": o for i, (o, a) in enumerate(zip((po, mo, vo), (p, m, v)))
                      if o.ctypes.data != a.ctypes.data})
    _check_no_overlap(named)

    lr = _scalar(lr, "lr")
    beta1 = _scalar(beta1, "beta1")
    beta2 = _scalar(beta2, "beta2")
    eps = _scalar(eps, "eps")
    weight_decay = _scalar(weight_decay, "weight_decay")
    gs = _scalar(grad_scale, "grad_scale")
    t = _scalar(step, "step")
    if not t >= 1:
        raise ValueError(f"step must be >= 1 (the step number after incrementing), got {step}")
    if n == 0:
        return param

    # Host-side scalars in float64, as torch computes them (it reads step as float32).
    t = float(np.float32(t))
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t
    step_size = lr / bc1
    bc2_sqrt = math.sqrt(bc2)
    F = np.float32
    w = F(1.0 - beta1)
    lerp_small = bool(abs(w) < F(0.5))
    wm1 = F(w - F(1.0))
    l2 = mode == "adam" and weight_decay != 0.0
    decay = F(1.0 - lr * weight_decay) if (mode == "adamw" and weight_decay != 0.0) else F(1.0)

    if num_threads is None:
        num_threads = torch.get_num_threads()
    num_threads = max(1, min(int(num_threads), numba.config.NUMBA_NUM_THREADS))
    n_main = n - n % TORCH_SCALAR_TAIL
    nchunks = max(1, min(num_threads, n_main // (64 * _ALIGN)))
    chunk = -(-n_main // nchunks)
    chunk = -(-chunk // _ALIGN) * _ALIGN

    stream_out = out.size > 0 and out.ctypes.data % LINE_BYTES == 0 and _STREAM_OUT
    prev = numba.get_num_threads()
    numba.set_num_threads(num_threads)
    try:
        _adam_kernel(p, g, m, v, po, mo, vo, out, nchunks, chunk, n_main, stream_out,
                     gs != 1.0, F(gs), l2, F(weight_decay), decay, lerp_small, w, wm1, F(beta2), F(1.0 - beta2),
                     F(bc2_sqrt), F(eps), F(-step_size))
    finally:
        numba.set_num_threads(prev)
    return param


def adam_(param, grad, exp_avg, exp_avg_sq, **kwargs):
    """``adamw_(..., mode="adam")``: Adam with L2 weight decay added to the gradient."""
    kwargs["mode"] = "adam"
    return adamw_(param, grad, exp_avg, exp_avg_sq, **kwargs)
