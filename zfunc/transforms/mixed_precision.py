"""`mixed_precision`: compute in bf16/fp16, keep fp32 master parameters, scale the loss for fp16.

``mixed_precision(step, policy)`` runs the step's forward and backward on a
low-precision copy of the parameters and applies the optimizer to a
full-precision master copy, as DeepSpeed's fp16/bf16 modes and JAX's ``jmp``
do. What the step computes does not change; only the dtypes it computes in.

Policy (jmp's four dtypes, each ``"fp32"``, ``"bf16"`` or ``"fp16"``):

================  ===========================================================
``param_dtype``   the master parameters: what the optimizer updates and what
                  ``step.gather(state)`` returns (normally fp32)
``compute_dtype`` ``state.params``: the copy the model runs on; floating inputs
                  and frozen parameters are cast to it too (floating buffers
                  keep their own dtype unless ``cast_buffers=True``, as
                  autocast and FSDP2 do: e.g. Llama's rotary ``inv_freq`` in
                  bf16 would be off by up to 0.7 at positions past 2048)
``output_dtype``  floating outputs of ``apply_fn`` (e.g. fp32 logits, so the
                  loss is computed in fp32)
``reduce_dtype``  the dtype in which `shard` should reduce gradients over
                  ranks (default: ``compute_dtype``, as DeepSpeed and FSDP do)
================  ===========================================================

``"bf16"`` = ``Policy("fp32", "bf16", "fp32", "bf16")``, ``"fp16"`` likewise,
``"fp32"`` = all fp32 (then the transform changes nothing: bitwise the plain
step). jmp's spelling ``"params=fp32,compute=bf16,output=bf16"`` also works.

State: ``state.extras["mixed_precision"]`` is a `MixedPrecisionState`
(``master`` params dict, ``loss_scale``, ``good_steps``, ``hysteresis_left``,
``skipped_steps``; 0-d tensors; ``policy``, the policy and loss-scaling mode
as codes), so saving a state saves the loss scaler, and a state (or a
checkpoint) made under another policy is refused rather than run with the
wrong scale.
``state.params`` holds the compute copy. ``master`` is empty when
``param_dtype == compute_dtype`` (then ``state.params`` *is* the master).

How the primitives change:

- ``value_and_grad``: with fp16 the differentiated loss is ``loss × scale``;
  the returned loss is the unscaled one, bitwise (under `pipeline`, whose
  loss exists on its last stage only, ``(mean of loss × scale) / scale``:
  bitwise the same for the power-of-two scales of dynamic scaling). Gradients come back in the
  compute dtype (under `accumulate`, in its accumulation dtype: fp32 by
  default) and still *scaled* (as DeepSpeed's ``p.grad``): the step
  should hand them to ``state.apply_gradients`` unchanged.
- ``apply``: parameters, floating inputs and frozen parameters (and floating
  buffers with ``cast_buffers=True``) are cast to the compute dtype,
  floating outputs to the output dtype. Running statistics (BatchNorm's, in
  train mode) and any cast buffer whose version counter the forward bumped
  are written back into the module, in the module's dtype; inside
  `value_and_grad` in-place buffer updates are refused, as without mixed
  precision. A forward that writes into a *parameter* in place
  (``nn.Embedding(max_norm=...)``) is refused: the write would reach the
  compute copy only, never the master.
- ``apply_gradients``: gradients are cast to the master dtype and unscaled;
  the optimizer runs on the master (inner transforms and the optimizer see
  the master as ``state.params``) and hands back the compute copy it wrote
  (`zfunc.interpret.UpdateRequest`), or it is cast from the master.

fp16 loss scaling (DeepSpeed's ``fp16`` config and its DynamicLossScaler
semantics; the knobs are keyword arguments of `mixed_precision`):

- the scale starts at ``2 ** initial_scale_power``; ``loss_scale > 0`` makes
  it static instead (never changes, no minimum);
- a step whose unscaled gradients hold any inf/NaN is *skipped*: params,
  master, optimizer state and ``state.step`` stay as they were (``step``
  counts applied updates, so a schedule indexed by it, or by the optimizer's
  own count, does not advance on a skipped step, as DeepSpeed's lr scheduler
  does not). The count of non-finite elements goes through `zfunc.psum`, so
  under `shard` all ranks agree and skip together;
- overflow: if ``hysteresis_left > 1`` it is decremented (scale kept);
  otherwise the scale halves (not below ``min_loss_scale``) — and if the
  scale already *was* ``min_loss_scale`` a `FloatingPointError` is raised
  at the next use of the state the step returned (the step skipped);
- no overflow: ``good_steps`` counts good steps since the last overflow
  (before this one). When it is a positive multiple of
  ``loss_scale_window`` the scale doubles and ``hysteresis_left`` is
  refilled, i.e. the first doubling comes on the ``window + 1``-th
  consecutive good step, then every ``window`` steps (DeepSpeed's
  ``stable_interval`` rule); with ``consecutive_hysteresis=True`` every good
  step refills ``hysteresis_left``.

bf16 and fp32 policies have no loss scale (fixed 1): gradients are not
checked and nothing is skipped, exactly like the plain step (NaNs propagate).

Metrics gain ``loss_scale`` (the scale in the returned state, i.e. the one
the next step uses) and ``skipped`` (bool 0-d tensor). Skipping reads
nothing on the host: the update reads the flag on the device
(`zfunc.interpret.StepContext.skip_update_if`), unlike DeepSpeed, which reads
one scalar per fp16 step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from zfunc.autodiff import split_loss
from zfunc.compiled import tracing
from zfunc.interpret import Facts, Finding, Transform, UpdateRequest, Updated, current, psum
from zfunc.tree import tree_map, tree_map_tensors

DTypeName = Literal["fp32", "bf16", "fp16"]

_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CODES = {"fp32": 0, "bf16": 1, "fp16": 2}
_SCALING_CODES = {"none": 0, "static": 1, "dynamic": 2}
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_MAX_SCALE_POWER = 127  # the largest power of two float32 holds
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
    """Which dtype each kind of tensor has under `mixed_precision` (see the module doc).

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


_POLICY_MISMATCH = ("this state was made under another mixed-precision policy than this compiled step's; use the "
                    "step that made it, or build a fresh state with this step's init")


class MixedPrecisionState(NamedTuple):
    """``state.extras["mixed_precision"]``: the master copy and the loss scaler, as tensors."""

    master: dict[str, torch.Tensor]  # fp32 master params (empty if params are the master)
    loss_scale: torch.Tensor         # float32 0-d
    good_steps: torch.Tensor         # int64 0-d: good steps since the last overflow, before this one
    hysteresis_left: torch.Tensor    # int64 0-d: overflows tolerated before the scale drops
    skipped_steps: torch.Tensor      # int64 0-d: total skipped steps
    policy: torch.Tensor             # int64 (5,): param, compute, output, reduce dtype codes; scaling mode


class _StepInfo:
    """What one call of the transformed step shares between its handlers (per-call scratch)."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale
        self.skipped: torch.Tensor | None = None


class mixed_precision(Transform):  # noqa: N801 (a transform reads like a function)
    """Compute in a low-precision copy, update an fp32 master; dynamic loss scaling for fp16.

    ``policy``: ``"bf16"``, ``"fp16"``, ``"fp32"``, a jmp string or a `Policy`.
    Loss-scaling knobs (fp16 only; DeepSpeed's names and defaults):
    ``loss_scale`` (0 = dynamic, > 0 = that static scale),
    ``initial_scale_power`` (16: start at 2**16), ``loss_scale_window``
    (1000), ``hysteresis`` (2), ``min_loss_scale`` (1),
    ``consecutive_hysteresis`` (False). See the module doc for the rules.
    """

    name = "mixed_precision"
    level = 0

    def __init__(self, step: Callable, policy: str | Policy = "bf16", *, loss_scale: float = 0.0,
                 initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, consecutive_hysteresis: bool = False,
                 cast_buffers: bool = False) -> None:
        self.policy = Policy.parse(policy)
        if not isinstance(cast_buffers, bool):
            raise ValueError(f"cast_buffers must be True or False, got {cast_buffers!r}")
        fp16 = self.policy.compute_dtype == "fp16"
        if not (isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool)
                and 0 <= loss_scale <= _FLOAT32_MAX):
            raise ValueError(f"loss_scale must be 0 (dynamic) or a positive number that float32 holds (the scale's "
                             f"dtype, at most {_FLOAT32_MAX:.3g}), got {loss_scale!r}")
        if loss_scale and not fp16:
            raise ValueError(f"loss_scale applies to fp16 compute only; policy {self.policy.short()!r} computes "
                             f"in {self.policy.compute_dtype} and needs no loss scaling")
        for knob, value, low in (("initial_scale_power", initial_scale_power, 0),
                                 ("loss_scale_window", loss_scale_window, 1), ("hysteresis", hysteresis, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{knob} must be an int >= {low}, got {value!r}")
        if initial_scale_power > _MAX_SCALE_POWER:
            # 2**128 is inf in float32: every step would overflow and be skipped, and inf / 2 never reaches
            # min_loss_scale, so nothing would ever say so.
            raise ValueError(f"initial_scale_power must be at most {_MAX_SCALE_POWER} (2**{_MAX_SCALE_POWER + 1} "
                             f"is inf in float32, the loss scale's dtype), got {initial_scale_power}; DeepSpeed's "
                             "default is 16")
        if not (isinstance(min_loss_scale, (int, float)) and not isinstance(min_loss_scale, bool)
                and 0 < min_loss_scale <= _FLOAT32_MAX):
            raise ValueError(f"min_loss_scale must be a positive finite number, got {min_loss_scale!r}")
        if not isinstance(consecutive_hysteresis, bool):
            raise ValueError(f"consecutive_hysteresis must be True or False, got {consecutive_hysteresis!r}")
        if fp16 and not loss_scale and 2.0 ** initial_scale_power < min_loss_scale:
            raise ValueError(f"2**initial_scale_power = {2.0 ** initial_scale_power} is below "
                             f"min_loss_scale = {min_loss_scale}")
        super().__init__(step)
        self.loss_scale = float(loss_scale)
        self.initial_scale_power = initial_scale_power
        self.loss_scale_window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_loss_scale = float(min_loss_scale)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cast_buffers = cast_buffers
        # "dynamic", "static" or "none"
        self.scaling = ("static" if loss_scale else "dynamic") if fp16 else "none"

    @property
    def has_master(self) -> bool:
        return self.policy.param_dtype != self.policy.compute_dtype

    def declare(self, facts: Facts) -> Facts:
        pol = self.policy
        return facts.replace(compute_dtype=pol.compute, master_dtype=pol.param, reduce_dtype=pol.reduce,
                             loss_scaling=self.scaling)

    def _policy_codes(self, device) -> torch.Tensor | list[int]:
        """The codes of this policy: a tensor on ``device``; a list for ``device=None``."""
        pol = self.policy
        codes = [_CODES[pol.param_dtype], _CODES[pol.compute_dtype], _CODES[pol.output_dtype],
                 _CODES[pol.reduce_dtype], _SCALING_CODES[self.scaling]]
        return codes if device is None else torch.tensor(codes, dtype=torch.int64, device=device)

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy.short()}
        if self.scaling == "static":
            out["loss_scale"] = self.loss_scale
        elif self.scaling == "dynamic":
            out.update(initial_scale_power=self.initial_scale_power, loss_scale_window=self.loss_scale_window,
                       hysteresis=self.hysteresis, min_loss_scale=self.min_loss_scale)
            if self.consecutive_hysteresis:
                out["consecutive_hysteresis"] = True
        if self.cast_buffers:
            out["cast_buffers"] = True
        return out

    # -- layout ----------------------------------------------------------------
    def init_state(self, state):
        if self.name in state.extras:
            raise ValueError("mixed_precision.init: this state already has a master copy; pass the plain state "
                             "from TrainState.create")
        pol = self.policy
        params = state.params
        opt_state = state.opt_state
        if any(v.dtype != pol.param for v in params.values()):
            # The optimizer state was made for params of another dtype: rebuild it for the master.
            if int(state.step) != 0:
                raise ValueError(f"mixed_precision.init: params are not {pol.param_dtype} and the state has "
                                 "taken steps; its optimizer state cannot be converted. Start from TrainState.create")
            master_like = {k: v.to(pol.param) for k, v in params.items()}
            opt_state = state.tx.init(master_like)
        if self.has_master:
            master = {k: v.to(pol.param) for k, v in params.items()}
            new_params = {k: v.to(pol.compute) for k, v in master.items()}
        else:
            master = {}
            new_params = {k: v.to(pol.param) for k, v in params.items()}
        device = state.step.device
        scale = {"dynamic": 2.0 ** self.initial_scale_power, "static": self.loss_scale, "none": 1.0}[self.scaling]
        mp = MixedPrecisionState(
            master=master,
            loss_scale=torch.tensor(scale, dtype=torch.float32, device=device),
            good_steps=torch.zeros((), dtype=torch.int64, device=device),
            hysteresis_left=torch.tensor(self.hysteresis, dtype=torch.int64, device=device),
            skipped_steps=torch.zeros((), dtype=torch.int64, device=device),
            policy=self._policy_codes(device),
        )
        return state.replace(params=new_params, opt_state=opt_state, extras={**state.extras, self.name: mp})

    def copies(self, state) -> dict[str, torch.Tensor]:
        mp = state.extras.get(self.name) if isinstance(getattr(state, "extras", None), dict) else None
        if not isinstance(mp, MixedPrecisionState) or not mp.master:
            return {}
        out = {f"state.params[{k!r}]": v for k, v in state.params.items() if isinstance(v, torch.Tensor)}
        out.update((f"state.extras[{self.name!r}].master[{k!r}]", v) for k, v in mp.master.items())
        return out

    def copies_explained(self) -> str:
        return (f"Under {self!r}, state.params holds the {self.policy.compute_dtype} compute copy of the "
                f"{self.policy.param_dtype} master weights in state.extras[{self.name!r}].master; each step "
                "updates the master and writes the compute copy from it.")

    def _state_of(self, state) -> MixedPrecisionState:
        mp = state.extras.get(self.name) if isinstance(getattr(state, "extras", None), dict) else None
        if not isinstance(mp, MixedPrecisionState):
            raise ValueError("this state is not in mixed_precision's layout: call step.init(state) on the plain "
                             "state from TrainState.create first")
        if tracing():  # the codes are data to a compiled step: checked when it runs, not read on the host
            expected = self._policy_codes(mp.policy.device)
            torch._assert_async((mp.policy == expected).all(), _POLICY_MISMATCH)
            return mp
        codes = _host_codes(mp.policy)
        if codes != self._policy_codes(None):
            raise ValueError(
                f"this state was made under another mixed-precision policy ({describe_policy_codes(codes)}) than "
                "this step's "
                f"({self.policy.short()!r}, loss scaling {self.scaling}); running it would train with the wrong "
                "dtypes or loss scale. Use the step that made it, or build a fresh state with this step's init "
                "and copy the weights in (zfunc.io.restore(dir, like=step.init(...), strict=False)).")
        return mp

    def gather_params(self, state, next) -> dict[str, torch.Tensor]:
        mp = self._state_of(state)
        return next(state.replace(params=dict(mp.master)) if mp.master else state)

    # -- the step --------------------------------------------------------------
    def start(self, ctx, state) -> _StepInfo:
        return _StepInfo(self._state_of(state).loss_scale)

    def run(self, state, batch):
        mp = self._state_of(state)
        info: _StepInfo = self.call_scratch()
        new_state, metrics = self.step(state, batch)
        out = new_state.extras.get(self.name, mp) if isinstance(getattr(new_state, "extras", None), dict) else mp
        skipped = info.skipped if info.skipped is not None else torch.zeros((), dtype=torch.bool)
        return new_state, {**metrics, "loss_scale": out.loss_scale, "skipped": skipped}

    # -- primitives ------------------------------------------------------------
    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        if self.scaling == "none":
            return next(fn, params, args, kwargs, has_aux)
        scale = self.call_scratch().scale
        if current().facts.pp > 1:
            # Under `pipeline` the loss function runs micro-batch by micro-batch inside torch's schedule and its
            # value reaches the other stages by a broadcast of the differentiated loss; an aux (the unscaled
            # loss) would cost a host round trip per step. The loss is unscaled from that broadcast instead.
            def scaled_only(p, *a, **kw):
                loss, aux = split_loss(fn(p, *a, **kw), has_aux)
                return (loss * scale, aux) if has_aux else loss * scale

            value, grads = next(scaled_only, params, args, kwargs, has_aux)
            return ((value[0] / scale, value[1]) if has_aux else value / scale), grads

        def scaled_loss(p, *a, **kw):
            loss, aux = split_loss(fn(p, *a, **kw), has_aux)
            # The product is taken in fp32 (a 0-d fp16 loss times 2**16 would overflow fp16 itself).
            return loss * scale, (loss.detach(), aux)

        (_, (loss, aux)), grads = next(scaled_loss, params, args, kwargs, True)
        return ((loss, aux) if has_aux else loss), grads

    def apply(self, next, call):
        pol = self.policy
        compute, output = pol.compute, pol.output
        if compute == torch.float32 and output == torch.float32 and pol.param == torch.float32:
            return next(call)  # fp32: nothing to cast (bitwise the plain step)

        def cast_in(t):
            return t.to(compute) if t.is_floating_point() and t.dtype != compute else t

        params = call.params
        if any(isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != compute for v in params.values()):
            params = {k: cast_in(v) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
        # (A compiled step has no version counters to read: there the check is not made.)
        versions = {} if tracing() else {k: v._version for k, v in params.items() if isinstance(v, torch.Tensor)}
        with call.structure.lock:  # the module's slots are shared with other threads' calls
            constants, buffers = self._constants(call, compute)
        call = dataclasses.replace(call, params=params, args=tree_map_tensors(cast_in, call.args),
                                   kwargs=tree_map_tensors(cast_in, call.kwargs), constants=constants)
        try:
            out = next(call)
        except RuntimeError as err:
            self._explain_running_statistics(call, err)
            raise
        if versions:
            refuse_parameter_writes(params, versions, "mixed_precision keeps an fp32 master the write never reaches")
        with call.structure.lock:
            self._write_back_buffers(call, buffers)
        return tree_map_tensors(
            lambda t: t.to(output) if t.is_floating_point() and t.dtype != output else t, out)

    def _explain_running_statistics(self, call, err: RuntimeError) -> None:
        """Re-raise torch's dtype error from a norm whose running statistics stayed in their own dtype
        (``cast_buffers=False``) while its weight and input are in the compute dtype, saying what to pass."""
        text = str(err)
        if self.cast_buffers or not ("expected scalar type" in text or "same dtype" in text):
            return
        norms = [name for name, m in call.model.named_modules()
                 if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]
        if not norms:
            kept = [name for name, b in call.model.named_buffers() if b.is_floating_point() and b.dtype != self.policy.compute]
            if kept:
                raise RuntimeError(
                    f"{self!r}: the model computes with floating buffers that stay in their own dtype by default "
                    f"(cast_buffers=False: {', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''}), and one met "
                    f"a {self.policy.compute_dtype} tensor where torch needs one dtype. Pass cast_buffers=True (the "
                    "buffers are then used in the compute dtype, as the parameters are), or cast the buffer where "
                    f"the model uses it (buffer.to(x.dtype)). torch said: {text.splitlines()[0][:200]}") from err
            return
        raise RuntimeError(
            f"{self!r}: {type(call.model).__name__} has norms with running statistics ({', '.join(norms[:4])}"
            f"{' ...' if len(norms) > 4 else ''}), which stay in their own dtype by default (cast_buffers=False) "
            f"while their weight and input are {self.policy.compute_dtype}; torch cannot mix the two. Pass "
            "cast_buffers=True (running statistics then kept in the compute dtype and written back), or put "
            f"the norms in eval mode. torch said: {text.splitlines()[0][:200]}") from err

    @staticmethod
    def _write_back_buffers(call, buffers) -> None:
        for original, copy, version, running_stat in buffers:
            # Running statistics are updated in place without a version bump: write them back always.
            if running_stat or (version is not None and copy._version != version):
                try:
                    with torch.no_grad():
                        original.copy_(copy)
                except RuntimeError as err:
                    if "captured" not in str(err):
                        raise
                    raise RuntimeError(
                        f"{type(call.model).__name__} updates a buffer in place during its forward (e.g. "
                        "BatchNorm running statistics). Inside zf.value_and_grad the step is a pure function "
                        "and cannot mutate module state: put such modules in eval mode, use "
                        "track_running_stats=False, or a norm without running statistics.") from err

    def _constants(self, call, compute: torch.dtype):
        """Compute-dtype copies of the frozen parameters (and floating buffers with ``cast_buffers``),
        keyed by qualified name."""
        constants = dict(call.constants)
        buffers = []
        cast: dict[int, torch.Tensor] = {}
        for name, where, attr, is_buffer, norm in _constant_slots(call):
            if is_buffer and not self.cast_buffers:
                continue
            tensor = where.get(attr)
            source = constants.get(name, tensor)
            if source is None or not source.is_floating_point() or source.dtype == compute:
                continue
            if id(source) not in cast:
                cast[id(source)] = copy = source.detach().to(compute)
                if is_buffer and source is tensor:  # the module's own buffer: write in-place updates back
                    running = norm is not None and norm.training and norm.track_running_stats \
                        and attr in ("running_mean", "running_var")
                    buffers.append((tensor, copy, None if tracing() else copy._version, running))
            constants[name] = cast[id(source)]
        return constants, buffers

    def apply_gradients(self, next, state, grads, request):
        mp = self._state_of(state)
        master_dtype = self.policy.param
        if self.has_master:
            # Ask the update for the compute copy, written into the compute params themselves
            # where it can (a fused kernel does so in the same pass).
            request = request._replace(compute_dtype=self.policy.compute, compute_into=dict(state.params))
        if self.scaling == "none":
            if not mp.master:
                return next(state, {k: g.to(master_dtype) for k, g in grads.items()}, request)
            # Handed on as they are (the compute dtype, or `accumulate`'s fp32 sum): the optimizer's
            # update upcasts them exactly (`zfunc.state.pure_update`), and a fused kernel reads them
            # as they are, saving a full fp32 copy of the gradients.
            new = next(state.replace(params=dict(mp.master)), grads, request)
            return self._write_back(new, mp)

        info = self.call_scratch()
        scale = mp.loss_scale
        # Unscale into fresh master-dtype tensors (never in place into the caller's grads), except
        # `accumulate`'s own fp32 sums, which the update consumes in place (no copy of the accumulator).
        sink = current().grad_sink
        grads = {k: g if sink is not None and g.dtype == master_dtype and sink.owns(g)
                 else g.to(master_dtype, copy=True) for k, g in grads.items()}
        found = unscale_and_check_(list(grads.values()), scale)
        found = psum(found)  # all ranks see the same flag sum under shard, so they skip together
        overflow = found > 0
        new_mp, at_min = self._update_scale(mp, overflow)
        info.skipped = overflow
        skipped = Updated(state.replace(extras={**state.extras, self.name: new_mp}), None)
        if tracing():
            # torch.compile: no host read. The update is computed, and where it overflowed the state
            # keeps its old values (`where_tree`); the error at the minimum scale is raised when it runs.
            torch._assert_async(~at_min, self._at_min_message())
            applied = self._applied(next, state, grads, request, mp, new_mp)
            return Updated(where_tree(overflow, skipped.state, applied.state), applied.compute_copy)
        # No host read: the update is skipped on the device where it overflowed (params, master, optimizer
        # state and step stay; only the scaler moves), and the error at the minimum scale is raised at the
        # next use of the state (`zfunc.interpret.Finding`).
        ctx = current()
        ctx.skip_update_if(overflow)
        message = self._at_min_message()
        ctx.findings.append(Finding(at_min.to(torch.float32).reshape(1), lambda values, step: FloatingPointError(
            f"{message} (at the step given the state with step={step}; its update was skipped)")))
        return self._applied(next, state, grads, request, mp, new_mp)

    def _at_min_message(self) -> str:
        return (f"mixed_precision: gradients overflowed (inf/NaN) at the minimum loss scale "
                f"{self.min_loss_scale:g}; the loss scale cannot drop further. fp16's range is too small "
                "for this run: use policy 'bf16' (same memory, fp32's exponent range), or lower "
                "min_loss_scale; a NaN at every step may also come from the model or the data "
                "(check the loss).")

    def _applied(self, next, state, grads, request, mp: MixedPrecisionState, new_mp: MixedPrecisionState) -> Updated:
        """The update of a step that did not overflow (fp16)."""
        if not mp.master:
            new = next(state, grads, request)
            return Updated(new.state.replace(extras={**new.state.extras, self.name: new_mp}), new.compute_copy)
        return self._write_back(next(state.replace(params=dict(mp.master)), grads, request), new_mp)

    def _write_back(self, new: Updated, mp: MixedPrecisionState) -> Updated:
        """``new`` came back from the optimizer holding the master as params: the compute copy it
        wrote (or a cast of the master) becomes ``params``."""
        master = dict(new.state.params)
        copy = new.compute_copy
        if copy is None:
            copy = {k: v.to(self.policy.compute) for k, v in master.items()}
        # (Built, not ``mp._replace``: torch 2.11's dynamo returns what ``_replace`` makes in a trace as an
        # empty tuple, and the next call recompiles on its length.)
        mp = MixedPrecisionState(master, mp.loss_scale, mp.good_steps, mp.hysteresis_left, mp.skipped_steps,
                                 mp.policy)
        state = new.state.replace(params=copy, extras={**new.state.extras, self.name: mp})
        return Updated(state, None)

    def _update_scale(self, mp: MixedPrecisionState, overflow: torch.Tensor):
        """The scaler after a step (branch-free), and whether an overflow hit the minimum scale."""
        skipped_steps = mp.skipped_steps + overflow.to(torch.int64)
        if self.scaling == "static":
            return (MixedPrecisionState(mp.master, mp.loss_scale, mp.good_steps, mp.hysteresis_left, skipped_steps,
                                        mp.policy), torch.zeros((), dtype=torch.bool))  # (not _replace: see above)
        scale, good, hyst = mp.loss_scale, mp.good_steps, mp.hysteresis_left
        exhausted = hyst <= 1
        drop = overflow & exhausted
        at_min = drop & (scale <= self.min_loss_scale)
        grow = ~overflow & (good > 0) & (good % self.loss_scale_window == 0)
        new_scale = torch.where(drop, torch.clamp(scale / 2, min=self.min_loss_scale),
                                torch.where(grow, scale * 2, scale))
        full = torch.full_like(hyst, self.hysteresis)
        on_overflow = torch.where(exhausted, hyst, hyst - 1)
        on_good = full if self.consecutive_hysteresis else torch.where(grow, full, hyst)
        new_hyst = torch.where(overflow, on_overflow, on_good)
        new_good = torch.where(overflow, torch.zeros_like(good), good + 1)
        return MixedPrecisionState(mp.master, new_scale, new_good, new_hyst, skipped_steps, mp.policy), at_min


def _host_codes(policy: torch.Tensor) -> list[int]:
    """A state's policy codes on the host: read once per tensor (again after an in-place write to it, e.g. a
    restore), not at every step, where the read would wait for the GPU to drain its queue."""
    seen = getattr(policy, "_zfunc_codes", None)
    if seen is None or seen[0] != policy._version:
        seen = (policy._version, policy.tolist())
        policy._zfunc_codes = seen
    return seen[1]


def describe_policy_codes(codes: list[int]) -> str:
    """A `MixedPrecisionState.policy`'s codes in words ("params=float32, compute=bfloat16, ...")."""
    if len(codes) != 5:
        return f"codes {codes}"
    names = {v: k for k, v in _CODES.items()}
    modes = {v: k for k, v in _SCALING_CODES.items()}
    return (f"params={names.get(codes[0])}, compute={names.get(codes[1])}, output={names.get(codes[2])}, "
            f"reduce={names.get(codes[3])}, loss scaling {modes.get(codes[4])}")


def where_tree(condition: torch.Tensor, if_true: Any, if_false: Any) -> Any:
    """Leaf-wise ``torch.where(condition, a, b)`` over two states (or trees) of one structure (other
    leaves from ``if_false``): the branch-free form of "skip this update" in a compiled step."""
    def pick(a, b):
        return tree_map(lambda x, y: torch.where(condition, x, y) if isinstance(y, torch.Tensor) else y, a, b)

    if hasattr(if_false, "opt_state"):  # a TrainState: field by field (its static fields are shared)
        return if_false.replace(step=pick(if_true.step, if_false.step), params=pick(if_true.params, if_false.params),
                                opt_state=pick(if_true.opt_state, if_false.opt_state),
                                extras=pick(if_true.extras, if_false.extras))
    return pick(if_true, if_false)


def unscale_and_check_(grads: list[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """``g ← g / scale`` in place for every gradient; returns 1.0 if any element is inf/NaN, else 0.0.

    One multi-tensor pass per device and dtype (torch's fused
    ``_amp_foreach_non_finite_check_and_unscale_``, what GradScaler runs)
    instead of a division and a count per tensor.
    """
    found = torch.zeros((), dtype=torch.float32, device=scale.device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in groups.items():
        found_here = torch.zeros(1, dtype=torch.float32, device=device)
        inverse = (1.0 / scale.to(device=device, dtype=torch.float32)).reshape(1)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inverse)
        found = torch.maximum(found, found_here.to(found.device).reshape(()))
    return found


def refuse_parameter_writes(params: dict, versions: dict, why: str) -> None:
    """Raise if the forward wrote into one of ``params`` in place (its version counter moved)."""
    for k, v in params.items():
        if isinstance(v, torch.Tensor) and v._version != versions.get(k, v._version):
            raise RuntimeError(
                f"the model's forward wrote into parameter {k!r} in place (e.g. nn.Embedding(max_norm=...) "
                f"renormalizes its weight during forward), but here the model runs on a copy of it: {why}, so "
                "the change would be lost and training would silently diverge from eager PyTorch. Make the "
                "forward pure (renormalize functionally, e.g. F.embedding(..., max_norm=None) and scale the "
                "rows yourself) or run without this transform.")


def _constant_slots(call) -> list[tuple[str, dict, str, bool, Any]]:
    """Where the model's frozen parameters and buffers live: (name, the owner's ``_parameters`` or
    ``_buffers``, attribute, is a buffer, the owner if it is a batch norm).

    Found once per model (kept in the model's `ModelStructure`) rather than by walking every module
    of the model on every forward: the tensors are read from these slots at each call, so a buffer
    the module replaced (``.to()``) is still the one cast.
    """
    slots = call.structure.constant_slots
    if slots is None:
        slots = []
        for prefix, module in call.model.named_modules(remove_duplicate=False):
            norm = module if isinstance(module, nn.modules.batchnorm._NormBase) else None
            head = f"{prefix}." if prefix else ""
            slots += [(head + attr, module._parameters, attr, False, None)
                      for attr, p in module._parameters.items() if p is not None and not p.requires_grad]
            slots += [(head + attr, module._buffers, attr, True, norm) for attr in module._buffers]
        if not tracing():  # (a store while torch.compile traces would cost a recompile: `zfunc.compiled`)
            call.structure.constant_slots = slots
    return slots

