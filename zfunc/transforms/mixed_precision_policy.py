"""`mixed_precision`'s policy: which dtype each kind of tensor has, and the state that records it.

A `Policy` is jmp's four dtypes (``param_dtype``, ``compute_dtype``,
``output_dtype``, ``reduce_dtype``), each ``"fp32"``, ``"bf16"`` or ``"fp16"``;
`zfunc.transforms.mixed_precision`'s module doc says what each one sets.

A state made by `mixed_precision` records its policy and loss-scaling mode as
codes (`MixedPrecisionState.policy`, `policy_codes`), so that a state (or a
checkpoint) made under another policy is refused (`check_policy_codes`) rather
than run with the wrong dtypes or scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import torch

from zfunc.compiled import tracing

DTypeName = Literal["fp32", "bf16", "fp16"]

_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CODES = {"fp32": 0, "bf16": 1, "fp16": 2}
_SCALING_CODES = {"none": 0, "static": 1, "dynamic": 2}
_ALIASES: dict[Any, str] = {
    "fp32": "fp32", "float32": "fp32", "f32": "fp32", "full": "fp32", "float": "fp32", torch.float32: "fp32",
    "bf16": "bf16", "bfloat16": "bf16", torch.bfloat16: "bf16",
    "fp16": "fp16", "float16": "fp16", "f16": "fp16", "half": "fp16", torch.float16: "fp16",
}


def _dtype_name(value: Any, field: str) -> str:
    key = value.lower() if isinstance(value, str) else value
    try:
        return _ALIASES[key]
    except (KeyError, TypeError):
        raise ValueError(f"{field} must be one of 'fp32', 'bf16', 'fp16' or torch.float32, torch.bfloat16, "
                         f"torch.float16; got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype each kind of tensor has under `mixed_precision` (see its module doc).

    Fields accept ``"fp32"``/``"bf16"``/``"fp16"``, their long names or torch
    dtypes and are stored as the short names. ``reduce_dtype=None`` means
    ``compute_dtype``.
    """

    param_dtype: DTypeName = "fp32"
    compute_dtype: DTypeName = "fp32"
    output_dtype: DTypeName = "fp32"
    reduce_dtype: DTypeName | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _dtype_name(getattr(self, field), field))
        reduce = self.compute_dtype if self.reduce_dtype is None else _dtype_name(self.reduce_dtype, "reduce_dtype")
        object.__setattr__(self, "reduce_dtype", reduce)

    @classmethod
    def parse(cls, policy: str | Policy) -> Policy:
        """``"bf16"``, ``"fp16"``, ``"fp32"``, a jmp string
        (``"params=fp32,compute=bf16,output=fp32[,reduce=fp32]"``) or a `Policy`."""
        if isinstance(policy, Policy):
            return policy
        if isinstance(policy, torch.dtype):
            low = _dtype_name(policy, "policy")
            return cls("fp32", low, "fp32", low)
        if not isinstance(policy, str):
            raise TypeError(f"policy must be a string ('bf16', 'fp16', 'fp32'), a torch dtype or a Policy, "
                            f"got {policy!r}")
        text = policy.strip().lower()
        if "=" not in text:
            low = _dtype_name(text, "policy")
            return cls("fp32", low, "fp32", low)
        fields = {"params": "param_dtype", "param": "param_dtype", "compute": "compute_dtype",
                  "output": "output_dtype", "reduce": "reduce_dtype"}
        values: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or key not in fields:
                raise ValueError(f"cannot parse policy {policy!r}: expected 'params=..,compute=..,output=..' "
                                 f"with keys {sorted(fields)}")
            values[fields[key]] = value
        return cls(**values)

    # torch dtypes
    @property
    def param(self) -> torch.dtype:
        return _DTYPES[self.param_dtype]

    @property
    def compute(self) -> torch.dtype:
        return _DTYPES[self.compute_dtype]

    @property
    def output(self) -> torch.dtype:
        return _DTYPES[self.output_dtype]

    @property
    def reduce(self) -> torch.dtype:
        return _DTYPES[self.reduce_dtype]

    def short(self) -> str | Policy:
        """The preset name if this policy is one, else itself (for ``repr``)."""
        for name in ("fp32", "bf16", "fp16"):
            if self == Policy.parse(name):
                return name
        return self


class MixedPrecisionState(NamedTuple):
    """``state.extras["mixed_precision"]``: the master copy and the loss scaler, as tensors."""

    master: dict[str, torch.Tensor]  # fp32 master params (empty if params are the master)
    loss_scale: torch.Tensor         # float32 0-d
    good_steps: torch.Tensor         # int64 0-d: good steps since the last overflow, before this one
    hysteresis_left: torch.Tensor    # int64 0-d: overflows tolerated before the scale drops
    skipped_steps: torch.Tensor      # int64 0-d: total skipped steps
    policy: torch.Tensor             # int64 (5,): param, compute, output, reduce dtype codes; scaling mode


def policy_codes(policy: Policy, scaling: str, device) -> torch.Tensor | list[int]:
    """The codes of ``policy`` and its loss-scaling mode (``"none"``, ``"static"``, ``"dynamic"``), as a
    `MixedPrecisionState` keeps them: a tensor on ``device``; a list for ``device=None``."""
    codes = [_CODES[policy.param_dtype], _CODES[policy.compute_dtype], _CODES[policy.output_dtype],
             _CODES[policy.reduce_dtype], _SCALING_CODES[scaling]]
    return codes if device is None else torch.tensor(codes, dtype=torch.int64, device=device)


_POLICY_MISMATCH = ("this state was made under another mixed-precision policy than this compiled step's; use the "
                    "step that made it, or build a fresh state with this step's init")


def check_policy_codes(codes: torch.Tensor, policy: Policy, scaling: str) -> None:
    """Refuse a state whose policy ``codes`` (`MixedPrecisionState.policy`) are not ``policy``'s and
    ``scaling``'s: running it would train with the wrong dtypes or loss scale."""
    if tracing():  # the codes are data to a compiled step: checked when it runs, not read on the host
        expected = policy_codes(policy, scaling, codes.device)
        torch._assert_async((codes == expected).all(), _POLICY_MISMATCH)
        return
    seen = host_codes(codes)
    if seen != policy_codes(policy, scaling, None):
        raise ValueError(
            f"this state was made under another mixed-precision policy ({describe_policy_codes(seen)}) than "
            "this step's "
            f"({policy.short()!r}, loss scaling {scaling}); running it would train with the wrong "
            "dtypes or loss scale. Use the step that made it, or build a fresh state with this step's init "
            "and copy the weights in (zfunc.io.restore(dir, like=step.init(...), strict=False)).")


def host_codes(codes: torch.Tensor) -> list[int]:
    """A state's policy codes on the host: read once per tensor (again after an in-place write to it, e.g. a
    restore), not at every step, where the read would wait for the GPU to drain its queue."""
    seen = getattr(codes, "_zfunc_codes", None)
    if seen is None or seen[0] != codes._version:
        seen = (codes._version, codes.tolist())
        codes._zfunc_codes = seen
    return seen[1]


def describe_policy_codes(codes: list[int]) -> str:
    """A `MixedPrecisionState.policy`'s codes in words ("params=float32, compute=bfloat16, ...")."""
    if len(codes) != 5:
        return f"codes {codes}"
    names = {v: k for k, v in _CODES.items()}
    modes = {v: k for k, v in _SCALING_CODES.items()}
    return (f"params={names.get(codes[0])}, compute={names.get(codes[1])}, output={names.get(codes[2])}, "
            f"reduce={names.get(codes[3])}, loss scaling {modes.get(codes[4])}")

