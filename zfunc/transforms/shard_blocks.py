"""Which blocks of a model gather which `shard` unit: found once per model and state layout.

Under stages 2 and 3 a block's forward runs on its unit's full parameters
(`zfunc.transforms.shard_units`). Which blocks those are (each unit's own
module, and every other block whose trainable parameters all belong to one
unit: the same layer object at two positions), which of a block's parameters
are its unit's and which another's (a weight tied across blocks), and whether
the layout's full shapes are the model's depend only on the model and the
state's layout, both immutable: `BlockPlan` holds them, built at the first
call and kept by the model's `zfunc.model_structure.ModelStructure.derived`, so a
step's call reads them instead of deriving them again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zfunc.compiled import tracing
from zfunc.model_call import refuse_container_block
from zfunc.params_check import check_layout_shapes
from zfunc.transforms.shard_layout import ROOT, ShardLayout, UnitLayout


class BlockUnit(NamedTuple):
    """A block whose forward gathers a unit: its parameters by local name, split by the unit they
    belong to (found once per model and layout, `BlockPlan`)."""

    name: str
    unit: UnitLayout
    mine: dict[str, str]  # local name -> key, for the unit's own parameters
    foreign: dict[str, str]  # local name -> key, for parameters of other units (a weight tied across blocks)

    @staticmethod
    def of(name: str, unit: UnitLayout, local: dict[str, str]) -> BlockUnit:
        own = set(unit.keys)
        return BlockUnit(name, unit, {n: k for n, k in local.items() if k in own},
                         {n: k for n, k in local.items() if k not in own})


class BlockPlan(NamedTuple):
    """What `zfunc.transforms.shard`'s ``apply`` derives from a model and a state's layout, once (kept by
    the model's `zfunc.model_structure.ModelStructure.derived`)."""

    blocks: tuple[BlockUnit, ...]  # the blocks whose forward gathers a unit (`_wrapped_blocks`)
    partial_keys: frozenset  # the keys the model holds only as shards: every block unit's

    @staticmethod
    def build(model_call, layout: ShardLayout, where: str) -> BlockPlan:
        """The plan, after checking that the layout's full shapes are the model's (the model sees the
        blocks' parameters only as 1-D shards, so no later check could see a mismatch)."""
        if not tracing():
            check_layout_shapes(model_call.model, model_call.structure.spec,
                                ((k, shape) for u in layout.units for k, shape in zip(u.keys, u.shapes)), where)
        blocks = tuple(BlockUnit.of(name, unit, model_call.block_param_names(name))
                       for name, unit in _wrapped_blocks(model_call, layout).items())
        return BlockPlan(blocks, frozenset(k for u in layout.units if u.name != ROOT for k in u.keys))


def _wrapped_blocks(model_call, layout: ShardLayout) -> dict[str, Any]:
    """The blocks whose forward gathers a unit: each unit's own module, and every other block of the
    model whose trainable parameters all belong to one unit (the same layer object at two positions).
    A module object is wrapped once, whatever names it has."""
    unit_of = layout.unit_of()
    structure = model_call.structure
    wrapped: dict[str, Any] = {}
    seen: set[int] = set()
    for unit in layout.units:
        if unit.name != ROOT:
            wrapped[unit.name] = unit
            seen.add(id(structure.module(unit.name)))
    for block in structure.blocks():
        if block in wrapped or id(structure.module(block)) in seen:
            continue
        owners = {unit_of[k].name for k in model_call.block_param_names(block).values() if k in unit_of}
        if len(owners) == 1 and ROOT not in owners:
            owner = owners.pop()
            if not block.startswith(owner + ".") and not owner.startswith(block + "."):
                wrapped[block] = layout.unit_of_name(owner)
                seen.add(id(structure.module(block)))
    return wrapped


def refuse_container_units(model_call, layout: ShardLayout) -> None:
    """Refuse a unit named by a container (``units=["blocks"]`` for a ModuleList), as wrapping its block would:
    where no block is wrapped (one rank: the model runs on the shards) the same program must fail alike."""
    for unit in layout.units:
        if unit.name != ROOT:
            refuse_container_block(unit.name, model_call.structure.module(unit.name))
