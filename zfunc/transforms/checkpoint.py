"""`checkpoint`: activation checkpointing (recompute blocks in backward) as a transform.

``checkpoint(step, modules=None, policy="recompute")``: the activations inside
each chosen block are not kept from the forward pass; the block is re-run in
backward (`zfunc.recompute`: under `zfunc.value_and_grad` the ordinary graph
with its saved tensors dropped and recomputed, `zfunc.recompute_eager`; inside
`torch.func` transforms, where saved-tensor hooks are refused, an
``autograd.Function``). The RNG state is replayed, so dropout masks
are the same in the recompute: the step computes exactly what the plain step
computes.

Blocks (``modules``), resolved by `zfunc.blocks.select_blocks`:

- ``None``: the model's blocks, `zfunc.blocks.find_blocks` (the children
  of its outermost ``ModuleList``/``Sequential`` containers, a transformer's
  layers; the same blocks `shard` makes its units of);
- a module class or tuple of classes: every outermost sub-module of that type;
- a predicate ``name -> bool`` on qualified names;
- a list of qualified names.

Names nested inside another chosen block are dropped (the outer block's
recompute covers them). Selecting nothing raises.

Policies (a string or one of the small dataclasses below):

==================  ===========================================================
``"recompute"``     keep only each block's inputs (and its parameters, which
                    are alive anyway); recompute everything in backward
``"save_ops"``      `SaveOps`: also keep the outputs of chosen ops (default:
                    the matmuls ``mm``, ``addmm``, ``bmm``, ``baddbmm``, like
                    JAX's ``checkpoint_policies.dots_saveable``); the recompute
                    replays them instead of recomputing them, so backward
                    re-runs only the cheap element-wise work
``"offload_inputs"``  `OffloadInputs`: the kept block inputs are moved to host
                    memory after forward and back before the recompute
                    (DeepSpeed's ``cpu_checkpointing``); on a CPU-only run the
                    inputs are already on the host and stay where they are
==================  ===========================================================

How `SaveOps` works: eagerly, through torch's selective activation
checkpointing (the chosen ops' outputs are kept, everything else is
recomputed). Inside a `torch.func` transform, where that is refused, the
block runs under a `TorchDispatchMode` that records the outputs of the chosen
aten ops (below autograd, so the recording sees plain tensors). In the
recompute the same mode hands back the recorded output instead of running
the op; autograd above it still records the op's own backward (which needs
the op's inputs, recomputed, not its output), so gradients are exact. Each
recorded op is matched by position and by its input shapes and dtypes; a
mismatch (a forward that took another path in the recompute) falls back to
computing, so a divergence costs time, never correctness. An output that the
forward later modified in place is not replayed. Metrics gain
``save_ops_replayed`` and ``save_ops_recomputed`` (ops of the chosen kinds
replayed from the forward, and recomputed).

A block in which a BatchNorm in training mode updates its running statistics
is refused: the recompute would update them a second time.

Composition: the wrappers are of kind ``"around"``, so under
``shard(stage=3)`` they wrap shard's gathering wrappers and the recompute
re-gathers the block's parameters in backward (one recompute, not two: shard
only asks for a recompute where no "around" wrapper exists). Under
`mixed_precision` the block runs on the compute-dtype copy; with
`accumulate` every micro-batch is checkpointed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zfunc.autodiff import under_torch_func_or_compile
from zfunc.blocks import select_blocks
from zfunc.facts import Facts
from zfunc.interpret import Transform
from zfunc.recompute import host_copy, kept_for_backward, recompute, refuse_running_statistics
from zfunc.tree import tree_leaves

# --------------------------------------------------------------------------
# Policies


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Keep each block's inputs only; recompute the whole block in backward."""

    def __str__(self) -> str:
        return "recompute"


@dataclasses.dataclass(frozen=True)
class SaveOps:
    """Keep the outputs of the named aten ops (default: matmuls); recompute the rest.

    ``ops``: aten op names (``"mm"``, ``"aten.addmm"``, ``"_scaled_dot_product_flash_attention"``,
    ...) or ``torch.ops.aten`` op(overload) objects.
    """

    ops: tuple = ("mm", "addmm", "bmm", "baddbmm")

    def __post_init__(self) -> None:
        ops = (self.ops,) if isinstance(self.ops, (str, torch._ops.OpOverloadPacket, torch._ops.OpOverload)) \
            else tuple(self.ops)
        if not ops:
            raise ValueError("SaveOps(ops=...) needs at least one op name")
        object.__setattr__(self, "ops", ops)
        self.packets()  # validate now

    def packets(self) -> frozenset:
        found = set()
        for op in self.ops:
            if isinstance(op, torch._ops.OpOverload):
                op = op.overloadpacket
            if isinstance(op, torch._ops.OpOverloadPacket):
                found.add(op)
                continue
            if not isinstance(op, str):
                raise TypeError(f"SaveOps ops must be aten op names or torch.ops.aten ops, got {op!r}")
            name = op.removeprefix("torch.ops.").removeprefix("aten.").removeprefix("aten::").split(".")[0]
            packet = getattr(torch.ops.aten, name, None) if name else None
            if not isinstance(packet, torch._ops.OpOverloadPacket):
                raise ValueError(f"SaveOps: {op!r} is not an aten op (e.g. 'mm', 'addmm', 'bmm')")
            found.add(packet)
        return frozenset(found)

    def __str__(self) -> str:
        return "save_ops" if self == SaveOps() else f"save_ops{self.ops!r}"


@dataclasses.dataclass(frozen=True)
class OffloadInputs:
    """Move the kept block inputs to host memory between forward and backward.

    ``pin_memory``: copy into page-locked host buffers (asynchronous copies),
    used only when the inputs are on an accelerator.
    """

    pin_memory: bool = True

    def __str__(self) -> str:
        return "offload_inputs"


CheckpointPolicy = Recompute | SaveOps | OffloadInputs
_BY_NAME: dict[str, Callable[[], Any]] = {"recompute": Recompute, "save_ops": SaveOps, "offload_inputs": OffloadInputs}


def parse_policy(policy: Any) -> Recompute | SaveOps | OffloadInputs:
    """A policy string (``"recompute"``, ``"save_ops"``, ``"offload_inputs"``) or dataclass."""
    if isinstance(policy, (Recompute, SaveOps, OffloadInputs)):
        return policy
    if isinstance(policy, str) and policy in _BY_NAME:
        return _BY_NAME[policy]()
    raise ValueError(f"checkpoint: unknown policy {policy!r}; use one of {sorted(_BY_NAME)} or "
                     "Recompute(), SaveOps(ops=...), OffloadInputs()")


# --------------------------------------------------------------------------
# The transform


class _Counts:
    """One step's SaveOps counters (per-call scratch): chosen ops replayed and recomputed."""

    def __init__(self) -> None:
        self.replayed = 0
        self.recomputed = 0


class checkpoint(Transform):  # noqa: N801 (a transform reads like a function)
    """Recompute the chosen blocks in backward instead of keeping their activations.

    Args:
      step: the step to transform.
      modules: which blocks (see the module doc); default the model's blocks.
      policy: "recompute", "save_ops", "offload_inputs" or one of the policy dataclasses.
    """

    name = "checkpoint"
    level = 0

    def __init__(self, step: Callable, modules: Any = None, policy: Any = "recompute") -> None:
        _check_modules(modules)
        self.policy = parse_policy(policy)
        super().__init__(step)
        self.modules = modules
        self._save_ops = self.policy.packets() if isinstance(self.policy, SaveOps) else frozenset()

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.modules is not None:
            out["modules"] = self.modules
        out["policy"] = str(self.policy)
        return out

    def declare(self, facts: Facts) -> Facts:
        return facts.replace(recompute=True)

    def start(self, ctx, state) -> _Counts:
        return _Counts()

    def run(self, state, batch):
        counts: _Counts = self.call_scratch()
        new_state, metrics = self.step(state, batch)
        if isinstance(self.policy, SaveOps):
            metrics = {**metrics, "save_ops_replayed": counts.replayed, "save_ops_recomputed": counts.recomputed}
        return new_state, metrics

    def blocks(self, model: nn.Module, structure=None) -> list[str]:
        """The qualified names of ``model``'s blocks this transform recomputes."""
        try:
            chosen = structure.select(self.modules) if structure is not None else select_blocks(model, self.modules)
        except AttributeError as err:
            raise ValueError(f"checkpoint(modules={self.modules!r}): {err}") from None
        chosen = sorted(set(chosen), key=chosen.index)
        for n in chosen:
            if isinstance(model.get_submodule(n), (nn.ModuleList, nn.ModuleDict)):
                raise ValueError(
                    f"checkpoint: {n!r} is a {type(model.get_submodule(n)).__name__}, a container that is "
                    f"never called; select the blocks in it instead (e.g. modules=['{n}.0', ...] or their class)")
        names = [n for n in chosen if not any(n.startswith(o + ".") for o in chosen if o != n)]
        if not names:
            hint = ("it has no ModuleList/Sequential of repeated blocks; pass modules= (classes, a "
                    "predicate on names, or a list of names)") if self.modules is None else "nothing matched"
            raise ValueError(f"checkpoint found no blocks to recompute in {type(model).__name__}: {hint}")
        return names

    def apply(self, next, call):
        counts: _Counts = self.call_scratch()
        for name in self._blocks_of(call):
            refuse_running_statistics(call.structure.submodules_of_type(name, nn.modules.batchnorm._NormBase),
                                      "checkpoint", "leave this block out of modules=")
            call.wrap_block(name, lambda n, body: self._wrapper(body, counts), kind="around")
        return next(call)

    def _blocks_of(self, call) -> list[str]:
        """`blocks` of the call's model, found once per model and choice of modules (kept by the model's
        `zfunc.model_structure.ModelStructure.derived`) rather than at every call."""
        chosen = tuple(self.modules) if isinstance(self.modules, list) else self.modules
        found = call.structure.derived("checkpoint.blocks", self,
                                       lambda: (chosen, self.blocks(call.model, call.structure)))
        if found[0] != chosen:  # (a list of names changed since: found again)
            return self.blocks(call.model, call.structure)
        return found[1]

    def _wrapper(self, body: Callable, counts: _Counts) -> Callable:
        policy = self.policy
        if isinstance(policy, SaveOps):
            def saving_body(block_params, *args, **kwargs):
                if under_torch_func_or_compile():
                    return recompute(_Replay(body, self._save_ops, counts), block_params, *args, **kwargs)
                return recompute(body, block_params, *args, context_fn=_selective(self._save_ops, counts),
                                 **kwargs)
            return saving_body
        if isinstance(policy, OffloadInputs):
            def offloading_body(block_params, *args, **kwargs):
                save = _host_saver(len(block_params), policy.pin_memory)
                return recompute(body, block_params, *args, save=save, inputs_to_host=policy.pin_memory, **kwargs)
            return offloading_body

        def recomputed_body(block_params, *args, **kwargs):
            return recompute(body, block_params, *args, **kwargs)
        return recomputed_body


def _selective(ops: frozenset, counts: _Counts) -> Callable:
    """torch's selective-checkpoint contexts keeping the outputs of ``ops`` (counted as replayed)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: PLC0415

    def policy(ctx, op, *args, **kwargs):
        if op.overloadpacket in ops:
            if not ctx.is_recompute:  # kept now, so the recompute takes it instead of running the op
                counts.replayed += 1
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


def _check_modules(modules: Any) -> None:
    """The forms `select_blocks` accepts (checked now, resolved against the model at the first call)."""
    if modules is None or isinstance(modules, type):
        return
    if isinstance(modules, (list, tuple)) and modules:
        if all(isinstance(m, str) for m in modules):
            return
        if isinstance(modules, tuple) and all(isinstance(m, type) for m in modules):
            return
        if all(isinstance(m, type) for m in modules):
            raise TypeError("checkpoint: pass module classes as a class or a tuple of classes, not a list")
    elif callable(modules) and not isinstance(modules, (str, nn.Module)):
        return
    raise TypeError("checkpoint: modules must be None, a module class (or tuple of classes), a predicate on "
                    f"qualified names, or a non-empty list of names; got {modules!r}")


# --------------------------------------------------------------------------
# SaveOps: record op outputs in forward, replay them in the recompute


class _Replay:
    """A block body that records chosen op outputs on its first run and replays them afterwards.

    One instance per block call (each forward of a block gets its own record).
    """

    def __init__(self, body: Callable, ops: frozenset, counts: _Counts) -> None:
        self.body, self.ops, self.counts = body, ops, counts
        self.records: list[list] | None = None  # [(func, input signature), output, its version]

    def __call__(self, block_params, *args, **kwargs):
        if self.records is None:  # the forward
            records: list[list] = []
            with _OpMode(self, records, replay=False):
                out = self.body(block_params, *args, **kwargs)
            # An output that the forward later changed in place holds another value now: do not replay it.
            for rec in records:
                if rec[1] is not None and rec[1]._version != rec[2]:
                    rec[1] = None
            self.records = records
            return out
        with _OpMode(self, self.records, replay=True):
            return self.body(block_params, *args, **kwargs)


def _signature(args, kwargs) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor))


class _OpMode(TorchDispatchMode):
    def __init__(self, replay_body: _Replay, records: list, replay: bool) -> None:
        super().__init__()
        self.owner, self.records, self.replay = replay_body, records, replay
        self.index = 0
        self.diverged = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in self.owner.ops:
            return func(*args, **kwargs)
        signature = (func, _signature(args, kwargs))
        if not self.replay:
            out = func(*args, **kwargs)
            kept = out if isinstance(out, torch.Tensor) else None
            if kept is not None:
                kept_for_backward(kept)
            self.records.append([signature, kept, kept._version if kept is not None else 0])
            return out
        counts = self.owner.counts
        if not self.diverged and self.index < len(self.records):
            rec = self.records[self.index]
            self.index += 1
            if rec[0] == signature:
                saved, rec[1] = rec[1], None  # each record replays once; free it as we go
                if saved is not None:
                    counts.replayed += 1
                    return saved.detach()  # a fresh alias: autograd attaches the op's history to it
            else:
                self.diverged = True
        else:
            self.diverged = True
        counts.recomputed += 1
        return func(*args, **kwargs)


# --------------------------------------------------------------------------
# OffloadInputs: recompute's save= hook


def _host_saver(num_params: int, pin_memory: bool) -> Callable:
    """A ``save`` hook for `recompute` that keeps the parameters and moves the other inputs to host.

    Under a `torch.func` transform ``save`` is called once per functorch
    level with the same values; the host copies of the first call are
    reused, so each input crosses to the host once. Loading releases them:
    what a ctx holds as attributes (unlike ``save_for_backward``) would
    otherwise live until the whole graph is freed, after backward.
    """
    cache: dict[str, list] = {}

    def save(tensors: tuple):
        params, inputs = tensors[:num_params], tensors[num_params:]
        if "host" not in cache:
            cache["host"] = [_to_host(t, pin_memory) for t in inputs]
        devices = [t.device for t in inputs]
        stash = [params, cache["host"]]

        def load(stored: list) -> tuple:
            kept, host = stored
            if kept is None:
                raise RuntimeError("checkpoint(policy='offload_inputs'): a second backward through a block "
                                   "whose offloaded inputs were released by the first (retain_graph is not "
                                   "supported with this policy)")
            stored[0] = stored[1] = None
            cache.clear()
            return _load(kept, host, devices)

        return stash, load

    return save


def _to_host(t: torch.Tensor, pin_memory: bool):
    if t.device.type == "cpu":
        # Already in host memory: keep it (no copy), but remember its version to catch in-place edits.
        return (t, t._version)
    return (host_copy(t.detach(), pin_memory), None)


def _load(params: tuple, host: list, devices: list) -> tuple:
    out = []
    for (t, version), device in zip(host, devices):
        if version is not None:
            if t._version != version:
                raise RuntimeError("checkpoint(policy='offload_inputs'): a block input was modified in place "
                                   "between forward and backward; the recompute would see other values")
            out.append(t)
        else:
            out.append(t.to(device, non_blocking=True))
    return (*params, *out)
