"""What depends only on a functional model's module, found once and kept across calls.

`ModelStructure` holds it (a block's parameter names and sub-modules, the
slots `zfunc.reparametrize` swaps, the frozen tensors, and what transforms
derive from the model and an object of theirs, `ModelStructure.derived`);
`BlockDispatch` is the ``forward`` installed once on each routed block, which
hands a running call's block to that call (`zfunc.model_call`);
`OutsideItsBlock` stands in, outside its block, for a block parameter a
transform holds only as a shard.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from zfunc.blocks import find_blocks, select_blocks
from zfunc.compiled import constant_table, remember, tracing
from zfunc.data_access import DataReadHistory, ParamsWatch
from zfunc.reparametrize import SlotTable
from zfunc.tree import requires_grad_of

T = TypeVar("T")
# How many objects' derived structures a model keeps per kind (`ModelStructure.derived`): a state's
# layout lives across steps; a few states of one model (an evaluation copy, a restore) may alternate.
DERIVED_KEPT = 8


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
        # {key: (shape, dtype)} of each trainable parameter as it is now: what params are checked against, and
        # what passed the check last (`zfunc.params_check.check_shapes_and_dtypes`).
        self.spec = {name: (p.shape, p.dtype) for name, _, _, p in self.trainable if self.aliases[name] == name}
        self.shapes_passed: dict = {}
        # The trainable tensors and their slots, as `_check_trainable` reads them at every call (in C).
        self._trainable_tensors = [p for _, _, _, p in self.trainable]
        self._trainable_owners = [where for _, where, _, _ in self.trainable]
        self._trainable_attrs = [attr for _, _, attr, _ in self.trainable]
        self._trainable_names = [name for name, _, _, _ in self.trainable]
        self.slots: dict = {}  # `zfunc.reparametrize.swapped`'s slots per (module, names)
        # The slot tables of the model and of its routed blocks, built now, outside any trace (`SlotTable`).
        self.slot_tables: dict[nn.Module, SlotTable] = {model: SlotTable(model)}
        # The module is one object shared by every call: swapping tensors into its slots (and a
        # block's forward) is exclusive. Reentrant: a block's swap runs inside the model's, and a
        # recompute in backward takes it again (possibly from autograd's own thread).
        self._lock = threading.RLock()
        self._block_names: dict[str, dict[str, str]] = {}
        self._block_ties: dict[str, bool] = {}
        self._outer: dict[tuple, list[tuple[str, str]]] = {}
        self._outer_tables: dict[tuple, dict] = {}
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
        # Where the frozen parameters and buffers live (`mixed_precision` casts them per call), found now: a
        # call traced by torch.compile would otherwise walk every module of the model again.
        self.constant_slots = constant_slots(model)
        # Route the model's blocks now, outside any torch.compile trace (`BlockDispatch`): the blocks
        # transforms wrap by default. Others are routed at the first eager call that wraps them.
        self._dispatches: dict[str, BlockDispatch] = {}
        self.route_blocks([name for name in self.blocks()
                           if not isinstance(self.module(name), (nn.ModuleList, nn.ModuleDict))])
        # (Found now, outside any trace, as the blocks' modules just were: the names a call of the whole model
        # with no block wrapped swaps in, which a traced call would otherwise find per name at every trace.)
        self.outer_table(())

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
            block = self.model.get_submodule(name)
            found = self._dispatches[name] = BlockDispatch.install(block, name)
            # What each call of the block asks of its structure, found now, outside any trace: a call traced by
            # torch.compile fills no cache (`zfunc.compiled.remember`) and would walk the block's modules again
            # for each (most of dynamo's work on zfunc's Python per block, once the update ran per unit).
            self.slot_tables.setdefault(block, SlotTable(block))
            self.submodules(name)
            self.block_param_names(name)
            self.block_has_ties(name)
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
            found = remember(self._of_type, (name, kind), [
                (f"{name}.{sub[:-1]}" if sub else name, m) for sub, m in self.submodules(name) if isinstance(m, kind)])
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

    def outer_table(self, prefixes: tuple[str, ...]) -> dict:
        """`outer_names` as ``(names, keys)`` in a `zfunc.compiled.constant_table`: what a call dynamo traces reads,
        under one guard (the pairs themselves it would guard name by name and key by key)."""
        table = self._outer_tables.get(prefixes)
        if table is None:
            pairs = self.outer_names(prefixes)
            names, keys = (tuple(column) for column in zip(*pairs)) if pairs else ((), ())
            table = remember(self._outer_tables, prefixes, constant_table((names, keys)))
        return table

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
        # The common case, read in C (this runs at every call, for every parameter): each still requires grad,
        # and so does the tensor its slot holds now (a slot that holds none is looked at below). (Dynamo cannot
        # trace a call of an attrgetter: a trace reads them one by one.)
        if not tracing():
            try:
                if all(map(requires_grad_of, self._trainable_tensors)) and all(map(
                        requires_grad_of, map(dict.get, self._trainable_owners, self._trainable_attrs))):
                    return
            except AttributeError:  # a slot holding None
                pass
        # While dynamo traces: the tensor each slot holds, read by ``map`` (natively, where it interprets the
        # loop below per parameter) and guarded by dynamo as it reads it, so a later change recompiles and
        # meets this check again. Read through the model's slot table, the path `zfunc.reparametrize.swapped`
        # takes to the same dicts and tensors next: an object dynamo reaches along two paths costs a guard
        # that both still lead to it (evaluated in Python at every call, and built by a pass quadratic in
        # the paths' depth), and the module's own tensors a guard each. A slot holding its original tensor
        # (the usual case) is the eager check; where it holds another, that one is what trains.
        else:
            slots = list(map(self.slot_tables[self.model].slots.get, self._trainable_names))
            nows = list(map(dict.get, map(operator.getitem, slots, itertools.repeat(0)),
                            map(operator.getitem, slots, itertools.repeat(1))))
            if False not in list(map(isinstance, nows, itertools.repeat(torch.Tensor))) + list(
                    map(getattr, nows, itertools.repeat("requires_grad"), itertools.repeat(True))):
                return
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
    def __new__(cls, name: str, key: str, shape, dtype, device, structure: ModelStructure):
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


def constant_slots(model: nn.Module) -> list[tuple[str, dict, str, bool, Any]]:
    """Where the model's frozen parameters and buffers live: (name, the owner's ``_parameters`` or
    ``_buffers``, attribute, is a buffer, the owner if it is a batch norm). The tensors are read from these
    slots at each call, so a buffer the module replaced (``.to()``) is still the one found."""
    slots = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        norm = module if isinstance(module, nn.modules.batchnorm._NormBase) else None
        head = f"{prefix}." if prefix else ""
        slots += [(head + attr, module._parameters, attr, False, None)
                  for attr, p in module._parameters.items() if p is not None and not p.requires_grad]
        slots += [(head + attr, module._buffers, attr, True, norm) for attr in module._buffers]
    return slots


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


class BlockDispatch:
    """A block's ``forward``, installed once per block and model: the call's override while a call
    runs (`zfunc.model_call._BlockOverride`), the block's own ``forward`` otherwise.

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
        self.active: Any = None  # the running call's override (`zfunc.model_call._BlockOverride`)

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
