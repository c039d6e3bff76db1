"""Low-level kernels (numba on the CPU, Triton on the GPU). Depend on numpy/numba/torch (and
triton, imported only when a GPU kernel runs), nothing of zfunc above.

Attributes load lazily, so ``import zfunc.kernels`` costs nothing until a kernel is used:

* ``adamw_`` / ``adam_`` (:mod:`zfunc.kernels.cpu_adam`): in-place Adam/AdamW over flat fp32
  CPU buffers, bitwise equal to ``torch.optim.AdamW(fused=True)``, optionally writing the
  bf16/fp16 copy of the new parameters in the same pass.
* :mod:`zfunc.kernels.bits`: bf16/fp16 <-> fp32 bit conversions for numba code.
* :mod:`zfunc.kernels.gpu_adam`: ``adam_flat_`` (one Triton launch of Adam/AdamW over a flat
  buffer, a per-chunk weight-decay table, grads in their own dtype, optional bf16/fp16 copy-out),
  with a pure-torch fallback used off the GPU; its chunk table, ``AdamSegments``, is in
  :mod:`zfunc.kernels.adam_segments`.

Which kernel an optimizer update uses is decided in one place, `zfunc.optim.fused`.
"""

from __future__ import annotations

import importlib

__all__ = ["adam_", "adamw_", "bits", "cpu_adam", "gpu_adam"]

_LAZY = {"adamw_": "cpu_adam", "adam_": "cpu_adam"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in ("cpu_adam", "bits", "gpu_adam"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
