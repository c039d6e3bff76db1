"""One call of a functional model, and how it runs.

A `ModelCall` is what the ``apply`` primitive carries through the transforms
(the module, the params and arguments, the block wrappers transforms add);
`ModelStructure` is what depends only on the module and is found once (a
block's parameter names, the slots `zfunc.reparametrize` swaps, the frozen
tensors); `run_model_call` is the plain implementation at the bottom of the
stack: the module run with its params swapped in, each wrapped block's
``forward`` routed through its wrappers (`_BlockOverride`). `OutsideItsBlock`
stands in, outside its block, for a block parameter a transform holds only as
a shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Literal, TypeVar

import torch
from torch import nn

from zfunc.blocks import find_blocks, select_blocks
from zfunc.compiled import remember, tracing
from zfunc.data_access import DataReadHistory, ParamsWatch
from zfunc.interpret import current
from zfunc.params_check import check_shapes_and_dtypes
from zfunc.recompute import recompute
from zfunc.reparametrize import swapped

T = TypeVar("T")
# How many objects' derived structures a model keeps per kind (`ModelStructure.derived`): a state's
# layout lives across steps; a few states of one model (an evaluation copy, a restore) may alternate.
DERIVED_KEPT = 8

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


class ModelStructure:
    """What depends only on a module's structure, found once per model and kept across calls.

    Each lookup walks modules, which would otherwise happen per block per
    forward. Filled lazily; every entry is a pure function of the module tree
    as it was when `functional` was called (a concurrent fill computes the
    same value).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.aliases: dict[str, str] = {}
        canonical_of: dict[int, str] = {}
        self.trainable: list[tuple[str, dict, str, torch.Tensor]] = []  # (name, owner's _parameters, attr, tensor)
        for prefix, module in model.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is not None and p.requires_grad:
                    name = f"{prefix}.{attr}" if prefix else attr
                    self.aliases[name] = canonical_of.setdefault(id(p), name)
                    self.trainable.append((name, module._parameters, attr, p))
        self.keys = frozenset(self.aliases.values())
        # {key: (shape, dtype)} of each trainable parameter as it is now: what params are checked against.
        self.spec = {name: (p.shape, p.dtype) for name, _, _, p in self.trainable if self.aliases[name] == name}
        self.slots: dict = {}  # `zfunc.reparametrize.swapped`'s slots per (module, names)
        # The module is one object shared by every call: swapping tensors into its slots (and a
        # block's forward) is exclusive. Reentrant: a block's swap runs inside the model's, and a
        # recompute in backward takes it again (possibly from autograd's own thread).
        self._lock = threading.RLock()
        self._block_names: dict[str, dict[str, str]] = {}
        self._block_ties: dict[str, bool] = {}
        self._outer: dict[tuple, list[tuple[str, str]]] = {}
        self._inner: dict[tuple, list[tuple[str, str]]] = {}
        self._placeholders: dict[tuple, dict[str, torch.Tensor]] = {}
        # While a call runs (under ``lock``): key -> the full parameter, for a sharded block's parameter
        # used outside its block (`OutsideItsBlock`); provided by the call's transforms.
        self.outside: Callable[[str], torch.Tensor] | None = None
        # While a call runs: what watches changes through `.data` of its parameters (`zfunc.data_access`).
        self.data_watch: ParamsWatch | None = None
        self.data_reads = DataReadHistory()
        self._blocks: list[str] | None = None
        self._selections: dict = {}
        self._of_type: dict = {}
        self._modules: dict[str, nn.Module] = {}
        self._derived: dict[tuple[str, int], tuple[Any, Any]] = {}
        # Where the frozen parameters and buffers live (`mixed_precision` casts them per call).
        self.constant_slots: list | None = None
        # Route the model's blocks now, outside any torch.compile trace (`BlockDispatch`): the blocks
        # transforms wrap by default. Others are routed at the first eager call that wraps them.
        self._dispatches: dict[str, BlockDispatch] = {}
        self.route_blocks([name for name in self.blocks()
                           if not isinstance(model.get_submodule(name), (nn.ModuleList, nn.ModuleDict))])

    def module(self, name: str) -> nn.Module:
        """``model.get_submodule(name)``, looked up once per name."""
        found = self._modules.get(name)
        if found is None:
            found = remember(self._modules, name, self.model.get_submodule(name))
        return found

    def derived(self, what: str, of: Any, build: Callable[[], T]) -> T:
        """``build()``, found once per kind ``what`` and object ``of`` (by identity: e.g. a state's shard
        layout, which is immutable): what a transform derives from this model and that object, made once
        rather than at every call. The entry keeps ``of`` alive, so its identity is never another object's;
        the last `DERIVED_KEPT` entries of each kind are kept."""
        key = (what, id(of))
        entry = self._derived.get(key)
        if entry is not None:
            return entry[1]
        value = build()
        if not tracing():
            self._derived[key] = (of, value)
            same = [k for k in self._derived if k[0] == what]
            if len(same) > DERIVED_KEPT:
                del self._derived[same[0]]
        return value

    def route_blocks(self, names: list[str]) -> None:
        """Route these sub-modules' forward through `BlockDispatch` now (see `BlockDispatch.install`)."""
        for name in names:
            self.dispatch(name)

    def dispatch(self, name: str) -> "BlockDispatch":
        """Sub-module ``name``'s `BlockDispatch` (installed now if it has none; never while dynamo traces)."""
        found = self._dispatches.get(name)
        if found is None:
            found = self._dispatches[name] = BlockDispatch.install(self.model.get_submodule(name), name)
        return found

    @property
    def lock(self) -> Any:
        """The model's reentrant lock (see ``__init__``); a no-op while torch.compile traces.

        Dynamo cannot trace a lock, and needs none: tracing is serialized by
        its compile lock, and a compiled step computes on the traced tensors
        directly. What it still does to the module at run time is put back
        in each slot the tensor the slot holds (its replay of the swaps,
        which restored them): compiled steps may run alongside each other,
        but not alongside an eager step of the same model.
        """
        return contextlib.nullcontext() if tracing() else self._lock

    def select(self, modules: Any) -> list[str]:
        """`select_blocks` for this model, found once per distinct ``modules`` argument."""
        key = tuple(modules) if isinstance(modules, list) else modules
        found = self._selections.get(key)
        if found is None:
            found = remember(self._selections, key, select_blocks(self.model, modules, self))
        return found

    def submodules(self, name: str) -> list[tuple[str, nn.Module]]:
        """``(local prefix, module)`` of block ``name``'s sub-modules (itself first, prefix ``""``; the others
        ``"attn."``, ...), each module once, in ``named_modules`` order: where its buffers and parameters sit."""
        found = self._of_type.get((name, None))
        if found is None:
            block = self.model.get_submodule(name)
            found = remember(self._of_type, (name, None),
                             [(f"{sub}." if sub else "", m) for sub, m in block.named_modules()])
        return found

    def submodules_of_type(self, name: str, kind: type) -> list[tuple[str, nn.Module]]:
        """``(qualified name, module)`` of block ``name``'s sub-modules of type ``kind`` (itself included)."""
        found = self._of_type.get((name, kind))
        if found is None:
            block = self.model.get_submodule(name)
            found = remember(self._of_type, (name, kind), [
                (f"{name}.{sub}" if sub else name, m) for sub, m in block.named_modules() if isinstance(m, kind)])
        return found

    def blocks(self) -> list[str]:
        """The model's repeated blocks (`find_blocks` over every parameter, frozen ones included)."""
        if self._blocks is None:
            found = find_blocks({n: p.numel() for n, p in self.model.named_parameters(remove_duplicate=False)})
            if tracing():
                return found
            self._blocks = found
        return self._blocks

    def block_param_names(self, name: str) -> dict[str, str]:
        """``{local name in block: key in params}`` for a sub-module's trainable params."""
        names = self._block_names.get(name)
        if names is None:
            block = self.model.get_submodule(name)
            prefix = f"{name}." if name else ""
            names = {local: self.aliases[prefix + local]
                     for local, p in block.named_parameters(remove_duplicate=False) if p.requires_grad}
            remember(self._block_names, name, names)
        return names

    def block_has_ties(self, name: str) -> bool:
        """Whether block ``name`` holds one tensor under two names (then swapping its params in
        must re-tie them, which walks the block's modules; most blocks need not)."""
        tied = self._block_ties.get(name)
        if tied is None:
            block = self.model.get_submodule(name)
            named = list(block.named_parameters(remove_duplicate=False)) + \
                list(block.named_buffers(remove_duplicate=False))
            tied = remember(self._block_ties, name, len({id(t) for _, t in named}) < len(named))
        return tied

    def outer_names(self, prefixes: tuple[str, ...]) -> list[tuple[str, str]]:
        """``(name, key)`` of the trainable names outside the blocks with these ``prefixes``."""
        outer = self._outer.get(prefixes)
        if outer is None:
            outer = remember(self._outer, prefixes,
                             [(n, k) for n, k in self.aliases.items() if not n.startswith(prefixes)])
        return outer

    def inner_names(self, prefixes: tuple[str, ...]) -> list[tuple[str, str]]:
        """``(name, key)`` of the trainable names inside the blocks with these ``prefixes``."""
        inner = self._inner.get(prefixes)
        if inner is None:
            outer = set(self.outer_names(prefixes))
            inner = remember(self._inner, prefixes, [(n, k) for n, k in self.aliases.items() if (n, k) not in outer])
        return inner

    def placeholders(self, keys: frozenset, params: dict) -> dict[str, torch.Tensor]:
        """``{name: placeholder}`` for every trainable name whose key is in ``keys``: a tensor with the
        parameter's shape and the dtype and device of ``params[key]``, holding no data, resolved on use
        (`OutsideItsBlock`). Built once per set of keys."""
        sample = params[next(iter(keys))]
        index = (keys, sample.dtype, sample.device)
        found = self._placeholders.get(index)
        if found is None:
            shapes = {n: p.shape for n, p in self.model.named_parameters(remove_duplicate=False)}
            found = remember(self._placeholders, index, {
                name: OutsideItsBlock(name, key, shapes[name], params[key].dtype, params[key].device, self)
                for name, key in self.aliases.items() if key in keys})
        return found

    def check_trainable(self) -> None:
        """Refuse a call after the module's trainable set changed since `functional` was called."""
        with self.lock:  # another thread's call may have other tensors in the slots right now
            self._check_trainable()

    def _check_trainable(self) -> None:
        for name, where, attr, p in self.trainable:
            # The slot may hold another tensor by now (``model.to("meta")`` makes new ones: the module
            # is only a template); what matters is that it still trains.
            now = where.get(attr)
            if not p.requires_grad or (now is not None and not now.requires_grad):
                raise ValueError(
                    f"the module's parameter {name!r} had requires_grad set to False after "
                    "zf.functional(model), which has no effect: "
                    "which parameters train is fixed when functional() is called (the params dict and the "
                    "optimizer state hold exactly those). To freeze it, set requires_grad=False before calling "
                    "zf.functional(model) and build a new state from its params (restore the weights with "
                    "zfunc.io.restore(..., strict=False) if you are resuming).")


class OutsideItsBlock(torch.Tensor):
    """What a sharded block's parameter is outside its block during a call (see `run_model_call`).

    It reports the parameter's shape, dtype and device (code that only reads
    ``model.dtype`` or ``model.device`` keeps working) and holds no data. When
    code outside the block computes with it (a weight shared with a layer
    outside the block; ``F.linear(h, model.blocks[0].weight)`` after the
    blocks ran: DeepSpeed's "external parameter"), it is swapped for the full
    parameter then and there (`ModelStructure.outside`, which the running
    call's transform provides: `shard` gathers the unit, its gradient flows
    back into the unit's reduction). Without such a provider (a use after the
    call ended) it is a clear error.
    """

    @staticmethod
    def __new__(cls, name: str, key: str, shape, dtype, device, structure: "ModelStructure"):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        t.param_name, t.key, t.structure = name, key, structure
        return t

    def __init__(self, *args, **kwargs) -> None:
        pass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:  # shape, dtype, device, ...
            return super().__torch_function__(func, types, args, kwargs)
        found = _first_outside((args, kwargs))
        resolve = found.structure.outside if found is not None else None
        if resolve is None:
            _refuse_outside(found, getattr(func, "__name__", str(func)))
        args, kwargs = _swap_outside((args, kwargs), resolve)
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        _refuse_outside(_first_outside((args, kwargs or {})), func.__name__)

    def __repr__(self) -> str:  # noqa: D105
        return f"OutsideItsBlock({self.param_name}, shape={tuple(self.shape)}, dtype={self.dtype})"


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
             torch.Tensor.element_size, torch.Tensor.__repr__, torch.Tensor.__format__}


def _first_outside(tree: Any) -> OutsideItsBlock | None:
    if isinstance(tree, OutsideItsBlock):
        return tree
    if isinstance(tree, (list, tuple)):
        return next((f for f in map(_first_outside, tree) if f is not None), None)
    if isinstance(tree, dict):
        return next((f for f in map(_first_outside, tree.values()) if f is not None), None)
    return None


def _swap_outside(tree: Any, resolve: Callable[[str], torch.Tensor]) -> Any:
    if isinstance(tree, OutsideItsBlock):
        return resolve(tree.key)
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_swap_outside(x, resolve) for x in tree)
    if isinstance(tree, list):
        return [_swap_outside(x, resolve) for x in tree]
    if isinstance(tree, dict):
        return {k: _swap_outside(v, resolve) for k, v in tree.items()}
    return tree


def _refuse_outside(found: OutsideItsBlock | None, op: str):
    name = found.param_name if found is not None else "a block parameter"
    raise RuntimeError(
        f"{name} is used outside its block ({op}) when no step is gathering it: under shard(stage=2|3) a block's "
        "parameters exist whole only while a step runs the model (or under a torch.func transform, where they "
        "cannot be gathered on demand). Compute with it inside the loss function (apply_fn's call), or keep the "
        f"block in the root unit (shard(..., units=[...]) without {name.rpartition('.')[0]!r}).")


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
    if not call.block_wrappers and not call.params.keys() >= structure.keys:
        missing = sorted(structure.keys - call.params.keys())
        raise ValueError(f"params lack {len(missing)} trainable tensors of {type(model).__name__}: "
                         f"{', '.join(missing[:8])}; pass the params dict from zf.functional (or the state's)")
    prefixes = tuple(f"{name}." for name in call.block_wrappers)
    ctx = current()
    if ctx is not None and not tracing():  # (a compiled step is guarded on its tensors' shapes by dynamo)
        transforms = ctx.stack.transforms  # (their repr is made only for an error: it is not cheap)
        check_shapes_and_dtypes(model, structure.spec, call.params, call.partial_keys, ctx.facts.compute_dtype,
                                lambda: f" under {transforms[0]!r}" if transforms else "")
    outer_params = {name: call.params[key] for name, key in structure.outer_names(prefixes) if key in call.params}
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


def _run_locked(call: ModelCall, model: nn.Module, outer_params: dict) -> Any:
    _merge_aliased_blocks(call)
    overrides = [_BlockOverride(call, name) for name in call.block_wrappers]
    for override in overrides:
        override.install()
    try:
        with swapped(model, outer_params, call.structure.slots):
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
    with structure.lock, swapped(block, block_params, structure.slots, tie_weights=tied), \
            watch.watching(block_params) if watch is not None else contextlib.nullcontext():
        if forward is not None:
            return forward(block, *args, **kwargs)
        return type(block).forward(block, *args, **kwargs)


def _plain_recompute(name: str, body: BlockBody) -> BlockBody:
    return lambda block_params, *args, **kwargs: recompute(body, block_params, *args, **kwargs)


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
        if isinstance(self.block, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"{name!r} is a {type(self.block).__name__}, a container that is never called itself, so wrapping "
                f"it would change nothing (its parameters would get no gradient). Name the blocks inside it "
                f"instead (e.g. '{name}.0', '{name}.1', ...).")
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
        changed = [name for name, mark in self._module_state().items() if before.get(name) != mark]
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
        marks: dict[str, tuple[int, int]] = {}
        seen: set[int] = set()
        for prefix, module in self.submodules:
            for attr, t in module._buffers.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    marks[prefix + attr] = (id(t), t._version)
        for name, t in self.constants.items():
            marks[name] = (id(t), t._version)
        seen.clear()
        for prefix, module in self.submodules:
            for attr, p in module._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                if type(p) is OutsideItsBlock:
                    # A stand-in for a sharded parameter (made without grad; never written: a write is
                    # refused): what its requires_grad and _version report, without its __torch_function__.
                    marks[prefix + attr] = (id(p), 0)
                elif not p.requires_grad:
                    marks[prefix + attr] = (id(p), p._version)
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


class BlockDispatch:
    """A block's ``forward``, installed once per block and model: the call's override while a call
    runs (`_BlockOverride`), the block's own ``forward`` otherwise.

    Why once, and not the override itself per call: torch.compile (dynamo 2.11) decides how to call
    a module from the module's real ``__dict__`` before it applies the writes the traced program has
    made so far, so a ``forward`` written into the block during the trace was not seen there (the
    block's own forward ran on the shards). A dispatch installed outside any trace is seen by every
    version; per call only its ``active`` attribute changes, which dynamo traces like any object's
    attribute. Outside a call it is invisible: the block runs its class's ``forward``.
    """

    __slots__ = ("block", "patched", "active")

    def __init__(self, block: nn.Module, patched: Callable | None = None) -> None:
        self.block = block
        self.patched = patched  # a forward the user had set on the instance: still what runs outside a call
        self.active: _BlockOverride | None = None

    def forward(self, *args, **kwargs):
        active = self.active
        if active is not None:
            return active.forward(*args, **kwargs)
        if self.patched is not None:
            return self.patched(*args, **kwargs)
        return type(self.block).forward(self.block, *args, **kwargs)

    def __getstate__(self):
        return {"block": self.block, "patched": self.patched}

    def __setstate__(self, state) -> None:
        self.block, self.patched, self.active = state["block"], state["patched"], None

    @staticmethod
    def of(block: nn.Module) -> "BlockDispatch | None":
        """The dispatch installed on ``block``, if any."""
        forward = block.__dict__.get("forward")
        owner = getattr(forward, "__self__", None)
        return owner if isinstance(owner, BlockDispatch) else None

    @staticmethod
    def install(block: nn.Module, name: str) -> "BlockDispatch":
        """The dispatch of ``block`` (installed now if it has none; never while dynamo traces)."""
        found = BlockDispatch.of(block)
        if found is not None:
            return found
        if tracing():
            raise RuntimeError(
                f"torch.compile reached block {name!r}, which a transform wraps (checkpoint(modules=...), "
                "shard(units=...)) but which zfunc has not yet routed: zfunc routes a block's forward once, "
                "outside any trace (at zf.functional() for the model's blocks found by find_blocks, at the "
                "first eager call for any other). Run one step eagerly before the compiled ones, or call "
                f"apply_fn.route_blocks([{name!r}]) once before compiling.")
        dispatch = BlockDispatch(block, block.__dict__.get("forward"))
        block.forward = dispatch.forward
        return dispatch


