"""The Triton kernels of `zfunc.kernels.gpu_adam`: fused Adam/AdamW and gradient statistics.

Kept apart from the Python API (`gpu_adam`: argument checks, the weight-decay
table, the torch fallback, the launches) so that each file reads top to
bottom. Importing this module does not import triton; `kernels` does, once per
interpreter setting.
"""

from __future__ import annotations

import functools
import types

import torch

@functools.cache
def kernels(interpret: bool) -> types.SimpleNamespace:
    """The Triton kernels, compiled from the plain functions below.

    ``triton.jit`` decides at decoration time whether a kernel runs in Triton's interpreter
    (``TRITON_INTERPRET``), so decorating happens here, once per setting, and not at import:
    importing this module never imports triton. Each set gets its own globals (``tl``,
    ``libdevice`` and the jitted helpers under the names the kernels call them by).
    """
    import triton
    import triton.language as tl_

    try:
        from triton.language.extra import libdevice as libdevice_
    except ImportError:  # older triton: the generic libdevice lived under tl.math
        libdevice_ = tl_.math
    g = dict(globals(), tl=tl_, libdevice=libdevice_)
    for name in _TRITON_FUNCS:
        fn = globals()[name]
        copy = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__annotations__ = fn.__annotations__  # the tl.constexpr marks: FunctionType drops them
        g[name] = triton.jit(copy)
    del interpret  # the cache key only: triton.jit reads TRITON_INTERPRET itself
    return types.SimpleNamespace(adam_kernel=g["_adam_kernel"], adam_multi_kernel=g["_adam_multi_kernel"])


def ptx(interpret: bool) -> bool:
    """Whether the kernels may use inline PTX (NVIDIA, compiled; not ROCm, not the interpreter)."""
    return not interpret and torch.version.hip is None



# ----------------------------------------------------------------------------- the kernels
#
# Plain functions: ``kernels()`` jits them with ``tl`` and ``libdevice`` bound (they are None
# here). Notes that hold throughout:
#   * divisions and square roots go through ``_div`` / ``_sqrt``: IEEE, subnormals kept (PTX
#     ``div.rn.f32`` / ``sqrt.rn.f32``), as in torch's kernels, built without fast-math. On NVIDIA
#     GPUs Triton's ``/`` is ``div.full.f32`` and ``tl.sqrt`` is ``sqrt.approx.f32`` (a few ulp
#     off), and ``tl.div_rn`` / ``tl.sqrt_rn`` become the ``.ftz`` forms (Triton 3.5).
#   * ``tl.fma`` wherever torch's kernel has an fma (explicit, or contracted by nvcc), and no
#     multiply feeding an add anywhere else, so Triton's own contraction changes nothing.
#   * no jitted functions of triton's standard library (tl.zeros, tl.sum, tl.cdiv, ...): those were
#     jitted when triton was imported, so if that happened without TRITON_INTERPRET, the
#     interpreter cannot call them; builtins (tl.full, tl.reduce, tl.where, ...) work either way.
#   * bf16 is stored as bits rounded here (``_bf16_bits``): the interpreter's float32 -> bf16
#     cast truncates, this gives the same bits in the interpreter and on the GPU.

tl = libdevice = None  # bound to triton.language / its libdevice in kernels()

_TRITON_FUNCS = ("_div", "_sqrt", "_bf16_bits", "_bf16_bits_to_f32", "_adam_update", "_adam_scalars", "_adam_kernel",
                 "_adam_multi_kernel")


def _div(a, b, PTX: tl.constexpr):
    """a / b, IEEE round to nearest, subnormals kept (what torch's CUDA kernel computes)."""
    if PTX:
        # tl.div_rn lowers to div.rn.ftz.f32 (Triton 3.5), which flushes subnormal inputs and
        # results to zero; say exactly which instruction we mean
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.div_rn(a, b)


def _sqrt(x, PTX: tl.constexpr):
    """sqrt(x), IEEE round to nearest, subnormals kept (tl.sqrt_rn: sqrt.rn.ftz.f32)."""
    if PTX:
        return tl.inline_asm_elementwise("sqrt.rn.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.sqrt_rn(x)


def _bf16_bits(x):
    """float32 -> bfloat16 bits (int16), round to nearest even; every NaN -> 0x7FFF (CUDA's)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # a carry out of the mantissa bumps the exponent: right
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FFF, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


def _bf16_bits_to_f32(b):
    return (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


def _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, mask, wd, lr_wd, gs, beta1, beta2, eps, step_size,
                 bc2_sqrt, ADAMW: tl.constexpr, HAS_SCALE: tl.constexpr, OUT_KIND: tl.constexpr,
                 PTX: tl.constexpr):
    """One block of elements; the math of torch's ``adam_math`` (module docstring)."""
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_SCALE:
        g = _div(g, gs, PTX)
    # torch skips the decay when wd == 0: p*0 would turn an inf param into NaN
    if ADAMW:
        p = tl.where(wd != 0.0, tl.fma(-lr_wd, p, p), p)
    else:
        g = tl.where(wd != 0.0, tl.fma(p, wd, g), g)
    m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
    g2 = g * g
    v = tl.fma(beta2, v, tl.fma(-beta2, g2, g2))
    denom = _div(_sqrt(v, PTX), bc2_sqrt, PTX) + eps
    p = p - _div(step_size * m, denom, PTX)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if OUT_KIND == 1:
        tl.store(o_ptr + offs, _bf16_bits(p), mask=mask)
    elif OUT_KIND == 2:
        tl.store(o_ptr + offs, p.to(tl.float16), mask=mask)  # RNE (cvt.rn.f16.f32; numpy when interpreted)


def _adam_scalars(lr_ptr, step_ptr, wd, beta1, beta2, INTERPRET: tl.constexpr):
    """A program's scalars from the device numbers: ``(lr, step_size, bc2_sqrt, lr * wd)``.

    The bias corrections 1 - β^t are formed in float64: in float32, β^t sits within a few ulps of 1
    at small t and the subtraction keeps only those ulps (1 - 0.999^3 in float32 is off by ~2e-5
    relative, which would scale the whole update). β itself is the float32 value the moments use, so
    the correction matches the moments it corrects."""
    lr = tl.load(lr_ptr).to(tl.float32)
    t = tl.load(step_ptr).to(tl.float64)
    b1 = tl.full((), beta1, tl.float32).to(tl.float64)
    b2 = tl.full((), beta2, tl.float32).to(tl.float64)
    if INTERPRET:  # no libdevice in the interpreter (numpy's float64 exp2/log2 instead)
        b1t = tl.exp2(t * tl.log2(b1))
        b2t = tl.exp2(t * tl.log2(b2))
    else:
        b1t = libdevice.pow(b1, t)  # __nv_pow, the double one
        b2t = libdevice.pow(b2, t)
    step_size = (lr.to(tl.float64) / (1.0 - b1t)).to(tl.float32)
    bc2_sqrt = tl.sqrt(1.0 - b2t).to(tl.float32)
    return lr, step_size, bc2_sqrt, lr * wd


def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, starts_ptr, lengths_ptr, wd_ptr, lr_ptr, step_ptr,
                 scale_ptr, found_ptr, beta1, beta2, eps, ADAMW: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_FOUND: tl.constexpr, OUT_KIND: tl.constexpr, INTERPRET: tl.constexpr,
                 PTX: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGN: tl.constexpr):
    """Program ``pid`` updates chunk ``pid`` of the table: ``[start, start + length)``, with
    ``length <= ITERS * BLOCK``, in masked steps of BLOCK elements: as many as the chunk needs (the
    short head/tail chunks of runs take one), or in the interpreter always ITERS (it cannot loop to a
    bound loaded from memory with numpy >= 2.4, nor to an assigned one: it turns every assigned
    value into a tensor, hence the inline conditional)."""
    pid = tl.program_id(0)
    lo = tl.load(starts_ptr + pid)
    n = tl.load(lengths_ptr + pid)
    if HAS_FOUND:  # a skipped step is an empty chunk: every access masked, nothing read or written
        n = tl.where(tl.load(found_ptr) == 0, n, 0)
    wd = tl.load(wd_ptr + pid)
    lr, step_size, bc2_sqrt, lr_wd = _adam_scalars(lr_ptr, step_ptr, wd, beta1, beta2, INTERPRET)
    if HAS_SCALE:
        gs = tl.load(scale_ptr).to(tl.float32)
    else:
        gs = 1.0
    if (lo % ALIGN == 0) & (n % ALIGN == 0):
        # recomputed as multiples of ALIGN so the compiler can prove 16-byte alignment of every
        # block and a constant mask over each group of ALIGN lanes: vector loads and stores
        base = lo // ALIGN * ALIGN
        end = base + n // ALIGN * ALIGN
        for k in range(ITERS if INTERPRET else (n + BLOCK - 1) // BLOCK):
            offs = base + k * BLOCK + tl.arange(0, BLOCK)
            _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, offs < end, wd, lr_wd, gs, beta1,
                         beta2, eps, step_size, bc2_sqrt, ADAMW, HAS_SCALE, OUT_KIND, PTX)
    else:
        end = lo + n
        for k in range(ITERS if INTERPRET else (n + BLOCK - 1) // BLOCK):
            offs = lo + k * BLOCK + tl.arange(0, BLOCK)
            _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, offs < end, wd, lr_wd, gs, beta1,
                         beta2, eps, step_size, bc2_sqrt, ADAMW, HAS_SCALE, OUT_KIND, PTX)


def _adam_multi_kernel(chunks_ptr, wd_ptr, bases_ptr, grads_ptr, lr_ptr, step_ptr, scale_ptr, found_ptr,
                       beta1, beta2, eps, ADAMW: tl.constexpr, HAS_SCALE: tl.constexpr,
                       HAS_FOUND: tl.constexpr, GRAD_KIND: tl.constexpr, OUT_KIND: tl.constexpr,
                       GRADS_ALIGNED: tl.constexpr, INTERPRET: tl.constexpr, PTX: tl.constexpr,
                       BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGN: tl.constexpr):
    """`_adam_kernel` over many runs at once, each with its own buffers: program ``pid`` updates chunk
    ``pid`` of the table ``chunks`` (rows ``run, start, length, aligned``, int64), elements
    ``[start, start + length)`` of run ``run``'s buffers, whose addresses are row ``run`` of ``bases``
    (``param, exp_avg, exp_avg_sq, out``) and entry ``run`` of ``grads``. ``aligned``: the run's four
    buffers are 16-byte aligned and the chunk starts and ends on the ALIGN grid (with GRADS_ALIGNED,
    the gradients' addresses too), so the vector path may say so to the compiler. GRAD_KIND: 0 fp32,
    1 bf16, 2 fp16 gradients; OUT_KIND as `_adam_kernel`'s. The arithmetic is `_adam_kernel`'s,
    through the same functions: the same bits."""
    pid = tl.program_id(0)
    row = chunks_ptr + pid * 4
    run = tl.load(row)
    lo = tl.load(row + 1)
    n = tl.load(row + 2)
    aligned = tl.load(row + 3)
    if HAS_FOUND:  # a skipped step is an empty chunk: every access masked, nothing read or written
        n = tl.where(tl.load(found_ptr) == 0, n, 0)
    wd = tl.load(wd_ptr + pid)
    p_ptr = tl.load(bases_ptr + run * 4).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(bases_ptr + run * 4 + 1).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(bases_ptr + run * 4 + 2).to(tl.pointer_type(tl.float32))
    if OUT_KIND == 1:  # bf16 copies stored as bits (_bf16_bits)
        o_ptr = tl.load(bases_ptr + run * 4 + 3).to(tl.pointer_type(tl.int16))
    elif OUT_KIND == 2:
        o_ptr = tl.load(bases_ptr + run * 4 + 3).to(tl.pointer_type(tl.float16))
    else:
        o_ptr = p_ptr  # (never written)
    if GRAD_KIND == 1:
        g_ptr = tl.load(grads_ptr + run).to(tl.pointer_type(tl.bfloat16))
    elif GRAD_KIND == 2:
        g_ptr = tl.load(grads_ptr + run).to(tl.pointer_type(tl.float16))
    else:
        g_ptr = tl.load(grads_ptr + run).to(tl.pointer_type(tl.float32))
    lr, step_size, bc2_sqrt, lr_wd = _adam_scalars(lr_ptr, step_ptr, wd, beta1, beta2, INTERPRET)
    if HAS_SCALE:
        gs = tl.load(scale_ptr).to(tl.float32)
    else:
        gs = 1.0
    if GRADS_ALIGNED & (aligned != 0):
        # 16-byte aligned blocks, as in _adam_kernel, where the addresses are loaded rather than
        # specialized: said to the compiler with multiple_of
        base = lo // ALIGN * ALIGN
        end = base + n // ALIGN * ALIGN
        for k in range(ITERS if INTERPRET else (n + BLOCK - 1) // BLOCK):
            offs = base + k * BLOCK + tl.arange(0, BLOCK)
            _adam_update(tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16), tl.multiple_of(m_ptr, 16),
                         tl.multiple_of(v_ptr, 16), tl.multiple_of(o_ptr, 16), offs, offs < end, wd, lr_wd, gs,
                         beta1, beta2, eps, step_size, bc2_sqrt, ADAMW, HAS_SCALE, OUT_KIND, PTX)
    else:
        end = lo + n
        for k in range(ITERS if INTERPRET else (n + BLOCK - 1) // BLOCK):
            offs = lo + k * BLOCK + tl.arange(0, BLOCK)
            _adam_update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, offs < end, wd, lr_wd, gs, beta1,
                         beta2, eps, step_size, bc2_sqrt, ADAMW, HAS_SCALE, OUT_KIND, PTX)
