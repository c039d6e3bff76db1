"""Run a module with other tensors in its parameter and buffer slots, for the length of a call.

What `torch.func.functional_call` does (through torch's private
``_reparametrize_module``), without its per-call work. That function, on
every call, builds an accessor, looks up each name's sub-module, and, to
re-tie weights, walks every sub-module of the model: for a GPT-2 with 24
blocks, zfunc's `apply` paid it once for the model and once per block per
forward, ~0.1 ms per block on the host, while the GPU waited.

`swapped` looks up the slot each name lives in (the owning sub-module's
``_parameters`` or ``_buffers`` dict, and the attribute) once per module and
set of names, and then only assigns into those dicts and assigns the
originals back. It takes that fast route only where torch's would do nothing
more: every name is a parameter or buffer slot, and every tensor reachable
under two names (tied weights) is given under all of them. Otherwise it
hands the call to ``_reparametrize_module`` itself.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Iterator

import torch
from torch import nn

from zfunc.compiled import remember, tracing

# (the owning module's _parameters or _buffers dict, attribute name), one per given name
Slots = list[tuple[dict, str]]


class SlotSet:
    """The slots of one set of names (`Slots`), laid out for `swapped`, which reads and assigns them for every
    parameter at every call: the owners' dicts and the attributes as two lists (read by ``map`` in C), and
    whether no slot is given under two names (then a forward's assignment to one is found in C too)."""

    __slots__ = ("attrs", "distinct", "owners")

    def __init__(self, slots: Slots) -> None:
        # (Two columns by one ``zip``: dynamo runs it natively, where it interprets a comprehension per slot.)
        owners, attrs = zip(*slots) if slots else ((), ())
        self.owners, self.attrs = list(owners), list(attrs)
        # (Not asked while dynamo traces, whose 2.11 cannot take the id of a dict: `_refuse_reassigned` checks
        # nothing in a compiled step.)
        self.distinct = not tracing() and len({(id(where), attr) for where, attr in slots}) == len(slots)


class SlotTable:
    """Every parameter and buffer slot of a module by qualified name, and the names that share one tensor.

    What `swapped` needs to find a set of names' slots, found in one walk over the module. A model's
    structure builds the tables of the model and its blocks once, eagerly (`zfunc.model_structure`), so that
    a call traced by torch.compile, which fills no cache (`zfunc.compiled.remember`), looks names up in
    them instead of tracing a walk over every sub-module of the model at each block (which was ~40% of
    dynamo's work on a GPT step). Identities are those of when it was built: releasing a module's
    parameters keeps them (``p.data = ...``).
    """

    __slots__ = ("slots", "twins")

    def __init__(self, module: nn.Module) -> None:
        self.slots: dict[str, tuple[dict, str]] = {}
        # Names that share one tensor, grouped by identity (`is`, not id(): torch.compile may trace this on
        # its first call, where a tensor swapped in by an outer call has no id to take).
        groups: list[tuple[torch.Tensor, list[str]]] = []
        for prefix, sub in module.named_modules(remove_duplicate=False):
            head = f"{prefix}." if prefix else ""
            for where in (sub._parameters, sub._buffers):
                for attr, t in where.items():
                    if t is None:
                        continue
                    self.slots.setdefault(head + attr, (where, attr))
                    group = next((g for g in groups if g[0] is t), None)
                    if group is None:
                        groups.append((t, [head + attr]))
                    else:
                        group[1].append(head + attr)
        self.twins = {name: names for _, names in groups if len(names) > 1 for name in names}


@contextlib.contextmanager
def swapped(module: nn.Module, tensors: dict[str, torch.Tensor], cache: dict,
            tie_weights: bool = True, table: SlotTable | None = None) -> Iterator[None]:
    """Inside the ``with``, ``module``'s tensor named ``k`` (qualified) is ``tensors[k]``.

    ``cache``: a dict the caller keeps across calls (the slots found for each
    module and set of names). ``tie_weights``: as in torch's
    ``functional_call``; it matters only on the slow route. ``table``: the
    module's `SlotTable`, if the caller has it.
    """
    key = (module, tuple(tensors))
    slots = cache.get(key)
    if slots is None:
        found = _find_slots(module, tensors, table)
        slots = remember(cache, key, False if found is None else SlotSet(found))
    if slots is False:
        with torch.nn.utils.stateless._reparametrize_module(module, tensors, tie_weights=tie_weights,
                                                             strict=False):
            yield
        return
    owners, attrs = slots.owners, slots.attrs
    originals = list(map(operator.getitem, owners, attrs))
    traced = tracing()
    try:
        if traced:  # (slot by slot through ``map``, which dynamo runs natively: see `zfunc.compiled`)
            list(map(dict.__setitem__, owners, attrs, tensors.values()))
        else:
            for where, attr, tensor in zip(owners, attrs, tensors.values()):
                where[attr] = tensor
        yield
        _refuse_reassigned(slots, tensors)
    finally:
        # In reverse: a slot given under two names (a module at two positions) ends with its original (both
        # entries read it before any was assigned).
        if traced:
            list(map(dict.__setitem__, reversed(owners), reversed(attrs), reversed(originals)))
        else:
            for where, attr, original in zip(reversed(owners), reversed(attrs), reversed(originals)):
                where[attr] = original


def _refuse_reassigned(slots: SlotSet, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a call whose forward assigned one of the swapped-in tensors (``self.ema = 0.9 * self.ema + ...``):
    restoring the slots would undo the assignment without a word."""
    if tracing():
        return
    if slots.distinct and all(map(operator.is_, map(operator.getitem, slots.owners, slots.attrs), tensors.values())):
        return  # (the common case, read in C: every slot holds what was swapped in)
    pairs = list(zip(slots.owners, slots.attrs))
    last = {(id(where), attr): tensor for (where, attr), tensor in zip(pairs, tensors.values())}  # (a slot given
    # under two names, a module at two positions, holds the later one)
    changed = [name for (where, attr), name in zip(pairs, tensors) if where[attr] is not last[id(where), attr]]
    if changed:
        raise RuntimeError(
            f"the model's forward assigns {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}, a tensor "
            "zfunc swapped in for this call (a parameter, or a buffer cast by mixed_precision(cast_buffers=True)); "
            "the slot is restored when the call ends, so the new value would be silently lost. Update a buffer in "
            "place (self.ema.mul_(0.9).add_(...)), or leave buffers uncast (cast_buffers=False, the default); "
            "change parameters outside the model, in the step.")


def _find_slots(module: nn.Module, tensors: dict[str, torch.Tensor], table: SlotTable | None = None) -> Slots | None:
    """The slot of each name, or None where the fast route would differ from torch's: a name that is not a
    parameter or buffer slot (a plain attribute, a missing name: torch's route handles those), or a tensor
    reachable under another name that is not given (torch's route re-ties it)."""
    table = SlotTable(module) if table is None else table
    # (By ``map`` and over the few tied names, not a loop over every name: a traced call finds them at
    # every trace, and dynamo interprets a loop instruction by instruction, `zfunc.compiled`.)
    slots: Slots = list(map(table.slots.get, tensors))
    if None in slots:
        return None
    names = frozenset(tensors)
    for name, twins in table.twins.items():
        if name in names and not names.issuperset(twins):
            return None
    return slots
