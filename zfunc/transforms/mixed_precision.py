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
  (`zfunc.primitives.UpdateRequest`), or it is cast from the master.

fp16 loss scaling follows DeepSpeed's ``fp16`` config and its
DynamicLossScaler (the knobs are keyword arguments of `mixed_precision`): the
scale starts at ``2 ** initial_scale_power`` (``loss_scale > 0``: static), a
step whose unscaled gradients hold any inf/NaN is *skipped* on every rank
(params, master, optimizer state and ``state.step`` stay), the scale halves on
overflow after ``hysteresis`` overflows and doubles after
``loss_scale_window`` good steps; an overflow at ``min_loss_scale`` raises a
`FloatingPointError` at the next use of the state. `zfunc.transforms.loss_scale`
states the rules and their arithmetic.

bf16 and fp32 policies have no loss scale (fixed 1): gradients are not
checked and nothing is skipped, exactly like the plain step (NaNs propagate).

Metrics gain ``loss_scale`` (the scale in the returned state, i.e. the one
the next step uses) and ``skipped`` (bool 0-d tensor). Skipping reads
nothing on the host: the update reads the flag on the device
(`zfunc.step_context.StepContext.skip_update_if`), unlike DeepSpeed, which reads
one scalar per fp16 step.

Where the parts live: the policy and the state's layout
(`zfunc.transforms.mixed_precision_policy`), the loss scaler
(`zfunc.transforms.loss_scale`), one model call in the compute dtype
(`zfunc.transforms.mixed_precision_cast`); this module is the transform, which
keeps the master and the compute copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zfunc.autodiff import split_loss
from zfunc.compiled import tracing
from zfunc.donation import Finding
from zfunc.facts import Facts
from zfunc.interpret import Transform
from zfunc.primitives import Updated, psum
from zfunc.step_context import current
from zfunc.transforms.loss_scale import LossScaler, ScalingMode, unscale_and_check_
from zfunc.transforms.mixed_precision_cast import run_in_compute_dtype
from zfunc.transforms.mixed_precision_policy import (  # noqa: F401 (describe_policy_codes: zfunc.io reads it here)
    MixedPrecisionState,
    Policy,
    check_policy_codes,
    describe_policy_codes,
    policy_codes,
)
from zfunc.tree import read_in_c


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
        self.scaler = LossScaler.for_policy(
            self.policy, loss_scale=loss_scale, initial_scale_power=initial_scale_power,
            loss_scale_window=loss_scale_window, hysteresis=hysteresis, min_loss_scale=min_loss_scale,
            consecutive_hysteresis=consecutive_hysteresis)
        super().__init__(step)
        self.cast_buffers = cast_buffers

    @property
    def scaling(self) -> ScalingMode:
        """The loss-scaling mode: "dynamic", "static" (fp16) or "none"."""
        return self.scaler.mode

    @property
    def has_master(self) -> bool:
        return self.policy.param_dtype != self.policy.compute_dtype

    def declare(self, facts: Facts) -> Facts:
        pol = self.policy
        return facts.replace(compute_dtype=pol.compute, master_dtype=pol.param, reduce_dtype=pol.reduce,
                             loss_scaling=self.scaling)

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy.short(), **self.scaler.settings()}
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
        mp = MixedPrecisionState(
            master=master,
            loss_scale=torch.tensor(self.scaler.initial(), dtype=torch.float32, device=device),
            good_steps=torch.zeros((), dtype=torch.int64, device=device),
            hysteresis_left=torch.tensor(self.scaler.hysteresis, dtype=torch.int64, device=device),
            skipped_steps=torch.zeros((), dtype=torch.int64, device=device),
            policy=policy_codes(pol, self.scaling, device),
        )
        return state.replace(params=new_params, opt_state=opt_state, extras={**state.extras, self.name: mp})

    def copied(self, state) -> tuple[tuple, list[torch.Tensor]]:
        mp = state.extras.get(self.name) if isinstance(getattr(state, "extras", None), dict) else None
        if not isinstance(mp, MixedPrecisionState) or not mp.master:
            return (), []
        params = state.params
        compute = list(params.values())
        if read_in_c(compute):  # (the common case, read in C: this runs for every parameter per step)
            keys = tuple(params)
        else:
            keys = tuple(k for k, v in params.items() if isinstance(v, torch.Tensor))
            compute = [params[k] for k in keys]
        return (keys, tuple(mp.master)), compute + list(mp.master.values())

    def copies_held_in(self, state) -> tuple[dict, ...]:
        mp = state.extras.get(self.name) if isinstance(getattr(state, "extras", None), dict) else None
        if not isinstance(mp, MixedPrecisionState) or not mp.master:
            return ()
        return state.params, mp.master

    @classmethod
    def copy_names(cls, key: tuple) -> list[str]:
        compute, master = key
        return [*(f"state.params[{k!r}]" for k in compute), *(f"state.extras[{cls.name!r}].master[{k!r}]" for k in master)]

    def copies_explained(self) -> str:
        return (f"Under {self!r}, state.params holds the {self.policy.compute_dtype} compute copy of the "
                f"{self.policy.param_dtype} master weights in state.extras[{self.name!r}].master; each step "
                "updates the master and writes the compute copy from it.")

    def _state_of(self, state) -> MixedPrecisionState:
        mp = state.extras.get(self.name) if isinstance(getattr(state, "extras", None), dict) else None
        if not isinstance(mp, MixedPrecisionState):
            raise ValueError("this state is not in mixed_precision's layout: call step.init(state) on the plain "
                             "state from TrainState.create first")
        check_policy_codes(mp.policy, self.policy, self.scaling)
        return mp

    def gather_params(self, state, next) -> dict[str, torch.Tensor]:
        mp = self._state_of(state)
        return next(state.replace(params={**mp.master}) if mp.master else state)

    # -- the step --------------------------------------------------------------
    def start(self, ctx, state) -> _StepInfo:
        return _StepInfo(self._state_of(state).loss_scale)

    def run(self, state, batch):
        mp = self._state_of(state)
        info: _StepInfo = self.call_scratch()
        new_state, metrics = self.step(state, batch)
        out = new_state.extras.get(self.name, mp) if isinstance(getattr(new_state, "extras", None), dict) else mp
        # (On the scale's device: a host tensor in a compiled GPU step costs a C++ kernel and its build, a minute.)
        skipped = (info.skipped if info.skipped is not None
                   else torch.zeros((), dtype=torch.bool, device=out.loss_scale.device))
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
        return run_in_compute_dtype(next, call, self.policy, self.cast_buffers, self)

    def apply_gradients(self, next, state, grads, request):
        mp = self._state_of(state)
        master_dtype = self.policy.param
        if request.grads_landing is not None and not (self.scaling == "none" and mp.master):
            request.grads_landing.wait_all()  # (read here, on the host: cast or unscaled; `UpdateRequest`)
            request = request._replace(grads_landing=None)
        if self.has_master:
            # Ask the update for the compute copy, written into the compute params themselves
            # where it can (a fused kernel does so in the same pass). (The state's own dicts, here and as the
            # master below, not copies: nothing changes a dict it is handed, and the fused update finds the
            # very dicts of the step before by their version tags, `zfunc.optim.fused_plan`.)
            request = request._replace(compute_dtype=self.policy.compute, compute_into=state.params)
        if self.scaling == "none":
            if not mp.master:
                return next(state, {k: g.to(master_dtype) for k, g in grads.items()}, request)
            # Handed on as they are (the compute dtype, or `accumulate`'s fp32 sum): the optimizer's
            # update upcasts them exactly (`zfunc.state.pure_update`), and a fused kernel reads them
            # as they are, saving a full fp32 copy of the gradients.
            new = next(state.replace(params=mp.master), grads, request)
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
        new_mp, at_min = self._scaled(mp, overflow)
        info.skipped = overflow
        # No host read: the update is skipped on the device where it overflowed (params, master, optimizer
        # state and step stay; only the scaler moves: branch-free, `torch.where` in the update), and the error
        # at the minimum scale is raised at the next use of the state (`zfunc.donation.Finding`; in a compiled
        # step, by the graph itself when it runs).
        ctx = current()
        ctx.skip_update_if(overflow)
        if tracing():
            torch._assert_async(~at_min, self.scaler.at_min_message())
            return self._applied(next, state, grads, request, mp, new_mp)
        message = self.scaler.at_min_message()
        ctx.findings.append(Finding(at_min.to(torch.float64).reshape(1), lambda values, step: FloatingPointError(
            f"{message} (at the step given the state with step={step}; its update was skipped)")))
        return self._applied(next, state, grads, request, mp, new_mp)

    def _applied(self, next, state, grads, request, mp: MixedPrecisionState, new_mp: MixedPrecisionState) -> Updated:
        """The update of a step that did not overflow (fp16)."""
        if not mp.master:
            new = next(state, grads, request)
            return Updated(new.state.replace(extras={**new.state.extras, self.name: new_mp}), new.compute_copy)
        return self._write_back(next(state.replace(params=mp.master), grads, request), new_mp)

    def _write_back(self, new: Updated, mp: MixedPrecisionState) -> Updated:
        """``new`` came back from the optimizer holding the master as params: the compute copy it
        wrote (or a cast of the master) becomes ``params``. (The dicts as the update returned them: the fused
        update hands back the very dicts it was given, whose tensors it wrote in place.)"""
        master = new.state.params
        copy = new.compute_copy
        if copy is None:
            copy = {k: v.to(self.policy.compute) for k, v in master.items()}
        # (Built, not ``mp._replace``: torch 2.11's dynamo returns what ``_replace`` makes in a trace as an
        # empty tuple, and the next call recompiles on its length.)
        mp = MixedPrecisionState(master, mp.loss_scale, mp.good_steps, mp.hysteresis_left, mp.skipped_steps,
                                 mp.policy)
        state = new.state.replace(params=copy, extras={**new.state.extras, self.name: mp})
        return Updated(state, None)

    def _scaled(self, mp: MixedPrecisionState, overflow: torch.Tensor) -> tuple[MixedPrecisionState, torch.Tensor]:
        """The state's scaler after a step (`LossScaler.update`, branch-free), and whether an overflow hit the
        minimum scale."""
        skipped_steps = mp.skipped_steps + overflow.to(torch.int64)
        scale, good, hysteresis, at_min = self.scaler.update(mp.loss_scale, mp.good_steps, mp.hysteresis_left,
                                                             overflow)
        # (Built, not ``mp._replace``: see `_write_back`.)
        return MixedPrecisionState(mp.master, scale, good, hysteresis, skipped_steps, mp.policy), at_min

