"""`DevicePlan`: the fused update of state on a GPU, structured once per state layout.

What `zfunc.optim.fused.fused_update` derives from where the state's tensors
live (which parameters form gap-free runs, each run's buffers and weight
decays, the kernel's chunk table, where the compute copy goes) depends only on
the layout of the state (master, moments, compute copy) and of the gradients;
under `shard` that layout is the same step after step. A plan holds it, built
on the first step. A later step checks, key by key, that it is given tensors
laid out so (`DevicePlan.state_at`: each state tensor the very one the plan was
built from, still at its address, or one of the same dtype and size at that
address; `DevicePlan.gradients_at`: each gradient at the address its run
expects, of the plan's dtype, contiguous, on its device, outside the state's
buffers, and shaped as the params, whose shapes are the plan's), then launches
one kernel over all runs (`zfunc.kernels.gpu_adam.adam_runs_`), after moving
the gradients' addresses to the device only if they changed. Nothing is read
back from the device.

What the check reads at every step is what cannot be known otherwise: the
state's dicts are found unchanged by their version tags (`zfunc.tree.dict_tags`:
one read per dict, where the ids of every tensor were compared), but a tensor
keeps its identity when its storage is swapped under it, so every address is
read; the gradients are new at every step, so everything the kernel relies on
is read of each, in a pass per attribute from C, and their shapes with the
params' (which spares the caller's own comparison of them,
`zfunc.state.check_grads_match`).

A state laid out otherwise (a new state, a restored or resharded one, another
dtype, gradients grouped differently) fails the check and gets a new plan: the
table, which holds addresses, is never used for tensors other than those it
was built from. The plan holds no tensor of the state (weak references only),
so a state dropped by its user is freed as before.
"""

from __future__ import annotations

import bisect
import itertools
import operator

import numpy
import torch

from zfunc.kernels.gpu_adam import AdamRuns, adam_runs_
from zfunc.tree import (
    SameObjects,
    SameValues,
    data_ptr_of,
    device_index_of,
    dict_tags,
    dtype_of,
    is_contiguous_of,
    read_in_c,
    shape_of,
    values_in_order,
    values_of,
)


# Addresses below this are compared in numpy's int64 (`DevicePlan._all_outside_state`): a run's end (start plus
# its bytes) then cannot overflow. Every address a CPU or CUDA allocator hands out is far below it.
_NUMPY_ADDRESSES = 2**62


class _Held:
    """What a plan expects of the state (params, moments, compute copy: every operand's tensors, key by key, in
    one list): the tensors it was built from (weakly), their addresses, dtypes and sizes.

    The usual step is given the very dicts of the step before, unchanged, holding the very tensors, where they
    were: found by the dicts' version tags (`zfunc.tree.SameValues`: one read per dict) and the tensors'
    addresses (one read per tensor, from C: a tensor keeps its identity when its storage is swapped under it,
    ``t.data = other``, ``t.set_(...)``, and the kernel writes to the addresses). Other dicts of the very
    tensors are found by the tensors' ids (`zfunc.tree.SameObjects`, trusted while every held tensor lives),
    after which their tags stand for them. Otherwise the tensors are compared one by one (`still_at`)."""

    __slots__ = ("dtypes", "misses", "numels", "plain", "ptrs", "same_values")

    def __init__(self, operands: tuple, keys: tuple) -> None:
        tensors = _in_order(operands, keys)
        self.dtypes = [t.dtype for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.misses = 0  # steps in a row given other tensors than those held (`DevicePlan.state_at`)
        self.rearm(operands, keys, tensors)

    def rearm(self, operands: tuple, keys: tuple, tensors: list) -> None:
        """Hold ``tensors`` (``operands``' values, key by key): at build, and later ones `still_at` found where
        the held ones were (the same addresses; the dtypes and sizes stay those the plan was built with), so
        that the steps after find them from C."""
        self.same_values = _same_values(operands, keys, tensors)
        self.ptrs = tuple(t.data_ptr() for t in tensors)
        self.plain = read_in_c(tensors)  # (the same objects later: their addresses read by ``map`` too)

    @property
    def refs(self) -> list:
        return self.same_values.objects.refs

    def same(self, operands: tuple, keys: tuple) -> bool:
        """Whether ``operands`` hold, key by key, the very tensors held, each at its address (the usual step,
        from C). Raises KeyError where an operand lacks a key."""
        same_values = self.same_values
        if same_values.tags is not None and dict_tags(operands) == same_values.tags:
            tensors = values_of(operands)  # (the dicts checked before, unchanged: keyed in order)
        elif _keyed_in_order(operands, keys):
            if not same_values(operands):
                return False
            tensors = values_of(operands)
        else:
            tensors = _in_order(operands, keys)
            if not same_values.objects(tensors):
                return False
        ptrs = tuple(map(data_ptr_of, tensors)) if self.plain else tuple(t.data_ptr() for t in tensors)
        return ptrs == self.ptrs

    def still_at(self, tensors: list, device_index: int) -> bool:
        """Whether ``tensors`` are, one by one, the tensor held at its address, or one of its dtype and size,
        contiguous, at that address on the plan's device (e.g. a new view of the same buffer)."""
        if len(tensors) != len(self.refs):
            return False
        for t, ref, ptr, dtype, numel in zip(tensors, self.refs, self.ptrs, self.dtypes, self.numels):
            if ref() is t:
                if numel and t.data_ptr() != ptr:
                    return False
            elif t.numel() != numel or (numel and (t.data_ptr() != ptr or t.dtype != dtype
                                                   or t.get_device() != device_index or not t.is_contiguous())):
                return False
        return True


def _same_values(operands: tuple, keys: tuple, tensors: list) -> SameValues:
    """`SameValues` of ``operands``, whose values key by key are ``tensors``; where an operand is not keyed in
    ``keys``' order its values are another list than ``tensors``: the ids are held, the tags not."""
    same = SameValues(operands)
    if not _keyed_in_order(operands, keys):
        same.objects, same.tags = SameObjects(tensors), None
    return same


def _keyed_in_order(operands: tuple, keys: tuple) -> bool:
    """Whether every operand is a plain dict keyed by exactly ``keys``, in their order (its values then are key
    by key; an ``OrderedDict`` keeps its order apart from its values)."""
    n = len(keys)
    return all(type(d) is dict and len(d) == n and tuple(d) == keys for d in operands)


def _in_order(operands: tuple | list, keys: tuple) -> list:
    """Every operand's tensors, key by key, operand after operand, in one list (raises KeyError where one
    lacks a key). (A dict whose keys are ``keys`` in their order, as every operand of a step under `shard`
    is, gives its values as they are: no lookup per key.)"""
    return list(itertools.chain.from_iterable(values_in_order(d, keys) for d in operands))


def _getter(positions: list[int]):
    """``xs -> tuple(xs[i] for i in positions)``, made from C (`operator.itemgetter` returns a bare item for
    one position)."""
    if len(positions) == 1:
        return lambda xs: (xs[positions[0]],)
    return operator.itemgetter(*positions)


class DevicePlan:
    """The structure of one state's fused update on one device (module docstring).

    Attributes:
      keys: every key of the params, in their order (empty ones included: they must stay empty).
      device: where the state lives.
      out_dtype: the compute copy's dtype (bf16/fp16), or None when no copy is written.
      grad_dtype: the gradients' dtype.
      table: the kernel's table of runs (`AdamRuns`).
    """

    def __init__(self, keys, shapes, device, out_dtype, grad_dtype, table, held, grad_runs, state_spans) -> None:
        self.keys, self.device, self.out_dtype, self.grad_dtype, self.table = keys, device, out_dtype, grad_dtype, table
        self._shapes = list(shapes)  # each key's parameter's shape (torch.Size), key by key: the gradients' too
        self._held = held  # the state operands' tensors (params, mu, nu[, into]), key by key, in one list
        self._device_index = device.index if device.type == "cuda" else -1  # (Tensor.get_device's number)
        self._grad_runs = grad_runs  # per run: its first key and ((key, byte offset, numel), ...)
        # The same, flat over every run's members in order, for the check made from C (`gradients_at`): each
        # member's key, byte offset in its run, and the position of its run's first member. (Where they are all
        # the keys, in order, as at one rank, the gradients read for their shapes are the members.)
        members = [member for _, run in grad_runs for member in run]
        self._member_keys = tuple(k for k, _, _ in members)
        self._members_are_keys = self._member_keys == tuple(keys)
        self._member_offsets = [offset for _, offset, _ in members]
        self._member_dtypes, self._trues = [grad_dtype] * len(members), [True] * len(members)
        self._member_devices = [self._device_index] * len(members)
        heads, firsts = [], []
        for _, run in grad_runs:
            firsts.append(len(heads))
            heads += [firsts[-1]] * len(run)
        self._head_of_member, self._first_of_run = _getter(heads), _getter(firsts)
        # Every run of one member (each gradient a tensor of its own, as autograd makes them at one rank): its
        # address is its run's, nothing to compare within a run.
        self._one_per_run = len(heads) == len(firsts)
        # The runs' gradient addresses last found outside the state's buffers (`gradients_at`): the state's buffers
        # are the plan's, so addresses found so once stay so (the caching allocator hands the gradients the same
        # blocks step after step).
        self._outside_at: tuple | None = None
        self._upload: tuple = ((), None)  # (`gradients_at`'s last addresses, and the int64 array of them or None)
        self._item = item = torch.empty((), dtype=grad_dtype).element_size()
        self._run_bytes = [run[-1][1] + run[-1][2] * item for _, run in grad_runs]
        # The state's buffers, [start, end) in bytes, sorted, those that abut merged (a unit's keys lie end to end
        # in each of its buffers: a few intervals to search, where the spans are one per run and operand).
        merged: list[list[int]] = []
        for a, b in state_spans:
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        self._starts = [a for a, _ in merged]
        self._ends = [b for _, b in merged]
        # The same as numpy arrays, for `_all_outside_state` (None: addresses too large for them), and each run's
        # last byte's offset from its first.
        self._np_starts = self._np_ends = self._np_last_bytes = None
        if max(self._ends, default=0) < _NUMPY_ADDRESSES:
            self._np_starts = numpy.array(self._starts, dtype=numpy.int64)
            self._np_ends = numpy.array(self._ends, dtype=numpy.int64)
            self._np_last_bytes = numpy.array(self._run_bytes, dtype=numpy.int64) - 1

    @classmethod
    def build(cls, runs: list[list[str]], decays: dict[str, float], params: dict, grads: dict, mu: dict, nu: dict,
              into: dict | None, out_dtype: torch.dtype | None) -> DevicePlan | None:
        """The plan for these tensors, or None where one launch cannot take them (the caller then takes the
        general path). ``runs``: the nonempty keys in runs that are one gap-free span in every operand
        (`zfunc.optim.spans.contiguous_runs`); the caller checked `fusable` and that ``into`` fits."""
        first = params[runs[0][0]]
        device = first.device
        grad_dtype = grads[runs[0][0]].dtype
        if any(grads[k].dtype != grad_dtype or params[k].device != device or grads[k].device != device
               or (into is not None and into[k].device != device) for run in runs for k in run):
            return None
        operands = [params, mu, nu] + ([into] if into is not None else [])
        # The runs in the params' key order (the kernel takes them in any): each step then reads the gradients of
        # one-key runs (each a tensor of its own, at one rank) as the grads dict holds them, without a lookup.
        position = {k: i for i, k in enumerate(params)}
        runs = sorted(runs, key=lambda run: position[run[0]])
        bases, segments, lengths, grad_runs, spans = [], [], [], [], []
        for run in runs:
            offset, segs, members = 0, [], []
            for k in run:
                n = params[k].numel()
                segs.append((offset, n, decays[k]))
                members.append((k, offset * grads[k].element_size(), n))
                offset += n
            bases.append(tuple(d[run[0]].data_ptr() for d in operands) + (0,) * (4 - len(operands)))
            segments.append(segs)
            lengths.append(offset)
            grad_runs.append((run[0], tuple(members)))
            spans.extend((d[run[0]].data_ptr(), d[run[0]].data_ptr() + offset * d[run[0]].element_size())
                         for d in operands)
        spans.sort()
        if any(b0 > a1 for (_, b0), (a1, _) in zip(spans, spans[1:])):
            return None  # state buffers sharing memory: adam_flat_ refuses them, the general path says so
        table = AdamRuns.build(bases, segments, lengths, device, out_dtype=out_dtype)
        keys = tuple(params)
        held = _Held(tuple(operands), keys)
        return cls(keys, [params[k].shape for k in keys], device, out_dtype, grad_dtype, table, held, grad_runs, spans)

    def grad_addresses(self, params: dict, grads: dict, mu: dict, nu: dict, into: dict | None) -> list[int] | None:
        """Each run's gradient address, if these tensors are laid out as the plan's (module docstring: `state_at`
        and `gradients_at`); else None."""
        return self.gradients_at(params, grads) if self.state_at(params, mu, nu, into) else None

    def state_at(self, params: dict, mu: dict, nu: dict, into: dict | None) -> bool:
        """Whether the state's operands hold, key by key, the tensors the plan was built from where they were, or
        tensors of their dtypes and sizes at those addresses (`_Held`)."""
        keys = self.keys
        if len(params) != len(keys) or (into is None) != (self.out_dtype is None):
            return False
        operands = (params, mu, nu) if into is None else (params, mu, nu, into)
        held = self._held
        try:
            if held.same(operands, keys):
                held.misses = 0
                return True
            tensors = _in_order(operands, keys)
        except KeyError:
            return False
        if not held.still_at(tensors, self._device_index):
            return False
        # Held from now on, so that the steps after find them from C; but where every step hands new tensors (which
        # is compared one by one all the same), held again only at the 1st, 2nd, 4th, 8th, ... such step in a row,
        # not made into weak references at each.
        held.misses += 1
        if not held.misses & (held.misses - 1):
            held.rearm(operands, keys, tensors)
        return True

    def gradients_at(self, params: dict, grads: dict) -> list[int] | None:
        """Each run's gradient address where ``grads`` are laid out as the plan expects (each gradient at its run's
        address plus its offset, of the plan's dtype, contiguous, on its device, outside the state's buffers)
        and shaped as ``params``, whose shapes are the plan's, key by key; else None. Reads only the shapes of
        ``params``: a caller that needs the gradients shaped as the params (`zfunc.state.check_grads_match`)
        need not compare them itself where this passes."""
        keys = self.keys
        if len(params) != len(keys) or len(grads) != len(keys):
            return None
        try:
            ps, gs = list(values_in_order(params, keys)), list(values_in_order(grads, keys))
        except KeyError:
            return None
        if not read_in_c(ps + gs):
            return self._gradients_one_by_one(ps, gs, grads)
        # The loop of `_gradients_one_by_one`, made from C (this runs at every step, over every parameter).
        if list(map(shape_of, ps)) != self._shapes or list(map(shape_of, gs)) != self._shapes:
            return None
        members = gs if self._members_are_keys else list(map(grads.__getitem__, self._member_keys))
        if self._one_per_run:
            starts = bases = tuple(map(data_ptr_of, members))
        else:
            bases = tuple(map(operator.sub, map(data_ptr_of, members), self._member_offsets))
            starts = self._first_of_run(bases)
        # (Each list compared with the one expected, element by element by identity: the same dtype object, True,
        # a small int; faster than building sets.)
        if ((not self._one_per_run and bases != self._head_of_member(bases))
                or list(map(dtype_of, members)) != self._member_dtypes
                or list(map(is_contiguous_of, members)) != self._trues
                or list(map(device_index_of, members)) != self._member_devices):
            return None
        array = None
        if starts != self._outside_at:
            outside, array = self._all_outside_state(starts)
            if not outside:
                return None
            self._outside_at = starts
        ptrs = list(starts)
        self._upload = (ptrs, array)  # (the addresses as the array the check made: `launch` sends it to the device)
        return ptrs

    def _gradients_one_by_one(self, ps: list, gs: list, grads: dict) -> list[int] | None:
        """`gradients_at` tensor by tensor, for tensors the getters may not read from C (`zfunc.tree.read_in_c`)."""
        if not all(isinstance(t, torch.Tensor) and t.shape == shape for t, shape in zip(ps + gs, self._shapes * 2)):
            return None
        dtype, device_index, item = self.grad_dtype, self._device_index, self._item
        ptrs = []
        for first, members in self._grad_runs:
            head = grads[first]
            if head.get_device() != device_index:
                return None
            base = head.data_ptr()
            # (the device once per run: with CUDA's unified addressing an address names one allocation on one
            # device, so a gradient found at the address its run expects is what the kernel reads there)
            for k, offset, n in members:
                g = grads[k]
                if g.data_ptr() != base + offset or g.numel() != n or g.dtype != dtype or not g.is_contiguous():
                    return None
            if not self._outside_state(base, base + members[-1][1] + members[-1][2] * item):
                return None
            ptrs.append(base)
        return ptrs

    def _all_outside_state(self, starts: tuple) -> tuple[bool, numpy.ndarray | None]:
        """`_outside_state` of every run at once (``starts``: each run's first address), in three numpy searches
        (on a GPU the gradients land elsewhere at every step, so this runs at every step), and ``starts`` as the
        int64 array searched (None where they were checked run by run). The state's buffers are sorted and
        disjoint, so a run's first byte lies between buffers where as many buffers begin as end at or before it,
        and the run stays there where no buffer begins at or before its last byte that did not begin at or
        before its first."""
        if self._np_starts is None or max(starts) >= _NUMPY_ADDRESSES:  # (beyond numpy's int64: run by run)
            return all(map(self._outside_state, starts, map(operator.add, starts, self._run_bytes))), None
        s = numpy.array(starts, dtype=numpy.int64)
        begun = self._np_starts.searchsorted(s, "right").tobytes()  # (compared as bytes: no ufunc, no reduction)
        return (self._np_ends.searchsorted(s, "right").tobytes() == begun
                and self._np_starts.searchsorted(s + self._np_last_bytes, "right").tobytes() == begun), s

    def _outside_state(self, start: int, end: int) -> bool:
        """Whether bytes [start, end) overlap none of the state's buffers: a gradient is read-only, but never in
        a buffer the kernel writes."""
        i = bisect.bisect_right(self._starts, start)
        return not ((i and self._ends[i - 1] > start) or (i < len(self._starts) and self._starts[i] < end))

    def launch(self, spec, grad_ptrs: list[int] | None, lr: torch.Tensor, step: torch.Tensor,
               divisor: torch.Tensor | None, skip: torch.Tensor | None) -> None:
        """The update of every run, in one launch (``spec``: the optimizer's `AdamSpec`; ``grad_ptrs``
        None: the gradients' addresses set last on the table, as `zfunc.optim.update_graph` sets them)."""
        device = self.device
        if grad_ptrs is not None:  # (as the array `gradients_at` made of them, where it made one)
            upload = self._upload
            self.table.set_grads(grad_ptrs, upload[1] if upload[0] is grad_ptrs else None)
        adam_runs_(self.table, None, self.grad_dtype, lr=lr.to(device), step=step.to(device), beta1=spec.b1,
                   beta2=spec.b2, eps=spec.eps, mode=spec.mode,
                   grad_scale=None if divisor is None else divisor.to(device),
                   found_inf=None if skip is None else skip.to(device))

