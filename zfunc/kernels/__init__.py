"""Low-level kernels (numba on the CPU). Depends on numpy/numba/torch only, nothing of zfunc above.

Attributes load lazily, so ``import zfunc.kernels`` costs nothing until a kernel is used:

* ``adamw_`` / ``adam_`` (:mod:`zfunc.kernels.cpu_adam`): in-place Adam/AdamW over flat fp32
  CPU buffers, bitwise equal to ``torch.optim.AdamW(fused=True)``, optionally writing the
  bf16/fp16 copy of the new parameters in the same pass.
* :mod:`zfunc.kernels.bits`: bf16/fp16 <-> fp32 bit conversions for numba code.
"""

from __future__ import annotations

import importlib

__all__ = ["adam_", "adamw_", "bits", "cpu_adam"]

_LAZY = {"adamw_": "cpu_adam", "adam_": "cpu_adam"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in ("cpu_adam", "bits"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
