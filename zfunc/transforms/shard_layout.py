"""Where each parameter's elements live under `shard`: units, flat buffers, rank slices.

A *unit* is a group of parameters that is gathered (stage 3) or
reduce-scattered (stage 2) with one collective: by default each of the
model's blocks (`zfunc.blocks.find_blocks`, the same blocks `checkpoint`
recomputes) is a unit, and every other parameter belongs to the root unit
``""``. A unit's parameters, flattened and concatenated in key
order, form one flat buffer padded with zeros to a multiple of N; rank r owns
the contiguous slice ``[r·S, (r+1)·S)`` of it, S = padded/N. So a parameter may
be split between ranks, and a rank's slice of a parameter may be empty.

Per-parameter tensors in the state (shards, optimizer moments, masters) are
1-D *views* into one flat buffer per unit, so a collective or a fused
optimizer kernel can take a whole unit at once without copying, while the
optimizer and the user still see a dict keyed by parameter name
(FSDP1's FlatParameter without the wrapper type).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Callable, Iterable

import torch

from zfunc.compiled import all_true, cached_property, constant_table, dict_of, remember, tracing
from zfunc.blocks import find_blocks
from zfunc.tree import SameValues, register_pytree_node, shape_of

ROOT = ""


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """One unit: its parameter keys, shapes and offsets in its flat buffer."""

    name: str
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    world_size: int

    # Derived sizes are cached on first use: shard reads them for every parameter
    # of every unit in every forward, and recomputing them made its Python
    # overhead grow with the square of a unit's parameter count (~30 ms per
    # GPT-2-medium step). The layout is immutable, so the cache never goes stale.
    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(_prod(s) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, pos = [], 0
        for n in self.numels:
            out.append(pos)
            pos += n
        return tuple(out)

    @cached_property
    def numel(self) -> int:
        return sum(self.numels)

    @cached_property
    def shard_size(self) -> int:
        return -(-self.numel // self.world_size)

    @cached_property
    def padded(self) -> int:
        return self.shard_size * self.world_size

    def local_range(self, index: int, rank: int) -> tuple[int, int]:
        """``[a, b)``: the elements of parameter ``index`` (flattened) owned by ``rank``."""
        start, n = self.offsets[index], self.numels[index]
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        a, b = max(start, lo) - start, min(start + n, hi) - start
        return (a, b) if b > a else (0, 0)

    def shard_position(self, index: int, rank: int) -> int:
        """Where parameter ``index``'s local slice starts in ``rank``'s flat shard."""
        a, b = self.local_range(index, rank)
        return self.offsets[index] + a - rank * self.shard_size if b > a else 0

    # -- building and viewing flat buffers ------------------------------
    def rank_region(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s slice ``[rank·S, (rank+1)·S)`` of a padded flat buffer (a view)."""
        return flat[rank * self.shard_size:(rank + 1) * self.shard_size]

    def shard_views(self, flat_shard: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """Per-key 1-D views of ``rank``'s flat shard."""
        return {key: flat_shard[pos:end] for key, pos, end in self.shard_spans(rank)}

    def split_shard(self, flat_shard: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """`shard_views` in one ``split_with_sizes`` (one dispatch instead of a slice per key: stage 3 makes
        them for every unit in every backward), where ``rank``'s slices tile its shard with none empty and no
        gradient is recorded (autograd would record a split's outputs as one multi-output node); else
        `shard_views`. The views are the same: offsets, shapes, strides."""
        sizes = self._split_sizes(rank)
        if sizes is None or torch.is_grad_enabled():
            return self.shard_views(flat_shard, rank)
        return dict(zip(self.keys, flat_shard.split_with_sizes(sizes)))

    def _split_sizes(self, rank: int) -> tuple[int, ...] | None:
        """The sizes `split_shard` splits ``rank``'s shard into (each key's, then the padding), or None."""
        cache = self._splits
        if rank not in cache:
            sizes, end = [], 0
            for _, a, b in self.shard_spans(rank):
                if a != end or b <= a:
                    return remember(cache, rank, None)
                sizes.append(b - a)
                end = b
            return remember(cache, rank, (*sizes, self.shard_size - end))
        return cache[rank]

    @cached_property
    def _splits(self) -> dict[int, tuple[int, ...] | None]:
        return {}

    def shard_spans(self, rank: int) -> tuple[tuple[str, int, int], ...]:
        """``(key, start, end)`` of each key's slice in ``rank``'s flat shard (cached per rank: shard views a
        unit's shard at every step)."""
        cache = self._spans
        if rank not in cache:
            spans = []
            for i, key in enumerate(self.keys):
                a, b = self.local_range(i, rank)
                pos = self.shard_position(i, rank)
                spans.append((key, pos, pos + (b - a)))
            return remember(cache, rank, tuple(spans))
        return cache[rank]

    @cached_property
    def _spans(self) -> dict[int, tuple[tuple[str, int, int], ...]]:
        return {}

    def filled_keys(self, rank: int) -> tuple[str, ...]:
        """The keys with elements in ``rank``'s flat shard, in their order there (their slices tile its start)."""
        cache = self._filled_tables  # (each a `constant_table`: a traced step reads it under one guard)
        if rank not in cache:
            filled = tuple(key for key, start, end in self.shard_spans(rank) if end > start)
            remember(cache, rank, constant_table(filled))
            return filled
        (filled,) = cache[rank]  # (`zfunc.compiled.table_of`, inline: a call dynamo inlines costs it instructions)
        return filled

    @cached_property
    def _filled_tables(self) -> dict[int, dict]:  # (not ``_filled``: a layout pickled before keeps tuples there)
        return {}

    def table(self) -> tuple[str, tuple[str, ...], tuple[int, ...], int, int, tuple[str, ...], tuple]:
        """``(name, keys, numels, numel, padded, shaped keys, their shapes)``: what a step reads of this unit to
        split and view its flat buffers (the last two: `_shaped`), as one `zfunc.compiled.constant_table`, which
        dynamo guards by one comparison where it would guard each element of each field."""
        (table,) = self._table  # (`zfunc.compiled.table_of`, inline: a call dynamo inlines costs it instructions)
        return table

    @cached_property
    def _table(self) -> dict:
        return constant_table((self.name, self.keys, self.numels, self.numel, self.padded, *self._shaped))

    def derive(self, rank: int) -> None:
        """Compute now what the cached properties and per-rank caches hold for ``rank``: a step that dynamo
        traces first (``torch.compile``) never runs eagerly to fill them, and a trace computes each again at
        every use without storing it (`zfunc.compiled.remember`): ~10% of the Python dynamo interpreted for a
        12-block step. Outside a trace only."""
        if torch.compiler.is_dynamo_compiling():
            return
        for name in ("numels", "offsets", "numel", "shard_size", "padded", "_strides", "_shaped", "_table"):
            getattr(self, name)
        self.shard_spans(rank), self._split_sizes(rank), self.shard_positions(rank), self.filled_keys(rank)

    def full_views(self, flat_full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-key views, in their shapes, of a gathered flat buffer."""
        return {key: flat_full[o:o + n].view(shape)
                for key, o, n, shape in zip(self.keys, self.offsets, self.numels, self.shapes)}

    def split_views(self, flat_full: torch.Tensor) -> dict[str, torch.Tensor]:
        """`full_views` made by one ``split``: what a traced step uses, where it is one node of the graph (not a
        slice and a view per key), and its gradient one concatenation (not a zero-filled scatter per key
        summed into the unit's gradient)."""
        return self.reshaped(self.split_flat(flat_full))

    def split_flat(self, flat_full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each key's 1-D part of a full flat buffer, by one ``split`` (the padding left out)."""
        ((_, keys, numels, numel, padded, _, _),) = self._table  # (`table`, inline: one guard while dynamo traces)
        return dict_of(keys, flat_full.split(numels + ((padded - numel,) if padded > numel else ())))

    def reshaped(self, slices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each key's tensor in ``slices`` viewed in its parameter's shape: at world size 1, where a shard
        is its whole parameter (1-D ones are given as they are)."""
        # (By ``map``: in C eagerly, and natively while dynamo traces, where a comprehension is interpreted per key.)
        ((_, keys, _, _, _, shaped, shapes),) = self._table  # (`table`, inline)
        out = dict_of(keys, map(slices.__getitem__, keys))
        out.update(zip(shaped, map(torch.Tensor.view, map(slices.__getitem__, shaped), shapes)))
        return out

    @cached_property
    def _shaped(self) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
        """The keys whose parameters are not 1-D, and their shapes (what `reshaped` views)."""
        pairs = [(key, shape) for key, shape in zip(self.keys, self.shapes) if len(shape) != 1]
        return tuple(key for key, _ in pairs), tuple(shape for _, shape in pairs)

    def strided_views(self, flat_full: torch.Tensor) -> list[torch.Tensor]:
        """`full_views` as one ``as_strided`` each (half the dispatches of slice + view), in key
        order; for plain data only (autograd through ``as_strided`` is slower than through a slice)."""
        base = flat_full.storage_offset()
        return [flat_full.as_strided(shape, stride, base + offset)
                for shape, stride, offset in zip(self.shapes, self._strides, self.offsets)]

    @cached_property
    def _strides(self) -> tuple[tuple[int, ...], ...]:
        return tuple(torch.empty(shape, device="meta").stride() for shape in self.shapes)

    def shard_data(self, slices: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
        """``rank``'s flat shard as plain data: the buffer ``slices`` are views of, else their concatenation.

        A state's shards are views of one flat buffer per unit (see the
        module docstring), and a step differentiates detached views of them,
        so there is usually nothing to copy: the buffer is found from the
        slices' storage, checked key by key for exactly this layout.
        """
        first = slices[self.keys[0]]
        storage = first.untyped_storage()
        if storage.nbytes() == self.shard_size * first.element_size():
            base = storage.data_ptr()
            if all(slices[k].numel() == 0 or (slices[k].untyped_storage().data_ptr() == base
                                               and slices[k].storage_offset() == pos)
                   for k, pos in zip(self.keys, self.shard_positions(rank))):
                return first.new_empty(0).set_(storage, 0, (self.shard_size,)).detach()
        with torch.no_grad():
            return self.cat_shard(slices, rank)

    def shard_positions(self, rank: int) -> tuple[int, ...]:
        """Where each key's slice starts in ``rank``'s flat shard (cached per rank)."""
        cache = self._positions
        if rank not in cache:
            return remember(cache, rank, tuple(self.shard_position(i, rank) for i in range(len(self.keys))))
        return cache[rank]

    @cached_property
    def _positions(self) -> dict[int, tuple[int, ...]]:
        return {}

    def pack_full(self, tensors: dict[str, torch.Tensor], like: torch.Tensor | None = None) -> torch.Tensor:
        """A new padded flat buffer holding ``tensors`` (full shapes), in one concatenation."""
        ref = like if like is not None else tensors[self.keys[0]]
        parts = [tensors[key].reshape(-1).to(device=ref.device, dtype=ref.dtype) for key in self.keys]
        if self.padded > self.numel:
            parts.append(torch.zeros(self.padded - self.numel, dtype=ref.dtype, device=ref.device))
        return torch.cat(parts)

    def cat_shard(self, slices: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
        """``rank``'s flat shard from its per-key slices (differentiable; pads with zeros).

        Empty slices stay in the concatenation: a rank whose share of a unit is
        only padding still gets an autograd edge to its (empty) slices, so its
        backward issues the unit's reduction like every other rank's.
        """
        parts = [_flat(slices[k]) for k in self.keys]
        used = sum(p.numel() for p in parts)
        ref = slices[self.keys[0]]
        if used < self.shard_size:
            parts.append(ref.new_zeros(self.shard_size - used))
        return torch.cat(parts)

    def flat_of(self, views: dict[str, torch.Tensor], size: int) -> torch.Tensor | None:
        """The flat buffer that ``views`` are views of, if they are exactly ours.

        Returns None when they are not (e.g. a caller replaced them with new
        tensors); the caller then repacks.
        """
        first = views[self.keys[0]]
        storage = first.untyped_storage()
        if storage.nbytes() != size * first.element_size():
            return None
        base = storage.data_ptr()
        flat = first.new_empty(0).set_(storage, 0, (size,))
        return flat if all(v.untyped_storage().data_ptr() == base for v in views.values()) else None

    def full_flat_of(self, views: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """`flat_of` for the unit's full parameters (stages 1/2), each also where the layout puts it: tensors
        moved between keys (two parameters of one shape swapped in state.params) share the storage too, and
        would be updated as each other."""
        flat = self.flat_of(views, self.padded)
        if flat is None:
            return None
        ours = list(map(views.__getitem__, self.keys))
        if (list(map(torch.Tensor.storage_offset, ours)) != list(self.offsets)
                or list(map(shape_of, ours)) != list(self.shapes)):
            return None
        return flat


class StateViews:
    """Stages 1/2, eager: each unit's flat buffer of one state and this rank's shard views of them, found once
    (`zfunc.transforms.shard.shard._flats_and_shards`) and reused while ``state.params`` holds the very
    tensors they were found from (`zfunc.tree.SameValues`: the very dict of the step before, unchanged, by its
    version tag; another dict of the same tensors by their ids).

    Derived data kept with the layout (`ShardLayout.state_views`), not configuration: one state at a time,
    dropped when that state's first parameter is freed (a state its user let go is not kept alive by its
    views), and left out of copies and pickles (a copy of a state finds its own)."""

    def __init__(self) -> None:
        self._entry: tuple[SameValues, dict, dict] | None = None

    def get(self, params: dict) -> tuple[dict, dict] | None:
        entry = self._entry  # (read once: another thread may put its own state's)
        if entry is None or not entry[0]((params,)):
            return None
        return entry[1], entry[2]

    def put(self, params: dict, flats: dict, shards: dict) -> None:
        same = SameValues((params,))
        self._entry = (same, flats, shards)
        weakref.finalize(next(iter(params.values())), self._drop, same)

    def _drop(self, same: SameValues) -> None:
        if self._entry is not None and self._entry[0] is same:
            self._entry = None

    def __deepcopy__(self, memo) -> "StateViews":
        return StateViews()

    def __reduce__(self):
        return StateViews, ()


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """The sharding of a whole state: stage, world size, rank, units.

    Lives in ``state.extras["shard"]`` so that checkpoints carry it. It is a
    pytree node with no leaves (all static), invisible to tree maps.
    """

    stage: int
    world_size: int
    rank: int
    units: tuple[UnitLayout, ...]

    def __post_init__(self) -> None:
        # (Derived tables built with the layout, which is immutable: see `UnitLayout.derive`.)
        if not torch.compiler.is_dynamo_compiling():
            for unit in self.units:
                unit.derive(self.rank)
            self.keys, self._unit_of, self._by_name  # noqa: B018 (filled by reading them)

    @cached_property
    def state_views(self) -> StateViews:
        """Stages 1/2: the unit flats and shard views of the state last stepped with this layout (`StateViews`)."""
        return StateViews()

    def unit_of(self) -> dict[str, UnitLayout]:
        """``{param key: its unit}`` (built once; the layout is immutable)."""
        return self._unit_of

    @cached_property
    def _unit_of(self) -> dict[str, UnitLayout]:
        return {key: unit for unit in self.units for key in unit.keys}

    def unit_of_name(self, name: str) -> UnitLayout | None:
        """The unit called ``name`` (``ROOT`` for the root), if there is one."""
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, UnitLayout]:
        return {unit.name: unit for unit in self.units}

    @cached_property
    def keys(self) -> frozenset[str]:
        return frozenset(k for u in self.units for k in u.keys)

    def reshaped(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every unit's `UnitLayout.reshaped`: at world size 1, each shard viewed in its parameter's shape, keyed
        in ``shards``' order (``shards`` holds exactly the layout's keys), so that what is differentiated, and its
        gradients, are keyed as the state is (the update reads them in that order: `zfunc.optim.fused_plan`)."""
        out = {**shards}  # (the 1-D ones as they are; an update of a key keeps its place)
        for unit in self.units:
            keys, shapes = unit._shaped
            out.update(zip(keys, map(torch.Tensor.view, map(shards.__getitem__, keys), shapes)))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "units": [{"name": u.name, "keys": list(u.keys), "shapes": [list(s) for s in u.shapes]}
                          for u in self.units]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShardLayout":
        n = data["world_size"]
        units = tuple(UnitLayout(u["name"], tuple(u["keys"]), tuple(tuple(s) for s in u["shapes"]), n)
                      for u in data["units"])
        return cls(data["stage"], n, data["rank"], units)


register_pytree_node(ShardLayout, lambda layout: ((), layout), lambda layout, _: layout)


def make_layout(params: dict[str, torch.Tensor], stage: int, world_size: int, rank: int,
                unit_names: Iterable[str] | None = None, blocks: Iterable[str] | None = None) -> ShardLayout:
    """Group ``params`` into units: ``unit_names`` if given, else ``blocks`` (the model's, recorded
    in the state), else `find_blocks` of the parameter names; everything else goes to the root.

    Refuses unit names that hold no parameter or that nest inside another unit.
    """
    if unit_names is not None:
        names = list(unit_names)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"shard(units=...): unit names are module names (non-empty strings), got {name!r}")
            if not any(key.startswith(name + ".") for key in params):
                raise ValueError(
                    f"shard(units=...): {name!r} holds no trainable parameter (parameter names look like "
                    f"{next(iter(params), '?')!r}); name modules whose parameters should be gathered together")
            outer = next((o for o in names if o != name and name.startswith(o + ".")), None)
            if outer is not None:
                raise ValueError(f"shard(units=...): {name!r} lies inside unit {outer!r}; name each module once")
        if len(set(names)) != len(names):
            raise ValueError(f"shard(units=...): a unit is named twice in {names}")
    elif blocks is not None:
        names = list(blocks)
    else:
        names = find_blocks({k: v.numel() for k, v in params.items()})
    groups: dict[str, list[str]] = {name: [] for name in [ROOT, *names]}
    for key in params:
        owner = next((n for n in names if key.startswith(n + ".")), ROOT)
        groups[owner].append(key)
    units = tuple(UnitLayout(name, tuple(keys), tuple(tuple(params[k].shape) for k in keys), world_size)
                  for name, keys in groups.items() if keys)
    return ShardLayout(stage, world_size, rank, units)


# --------------------------------------------------------------------------
# Param-shaped subtrees: dicts keyed exactly like params (moments, masters).


def is_param_shaped(node: Any, keys: set[str]) -> bool:
    """Whether ``node`` is a dict of tensors keyed exactly by ``keys``."""
    # (The length first: a cheap refusal of the other dicts. Then the keys as sets and the values' types by
    # ``map``, both from C: this runs for every param-shaped dict of the state at every step, and dynamo runs
    # them natively too, `zfunc.compiled`.)
    if not isinstance(node, dict) or len(node) != len(keys):
        return False
    if tracing():  # (a frozenset: dynamo interprets the comparison of a dict view key by key)
        return frozenset(node) == keys and all_true(map(isinstance, node.values(), itertools.repeat(torch.Tensor)))
    return node.keys() == keys and all(map(isinstance, node.values(), itertools.repeat(torch.Tensor)))


def map_param_shaped(tree: Any, keys: set[str], fn: Callable[[dict], dict],
                     other: Callable[[Any], Any] | None = None) -> Any:
    """Rebuild ``tree`` with every param-shaped dict ``d`` replaced by ``fn(d)`` and, with ``other``, every
    leaf outside those dicts ``x`` by ``other(x)``."""
    if is_param_shaped(tree, keys):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_param_shaped(v, keys, fn, other) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_param_shaped(v, keys, fn, other) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_param_shaped(v, keys, fn, other) for v in tree)
    return tree if other is None else other(tree)


def zip_param_shaped(old: Any, new: Any, keys: set[str], fn: Callable[[dict, dict], dict]) -> Any:
    """Walk two trees of the same shape; param-shaped pairs become ``fn(old, new)``, the rest ``new``. A
    subtree that is the very object in both is ``new`` as it is (nothing to pair: ``fn`` of a dict with
    itself is that dict, as `zfunc.transforms.shard`'s write-back makes it; the fused update hands its
    moments back so, and they are not walked key by key at every step). (Not while dynamo traces: its 2.11
    cannot trace ``is`` between two dicts.)"""
    return _zip_param_shaped(old, new, keys, fn, tracing())


def _zip_param_shaped(old: Any, new: Any, keys: set[str], fn: Callable, traced: bool) -> Any:
    """`zip_param_shaped`, told once whether dynamo traces (not asked at every node of the trees)."""
    if not isinstance(old, (dict, list, tuple)):  # (a leaf: a count, a scale, a layout)
        return new
    if not traced and old is new:
        return new
    if is_param_shaped(old, keys) and isinstance(new, dict):
        return fn(old, new)
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: _zip_param_shaped(old.get(k), v, keys, fn, traced) for k, v in new.items()}
    if isinstance(old, tuple) and hasattr(old, "_fields") and type(new) is type(old):
        return type(new)(*(_zip_param_shaped(o, n, keys, fn, traced) for o, n in zip(old, new)))
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) and len(old) == len(new):
        return type(new)(_zip_param_shaped(o, n, keys, fn, traced) for o, n in zip(old, new))
    return new


def merge_units(pieces: list, order: list[str]) -> Any:
    """One tree from per-unit trees of one structure: their param-shaped dicts (each keyed by its unit's
    keys) joined in ``order``; every other leaf taken from the first piece (they agree: step counts,
    loss scales)."""
    def keys_of(tree) -> set:
        return set(tree.params) if hasattr(tree, "params") else set()

    key_sets = [keys_of(p) for p in pieces]
    position = {k: i for i, k in enumerate(order)}

    def merge(nodes: list) -> Any:
        first = nodes[0]
        if all(is_param_shaped(n, ks) for n, ks in zip(nodes, key_sets)):
            joined = {k: v for n in nodes for k, v in n.items()}
            return {k: joined[k] for k in sorted(joined, key=position.__getitem__)}
        if isinstance(first, dict):
            return {k: merge([n[k] for n in nodes]) for k in first}
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*(merge([n[i] for n in nodes]) for i in range(len(first))))
        if isinstance(first, (list, tuple)):
            return type(first)(merge([n[i] for n in nodes]) for i in range(len(first)))
        if hasattr(first, "params") and hasattr(first, "replace"):  # a TrainState
            return first.replace(step=first.step, params=merge([n.params for n in nodes]),
                                 opt_state=merge([n.opt_state for n in nodes]),
                                 extras=merge([n.extras for n in nodes]))
        return first

    return merge(pieces)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 1-D (itself when it is: no view, which in a traced graph would be one more node)."""
    return t if t.dim() == 1 else t.reshape(-1)


def _prod(shape: Iterable[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
