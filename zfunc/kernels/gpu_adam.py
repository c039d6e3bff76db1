"""Adam/AdamW and gradient statistics over flat GPU buffers, in one pass each.

Three entry points:

* ``adam_flat_`` updates one flat fp32 parameter buffer (with its two flat
  moment buffers) from one flat gradient buffer in a single kernel launch.
  Which weight decay applies where is an ``AdamSegments`` table built once
  (runs of ``(start, length, weight_decay)``); elements no run covers are left
  alone. Gradients may be fp32, bf16 or fp16 (read as they are, upcast in
  registers), and the new parameters can be written a second time, rounded to
  bf16/fp16, into ``out_lowp`` in the same pass: the compute copy then costs
  its 2 bytes per element of writes instead of a separate cast pass (6 bytes
  per element: read fp32, write 16-bit).

The learning rate, step, gradient scale and found-inf flag are 0-d tensors on
the device, read inside the kernels: nothing syncs with the host, and a CUDA
graph captured around a step stays valid as they change.

Math of ``adam_flat_`` (per element; t = step, the 1-based index of this
update; ``wd`` the element's weight decay). It is the fp32 path of torch's
CUDA fused Adam (``aten/src/ATen/native/cuda/fused_adam_utils.cuh`` as shipped
with torch 2.13; every scalar is cast to float32 first, every operation is
float32, ``fma`` is a fused multiply-add with one rounding)::

    # once per program, from the device scalars (powf: CUDA's, through libdevice)
    bc1 = 1 - powf(beta1, t);  bc2_sqrt = sqrt(1 - powf(beta2, t));  step_size = lr / bc1

    g = grad / grad_scale                                  (only with grad_scale)
    adam  (L2):        g = fma(p, wd, g)                   (only where wd != 0)
    adamw (decoupled): p = fma(-(lr*wd), p, p)             (only where wd != 0)
    m = fma(beta1, m, fma(-beta1, g, g))
    v = fma(beta2, v, fma(-beta2, g*g, g*g))
    p = p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)
    out_lowp = round_to_nearest_even(p)                    (optional bf16/fp16 copy)

Divisions and square roots are the IEEE ones, subnormals kept, as torch's
kernel (built without fast-math) computes them; Triton's ``/`` and
``tl.sqrt`` are approximate on NVIDIA GPUs and its ``div_rn``/``sqrt_rn``
flush subnormals, so the kernel names the PTX instructions. The ``fma`` in
the weight-decay lines is what nvcc makes of torch's ``grad += param*wd`` and
``param -= lr*wd*param`` (it contracts a multiply feeding an add). So the
Triton kernel should agree with ``torch.optim.AdamW(fused=True)`` on CUDA bit
for bit; ``benchmarks/gpu_adam.py`` and ``tests/test_gpu_adam.py`` (on a CUDA
machine) check it. Torch's CPU kernel computes differently (a lerp for ``m``,
``float32(1 - beta2)`` where CUDA has ``1 - float32(beta2)``, bias corrections
in float64): CPU results, the ``"torch"`` backend's and the Triton
interpreter's (whose ``fma`` is a rounded multiply plus a rounded add), differ
from CUDA's by ~1e-6 of the update.

Unlike torch, the gradient is never written: torch's fused kernels store the
unscaled gradient back when given ``grad_scale``; here grads are read-only
(they may be bf16). The bf16 copy of a NaN is the canonical NaN ``0x7FFF``
(what ``.to(torch.bfloat16)`` gives on CUDA; torch's CPU cast gives ``0xFFFF``).

Backends: ``"triton"`` (one launch per ``adam_flat_``; needs CUDA tensors, or
``TRITON_INTERPRET=1`` in the environment for CPU tensors in Triton's
interpreter), ``"torch"`` (any device: ``torch._fused_adam[w]_`` once per
distinct weight decay, plus a ``copy_`` for ``out_lowp``),
``"auto"`` (Triton for CUDA tensors when it imports, else torch). Importing
this module does not import triton; the kernels are jitted on first use.

Memory traffic of one ``adam_flat_`` element: read p, g, m, v and write p, m,
v: 28 bytes with fp32 grads, 26 with 16-bit grads; ``out_lowp`` adds 2.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Sequence

import torch

from zfunc.kernels.adam_segments import (  # noqa: F401 (CHUNK, MIN_CHUNK: re-exported)
    ALIGN,
    CHUNK,
    MIN_CHUNK,
    PROGRAMS_PER_SM,
    AdamRuns,
    AdamSegments,
    sm_count,
)

__all__ = ["ALIGN", "CHUNK", "MIN_CHUNK", "PROGRAMS_PER_SM", "TRITON_CONFIG", "AdamRuns", "AdamSegments",
           "adam_flat_", "adam_runs_", "resolve_backend", "triton_available"]

# Launch parameters of the Triton kernels (read at every call: the benchmark sweeps them).
#   adam_block / adam_warps: elements per loop step and warps per program of adam_flat_.
# Defaults: 4 elements per thread per step (one 16-byte access per stream); ptxas gives the Adam
# kernel ~80 registers at that size for sm_90 (8 elements per thread: ~130-160).
TRITON_CONFIG = {"adam_block": 1024, "adam_warps": 8}

# The torch backend upcasts/unscales gradients into temporaries; it does so this many elements
# at a time, so the extra memory stays bounded.
_TORCH_TMP_ELEMS = 1 << 24

_FLOAT_GRADS = (torch.float32, torch.bfloat16, torch.float16)
_LOWP = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- checks

def _flat(t, name: str, dtypes: tuple, numel: int | None = None, device=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {' or '.join(str(d) for d in dtypes)}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a 1-D contiguous tensor, got shape {tuple(t.shape)} "
                         f"stride {t.stride()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, param has {numel}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, param on {device}")
    return t.detach()


def _device_scalar(t, name: str, device, optional: bool = False):
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a 1-element tensor on {device} (read on the device, no host "  # noqa: TRY004
                         f"sync), got {type(t).__name__}")
    if t.numel() != 1:
        raise ValueError(f"{name} must have 1 element, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; it must be on the buffers' device {device}")
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} has dtype {t.dtype}; expected a real number type")
    return t.detach().reshape(())


def _check_no_overlap(named: dict) -> None:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                   for name, t in named.items() if t is not None and t.numel())
    for (_, hi0, n0), (lo1, _, n1) in itertools.pairwise(spans):
        if lo1 < hi0:
            raise ValueError(f"{n0} and {n1} share memory; every buffer must be distinct")


# ----------------------------------------------------------------------------- triton plumbing

@functools.cache
def _triton():
    """The triton module, or None when it does not import."""
    try:
        import triton
        import triton.language
    except Exception:  # noqa: BLE001  (ImportError, or a broken install: treat as absent)
        return None
    return triton


def triton_available() -> bool:
    return _triton() is not None


def _interpreting() -> bool:
    """Whether triton.jit would make an interpreted kernel now (TRITON_INTERPRET, or triton's knob)."""
    knobs = getattr(_triton(), "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend ``"auto"``, ``"triton"`` or ``"torch"`` stands for on ``device`` (raises where it cannot
    run there)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton() is not None else "torch"
    if backend == "triton":
        if _triton() is None:
            raise ImportError("backend='triton' but triton does not import; use backend='torch'")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(f"backend='triton' needs CUDA tensors (got {device}), or TRITON_INTERPRET=1 "
                             f"in the environment to run the kernels in Triton's interpreter")
    return backend


def _on(device: torch.device, launch, *args, **kwargs) -> None:
    """``launch(*args, **kwargs)`` with ``device`` current (Triton launches on the current device); where it is
    current already, as it is (no context entered: this runs at every step)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            launch(*args, **kwargs)
    else:
        launch(*args, **kwargs)


# ----------------------------------------------------------------------------- adam_flat_

def adam_flat_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               segments: AdamSegments, *, lr: torch.Tensor, step: torch.Tensor, beta1: float, beta2: float,
               eps: float, mode: str = "adamw", grad_scale: torch.Tensor | None = None,
               out_lowp: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
               backend: str = "auto") -> None:
    """One Adam/AdamW step, in place, over the elements of flat buffers that ``segments`` covers.

    Args:
        param, exp_avg, exp_avg_sq: 1-D contiguous float32 tensors of one length, one device.
        grad: 1-D contiguous float32, bfloat16 or float16 tensor of that length. Read only.
        segments: an :class:`AdamSegments` on the same device; its runs must end within the
            buffers. Elements outside its runs are not touched (``out_lowp`` included).
        lr, step: 1-element tensors on the device (``step``: the 1-based index of this update,
            any real dtype; it is used as float32, like torch's ``state_steps``).
        beta1, beta2, eps: numbers.
        mode: ``"adamw"`` (decoupled decay, ``torch.optim.AdamW``) or ``"adam"`` (L2 decay added
            to the gradient, ``torch.optim.Adam``).
        grad_scale: optional 1-element tensor on the device; gradients are divided by it first
            (a loss scale, or a clipping divisor).
        out_lowp: optional 1-D contiguous bfloat16/float16 tensor of the same length; receives
            the updated parameters rounded to nearest even (``param.to(out_lowp.dtype)``).
        found_inf: optional 1-element tensor on the device; when it is nonzero the step is
            skipped on the device (torch's GradScaler protocol). The Triton backend then writes
            nothing; the torch backend on CUDA still refreshes ``out_lowp`` from the unchanged
            params. Advancing ``step`` is the caller's business either way.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (module docstring).
    """
    if mode not in ("adam", "adamw"):
        raise ValueError(f"mode must be 'adam' or 'adamw', got {mode!r}")
    if not isinstance(segments, AdamSegments):
        raise ValueError(f"segments must be an AdamSegments (AdamSegments.build(...)), got "  # noqa: TRY004
                         f"{type(segments).__name__}")
    param = _flat(param, "param", (torch.float32,))
    n, device = param.numel(), param.device
    exp_avg = _flat(exp_avg, "exp_avg", (torch.float32,), n, device)
    exp_avg_sq = _flat(exp_avg_sq, "exp_avg_sq", (torch.float32,), n, device)
    grad = _flat(grad, "grad", _FLOAT_GRADS, n, device)
    if out_lowp is not None:
        out_lowp = _flat(out_lowp, "out_lowp", _LOWP, n, device)
    if segments.device != device:
        raise ValueError(f"segments are on {segments.device}, the buffers on {device}; build them with "
                         f"AdamSegments.build(runs, device={str(device)!r})")
    if segments.end > n:
        raise ValueError(f"segments reach element {segments.end}, the buffers have {n}")
    lr = _device_scalar(lr, "lr", device)
    step = _device_scalar(step, "step", device)
    grad_scale = _device_scalar(grad_scale, "grad_scale", device, optional=True)
    found_inf = _device_scalar(found_inf, "found_inf", device, optional=True)
    beta1, beta2, eps = _number(beta1, "beta1"), _number(beta2, "beta2"), _number(eps, "eps")
    _check_no_overlap({"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                       "out_lowp": out_lowp})
    backend = resolve_backend(backend, device)
    if not segments.runs:
        return
    if backend == "triton":
        _adam_triton(param, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1, beta2, eps, mode,
                     grad_scale, out_lowp, found_inf)
    else:
        _adam_torch(param, grad, exp_avg, exp_avg_sq, segments, lr, step, beta1, beta2, eps, mode,
                    grad_scale, out_lowp, found_inf)


_GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_KINDS = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def adam_runs_(runs: AdamRuns, grad_ptrs: list[int] | None, grad_dtype: torch.dtype, *, lr: torch.Tensor,
               step: torch.Tensor, beta1: float, beta2: float, eps: float, mode: str = "adamw",
               grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
    """`adam_flat_` over every run of ``runs`` in one launch (Triton only), the same bits.

    Args:
        runs: the table (`AdamRuns.build`): the runs' buffers, by address, with their weight decays
            and the copies' dtype.
        grad_ptrs: the address of each run's gradients (``grad_dtype``, contiguous, the run's length),
            which must not overlap the runs' buffers. Addresses, not tensors: this is the low-level
            entry of a caller that checked them (`zfunc.optim.fused_plan`), and nothing here can.
            None: the addresses set last (`AdamRuns.set_grads`), which the kernel reads from the
            table on the device (a launch captured in a CUDA graph reads the ones set before each replay).
        lr, step, grad_scale, found_inf: 0-d tensors on the runs' device (as `adam_flat_`'s;
            ``found_inf`` may be a bool or uint8 flag).
        beta1, beta2, eps, mode: as `adam_flat_`'s.
    """
    if mode not in ("adam", "adamw"):
        raise ValueError(f"mode must be 'adam' or 'adamw', got {mode!r}")
    if grad_dtype not in _GRAD_KINDS:
        raise ValueError(f"grad_dtype must be one of {list(_GRAD_KINDS)}, got {grad_dtype}")
    device = runs.device
    launcher = runs.launcher or _runs_launcher(runs)
    if grad_ptrs is not None:
        runs.set_grads(grad_ptrs)
    grad_ptrs = runs.grad_ptrs
    if not runs.num_chunks:
        return
    if found_inf is not None and found_inf.dtype == torch.bool:
        found_inf = found_inf.view(torch.uint8)  # (a view: no launch)
    interp, kernel, block, warps, use_ptx = launcher
    _on(device, kernel[(runs.num_chunks,)],
        runs.chunks, runs.weight_decays, runs.bases, runs.grads, lr, step,
        grad_scale if grad_scale is not None else lr, found_inf if found_inf is not None else lr,
        float(beta1), float(beta2), float(eps),
        ADAMW=mode == "adamw", HAS_SCALE=grad_scale is not None, HAS_FOUND=found_inf is not None,
        GRAD_KIND=_GRAD_KINDS[grad_dtype], OUT_KIND=_OUT_KINDS[runs.out_dtype],
        GRADS_ALIGNED=runs.grads_aligned, INTERPRET=interp, PTX=use_ptx, BLOCK=block,
        ITERS=-(-runs.chunk // block), ALIGN=ALIGN, num_warps=warps)


def _runs_launcher(runs: AdamRuns) -> tuple:
    """What `adam_runs_` launches ``runs`` with from its first launch on (`AdamRuns.launcher`): whether Triton
    interprets, the kernel, its block and warps, inline PTX or not. Raises where Triton cannot run there (no
    triton; no CUDA and no interpreter)."""
    resolve_backend("triton", runs.device)  # (raises, saying why; once per table, not per launch)
    interp = _interpreting()
    from zfunc.kernels.triton_kernels import kernels, ptx  # noqa: PLC0415 (imports triton when run)

    runs.launcher = (interp, kernels(interp).adam_multi_kernel, int(TRITON_CONFIG["adam_block"]),
                     int(TRITON_CONFIG["adam_warps"]), ptx(interp))
    return runs.launcher


def _number(x, name: str) -> float:
    if isinstance(x, (torch.Tensor, bool)):
        raise ValueError(f"{name} must be a Python number, got {type(x).__name__}")  # noqa: TRY004
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {type(x).__name__}") from None


def _adam_triton(param, grad, exp_avg, exp_avg_sq, seg, lr, step, beta1, beta2, eps, mode, grad_scale,
                 out_lowp, found_inf):
    from zfunc.kernels.triton_kernels import kernels, ptx  # noqa: PLC0415 (imports triton when run)

    interp = _interpreting()
    k = kernels(interp)
    cfg = TRITON_CONFIG
    block = int(cfg["adam_block"])
    out_kind = 0 if out_lowp is None else (1 if out_lowp.dtype == torch.bfloat16 else 2)
    # bf16 copies are stored as bit patterns, rounded in the kernel (_bf16_bits); no copy: a dummy
    out = param if out_lowp is None else (out_lowp.view(torch.int16) if out_kind == 1 else out_lowp)
    _on(param.device, k.adam_kernel[(seg.num_chunks,)],
        param, grad, exp_avg, exp_avg_sq, out, seg.starts, seg.lengths, seg.weight_decays,
        lr, step, grad_scale if grad_scale is not None else lr, found_inf if found_inf is not None else lr,
        beta1, beta2, eps,
        ADAMW=mode == "adamw", HAS_SCALE=grad_scale is not None, HAS_FOUND=found_inf is not None,
        OUT_KIND=out_kind, INTERPRET=interp, PTX=ptx(interp), BLOCK=block, ITERS=-(-seg.chunk // block),
        ALIGN=ALIGN, num_warps=int(cfg["adam_warps"]))


def _adam_torch(param, grad, exp_avg, exp_avg_sq, seg, lr, step, beta1, beta2, eps, mode, grad_scale,
                out_lowp, found_inf):
    device = param.device
    if found_inf is not None and device.type == "cpu" and bool(found_inf != 0):
        return  # free to read on the host: skip everything, like the Triton kernel does
    kernel = torch._fused_adamw_ if mode == "adamw" else torch._fused_adam_
    lr = lr.to(torch.float32)
    step = step.to(torch.float32)
    scale = None if grad_scale is None else grad_scale.to(torch.float32)
    found = None if found_inf is None else found_inf.to(torch.float32)
    # torch's kernels want fp32 grads and write the unscaled grad back when given grad_scale;
    # grads here are read-only and may be 16-bit, so those cases go through fp32 temporaries
    # (g / scale is the same float32 division the kernel would do).
    tmp = grad.dtype != torch.float32 or scale is not None
    by_wd: dict[float, list[tuple[int, int]]] = {}
    for start, length, wd in seg.runs:
        by_wd.setdefault(wd, []).append((start, length))
    for wd, runs in by_wd.items():
        for batch in _batches(runs, _TORCH_TMP_ELEMS if tmp else None):
            ps = [param[s:s + n] for s, n in batch]
            gs = [grad[s:s + n] for s, n in batch]
            if tmp:  # .float() copies 16-bit grads; torch.div makes a new tensor of fp32 ones
                gs = [g.float() if scale is None else torch.div(g.float(), scale) for g in gs]
            kernel(ps, gs, [exp_avg[s:s + n] for s, n in batch], [exp_avg_sq[s:s + n] for s, n in batch], [],
                   [step] * len(ps), lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps,
                   amsgrad=False, maximize=False, grad_scale=None, found_inf=found)
    if out_lowp is not None:
        if len(seg.runs) == 1:
            s, n, _ = seg.runs[0]
            out_lowp[s:s + n].copy_(param[s:s + n])
        else:
            torch._foreach_copy_([out_lowp[s:s + n] for s, n, _ in seg.runs],
                                 [param[s:s + n] for s, n, _ in seg.runs])


def _batches(runs: list[tuple[int, int]], limit: int | None):
    """Split runs into lists of at most ``limit`` elements in all (pieces of runs where needed)."""
    if limit is None:
        yield runs
        return
    batch, size = [], 0
    for start, length in runs:
        while length:
            take = min(length, limit - size)
            batch.append((start, take))
            size += take
            start += take
            length -= take
            if size == limit:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch
