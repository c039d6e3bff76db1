"""What a transformed step does differently while `torch.compile` traces it.

A zfunc step is a pure function of ``(state, batch)``; ``torch.compile(step,
fullgraph=True)`` turns the whole of it — forward, backward, the collectives
of `shard` and the optimizer update — into one graph. Dynamo traces the same
Python code the eager step runs; a few things it cannot trace take another
route while it traces (``tracing()`` is true then, and false in every eager
call, so the eager step is unchanged):

- the step context: the eager step keeps it in a `contextvars.ContextVar`,
  which dynamo cannot read; the traced step keeps it in a plain object
  (`zfunc.step_context.current`), written only in the tracer's model of the
  program;
- memo caches (a model's parameter slots, a block's names): filled by eager
  calls only. A cache entry stored while tracing would be written for real
  when the compiled step runs, and the next call's guards (which saw the
  cache without it) would fail: one needless recompile. Tracing computes
  the entry instead of storing it (`remember`); so what every call asks of
  the model's structure (slot tables, a block's names and sub-modules) is
  built eagerly when `functional` builds the structure, and a trace only
  looks it up;
- the model's lock: none while tracing (dynamo serializes tracing);
- collectives (`shard`): torch's functional collectives, which Inductor can
  reorder and overlap (`zfunc.transforms.shard_compiled`), instead of
  asynchronous work objects waited for with a timeout;
- the optimizer: the fused form's arithmetic as torch operations once per
  unit's flat buffers, written back in place with one copy per buffer
  (`zfunc.optim.flat`, where the state's views record their buffer), instead
  of the fused kernels (numba, Triton), which dynamo cannot trace; other
  optimizers the pure pytree update;
- fp16 loss scaling: the skip of an overflowing step is a ``torch.where`` in
  the update (the step's skip flag, as eager) instead of a Python branch on a
  host read;
- a recomputed block (`checkpoint`, stage 3's recompute) runs as it is: the
  step differentiates with `torch.func.vjp`, under which the eager
  recompute's saved-tensor hooks (and torch's checkpoint region) are refused, and an ``autograd.Function`` that
  re-runs the block under a nested ``torch.func.vjp`` in its backward fails
  in functorch's level bookkeeping (torch 2.11 and 2.13). So the graph keeps
  a block's activations from forward to backward, and at stage 3 its gathered
  weights, unless the step is compiled with `zfunc.compile_step` (an Inductor
  pass that gathers them again for backward, in the graph);
  `zfunc.transforms.compile_blocks` (regional compile: the blocks compiled,
  the step eager) keeps the eager step's memory.
- identical blocks are traced and compiled once per block, not once for
  all: ``torch.compiler.nested_compile_region`` and dynamo's graph
  deduplication refuse the functorch wrappers of the step's
  ``torch.func.vjp`` (2.11 and 2.13: ``tests/test_compile_regions.py``), so
  the compile time of the whole step grows with the depth.

What a trace costs (``benchmarks/compile_time.py --json``: its ``phases`` and ``caches``): dynamo's
time grows with the tensors the traced code touches, each a graph input it wraps and guards
(a view of a flat buffer costing about twice a tensor of its own), and with the Python it
interprets per parameter. A stage 3 step with a master copy and Adam touches four views per
parameter (the compute shard, the master, both moments) against the floor's one parameter, so
per-key work while tracing is kept out of the way: computed once (tables built with the layout or
the model's structure), made only where an error is raised, or written in the forms dynamo runs
natively (see "Per-key work" below; ``tests/test_compile_trace_cost.py`` bounds the instructions a
traced step interprets per block). At world size 1 what torch.func.vjp differentiates is each unit's
flat buffer, not each parameter (`zfunc.transforms.shard.shard._value_and_grad_of_flats`: vjp's
wrapping is interpreted per leaf), and the graph holds no autograd Function (the model runs on the
shards themselves, `zfunc.transforms.shard_units.Units.runs_on_shards`), so AOTAutograd's cache,
which refuses one, spares a warm run the joint graph's trace.

The guards. Dynamo guards what a trace reads, and builds every guard at every trace (a warm start's
too) and checks them at every call: a tuple of N constants read element by element is N + 1
guards, and an object reached along two paths (a table's entry and the module's own attribute,
two tables holding one dict) a guard that both still lead to it, which dynamo evaluates in Python
at every call, after a pass over all such guards that grows with the square of their paths'
depth. So zfunc's tables that never change are read as one constant each (`constant_table`), and
what zfunc reads twice (a slot of the model, `zfunc.model_structure.ModelStructure._check_trainable`
and `zfunc.reparametrize.swapped`) is read along one path (``tests/test_compile_trace_cost.py``
bounds the guard entries per block). What stays per state
tensor: its tensor match, and at one rank each view's recorded buffer and key
(`zfunc.optim.flat.owner_of`): the guards that a state's views are still where the flat update
writes.

What needs no other route: a wrapped block's forward is routed by a
`zfunc.model_structure.BlockDispatch` installed once outside any trace, whose
``active`` attribute dynamo traces like any object's.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import AbstractSet, Any, Callable, Iterable, Mapping, NamedTuple, TypeVar

import torch
import torch.utils._pytree as torch_pytree

T = TypeVar("T")


# ``tracing()``: whether dynamo (torch.compile) is tracing the code that calls this (false in eager code). Torch's
# own function, not a wrapper of it: eager code asks it many times per step (a wrapper was a Python call more
# each), and dynamo folds it to a constant either way.
tracing: Callable[[], bool] = torch.compiler.is_dynamo_compiling


def remember(cache: dict, key: Any, value: T) -> T:
    """``cache[key] = value`` (returns ``value``), except while dynamo traces (see the module doc)."""
    if not torch.compiler.is_dynamo_compiling():
        cache[key] = value
    return value


# --------------------------------------------------------------------------
# Per-key work in the forms dynamo runs natively.
#
# Dynamo interprets each bytecode of the Python it traces, and some builtins through Python
# polyfills of its own: ``dict(d)``, ``dict(zip(...))``, a comprehension, ``all``/``any``, ``set(...)``
# and a comparison of dict key views cost it ~5-15 instructions per key (torch 2.13), which a step
# pays for every parameter at every trace. ``d.copy()``/``{**d}``, ``dict.update``, ``frozenset(...)``,
# ``list(map(f, ...))`` of a builtin ``f`` and ``x in list`` it runs in a few instructions whatever
# the length. The helpers below are those forms (``tests/test_compile_trace_cost.py`` bounds what a
# traced step interprets per block).


def dict_of(keys: Iterable, values: Iterable) -> dict:
    """``dict(zip(keys, values))``, made by one ``update`` (which dynamo runs natively)."""
    out: dict = {}
    out.update(zip(keys, values))
    return out


def same_keys(d: Mapping, keys: AbstractSet) -> bool:
    """``d.keys() == keys`` for a set ``keys`` (while dynamo traces, compared as a frozenset: its
    comparison of a dict view is interpreted per key)."""
    if torch.compiler.is_dynamo_compiling():
        return frozenset(d) == keys
    return d.keys() == keys


def all_true(flags: Iterable) -> bool:
    """``all(flags)`` (while dynamo traces, as ``False not in list(flags)``: its ``all`` is interpreted
    per item); ``flags`` are bools, e.g. ``map(isinstance, values, repeat(torch.Tensor))``."""
    if torch.compiler.is_dynamo_compiling():
        return False not in list(flags)
    return all(flags)


def constant_table(value: tuple) -> dict:
    """``value``, a table of constants (a tuple of strings, ints, None and such tuples) that code dynamo traces
    reads, kept as the one key of a dict: read it back with `table_of`.

    Why: dynamo guards what a trace reads, element by element: a tuple of N strings read from a source costs
    N + 1 guards, each built at every trace and checked at every call. A dict's keys it guards as a whole,
    by one comparison (``DICT_KEYS_MATCH``, torch 2.11 and 2.13), and the parts of a key read so are
    constants of the trace. So a table that never changes (a layout's, a model structure's: built once,
    outside any trace) costs one guard, which still fails, and retraces, wherever another table is found."""
    return {value: None}


def table_of(holder: dict) -> tuple:
    """The table a `constant_table` holds."""
    (value,) = holder
    return value


def init_fields(cls: type) -> tuple[str, ...]:
    """The names of a dataclass's fields, for `replaced`; each must be an ``__init__`` argument."""
    fields = dataclasses.fields(cls)
    if not all(f.init for f in fields):
        raise TypeError(f"{cls.__name__} has fields outside __init__: replace it with dataclasses.replace")
    return tuple(f.name for f in fields)


def replaced(obj: T, names: tuple[str, ...], changes: dict) -> T:
    """``dataclasses.replace(obj, **changes)`` for a dataclass of exactly the fields ``names`` (`init_fields`), built
    from the fields read by ``map``: dynamo interprets ``dataclasses.replace`` field by field, guarding each
    field's metadata, at every state, fact and model call a step replaces."""
    fields = dict_of(names, map(getattr, itertools.repeat(obj), names))
    fields.update(changes)
    return type(obj)(**fields)


# --------------------------------------------------------------------------
# Pytrees while tracing.
#
# zfunc's pytrees go through optree (`zfunc.tree`), which dynamo traces through its own
# polyfill; on torch 2.13 with optree 0.20 that polyfill fails on an empty dict (a block
# called without keyword arguments: optree's dict metadata cannot be wrapped). While
# tracing, the same trees are flattened here instead, by optree's rules for the nodes
# zfunc uses: None has no children, tuples and lists, dicts in sorted key order (rebuilt
# in their insertion order), NamedTuples, and the types registered with torch's pytree
# (`zfunc.tree.register_pytree_node` registers zfunc's there); anything else is a leaf.


class TracedSpec(NamedTuple):
    """A tree's structure, as flattened while tracing (``kind`` None: a leaf)."""

    kind: Any
    meta: Any
    children: tuple


_LEAF = TracedSpec(None, None, ())
_NAMED_TUPLE = "namedtuple"  # a NamedTuple's meta (compared by identity: no registered node's context is this object)


def _one_level(node: Any) -> tuple[tuple, Any] | None:
    """``(children, meta)`` of a node; None for a leaf."""
    if isinstance(node, torch.Tensor) and type(node) not in torch_pytree.SUPPORTED_NODES:
        return None  # (the usual leaf, asked first: dynamo traces every step of this per leaf)
    kind = type(node)
    if node is None:
        return (), None
    if kind is tuple or kind is list:
        return tuple(node), None
    if kind is dict:
        keys = list(node)
        try:
            order = sorted(keys)
        except TypeError:  # keys of mixed types: optree keeps their order then
            order = keys
        return tuple(node[k] for k in order), (tuple(order), tuple(keys))
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # a NamedTuple (asked of the instance:
        return tuple(node), _NAMED_TUPLE                       # torch 2.11's dynamo cannot ask the class)
    entry = torch_pytree.SUPPORTED_NODES.get(kind)
    if entry is None:
        return None
    children, context = entry.flatten_fn(node)
    return tuple(children), context


def traced_flatten(tree: Any) -> tuple[list, TracedSpec]:
    """``(leaves, spec)`` of ``tree`` (see above)."""
    flat = _flat_dict(tree)
    if flat is not None:
        return flat
    leaves: list = []

    def visit(node: Any) -> TracedSpec:
        if isinstance(node, torch.Tensor) and type(node) not in torch_pytree.SUPPORTED_NODES:
            leaves.append(node)  # (the usual leaf, without the call below: dynamo inlines every call it traces)
            return _LEAF
        level = _one_level(node)
        if level is None:
            leaves.append(node)
            return _LEAF
        children, meta = level
        return TracedSpec(type(node), meta, tuple(visit(c) for c in children))

    spec = visit(tree)
    return leaves, spec


def _flat_dict(tree: Any) -> tuple[list, TracedSpec] | None:
    """`traced_flatten` of a non-empty dict whose values are all tensor leaves (params, gradients, moments), by
    ``map`` and ``sorted`` (which dynamo runs natively, where `traced_flatten`'s walk is interpreted per
    leaf); None for any other tree."""
    if type(tree) is not dict or not tree:
        return None
    for kind in frozenset(map(type, tree.values())):  # (the few distinct types of the values)
        if not issubclass(kind, torch.Tensor) or kind in torch_pytree.SUPPORTED_NODES:
            return None
    keys = list(tree)
    try:
        order = sorted(keys)
    except TypeError:  # keys of mixed types: optree keeps their order then
        order = keys
    return list(map(tree.__getitem__, order)), TracedSpec(dict, (tuple(order), tuple(keys)), (_LEAF,) * len(order))


def traced_unflatten(spec: TracedSpec, leaves: Any) -> Any:
    """The tree of structure ``spec`` holding ``leaves`` (inverts `traced_flatten`)."""
    it = iter(leaves)

    def build(s: TracedSpec) -> Any:
        if s.kind is None:
            return next(it)
        children = [build(c) for c in s.children]
        if s.kind is type(None):
            return None
        if s.kind is tuple:
            return tuple(children)
        if s.kind is list:
            return children
        if s.kind is dict:
            order, keys = s.meta
            out = dict.fromkeys(keys)
            out.update(zip(order, children))
            return out
        if s.meta is _NAMED_TUPLE:
            return s.kind(*children)
        return torch_pytree.SUPPORTED_NODES[s.kind].unflatten_fn(children, s.meta)

    return build(spec)


def traced_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    """``fn`` applied leaf-wise over ``tree`` and trees of its structure."""
    leaves, spec = traced_flatten(tree)
    others = [traced_flatten(r)[0] for r in rest]
    if any(len(o) != len(leaves) for o in others):
        raise ValueError("tree_map: the trees have different structures")
    return traced_unflatten(spec, [fn(*xs) for xs in zip(leaves, *others)])


class cached_property:  # noqa: N801 (a drop-in for functools.cached_property)
    """`functools.cached_property` for values that are pure functions of their object, readable
    while dynamo traces: no lock (Python 3.11's takes an RLock, which dynamo cannot trace), and,
    while tracing, computed without being stored (see `remember`)."""

    def __init__(self, func: Callable) -> None:
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        found = instance.__dict__.get(self.name, _MISSING)
        if found is _MISSING:
            found = self.func(instance)
            if not torch.compiler.is_dynamo_compiling():
                instance.__dict__[self.name] = found
        return found


_MISSING = object()
