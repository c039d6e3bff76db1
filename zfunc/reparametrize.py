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
from typing import Iterator

import torch
from torch import nn

from zfunc.compiled import remember, tracing

# (the owning module's _parameters or _buffers dict, attribute name), one per given name
Slots = list[tuple[dict, str]]


@contextlib.contextmanager
def swapped(module: nn.Module, tensors: dict[str, torch.Tensor], cache: dict,
            tie_weights: bool = True) -> Iterator[None]:
    """Inside the ``with``, ``module``'s tensor named ``k`` (qualified) is ``tensors[k]``.

    ``cache``: a dict the caller keeps across calls (the slots found for each
    module and set of names). ``tie_weights``: as in torch's
    ``functional_call``; it matters only on the slow route.
    """
    key = (module, tuple(tensors))
    slots = cache.get(key)
    if slots is None:
        slots = remember(cache, key, _find_slots(module, tensors) or False)
    if slots is False:
        with torch.nn.utils.stateless._reparametrize_module(module, tensors, tie_weights=tie_weights,
                                                             strict=False):
            yield
        return
    originals = []
    try:
        for (where, attr), tensor in zip(slots, tensors.values()):
            originals.append(where[attr])
            where[attr] = tensor
        yield
        _refuse_reassigned(slots, tensors)
    finally:
        # In reverse: a slot given under two names (a module at two positions) ends with its first original.
        for (where, attr), original in reversed(list(zip(slots, originals))):
            where[attr] = original


def _refuse_reassigned(slots: Slots, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a call whose forward assigned one of the swapped-in tensors (``self.ema = 0.9 * self.ema + ...``):
    restoring the slots would undo the assignment without a word."""
    if tracing():
        return
    last = {(id(where), attr): tensor for (where, attr), tensor in zip(slots, tensors.values())}  # (a slot given
    # under two names, a module at two positions, holds the later one)
    changed = [name for (where, attr), name in zip(slots, tensors) if where[attr] is not last[id(where), attr]]
    if changed:
        raise RuntimeError(
            f"the model's forward assigns {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}, a tensor "
            "zfunc swapped in for this call (a parameter, or a buffer cast by mixed_precision(cast_buffers=True)); "
            "the slot is restored when the call ends, so the new value would be silently lost. Update a buffer in "
            "place (self.ema.mul_(0.9).add_(...)), or leave buffers uncast (cast_buffers=False, the default); "
            "change parameters outside the model, in the step.")


def _find_slots(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Slots | None:
    """The slot of each name, or None where the fast route would differ from torch's."""
    names = set(tensors)
    # Names that share one tensor, grouped by identity (`is`, not id(): torch.compile traces this on its
    # first call, where a tensor swapped in by an outer call has no id to take).
    groups: list[tuple[torch.Tensor, list[str]]] = []
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        group = next((g for g in groups if g[0] is t), None)
        if group is None:
            groups.append((t, [name]))
        else:
            group[1].append(name)
    slots: Slots = []
    for name in tensors:
        prefix, _, attr = name.rpartition(".")
        try:
            owner = module.get_submodule(prefix) if prefix else module
        except AttributeError:
            return None
        if attr in owner._parameters and owner._parameters[attr] is not None:
            where = owner._parameters
        elif attr in owner._buffers and owner._buffers[attr] is not None:
            where = owner._buffers
        else:
            return None  # a plain attribute or a missing name: torch's route handles those
        twins = next((group for t, group in groups if t is where[attr]), [name])
        if not set(twins) <= names:
            return None  # a tied twin not given: torch's route re-ties it
        slots.append((where, attr))
    return slots
