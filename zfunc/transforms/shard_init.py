"""What `shard` does once, at ``step.init``, for the ranks to train one model, and how it cuts the state to
this rank's share (`partition_state`, `partition_meta_state`: unit by unit, each kind of tensor on its tier).

Every rank must build the same step over the same model (`agree_on_structure`:
the step, parameter names, shapes and dtypes, units, optimizer structure and
hyperparameters, compared on every rank before anything is partitioned); the
initial values are rank 0's on every rank, as DDP does (`from_rank_zero`, or
`same_random_stream` for a meta-built model whose values are drawn unit by
unit); and a root unit holding most of the parameters is worth a warning
(`warn_about_root`: the blocks were probably not found).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from zfunc import dist
from zfunc.interpret import Transform
from zfunc.optim.flat import OWNER, PLACE
from zfunc.tiers.placement import Placement
from zfunc.transforms.shard_layout import ROOT, ShardLayout, make_layout, map_param_shaped, merge_units
from zfunc.tree import tree_leaves, tree_map_tensors

log = logging.getLogger("zfunc.shard")

# A stage-3 root unit holding more than this share of the parameters is gathered whole for the
# whole step: worth a warning, since it usually means the blocks were not found.
ROOT_SHARE_WARNING = 0.5


def agree_on_structure(transform: Any, state, layout: ShardLayout, group: dist.Group) -> None:
    """Every rank must build the same step over the same model: refuse, on every rank, otherwise."""
    if group.size == 1:
        return
    dist.announce(group, "step.init of shard")
    described = {
        "the step": without_addresses(transform.agreed_repr()),
        "the parameter names, in order": list(state.params),
        "the parameter shapes and dtypes": {k: [list(v.shape), str(v.dtype)] for k, v in state.params.items()},
        "the units": [[u.name, list(u.keys)] for u in layout.units],
        "the optimizer state's structure": str(_structure_of(state.opt_state)),
        "the optimizer's hyperparameters": describe_hyperparams(getattr(state.tx, "hyperparams", None)),
    }
    for what, value in described.items():
        dist.agree(value, group, what)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def without_addresses(text: str) -> str:
    """``text`` without the memory addresses of reprs (``<function f at 0x7f..>``): the same code sits at
    other addresses on each rank's process, so ranks compare what the objects are, not where."""
    return _ADDRESS.sub("", text)


def describe_hyperparams(value: Any, depth: int = 0) -> Any:
    """A JSON description of an optimizer's hyperparameters that ranks can compare (`dist.agree`):
    numbers as numbers, nested transformations by their own hyperparameters, functions (schedules,
    masks) by qualified name and the numbers they close over (a schedule's peak rate lives there)."""
    if depth > 8:
        return "..."
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # (JSON has no NaN or infinity)
    if isinstance(value, torch.Tensor):
        return describe_hyperparams(value.tolist(), depth + 1) if value.numel() <= 64 else \
            [list(value.shape), str(value.dtype)]
    if isinstance(value, Mapping):
        return {str(k): describe_hyperparams(v, depth + 1) for k, v in value.items()}
    hyperparams = getattr(value, "hyperparams", None)
    if isinstance(hyperparams, Mapping):  # a nested GradientTransformation
        return describe_hyperparams(hyperparams, depth + 1)
    if isinstance(value, (list, tuple)):
        return [describe_hyperparams(v, depth + 1) for v in value]
    if isinstance(value, functools.partial):
        return {"partial": describe_hyperparams(value.func, depth + 1),
                "args": describe_hyperparams(value.args, depth + 1),
                "keywords": describe_hyperparams(value.keywords, depth + 1)}
    if callable(value) and hasattr(value, "__qualname__"):
        cells = [c.cell_contents for c in getattr(value, "__closure__", None) or () if _filled(c)]
        closed = [describe_hyperparams(c, depth + 1) for c in cells
                  if isinstance(c, (bool, int, float, str, torch.Tensor)) or callable(c)]
        return {"function": f"{getattr(value, '__module__', '?')}.{value.__qualname__}", "closes over": closed}
    return without_addresses(repr(value))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return False
    return True


def _structure_of(tree) -> list:
    return [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x) for x in tree_leaves(tree)]


def from_rank_zero(state, group: dist.Group):
    """The initial state is rank 0's on every rank, as DDP does: each tensor is broadcast from rank 0.

    Ranks seeded differently before building the model (``seed + rank``) would
    otherwise train a model spliced from several initializations. A warning
    says when the values actually differed.
    """
    if group.size == 1:
        return state
    leaves = [x for x in tree_leaves(state) if isinstance(x, torch.Tensor) and x.numel()]
    fingerprint = float(sum(float(x.double().sum()) for x in leaves if x.is_floating_point()))
    fingerprints = dist.all_gather_json(fingerprint, group, "comparing the ranks' initial parameters")
    if len(set(fingerprints)) > 1:
        log.warning("shard: the ranks built different initial parameters (e.g. seeded with seed + rank); "
                    "every rank now starts from rank 0's, as DDP does")
        if group.rank == 0:
            warnings.warn("shard.init: ranks had different initial parameters; using rank 0's (as DDP does). "
                          "Seed every rank alike before building the model to silence this.", stacklevel=3)

    def broadcast(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t
        placed = group.place(t).contiguous()
        work = torch.distributed.broadcast(placed, src=torch.distributed.get_global_rank(group.handle, 0)
                                           if group.handle is not None else 0, group=group.handle, async_op=True)
        dist.Comm(group).finish(work, "sending rank 0's initial parameters")
        return placed if placed.device == t.device else placed.to(t.device)

    return tree_map_tensors(broadcast, state)


def same_random_stream(group: dist.Group, device: torch.device) -> None:
    """Every rank draws a meta-built model's values from rank 0's generator state (ranks seeded with
    ``seed + rank`` would otherwise build different models)."""
    if group.size == 1:
        return
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    placed = group.place(state.clone())
    work = torch.distributed.broadcast(placed, src=torch.distributed.get_global_rank(group.handle, 0)
                                       if group.handle is not None else 0, group=group.handle, async_op=True)
    dist.Comm(group).finish(work, "sending rank 0's random generator state")
    if cuda:
        torch.cuda.set_rng_state(placed.cpu(), device)
    else:
        torch.set_rng_state(placed.cpu())


def warn_about_root(layout: ShardLayout) -> None:
    total = sum(u.numel for u in layout.units)
    root = sum(u.numel for u in layout.units if u.name == ROOT)
    if layout.stage == 3 and total and root / total > ROOT_SHARE_WARNING:
        warnings.warn(
            f"shard(stage=3): the root unit holds {root / total:.0%} of the parameters and is gathered whole for "
            f"the whole step ({len(layout.units) - 1} block units were found). If the model has blocks that "
            "find_blocks did not recognize, name them with shard(..., units=[...]).", stacklevel=3)


# -- cutting the state to this rank's share ------------------------------------------------------------------
def partition_state(transform: Any, state):
    """``shard.init_state``: the plain state ``state`` (every rank's the same after `from_rank_zero`) laid out
    in units (`shard_layout.make_layout`) and cut, unit by unit, to this rank's share on each tensor's tier."""
    if "shard" in state.extras:
        raise ValueError("shard.init: this state is already sharded; pass the plain state from TrainState.create")
    group = transform._group()
    layout = make_layout(state.params, transform.stage, group.size, group.rank, transform.units, state.blocks)
    agree_on_structure(transform, state, layout, group)
    state = from_rank_zero(state, group)
    warn_about_root(layout)
    placement = _placement(transform, layout, group)
    keys = set(state.params)
    pieces = []
    for unit in layout.units:  # one unit at a time: its part of every param-shaped dict
        part = lambda tree, unit=unit: {k: tree[k] for k in unit.keys}  # noqa: E731
        sub = state.replace(params=part(state.params), opt_state=map_param_shaped(state.opt_state, keys, part),
                            extras=map_param_shaped(dict(state.extras), keys, part))
        pieces.append(_partition_unit(transform.stage, sub, layout, unit, placement))
    merged = merge_units(pieces, list(state.params))
    return _finish(transform, merged, state, layout, group)


def partition_meta_state(transform: Any, state, init_device):
    """``shard.init_meta``: a meta-built model's values drawn unit by unit (`zfunc.materialize`); each complete
    unit goes through the inner transforms' init and is cut to this rank's share at once, so no rank ever
    holds more than one unit (and the root unit) of full values."""
    group = transform._group()
    layout = make_layout(state.params, transform.stage, group.size, group.rank, transform.units, state.blocks)
    agree_on_structure(transform, state, layout, group)
    same_random_stream(group, torch.device(init_device))
    warn_about_root(layout)
    placement = _placement(transform, layout, group)
    inner = transform.step
    pieces = []

    def take(name: str, values: dict[str, torch.Tensor]) -> None:
        unit = layout.unit_of_name(name)
        sub = type(state).create({k: values[k] for k in unit.keys}, state.tx)
        del values
        sub = inner.init(sub) if isinstance(inner, Transform) else sub
        pieces.append(_partition_unit(transform.stage, sub, layout, unit, placement))

    state.materializer.run({u.name: frozenset(u.keys) for u in layout.units}, take, init_device, group.device)
    merged = merge_units(pieces, list(state.params))
    return _finish(transform, merged.replace(ties=state.ties, blocks=state.blocks), state, layout, group)


def _placement(transform: Any, layout: ShardLayout, group: dist.Group) -> Placement:
    facts = transform.stack.facts
    return Placement([(u.name, u.shard_size) for u in layout.units], facts.optimizer_split, group.device,
                     facts.params_tier, facts.nvme_dir)


def _partition_unit(stage: int, state, layout: ShardLayout, unit, placement: Placement):
    """``state``'s part for ``unit`` (full tensors, inner transforms' layout) as this rank's share, each
    kind of tensor on its tier (`zfunc.tiers.placement`): parameters where the stack computes (stage 3:
    where parameter shards live), optimizer state and masters on the unit's tier."""
    keys = set(unit.keys)

    def optimizer(tree: dict) -> dict:
        region = unit.rank_region(unit.pack_full(tree), layout.rank)
        return owned_views(unit, placement.optimizer_tensor(unit.name, region), layout.rank)

    opt_state = map_param_shaped(state.opt_state, keys, optimizer)
    extras = map_param_shaped(dict(state.extras), keys, optimizer)
    params = {k: state.params[k] for k in unit.keys}
    if stage == 3:
        # (The owner also keeps a pinned buffer's registration as long as its views live.)
        new_params = owned_views(unit, placement.params_tensor(unit.rank_region(unit.pack_full(params),
                                                                                 layout.rank)), layout.rank)
    else:  # full parameters, stored as views of one flat buffer per unit, each recording it
        flat = unit.pack_full(params).to(placement.device)
        new_params = _recording_owner(unit.full_views(flat), flat)
    return state.replace(params=new_params, opt_state=opt_state, extras=extras)


def _finish(transform: Any, merged, state, layout: ShardLayout, group: dist.Group):
    """The merged units' state, with the shard layout recorded and the small replicated tensors
    (step, counts, loss scale) on the compute device when the whole optimizer state is there."""
    merged = merged.replace(extras={**merged.extras, "shard": layout}, ties=state.ties, blocks=state.blocks)
    if group.device.type == "cuda" and transform.stack.facts.optimizer_split[0] >= 1.0:
        keys = set(state.params)
        on_device = lambda t: t.to(group.device)  # noqa: E731
        small = lambda tree: tree_map_tensors(on_device, tree)  # noqa: E731
        merged = merged.replace(step=on_device(merged.step),
                                opt_state=_map_small(merged.opt_state, keys, small),
                                extras=_map_small(merged.extras, keys, small))
    return merged


def owned_views(unit, flat_shard: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
    """Per-key views of ``unit``'s flat shard on ``rank``, each recording the buffer it views (``_zfunc_owner``,
    `zfunc.optim.flat`: a compiled step updates and writes back the unit through it, in one piece)."""
    return _recording_owner(unit.shard_views(flat_shard, rank), flat_shard)


def _recording_owner(views: dict[str, torch.Tensor], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """``views`` (of ``flat``), each recording ``flat`` as the buffer it views (``_zfunc_owner``) and its key as
    where in it it lies (``_zfunc_key``). A compiled step cannot read a view's storage offset; what it reads
    instead is this record, so that a view found under another key (two parameters of one shape swapped in
    state.params) is not taken for the one the layout puts there (`zfunc.optim.flat.owner_of`)."""
    for key, view in views.items():
        setattr(view, OWNER, flat)
        setattr(view, PLACE, key)
    return views


def _map_small(tree, keys: set, fn):
    """``tree`` with ``fn`` applied to every tensor but those in its param-shaped dicts (which stay where placed)."""
    return map_param_shaped(tree, keys, lambda d: d, lambda x: fn(x) if isinstance(x, torch.Tensor) else x)
