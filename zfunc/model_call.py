"""One call of a functional model, and how it runs.

A `ModelCall` is what the ``apply`` primitive carries through the transforms
(the module, the params and arguments, the block wrappers transforms add);
`run_model_call` is the plain implementation at the bottom of the stack: the
module run with its params swapped in, each wrapped block's ``forward`` routed
through its wrappers (`_BlockOverride`, handed the block's calls by its
`zfunc.model_structure.BlockDispatch`). What depends only on the module is
found once, in `zfunc.model_structure.ModelStructure`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Literal

import torch
from torch import nn

from zfunc.compiled import dict_of, init_fields, replaced, tracing
from zfunc.data_access import ParamsWatch
from zfunc.interpret import current
from zfunc.model_structure import ModelStructure, OutsideItsBlock
from zfunc.params_check import check_shapes_and_dtypes
from zfunc.recompute import recompute
from zfunc.reparametrize import swapped

# A block body runs one sub-module on its (local-named) trainable params:
#     body(block_params: dict[str, Tensor], *args, **kwargs) -> output
BlockBody = Callable[..., Any]
# A block wrapper rewrites a body: wrapper(block_name, body) -> body
BlockWrapper = Callable[[str, BlockBody], BlockBody]


@dataclasses.dataclass
class ModelCall:
    """One call of a functional model, as transforms see and rewrite it.

    ``params`` are the trainable parameters handed to ``apply_fn`` (whatever
    the active transforms keep there: full tensors, a compute-dtype copy,
    or shards that a transform gathers per block).

    ``block_wrappers`` maps a block's qualified name to wrappers of its body.
    Wrappers of kind ``"materialize"`` (gather, cast) run innermost, right
    around the module's own forward; wrappers of kind ``"around"`` wrap
    those and must recompute their body in backward (as `zfunc.recompute`
    does) rather than keep what it materialized: a recomputed block then
    re-gathers its parameters in backward instead of saving them.
    """

    model: nn.Module
    params: dict[str, torch.Tensor]
    args: tuple
    kwargs: dict
    structure: "ModelStructure"
    block_wrappers: dict[str, list[tuple[str, BlockWrapper]]] = dataclasses.field(default_factory=dict)
    # Replacements, by qualified name, for the module's own non-trainable
    # tensors (frozen parameters, buffers): e.g. compute-dtype copies under
    # `mixed_precision`. Inside a wrapped block they are handed to the block's
    # own forward, so a block recomputed in backward sees them too.
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    recompute_required: set[str] = dataclasses.field(default_factory=set)
    # Keys whose tensor in ``params`` is not the full parameter (a shard that a block wrapper
    # gathers), and how to get the full one elsewhere: see `run_model_call`.
    partial_keys: frozenset = frozenset()
    resolve_outside: Callable[[str], torch.Tensor] | None = None
    # What runs a wrapped block's own forward, ``block_forward(block, *args, **kwargs)`` with its params
    # swapped in (None: the block's class's forward); `compile_blocks` hands a compiled one.
    block_forward: Callable | None = None
    # Blocks whose call a transform takes over, around all their wrappers: ``fn(run, args, kwargs)`` stands for
    # the block (``run(*args, **kwargs)`` runs it with its wrappers, or is never called: `pipeline` skips the
    # blocks of other stages and ends its stage's forward after its last block). See `intercept`.
    intercepts: dict[str, Callable] = dataclasses.field(default_factory=dict)

    def replace(self, **changes: Any) -> "ModelCall":
        """A copy with some fields replaced (``dataclasses.replace``, as `zfunc.compiled.replaced` makes it)."""
        return replaced(self, _FIELDS, changes)

    @property
    def aliases(self) -> dict[str, str]:
        """Every trainable qualified name, tied ones included -> its key in params."""
        return self.structure.aliases

    def recomputed(self, name: str) -> bool:
        """Whether block ``name`` is recomputed in backward (an "around" wrapper, or a required recompute)."""
        return name in self.recompute_required or any(k == "around" for k, _ in self.block_wrappers.get(name, ()))

    def wrap_block(self, name: str, wrapper: BlockWrapper,
                   kind: Literal["materialize", "around"] = "around") -> None:
        if kind not in ("materialize", "around"):
            raise ValueError(f"kind must be 'materialize' or 'around', got {kind!r}")
        self.block_wrappers.setdefault(name, []).append((kind, wrapper))

    def intercept(self, name: str, fn: Callable) -> None:
        """Route every call of block ``name`` through ``fn(run, args, kwargs)``, outside all its wrappers.

        ``fn`` may call ``run(*args, **kwargs)`` (the block with every wrapper, a recompute included) or return
        something else without running the block. An intercept is never recomputed: it runs once per forward.
        One intercept per block.
        """
        if name in self.intercepts:
            raise ValueError(f"block {name!r} is intercepted twice in one call")
        self.intercepts[name] = fn
        self.block_wrappers.setdefault(name, [])

    def require_recompute(self, name: str) -> None:
        """Ask that block ``name`` keep nothing it materialized for backward.

        `shard(stage=3)` asks this so that a gathered block is not saved by
        autograd; if no "around" wrapper (all of which recompute, e.g. the
        `checkpoint` transform's) is given for the block, a plain recompute
        is added. Either way the block is recomputed once, not twice.
        """
        self.block_wrappers.setdefault(name, [])
        self.recompute_required.add(name)

    def block_param_names(self, name: str) -> dict[str, str]:
        """``{local name: params key}`` of the trainable parameters of block ``name``."""
        return self.structure.block_param_names(name)


_FIELDS = init_fields(ModelCall)


# --------------------------------------------------------------------------
# The plain implementation of the ``apply`` primitive.


def run_model_call(call: ModelCall) -> Any:
    """Run ``call``: the module with its params swapped in (what `torch.func.functional_call`
    does, see `zfunc.reparametrize`), honouring block wrappers.

    Names inside a wrapped block take their params from the block's body. Every
    other name (a tied twin outside the block included) takes them from the
    call; a name whose tensor in the call is only a shard
    (``call.partial_keys``) gets an `OutsideItsBlock` placeholder outside its
    block, which ``call.resolve_outside`` turns into the full parameter when
    code there computes with it (rather than a read of the template module's
    stale tensor).
    """
    model, structure = call.model, call.structure
    # (While dynamo traces, the keys as a frozenset: it interprets a dict view's comparison per key.)
    if not call.block_wrappers and not (frozenset(call.params) >= structure.keys if tracing()
                                        else call.params.keys() >= structure.keys):
        missing = sorted(structure.keys - frozenset(call.params))  # (a view: dynamo 2.11 cannot subtract it)
        raise ValueError(f"params lack {len(missing)} trainable tensors of {type(model).__name__}: "
                         f"{', '.join(missing[:8])}; pass the params dict from zf.functional (or the state's)")
    prefixes = tuple(f"{name}." for name in call.block_wrappers)
    ctx = current()
    if ctx is not None and not tracing():  # (a compiled step is guarded on its tensors' shapes by dynamo)
        transforms = ctx.stack.transforms  # (their repr is made only for an error: it is not cheap)
        check_shapes_and_dtypes(model, structure.spec, call.params, call.partial_keys, ctx.facts.compute_dtype,
                                lambda: f" under {transforms[0]!r}" if transforms else "", structure.shapes_passed)
    if tracing():
        outer_params = _named_in_trace(structure.outer_table(prefixes), call.params)
    else:
        outer_params = _named(structure.outer_names(prefixes), call.params)
    if prefixes:
        outer_params.update({name: call.params[key] for name, key in structure.inner_names(prefixes)
                             if key in call.params})
    if call.partial_keys and not tracing():
        # (A compiled step cannot trace the placeholders, a tensor subclass made per call: there a block's
        # parameter used outside its block is not supported, see `zfunc.transforms.shard_compiled`.)
        outer_params.update(structure.placeholders(call.partial_keys, call.params))
    outer_params.update({name: t for name, t in call.constants.items() if not name.startswith(prefixes)})
    # Inside a step or where gradients are taken (not for an inference call under no_grad, nor compiled);
    # writes through `.data` need seeing where the model runs on copies or recomputes (`zfunc.data_access`).
    watch = None
    with structure.lock:
        if (ctx is not None or torch.is_grad_enabled()) and not tracing():
            copies = ctx is not None and (ctx.facts.compute_dtype is not None or ctx.facts.stage >= 3
                                          or ctx.facts.recompute)
            watch = ParamsWatch(see_data_writes=copies and structure.data_reads.should_watch())
        outside, structure.outside = structure.outside, call.resolve_outside
        outer_watch, structure.data_watch = structure.data_watch, watch
        try:
            if watch is None:
                return _run_locked(call, model, outer_params)
            with watch, watch.watching(outer_params):
                out = _run_locked(call, model, outer_params)
            structure.data_reads.record(watch)
            return out
        finally:
            structure.outside, structure.data_watch = outside, outer_watch


def _named(pairs: list[tuple[str, str]], params: dict) -> dict:
    """``{name: params[key]}`` for the ``(name, key)`` pairs whose key ``params`` has."""
    return {name: params[key] for name, key in pairs if key in params}


def _named_in_trace(table: dict, params: dict) -> dict:
    """`_named` while dynamo traces, of the pairs as ``(names, keys)`` in a `zfunc.compiled.constant_table`
    (`ModelStructure.outer_table`: one guard for all of them)."""
    ((names, keys),) = table
    if frozenset(keys) <= frozenset(params):  # (every key there, the usual case, by ``map``: natively in a trace)
        return dict_of(names, map(params.__getitem__, keys))
    return {name: params[key] for name, key in zip(names, keys) if key in params}


def _run_locked(call: ModelCall, model: nn.Module, outer_params: dict) -> Any:
    _merge_aliased_blocks(call)
    overrides = [_BlockOverride(call, name) for name in call.block_wrappers]
    for override in overrides:
        override.install()
    try:
        with swapped(model, outer_params, call.structure.slots, table=call.structure.slot_tables.get(model)):
            return model(*call.args, **call.kwargs)
    except RuntimeError as err:
        if "mutate a captured Tensor" in str(err):
            raise RuntimeError(
                f"{type(model).__name__} updates a buffer in place during its forward (e.g. BatchNorm running "
                "statistics). Inside zf.value_and_grad the step is a pure function and cannot mutate module "
                "state: put such modules in eval mode, use track_running_stats=False, or a norm without "
                "running statistics (LayerNorm, GroupNorm).") from err
        raise
    finally:
        for override in overrides:
            override.uninstall()


def _merge_aliased_blocks(call: ModelCall) -> None:
    """One module object under two block names (``ModuleList([a, b, a])``) gets one override: the
    first name's wrappers, plus any kind of wrapper only the other names have."""
    first: dict[int, str] = {}
    for name in list(call.block_wrappers):
        module = call.structure.module(name)
        owner = first.setdefault(id(module), name)
        if owner == name:
            continue
        kinds = {kind for kind, _ in call.block_wrappers[owner]}
        for kind, wrap in call.block_wrappers.pop(name):
            if kind not in kinds:
                call.block_wrappers[owner].append((kind, wrap))
        if name in call.recompute_required:
            call.recompute_required.discard(name)
            call.recompute_required.add(owner)


def _call_block(block: nn.Module, block_params: dict, args: tuple, kwargs: dict, structure: ModelStructure,
                tied: bool = True, forward: Callable | None = None) -> Any:
    """The innermost body: the block's own ``forward`` with its params swapped in.

    ``forward`` itself, not ``block(...)``: the parent's call of the block
    already ran the block's hooks once (and a recompute in backward should
    not run them again). ``tied``: whether the block holds a tensor under two
    names; only then may swapping in need to re-tie (see `swapped`). ``forward``:
    what runs it instead of its class's ``forward`` (`ModelCall.block_forward`).
    """
    watch = structure.data_watch
    with structure.lock, swapped(block, block_params, structure.slots, tie_weights=tied,
                                 table=structure.slot_tables.get(block)), \
            watch.watching(block_params) if watch is not None else contextlib.nullcontext():
        if forward is not None:
            return forward(block, *args, **kwargs)
        return type(block).forward(block, *args, **kwargs)


def _plain_recompute(name: str, body: BlockBody) -> BlockBody:
    return lambda block_params, *args, **kwargs: recompute(body, block_params, *args, **kwargs)


def refuse_container_block(name: str, module: nn.Module) -> None:
    """Refuse a block (a unit, a region to wrap) named by a container that is never called itself."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"{name!r} is a {type(module).__name__}, a container that is never called itself, so wrapping "
            f"it would change nothing (its parameters would get no gradient). Name the blocks inside it "
            f"instead (e.g. '{name}.0', '{name}.1', ...).")


class _BlockOverride:
    """Routes a block's forward through its wrappers while a call runs.

    The block's `BlockDispatch` hands its forward to this override for the
    duration of the call only. Inside the wrapped body the original forward must run, so
    the override steps aside while its body runs (``_inside``); a recompute in
    backward runs after the call has ended and meets the original forward.
    """

    def __init__(self, call: ModelCall, name: str) -> None:
        self.call, self.name = call, name
        self.block = call.structure.module(name)
        refuse_container_block(name, self.block)
        self.dispatch = call.structure.dispatch(name)
        self._previous: _BlockOverride | None = None
        self.param_names = call.block_param_names(name)
        self.submodules = call.structure.submodules(name)
        self.tied = call.structure.block_has_ties(name)
        prefix = f"{name}."
        self.constants = {n[len(prefix):]: t for n, t in call.constants.items() if n.startswith(prefix)}
        wrappers = list(call.block_wrappers[name])
        if name in call.recompute_required and not any(kind == "around" for kind, _ in wrappers):
            wrappers.append(("around", _plain_recompute))
        body: BlockBody = lambda bp, *a, **kw: self._original(bp, a, kw)  # noqa: E731
        for kind in ("materialize", "around"):
            for k, wrap in wrappers:
                if k == kind:
                    body = wrap(name, body)
        self.body = body
        self.recomputed = any(kind == "around" for kind, _ in wrappers)  # `ModelCall.recomputed`, decided now
        self._inside = False

    def _original(self, block_params, args, kwargs):
        was_inside, self._inside = self._inside, True
        try:
            if self.constants:
                block_params = {**block_params, **self.constants}
            return _call_block(self.block, block_params, args, kwargs, self.call.structure, self.tied,
                               self.call.block_forward)
        finally:
            self._inside = was_inside

    def forward(self, *args, **kwargs):
        if self._inside:  # the body is running the module itself
            return type(self.block).forward(self.block, *args, **kwargs)
        intercept = self.call.intercepts.get(self.name)
        if intercept is not None:
            return intercept(self._wrapped_forward, args, kwargs)
        return self._wrapped_forward(*args, **kwargs)

    def _wrapped_forward(self, *args, **kwargs):
        block_params = {local: self.call.params[key] for local, key in self.param_names.items()}
        if not self.recomputed or tracing():
            return self.body(block_params, *args, **kwargs)
        before = self._module_state()
        out = self.body(block_params, *args, **kwargs)
        after = self._module_state()
        # (One comparison of two dicts of ints in the common case: they are read per recomputed block per forward.)
        changed = [] if after == before else [name for name, mark in after.items() if before.get(name) != mark]
        if changed:
            raise RuntimeError(
                f"block {self.name!r} changes {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} (a buffer "
                "or frozen parameter, in place or by assignment) during its forward, and it is recomputed in "
                "backward (checkpoint, or shard(stage=3, reshard='recompute')): the recompute would change it a "
                "second time and compute the gradients from the changed value, so the result would silently "
                "differ from eager PyTorch. Leave this block out of the recompute (checkpoint(step, "
                "modules=[...]) without it; shard's reshard='release'), or keep such updates out of forward "
                "(e.g. update the buffer in the step, outside the model).")
        return out

    def _module_state(self) -> dict[str, tuple[int, int]]:
        """``(identity, version)`` of each buffer and frozen parameter the block holds or is given.

        What ``named_buffers()``, the constants and the ``named_parameters()`` that do not require grad
        give, read from the sub-modules' slot dicts directly: the module walk is found once per block
        (`ModelStructure.submodules`), and a buffer registered during the forward is still seen.
        """
        # (A tensor held under two names is marked under both: the before/after comparison is the same. Walked
        # per recomputed block twice a step, so kept to one pass without sets.)
        marks: dict[str, tuple[int, int]] = {}
        for prefix, module in self.submodules:
            buffers = module._buffers
            if buffers:
                for attr, t in buffers.items():
                    if t is not None:
                        marks[prefix + attr] = (id(t), t._version)
            parameters = module._parameters
            if not parameters:  # (most of a block's sub-modules: an activation, a dropout, a container)
                continue
            for attr, p in parameters.items():
                if p is None:
                    continue
                if type(p) is OutsideItsBlock:
                    # A stand-in for a sharded parameter (made without grad; never written: a write is
                    # refused): what its requires_grad and _version report, without its __torch_function__.
                    marks[prefix + attr] = (id(p), 0)
                elif not p.requires_grad:
                    marks[prefix + attr] = (id(p), p._version)
        for name, t in self.constants.items():
            marks[name] = (id(t), t._version)
        return marks

    def install(self) -> None:
        self._previous = self.dispatch.active
        self.dispatch.active = self

    def uninstall(self) -> None:
        self.dispatch.active, self._previous = self._previous, None
        # self.body ends in self._original: a reference cycle that would keep this call (and the
        # params it was given) alive until the next gc. Recomputes still in flight hold their
        # own reference to the body.
        self.body = None
