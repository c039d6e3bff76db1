"""The fused form of Adam/AdamW as torch operations over flat buffers: the update of a traced step.

Under torch.compile the fused kernels (numba, Triton) cannot be traced, and the
pure pytree update (`zfunc.state.pure_update`) puts one copy of Adam's
arithmetic per parameter tensor into the graph: ~20 operator nodes per
parameter for the update, its write-back into the state and the per-key views,
every one of them reading the same 0-d tensors (learning rate, bias
corrections), which makes Inductor's fusion search meet one group as large as
the update. Here a step's update runs once per *flat run* instead: a group of
keys whose tensors are, in every param-shaped operand, consecutive views of one
flat buffer (under `shard`, a unit's slice of each kind of state: its master,
its moments, its parameter shards), so the graph holds one set of elementwise
operations and one write per buffer, whatever the number of parameters.

Where a buffer is. A tensor of the state that is a view of a flat buffer made
by zfunc carries it as ``tensor._zfunc_owner`` and the key it was made for as
``tensor._zfunc_key`` (set where the buffer is cut into views,
`zfunc.transforms.shard_init`). Dynamo reads those attributes like any
Python attribute (the owner becomes a graph input, aliasing the views, which
AOTAutograd then merges into one base; the key a constant) and guards on
which tensor and which string they are, so a run is taken as flat only when
every key of it holds the very same owner and each tensor sits under the key
it was made for: a state whose tensors were replaced (no owner, or another
one) or moved between keys (two of one shape swapped: the same owner, at each
other's places) takes the per-key route for that operand. Which keys form a
run, in which order, is told by the caller
(`zfunc.primitives.UpdateRequest.flat_runs`: the layout knows it; the storage
offsets of a traced tensor cannot be read, so the recorded key stands for
the place).

Exactness: every element goes through the same operations, in the same
order and dtypes, as in the pure chain of `zfunc.optim.adamw` / `adam`
(optionally after ``clip_by_global_norm``) followed by `apply_updates`, so
the result equals the per-parameter update bit for bit
(``tests/test_flat_update.py``). Weight decay that differs between the keys
of a run (a mask) is one per-element selection (``torch.where`` between
``p·(1 − lr·λ)`` and ``p``), built from the per-key flags at trace time.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

import torch

from zfunc.optim.fused import AdamSpec
from zfunc.optim.transforms import global_norm
from zfunc.tree import numel_of

OWNER = "_zfunc_owner"
PLACE = "_zfunc_key"  # the key a view of a flat buffer was made for (its place in the buffer, told by the layout)


def owner_of(tensors: dict | None, keys: tuple[str, ...]) -> torch.Tensor | None:
    """The flat buffer whose leading span ``tensors[keys]`` are views of, in order (see the module doc), or
    None where any key has no owner or another one, or holds a view made for another key."""
    if tensors is None:
        return None
    # (Read by ``map`` over builtins, which dynamo runs natively: it interprets a loop per key, `zfunc.compiled`.)
    # Each view's recorded key (``_zfunc_key``) is, while dynamo traces, a guarded constant: a state with views
    # moved between keys fails the guard and is traced anew, and found out of place here.
    views = list(map(tensors.__getitem__, keys))
    owners = list(map(getattr, views, repeat(OWNER), repeat(None)))
    owner = owners[0]
    if (owner is None or False in list(map(operator.is_, owners, repeat(owner)))
            or tuple(map(getattr, views, repeat(PLACE), repeat(None))) != keys):
        return None
    return owner


def moved_keys(tensors: dict, keys: tuple[str, ...]) -> list[str]:
    """The keys of ``keys`` under which ``tensors`` holds a view made for another key (``_zfunc_key``; views
    that record none, made anew by the user, are not counted: they are no buffer's, and taken key by key)."""
    places = tuple(map(getattr, map(tensors.__getitem__, keys), repeat(PLACE), repeat(None)))
    if places == keys:  # (every view at its place: one comparison, which dynamo runs natively, not a loop per key)
        return []
    return [k for k, place in zip(keys, places) if place is not None and place != k]


def _parts_of(tensors: dict, keys: tuple[str, ...], used: int, made: tuple | None) -> torch.Tensor | None:
    """``made``'s flat (``(flat, parts)``, parts its views in ``keys`` order) where ``tensors[keys]`` are those very
    parts and it holds exactly the run's ``used`` elements, else None. (Called only with a ``made``: a call that
    dynamo inlines costs it ~30 instructions.)"""
    flat, parts = made
    if (flat.dim() == 1 and flat.numel() == used and len(parts) == len(keys)
            and False not in list(map(operator.is_, map(tensors.__getitem__, keys), parts))):
        return flat
    return None


def _read(tensors: dict, keys: tuple[str, ...], used: int, owner: torch.Tensor | None) -> torch.Tensor:
    """The run's values as one 1-D tensor: the owner's leading span, else a concatenation."""
    if owner is not None:
        return owner if owner.numel() == used else owner[:used]
    parts = list(map(torch.flatten, map(tensors.__getitem__, keys)))  # (a 1-D tensor is itself: no view)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _whole_gradient(grads: dict, keys: tuple[str, ...], used: int, made: tuple | None) -> torch.Tensor:
    """The run's gradients as one 1-D tensor: ``made``'s flat where ``grads[keys]`` are its parts, else `_read`."""
    flat = _parts_of(grads, keys, used, made) if made is not None else None
    return flat if flat is not None else _read(grads, keys, used, None)


def _write(tensors: dict, keys: tuple[str, ...], used: int, owner: torch.Tensor | None,
           new: torch.Tensor, out: dict) -> None:
    """``new`` (the run's new values) into ``out``: written into the owner in place (``out`` keeps the
    tensors, views of it), else as new per-key tensors (views of ``new``). (Called under ``torch.no_grad``:
    one for all of a run's writes, a context that dynamo interprets at each entry.)"""
    if owner is not None:
        (owner if owner.numel() == used else owner[:used]).copy_(new)
        return
    parts = new.split([tensors[k].numel() for k in keys]) if len(keys) > 1 else (new,)
    for k, part in zip(keys, parts):
        out[k] = part.view(tensors[k].shape)


def flat_adam_update(spec: AdamSpec, params: dict, grads: dict, opt_state: Any, runs: tuple[tuple[str, ...], ...],
                     compute_dtype: torch.dtype | None = None, compute_into: dict | None = None,
                     skip: torch.Tensor | None = None, run_grads: tuple | None = None,
                     run_params: tuple | None = None):
    """One Adam/AdamW update run by run (see the module docstring): ``(params, opt_state, compute_copy)``,
    what `zfunc.optim.fused.fused_update` returns, or None where these tensors do not fit (then the caller
    takes the pure update).

    Args:
      spec: the optimizer's fused form (``tx.fused``).
      params, grads: dicts keyed alike; ``grads`` may be in a lower precision (upcast exactly).
      opt_state: the optimizer state; its moments are written in place where they have owners.
      runs: the flat runs, disjoint, each a tuple of keys in buffer order; keys left out must hold no elements.
      compute_dtype, compute_into: also the new parameters in this dtype, written into ``compute_into``'s
        owners where they have them (else returned as new tensors); keys without elements keep
        ``compute_into``'s (empty) tensors.
      skip: a 0-d bool; where set, everything keeps its old value (branch-free).
      run_grads: per run, None or ``(flat, parts)``: the run's gradients made as ``parts``, views of the 1-D
        ``flat`` (`zfunc.primitives.UpdateRequest.flat_grads`); where ``grads`` holds those very views, the run
        reads ``flat`` whole instead of concatenating them (the same values, one copy fewer in the graph).
      run_params: per run, None or ``(flat, parts)``: the run's parameters made as ``parts``, views of ``flat``,
        which record no owner (`zfunc.primitives.UpdateRequest.flat_params`); where ``params`` (or
        ``compute_into``) holds those very views, ``flat`` is taken as their owner.
    """
    adam = spec.adam_state(opt_state)
    mu, nu = adam.mu, adam.nu
    if not (isinstance(params, dict) and isinstance(grads, dict) and isinstance(mu, dict) and isinstance(nu, dict)):
        return None
    # Every key with elements in a run (the runs are disjoint; membership tests, not a set comparison: dynamo 2.11 cannot
    # trace `<=` between a set and dict keys), and each run's element count, in one pass over the keys.
    sizes = []
    covered = 0
    have = frozenset(params)
    for run in runs:
        if not frozenset(run) <= have:  # (not ``issuperset``, which dynamo interprets per key)
            return None
        sizes.append(sum(list(map(numel_of, map(params.__getitem__, run)))))
        covered += len(run)
    if covered != len(params):
        counted = {k for run in runs for k in run}
        for k, p in params.items():
            if k not in counted and p.numel():
                return None
    # Each run's operands as ``(tensors, owner)``: one dtype and device within a run (an owner's, else checked
    # key by key), the same across params and moments.
    operands, known = [], run_params if run_params is not None else (None,) * len(runs)
    for run, used, made in zip(runs, sizes, known):
        owned = [(params, _owner(params, run, used, made)), (mu, owner_of(mu, run)), (nu, owner_of(nu, run))]
        kinds = {(o.dtype, o.device) if o is not None else _one_kind(d, run) for d, o in owned}
        if len(kinds) != 1 or None in kinds:
            return None
        operands.append(owned)
    lr = spec.schedule(spec.lr_state(opt_state).count)
    neg_lr = -lr
    # The 0-d quantities, once for the whole update (as `scale_by_adam` and `scale_by_learning_rate` compute them).
    t = (adam.count + 1).to(torch.float64)
    bias_correction1 = 1 - spec.b1 ** t
    bias_correction2_sqrt = (1 - spec.b2 ** t).sqrt()
    keep = None
    decays = spec.weight_decays(params)
    if spec.mode == "adamw" and spec.weight_decay:
        keep = (1 - lr.to(torch.float64) * spec.weight_decay).to(lr.dtype)
    clip_scale = None
    if spec.clip is not None:  # clip_by_global_norm before the optimizer: the same norm of the same gradients
        clip_scale = (spec.clip / (global_norm(grads) + 1e-6)).clamp(max=1.0)
    # The new per-key tensors of operands without an owner (those with one keep their tensors, written in place).
    new_params, new_mu, new_nu = {}, {}, {}
    copy = {**compute_into} if compute_dtype is not None and compute_into is not None else None
    fresh_copy: dict[str, torch.Tensor] = {}
    for i, (run, owned, used) in enumerate(zip(runs, operands, sizes)):
        owners = [o for _, o in owned]
        p, m, v = map(_read, (params, mu, nu), repeat(run), repeat(used), owners)  # (no generator for dynamo)
        u = _whole_gradient(grads, run, used, run_grads[i] if run_grads is not None else None)
        u = u if u.dtype == p.dtype else u.to(p.dtype)
        if clip_scale is not None:
            u = u * clip_scale.to(u.dtype)
        if spec.mode == "adam" and spec.weight_decay:
            u = u.add(p, alpha=spec.weight_decay)
        m_new = torch.lerp(m, u.to(m.dtype), 1 - spec.b1)
        v_new = (v * spec.b2).addcmul(u, u, value=1 - spec.b2).to(v.dtype)
        direction = (m_new / bias_correction1.to(m_new.dtype)) / (
            (v_new.sqrt() / bias_correction2_sqrt.to(v_new.dtype)) + spec.eps)
        start = p if keep is None else _decayed(p, keep, run, decays, params)
        update = (torch.addcmul(start, direction, neg_lr) - p).to(torch.promote_types(u.dtype, p.dtype))
        p_new = (p + update).to(p.dtype)
        if skip is not None:
            p_new, m_new, v_new = (torch.where(skip, old, new) for old, new in ((p, p_new), (m, m_new), (v, v_new)))
        target = None
        if copy is not None:  # (before the master is written: its owner's span is ``p``'s storage)
            c_new = p_new.to(compute_dtype)
            target = _owner(compute_into, run, used, known[i])
            if target is not None and (target.dtype, target.device) != (compute_dtype, p.device):
                target = None
        with torch.no_grad():
            if copy is not None:
                _write(compute_into, run, used, target, c_new, fresh_copy)
            for d, o, new, out in zip((params, mu, nu), owners, (p_new, m_new, v_new), (new_params, new_mu, new_nu)):
                _write(d, run, used, o, new, out)
    if copy is not None:
        copy.update(fresh_copy)
    new_params, new_mu, new_nu = (old if not fresh else {**old, **fresh}
                                  for old, fresh in ((params, new_params), (mu, new_mu), (nu, new_nu)))
    return new_params, spec.advanced(opt_state, new_mu, new_nu, lr, skip), copy


def _owner(tensors: dict, keys: tuple[str, ...], used: int, made: tuple | None) -> torch.Tensor | None:
    """The buffer ``tensors[keys]`` are views of: told (`_parts_of`: where the first is the first part), else
    recorded on them (`owner_of`)."""
    if made is not None and tensors[keys[0]] is made[1][0]:
        return _parts_of(tensors, keys, used, made)
    return owner_of(tensors, keys)


def _one_kind(tensors: dict, keys: tuple[str, ...]) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device of ``tensors[keys]`` if they all share one, else None."""
    first = tensors[keys[0]]
    kind = (first.dtype, first.device)
    return kind if all((tensors[k].dtype, tensors[k].device) == kind for k in keys[1:]) else None


def _decayed(p: torch.Tensor, keep: torch.Tensor, run: tuple[str, ...], decays: dict, params: dict) -> torch.Tensor:
    """``p·keep`` where the key's weight decays (``decays[key] != 0``), ``p`` elsewhere (exactly the per-key
    choice); ``p`` is the run's keys' values, in order."""
    rates = list(map(decays.__getitem__, run))  # (by ``map``, which dynamo runs natively, `zfunc.compiled`)
    if 0 not in rates:
        return p * keep
    if rates.count(0) == len(rates):
        return p
    flags = [decays[k] != 0 for k in run]
    sizes = [params[k].numel() for k in run]
    mask = torch.repeat_interleave(torch.tensor(flags, device=p.device), torch.tensor(sizes, device=p.device),
                                   output_size=p.numel())
    return torch.where(mask, p * keep, p)
