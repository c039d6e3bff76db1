"""Pytree utilities.

zfunc's pytrees are nested dicts, lists, tuples and NamedTuples of tensors, plus
zfunc's own state types (`TrainState`), which are registered both with optree
(namespace ``"zfunc"``) and with torch's own pytree registry, because
torch.func flattens with the latter and would otherwise treat a TrainState as
one opaque leaf.

The other way round, a type that a library registered with torch's registry
only (every Hugging Face ``ModelOutput``) is a node here too, flattened by
torch's functions (`_follow_torch_registry`): otherwise a model's output
would be one opaque leaf, and e.g. `mixed_precision`'s output cast would
never reach its logits.

Every function here takes and returns plain pytrees; nothing is mutated.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any, Callable, Iterable, Sequence

import optree
import torch
import torch.utils._pytree as torch_pytree

from zfunc.compiled import TracedSpec, traced_flatten, traced_map, traced_unflatten, tracing

NAMESPACE = "zfunc"

PyTree = Any


def register_pytree_node(cls: type, flatten: Callable, unflatten: Callable) -> None:
    """Register ``cls`` with optree (namespace ``zfunc``) and torch's pytree.

    ``flatten(obj) -> (children, aux)`` and ``unflatten(aux, children) -> obj``,
    with ``aux`` hashable static data (compared when trees are matched).
    """
    optree.register_pytree_node(cls, flatten, lambda aux, children: unflatten(aux, children),
                                namespace=NAMESPACE)
    torch_pytree.register_pytree_node(
        cls,
        lambda obj: flatten(obj),
        lambda children, aux: unflatten(aux, children),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
    )


class _TorchContext:
    """The static data of a node flattened by torch's registry, for optree: torch's contexts may be
    unhashable (a ModelOutput's is the list of its keys), optree's must hash."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TorchContext) and self.value == other.value

    def __hash__(self) -> int:
        value = self.value
        return hash(tuple(value) if isinstance(value, list) else value)

    def __repr__(self) -> str:
        return repr(self.value)


# How many entries torch's registry had when its foreign types were last copied into optree's: a
# library registers its types at import time (transformers: each ModelOutput subclass as it is
# defined), so a changed count is the one cheap sign that there is something new to copy.
_torch_registry_seen = 0


def _follow_torch_registry() -> None:
    """Register with optree (namespace ``zfunc``) each type registered with torch's pytree registry by
    another library (not torch's own types: torch.Size or a ``torch.return_types`` tuple stay what optree
    makes of them, nor zfunc's, registered with both already). Called by every tree function; costs one
    ``len`` unless the registry grew."""
    global _torch_registry_seen
    nodes = torch_pytree.SUPPORTED_NODES
    if len(nodes) == _torch_registry_seen:
        return
    for cls, node in list(nodes.items()):
        module = getattr(cls, "__module__", "") or ""
        if module == "builtins" or module == "collections" or module.split(".")[0] in ("torch", "zfunc"):
            continue
        if optree.register_pytree_node.get(cls, namespace=NAMESPACE) is not None:
            continue
        try:
            optree.register_pytree_node(
                cls,
                lambda obj, flatten=node.flatten_fn: _flatten_by_torch(flatten, obj),
                lambda context, children, unflatten=node.unflatten_fn: unflatten(list(children), context.value),
                namespace=NAMESPACE)
        except ValueError:  # registered meanwhile (another thread), or a type optree handles itself
            pass
    _torch_registry_seen = len(nodes)


def _flatten_by_torch(flatten: Callable, obj: Any) -> tuple:
    children, context = flatten(obj)
    return children, _TorchContext(context)


def tree_leaves(tree: PyTree) -> list:
    """Leaves of ``tree`` in a deterministic order (dicts by sorted key)."""
    if tracing():  # (see `zfunc.compiled`)
        return traced_flatten(tree)[0]
    _follow_torch_registry()
    return optree.tree_leaves(tree, none_is_leaf=False, namespace=NAMESPACE)


def tree_flatten(tree: PyTree):
    """``(leaves, treedef)``; ``tree_unflatten(treedef, leaves)`` inverts it."""
    if tracing():
        return traced_flatten(tree)
    _follow_torch_registry()
    return optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)


def tree_unflatten(treedef, leaves) -> PyTree:
    if isinstance(treedef, TracedSpec):
        return traced_unflatten(treedef, leaves)
    return optree.tree_unflatten(treedef, leaves)


def tree_structure(tree: PyTree):
    _follow_torch_registry()
    return optree.tree_structure(tree, none_is_leaf=False, namespace=NAMESPACE)


def tree_map(fn: Callable, tree: PyTree, *rest: PyTree) -> PyTree:
    """Apply ``fn`` leaf-wise over ``tree`` and trees of the same structure."""
    if tracing():
        return traced_map(fn, tree, *rest)
    _follow_torch_registry()
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False, namespace=NAMESPACE)


def tree_map_with_path(fn: Callable, tree: PyTree, *rest: PyTree) -> PyTree:
    """Like `tree_map`, with ``fn(path, leaf, ...)``; ``path`` is a tuple of keys."""
    _follow_torch_registry()
    return optree.tree_map_with_path(fn, tree, *rest, none_is_leaf=False, namespace=NAMESPACE)


def tree_map_tensors(fn: Callable[[torch.Tensor], Any], tree: PyTree) -> PyTree:
    """Apply ``fn`` to tensor leaves only; other leaves pass through unchanged."""
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def tree_zeros_like(tree: PyTree) -> PyTree:
    return tree_map(torch.zeros_like, tree)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    return tree_map(torch.add, a, b)


def tree_scale(tree: PyTree, factor) -> PyTree:
    return tree_map(lambda x: x * factor, tree)


def tree_cast(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """Cast floating-point tensor leaves to ``dtype`` (others untouched)."""
    return tree_map_tensors(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


def tree_sum_of_squares(tree: PyTree) -> torch.Tensor:
    """Σ over all elements of all leaves of x², accumulated in fp32.

    This is a *local* quantity: under `shard` each rank holds only its shards;
    use `zfunc.psum` (as `zfunc.optim.global_norm` does) to sum it over ranks.
    """
    leaves = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float32, device=leaves[0].device)
    # One multi-tensor norm per (device, dtype) group (as clip_grad_norm_ does),
    # not a square-and-sum per tensor: a few launches for thousands of shards.
    groups: dict[tuple, list[torch.Tensor]] = {}
    for x in leaves:
        if x.numel():
            exact = x.dtype in (torch.float32, torch.float64)  # low precision: norms in fp32
            groups.setdefault((x.device, x.dtype if exact else torch.float32), []).append(x)
    for group in groups.values():
        total = total + torch.stack(_norms(group)).float().square().sum().to(total.device)
    return total


def tree_all_finite(tree: PyTree) -> torch.Tensor:
    """A bool tensor: every element of every floating leaf is finite (local)."""
    leaves = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        return torch.tensor(True)
    return torch.stack([torch.isfinite(x).all() for x in leaves]).all()


def _norms(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each leaf's L2 norm (fp32 for bf16/fp16 leaves), one multi-tensor pass per dtype, in ``leaves``' order.
    bf16/fp16 leaves are read as they are (foreach_norm's ``dtype``: the numbers of their fp32 copies'
    norms, without a cast launch and a copy per leaf)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(leaves):
        by_dtype.setdefault(x.dtype, []).append(i)
    out: list = [None] * len(leaves)
    for dtype, where in by_dtype.items():
        part = [leaves[i] for i in where]
        if dtype in (torch.bfloat16, torch.float16):
            norms = torch._foreach_norm(part, dtype=torch.float32)
        elif dtype in (torch.float32, torch.float64):
            norms = torch._foreach_norm(part)
        else:
            norms = torch._foreach_norm([x.float() for x in part])
        for i, n in zip(where, norms):
            out[i] = n
    return out


def _same_keys_and_shapes(expected: dict, got: dict) -> bool:
    """Whether ``got`` has ``expected``'s keys, and the same shape wherever both hold a tensor (one loop:
    dynamo interprets a third of the instructions of a key-set comparison and any() over a generator)."""
    if len(expected) != len(got):
        return False
    for k, e in expected.items():
        if k not in got:
            return False
        g = got[k]
        if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and e.shape != g.shape:
            return False
    return True


def _shapes(values: Iterable) -> list:
    """Each value's ``shape`` (None for a value without one), read by ``map``."""
    return list(map(getattr, values, itertools.repeat("shape"), itertools.repeat(None)))


def describe_mismatch(expected: dict, got: dict, what: str = "params") -> str:
    """A readable list of differences between two flat dicts of tensors ("" when they match)."""
    if tracing():
        # (A traced step runs this at every compile: the shapes read by ``map`` over ``getattr``, which dynamo
        # runs natively, where it interprets a loop instruction by instruction per key, `zfunc.compiled`.)
        if frozenset(expected) == frozenset(got) and _shapes(expected.values()) == _shapes(
                map(got.__getitem__, expected)):
            return ""
    elif keyed_alike(expected, got):
        # The usual case: every shape alike. Read in C where it can (this runs for every parameter at every step);
        # in one pass otherwise.
        theirs = list(values_in_order(got, expected))
        if read_in_c(expected.values()) and read_in_c(theirs):
            if list(map(shape_of, expected.values())) == list(map(shape_of, theirs)):
                return ""
        elif _same_keys_and_shapes(expected, got):
            return ""
    lines = []
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing:
        lines.append(f"  missing from {what}: {', '.join(missing)}")
    if extra:
        lines.append(f"  unexpected in {what}: {', '.join(extra)}")
    for k in sorted(set(expected) & set(got)):
        e, g = expected[k], got[k]
        if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and e.shape != g.shape:
            lines.append(f"  {k}: expected shape {tuple(e.shape)}, got {tuple(g.shape)}")
    return "\n".join(lines)


def weak_refs(tensors: Iterable[torch.Tensor]) -> list[weakref.ref]:
    """Weak references to ``tensors``, in order: what a cache keeps to know later whether it is handed the very
    same tensors (`still_the_same`) without keeping them alive."""
    return [weakref.ref(t) for t in tensors]


def still_the_same(refs: list[weakref.ref], tensors: Iterable[torch.Tensor]) -> bool:
    """Whether ``tensors`` are, one by one and as many, the very tensors ``refs`` were made from (`weak_refs`)."""
    tensors = list(tensors)
    if len(refs) != len(tensors):
        return False
    if tracing():
        return all(ref() is t for ref, t in zip(refs, tensors))
    return all(map(operator.is_, map(_dereference, refs), tensors))  # (in C: this runs per parameter per step)


_dereference = weakref.ref.__call__


class SameObjects:
    """Whether a sequence of objects is, one by one, the very objects it was made from, without keeping them
    alive and without reading them: their ids, compared from C (a step's check of every tensor of a state,
    whose cost on a GPU host is the memory each read touches). An id names one object only while it lives, so
    the ids are trusted only while every one of the objects does: a weak reference's callback, run as one
    dies (before its id can be reused), turns ``alive`` off for good."""

    __slots__ = ("alive", "ids", "refs")

    def __init__(self, objects: Iterable) -> None:
        objects = list(objects)
        self.alive = alive = [True]

        def died(_ref, alive=alive) -> None:  # (holds the flag only: the holder is not kept alive by its refs)
            alive[0] = False

        self.refs = [weakref.ref(o, died) for o in objects]
        self.ids = tuple(map(id, objects))

    def __call__(self, objects: Iterable) -> bool:
        return self.alive[0] and tuple(map(id, objects)) == self.ids


# -- a dict's version tag: evidence that a dict still holds what it held ----------------------------------
# CPython gives every dict a version tag (``ma_version_tag``) from one counter of the interpreter: a new dict
# gets a tag no dict had before, and inserting, deleting or replacing a value by another object gives the dict
# a new one. So a dict read with a tag read before is that very dict, unchanged since: it holds the very
# objects it held then, in the same order, alive (it holds them). One read per dict (~60 ns) where a walk of
# its values reads each; what a step checks of a state's dicts of tensors at every step.


def _dict_tag_reader() -> Callable[[dict], int] | None:
    """The reader of a dict's version tag, or None where there is none that behaves as described above.

    Torch's dynamo guards read it (``torch._C._dynamo.guards.dict_version``: private, present in torch 2.11 and
    2.13 on Python 3.11 and 3.12; Python 3.14 removes the tag). It is tried once, here, on dicts of its own:
    without a reader, or with one that does not tell a changed dict or another dict by its tag, every caller
    walks the values instead (`SameValues`)."""
    read = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), "dict_version", None)
    if read is None:
        return None
    try:
        mine, twin, kept = {0: 0}, {0: 0}, object()
        first = read(mine)
        mine[0] = kept
        replaced = read(mine)
        mine[0] = kept  # (the same object again: nothing changed)
        if read(mine) != replaced or len({first, replaced, read(twin), read({**twin})}) != 4:
            return None
    except Exception:  # noqa: BLE001 (a private reader that fails in any way is no reader)
        return None
    return read


DICT_TAG = _dict_tag_reader()


def dict_tags(dicts: Iterable) -> tuple | None:
    """Each dict's version tag, in order (see above), or None where tags cannot stand for the dicts: no reader
    (`_dict_tag_reader`), or one of them not exactly a ``dict`` (an ``OrderedDict`` reorders its keys without a
    new tag; a subclass may keep its values elsewhere). Eager code only (dynamo cannot trace the reader)."""
    dicts = tuple(dicts)
    if DICT_TAG is None or not all(map(operator.is_, map(type, dicts), itertools.repeat(dict))):
        return None
    return tuple(map(DICT_TAG, dicts))


class SameValues:
    """Whether dicts hold, value after value, the very objects they held when this was made, without keeping
    those alive.

    In the usual step the dicts are the very ones last checked, unchanged: their version tags say so, one read
    per dict (`dict_tags`). Otherwise the values are compared by identity (`SameObjects`: one id per value, read
    from C), and where they pass, the dicts' tags stand for them from then on. (Tags say nothing of what
    happened to the objects themselves: a tensor's storage swapped under it (``t.data = other``, ``t.set_``)
    keeps its identity; a caller that cares reads what it needs of them, e.g. their addresses.)"""

    __slots__ = ("objects", "tags")

    def __init__(self, dicts: Sequence[dict]) -> None:
        self.objects = SameObjects(values_of(dicts))
        self.tags = dict_tags(dicts)

    def __call__(self, dicts: Sequence[dict]) -> bool:
        tags = dict_tags(dicts)
        if tags is not None and tags == self.tags:
            return True
        if not self.objects(values_of(dicts)):
            return False
        self.tags = tags
        return True


class VersionBases:
    """The tensors whose version counters are a list of tensors' counters: a view shares its base's counter (an
    in-place write into any view of a buffer moves the buffer's version, and every view's), any other tensor
    has its own. Where the tensors are views of a few buffers (`shard`'s per-key views of each unit's flat
    buffer), the few bases' versions say whether any of the tensors was written in place: one read per buffer
    where a walk reads one per tensor.

    Each buffer's version is read through the first of the tensors that shares its counter (not the buffer's
    own tensor, which the step has not read: the first view's object the caller has, after a walk of the
    tensors, in its caches). Holds the tensors weakly. A view keeps its base's counter for good:
    ``t.data = other`` and ``t.set_(...)`` keep it, and the one call that gives a tensor another counter,
    `torch.utils.swap_tensors`, refuses a tensor with a weak reference (every view is held weakly for that).
    Reading `versions` needs the tensors alive: a caller reads it only where it knows them alive (in a dict it
    found unchanged, `dict_tags`). Eager code only."""

    __slots__ = ("firsts", "views")

    def __init__(self, firsts: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        self.firsts = [weakref.ref(t) for t in firsts]
        self.views = [weakref.ref(t) for t in views]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> VersionBases | None:
        """The bases of ``tensors``, or None where they are fewer buffers than tensors by none (each tensor with
        a counter of its own, as without `shard`: their own versions are as few reads, and none is held)."""
        firsts: dict[int, torch.Tensor] = {}  # (each base's id: the first tensor sharing its counter)
        for t in tensors:
            firsts.setdefault(id(t if t._base is None else t._base), t)
        if len(firsts) == len(tensors):
            return None
        return cls(list(firsts.values()), [t for t in tensors if t._base is not None])

    def versions(self) -> list[int]:
        """Each buffer's version, in order."""
        return list(map(version_of, map(_dereference, self.firsts)))


def values_of(dicts: Iterable[dict]) -> Iterable:
    """Every dict's values, dict after dict, in one iterator."""
    return itertools.chain.from_iterable(map(dict.values, dicts))


def keyed_alike(a: dict, b: dict) -> bool:
    """``a.keys() == b.keys()``: compared in order first (two tuples of the same key objects, from C, where a
    comparison of key sets looks every key up: a step's param-shaped dicts are keyed in one order), as sets
    where the orders differ."""
    return len(a) == len(b) and (tuple(a) == tuple(b) or a.keys() == b.keys())


def values_in_order(d: dict, keys) -> Iterable:
    """``d[k] for k in keys``: ``d``'s values as they are where ``d`` is keyed by ``keys`` in their order already
    (as a step's param-shaped dicts are: no lookup per key), else looked up by ``map`` (raises KeyError where a
    key is missing)."""
    return d.values() if len(d) == len(keys) and tuple(d) == tuple(keys) else map(d.__getitem__, keys)


# -- reads of every tensor of a list, at C speed ----------------------------------------------------------
# A step reads a few attributes of every parameter (its version, its data pointer, its shape) for checks that
# pass in the common case; a comprehension makes one Python-level call per tensor and read, which on a GPU
# host cost more than the kernels some of them guard. ``map`` over these getters makes the same reads from C.

PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
version_of = operator.attrgetter("_version")
shape_of = operator.attrgetter("shape")
dtype_of = operator.attrgetter("dtype")
requires_grad_of = operator.attrgetter("requires_grad")
# (methods, unbound: ``map(data_ptr_of, tensors)``)
data_ptr_of, numel_of, is_contiguous_of, device_index_of = (torch.Tensor.data_ptr, torch.Tensor.numel,
                                                            torch.Tensor.is_contiguous, torch.Tensor.get_device)


def read_in_c(values: Iterable) -> bool:
    """Whether ``map`` over the getters above may read every one of ``values``: each is a `torch.Tensor` or
    `nn.Parameter` (not a subclass, whose attributes may run its own code, nor another object), and dynamo is
    not tracing (it cannot trace a call of an ``attrgetter``; a compiled step makes these reads once, at its
    trace, whichever way)."""
    return not tracing() and PLAIN_TENSOR_TYPES.issuperset(map(type, values))
