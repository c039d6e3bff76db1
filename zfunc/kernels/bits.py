"""Bit-level helpers for numba CPU kernels: bfloat16/float16 <-> float32 and FMA.

numba has neither ``bfloat16`` nor ``float16`` on the CPU, so half-precision
data travels as its raw 16-bit patterns (``t.view(torch.uint16).numpy()`` or
``.view(torch.int16)``, zero-copy) and is converted here, inside the kernel,
with integer operations on the float32 bit pattern.

Scalar helpers (``@njit(inline='always')``, callable from any njit code):

* ``f32_as_u32(x)`` / ``u32_as_f32(u)``: reinterpret bits (LLVM ``bitcast``).
* ``fma_f32(a, b, c)``: ``a*b + c`` with one rounding (LLVM ``llvm.fma.f32``;
  a hardware FMA where the CPU has one, a correctly rounded libm call otherwise).
* ``nt_store_line(dst, di, src, si)`` / ``store_fence()``: copy one 64-byte line with a
  non-temporal (streaming) store, and order such stores (``sfence`` on x86): lets a kernel
  write a large output stream without first reading every destination line into cache.
* ``bf16_bits_to_f32(h)`` / ``fp16_bits_to_f32(h)``: exact widening.
* ``f32_to_bf16_bits(x)`` / ``f32_to_fp16_bits(x)``: round to nearest, ties to
  even, exactly like ``tensor.to(torch.bfloat16)`` / ``.to(torch.float16)``:
  overflow becomes +-inf, float16 subnormals are produced (and rounded)
  correctly, NaN stays NaN (quiet, sign kept; the payload is not preserved).

Array helpers (``*_array``), used by the tests and usable from Python, convert
whole numpy arrays in parallel.

Bit patterns are passed as ``uint16`` or ``int16`` integers; the helpers only
look at the low 16 bits.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "LINE_BYTES",
    "bf16_bits_to_f32",
    "bf16_bits_to_f32_array",
    "f32_as_u32",
    "f32_to_bf16_bits",
    "f32_to_bf16_bits_array",
    "f32_to_fp16_bits",
    "f32_to_fp16_bits_array",
    "fma_f32",
    "fp16_bits_to_f32",
    "fp16_bits_to_f32_array",
    "nt_store_line",
    "store_fence",
    "u32_as_f32",
]


# ----------------------------------------------------------------------------- intrinsics

@intrinsic
def f32_as_u32(typingctx, x):
    """The IEEE bits of a float32 as a uint32 (no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def u32_as_f32(typingctx, u):
    """A uint32 bit pattern read as a float32 (no conversion)."""
    if not isinstance(u, types.Integer) or u.bitwidth != 32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def fma_f32(typingctx, a, b, c):
    """``a*b + c`` in float32 with a single rounding."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


LINE_BYTES = 64  # bytes written by one nt_store_line; the destination must be aligned to it
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def nt_store_line(typingctx, dst, di, src, si):
    """Copy the 64 bytes at ``src[si:]`` to ``dst[di:]`` with a non-temporal store.

    ``dst``/``src``: 1-D contiguous arrays of one dtype; ``&dst[di]`` must be 64-byte aligned
    (``src`` need not be). No bounds checks. Follow a run of these by ``store_fence()``.
    """
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.dtype == src.dtype
            and dst.ndim == 1 and src.ndim == 1 and isinstance(di, types.Integer)
            and isinstance(si, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        dty, _, sty, _ = sig.args
        dary = context.make_array(dty)(context, builder, args[0])
        sary = context.make_array(sty)(context, builder, args[2])
        dptr = builder.gep(dary.data, [context.cast(builder, args[1], sig.args[1], types.int64)])
        sptr = builder.gep(sary.data, [context.cast(builder, args[3], sig.args[3], types.int64)])
        vty = ir.VectorType(ir.IntType(32), LINE_BYTES // 4)
        val = builder.load(builder.bitcast(sptr, vty.as_pointer()), align=1)
        st = builder.store(val, builder.bitcast(dptr, vty.as_pointer()), align=LINE_BYTES)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.none(dst, di, src, si), codegen


@intrinsic
def store_fence(typingctx):
    """Order earlier non-temporal stores before later stores (x86 ``sfence``)."""

    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse.sfence")
            builder.call(fn, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


# ----------------------------------------------------------------------------- scalar conversions

_TWO_M24 = np.float32(2.0 ** -24)  # value of the float16 subnormal unit


@njit(inline="always", cache=True)
def bf16_bits_to_f32(h):
    """bfloat16 bits (low 16 bits of ``h``) -> float32, exact."""
    return u32_as_f32(np.uint32((np.uint32(h) & np.uint32(0xFFFF)) << np.uint32(16)))


@njit(inline="always", cache=True)
def fp16_bits_to_f32(h):
    """IEEE float16 bits (low 16 bits of ``h``) -> float32, exact (subnormals, inf, NaN)."""
    hb = np.uint32(h) & np.uint32(0xFFFF)
    sign = (hb & np.uint32(0x8000)) << np.uint32(16)
    e = (hb >> np.uint32(10)) & np.uint32(0x1F)
    mant = hb & np.uint32(0x3FF)
    # subnormal or zero: mant * 2^-24 is exact in float32
    sub = f32_as_u32(np.float32(mant) * _TWO_M24)
    normal = ((e + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))
    special = np.uint32(0x7F800000) | (mant << np.uint32(13))  # inf / NaN (payload kept)
    mag = sub if e == np.uint32(0) else (special if e == np.uint32(0x1F) else normal)
    return u32_as_f32(np.uint32(sign | mag))


@njit(inline="always", cache=True)
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN -> quiet NaN."""
    u = f32_as_u32(x)
    a = u & np.uint32(0x7FFFFFFF)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u >> np.uint32(16)) | np.uint32(0x40)
    return np.uint16(nan if a > np.uint32(0x7F800000) else rounded)


@njit(inline="always", cache=True)
def f32_to_fp16_bits(x):
    """float32 -> IEEE float16 bits (uint16), round to nearest even.

    |x| >= 65520 (and inf) -> inf, NaN -> quiet NaN, |x| < 2^-14 -> float16
    subnormal (rounded on the 2^-24 grid; |x| <= 2^-25 -> signed zero).
    """
    u = f32_as_u32(x)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    # normal float16 range: rebias the exponent (127 -> 15) and round the 13 dropped bits
    a2 = a - np.uint32(0x38000000)
    normal = (a2 + np.uint32(0xFFF) + ((a2 >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    # subnormal range: value / 2^-24 = mant >> (126 - e), rounded to nearest even
    e = a >> np.uint32(23)
    mant = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    in_sub = (e > np.uint32(101)) & (e <= np.uint32(112))
    sh = np.uint32(np.uint32(126) - e) if in_sub else np.uint32(25)  # 14..24, or 25 (-> 0)
    half_m1 = (np.uint32(1) << (sh - np.uint32(1))) - np.uint32(1)
    sub = (mant + half_m1 + ((mant >> sh) & np.uint32(1))) >> sh
    if a > np.uint32(0x7F800000):
        mag = np.uint32(0x7E00)
    elif a >= np.uint32(0x477FF000):
        mag = np.uint32(0x7C00)
    elif a >= np.uint32(0x38800000):
        mag = normal
    else:
        mag = sub
    return np.uint16(sign | mag)


# ----------------------------------------------------------------------------- array conversions

@njit(parallel=True, cache=True)
def bf16_bits_to_f32_array(h):
    """uint16/int16 array of bfloat16 bits -> float32 array."""
    out = np.empty(h.size, np.float32)
    for i in prange(h.size):
        out[i] = bf16_bits_to_f32(h[i])
    return out


@njit(parallel=True, cache=True)
def fp16_bits_to_f32_array(h):
    """uint16/int16 array of float16 bits -> float32 array."""
    out = np.empty(h.size, np.float32)
    for i in prange(h.size):
        out[i] = fp16_bits_to_f32(h[i])
    return out


@njit(parallel=True, cache=True)
def f32_to_bf16_bits_array(x):
    """float32 array -> uint16 array of bfloat16 bits (round to nearest even)."""
    out = np.empty(x.size, np.uint16)
    for i in prange(x.size):
        out[i] = f32_to_bf16_bits(x[i])
    return out


@njit(parallel=True, cache=True)
def f32_to_fp16_bits_array(x):
    """float32 array -> uint16 array of float16 bits (round to nearest even)."""
    out = np.empty(x.size, np.uint16)
    for i in prange(x.size):
        out[i] = f32_to_fp16_bits(x[i])
    return out
