"""The precision plugin of `ZfuncStrategy`: zfunc computes the gradients, Lightning does not.

Lightning picks a precision plugin from ``Trainer(precision=...)`` by type
(autocast for "bf16-mixed", a GradScaler for "16-mixed"). Under zfunc the
step owns precision (`mixed_precision`: a bf16/fp16 compute copy, an fp32
master, fp16 loss scaling), so the strategy swaps whatever Lightning chose for
`ZfuncPrecision` of the same name:

=============  =======================================================================
precision      under zfunc
=============  =======================================================================
"32-true"      fp32, no transform
"bf16-mixed"   ``mixed_precision(step, "bf16")``: bf16 compute copy, fp32 master (DeepSpeed's bf16)
"16-mixed"     ``mixed_precision(step, "fp16", ...)`` with the strategy's loss-scale arguments
"bf16-true"    the module in bf16 (as Lightning's own "bf16-true"): bf16 parameters, no master
=============  =======================================================================

"16-true", "64-true" and the transformer-engine/bitsandbytes plugins are
refused. On a CPU Lightning itself turns "16-mixed" into "bf16-mixed" (with a
warning) before any strategy sees it; pass
``plugins=[zfunc.lightning.ZfuncPrecision("16-mixed")]`` to keep fp16 there.

Its ``backward`` does nothing (the zfunc step differentiates the loss
``training_step`` returned) and it never steps an optimizer; the callback
hooks around backward still run.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Literal, get_args

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning_utilities import apply_to_collection

ZfuncPrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
_TRUE_DTYPES = {"bf16-true": torch.bfloat16}


class ZfuncPrecision(Precision):
    """Lightning's precision names under zfunc (see the module doc)."""

    def __init__(self, precision: ZfuncPrecisionName = "32-true") -> None:
        if precision not in get_args(ZfuncPrecisionName):
            hint = (" ('16-true' trains fp16 weights without a master or loss scale; use '16-mixed')"
                    if precision == "16-true" else "")
            raise ValueError(f"zfunc's Lightning strategy does not support precision={precision!r}; use one of "
                             f"{get_args(ZfuncPrecisionName)}{hint}")
        self.precision = precision

    @property
    def mixed_policy(self) -> str | None:
        """The `mixed_precision` policy this precision asks for, or None."""
        return {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(self.precision)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        dtype = _TRUE_DTYPES.get(self.precision)
        return module if dtype is None else module.to(dtype=dtype)

    def convert_input(self, data: Any) -> Any:
        dtype = _TRUE_DTYPES.get(self.precision)
        if dtype is None:   # mixed_precision casts the model's floating inputs itself
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=dtype)

    def tensor_init_context(self):
        dtype = _TRUE_DTYPES.get(self.precision)
        return nullcontext() if dtype is None else _DtypeContextManager(dtype)

    def module_init_context(self):
        return self.tensor_init_context()

    def forward_context(self):
        return nullcontext()   # no autocast: mixed_precision runs a compute copy instead

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: zfunc's step took the gradients of this loss already."""

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ZfuncPrecision never steps a torch optimizer: ZfuncStrategy.optimizer_step runs the "
                           "zfunc update")

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Nothing: ``gradient_clip_val`` is zf.optim.clip_by_global_norm in the zfunc optimizer."""


def precision_name(plugin: Precision | None) -> str:
    """The Lightning precision name of whatever plugin Lightning chose; refuses plugins zfunc cannot honour."""
    if plugin is None:
        return "32-true"
    if isinstance(plugin, ZfuncPrecision):
        return plugin.precision
    if type(plugin) is Precision:
        return "32-true"
    if type(plugin) in (MixedPrecision, HalfPrecision):
        return plugin.precision
    if type(plugin) is DoublePrecision:
        return "64-true"
    raise ValueError(f"zfunc's Lightning strategy cannot run the precision plugin {type(plugin).__name__}: zfunc's "
                     f"step owns precision; use Trainer(precision=...) with one of {get_args(ZfuncPrecisionName)}")
