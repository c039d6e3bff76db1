"""Gap-free spans of per-parameter views: what lets a fused kernel take many parameters in one pass.

The state's tensors are views of flat buffers (a unit's master, its moments, its gradient
shard), so consecutive keys often cover one span of one storage. `contiguous_runs` finds those
runs (once per layout, with a cache that lives with the optimizer), `span_of` hands one back as a
1-D tensor, and `laid_out_like` makes new buffers laid out the same way. Used by the fused update
(`zfunc.optim.fused`) and by `offload`'s copies between the device and the host.
"""

from __future__ import annotations

import weakref

import torch


def laid_out_like(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """New tensors of ``dtype`` shaped like ``tensors``, one buffer per gap-free span of them (pinned
    host memory for host tensors on a CUDA machine)."""
    out: dict[str, torch.Tensor] = {}
    for keys in contiguous_runs([k for k, t in tensors.items() if t.numel()], [tensors]):
        first = tensors[keys[0]]
        pin = first.device.type == "cpu" and torch.cuda.is_available()
        flat = torch.empty(sum(tensors[k].numel() for k in keys), dtype=dtype, device=first.device,
                           pin_memory=pin)
        start = first.storage_offset()
        for k in keys:
            offset = tensors[k].storage_offset() - start if len(keys) > 1 else 0
            out[k] = flat[offset:offset + tensors[k].numel()].view(tensors[k].shape)
    for k, t in tensors.items():
        if k not in out:  # empty (a rank's empty slice of a parameter)
            out[k] = torch.empty(t.shape, dtype=dtype, device=t.device)
    return out


def contiguous_runs(keys: list[str], operands: list[dict], same: dict | None = None,
                    cache: dict | None = None) -> list[list[str]]:
    """``keys`` split into runs that are one gap-free span, in one order, in every operand.

    Keys are ordered by their position in ``operands[0]``; ``same`` (key -> value):
    a run also never joins keys whose values differ (e.g. weight decays).

    With ``cache`` (a dict that lives with the optimizer, `AdamSpec.tables`), the runs found for these keys
    are reused for as long as every operand still lays them out so: an operand holding the very tensors it
    held then (the state's master and moments, step after step) is not looked at again, and any other (the
    step's fresh gradients) is checked run by run. A step then costs one identity check per tensor instead
    of a sort and a comparison of every neighbouring pair in every operand.
    """
    if cache is None:
        return find_runs(keys, operands, same)
    signature = ("runs", len(operands), tuple(keys), None if same is None else tuple(same[k] for k in keys))
    found = cache.get(signature)
    if found is not None:
        runs, held = found
        if all(_still_runs(runs, d, refs) for d, refs in zip(operands, held)):
            return runs
    runs = find_runs(keys, operands, same)
    cache[signature] = (runs, [{k: weakref.ref(d[k]) for k in keys} for d in operands])
    return runs


def _still_runs(runs: list[list[str]], d: dict, refs: dict) -> bool:
    """Whether every run is still one gap-free span of ``d``, in order: at once where ``d`` holds the tensors
    ``refs`` point to (a view's storage and offsets never change), else by looking at each run."""
    if all(refs[k]() is d[k] for run in runs for k in run):
        return True
    for run in runs:
        first = d[run[0]]
        if not first.is_contiguous():
            return False
        if len(run) == 1:
            continue
        ptr, dtype, device = first.untyped_storage().data_ptr(), first.dtype, first.device
        end = first.storage_offset() + first.numel()
        for k in run[1:]:
            t = d[k]
            if (t.storage_offset() != end or t.untyped_storage().data_ptr() != ptr or t.dtype != dtype
                    or t.device != device or not t.is_contiguous()):
                return False
            end += t.numel()
    return True


def find_runs(keys: list[str], operands: list[dict], same: dict | None) -> list[list[str]]:
    """`contiguous_runs` without a cache: ``keys`` sorted by where ``operands[0]`` holds them, each joined to
    the run before it where it continues that run's span in every operand (and ``same`` agrees)."""
    keys = sorted(keys, key=lambda k: (operands[0][k].untyped_storage().data_ptr(),
                                       operands[0][k].storage_offset()))
    runs: list[list[str]] = []
    for key in keys:
        last = runs[-1][-1] if runs else None
        if last is not None and _continues(last, key, operands) and (same is None or same[key] == same[last]):
            runs[-1].append(key)
        else:
            runs.append([key])
    return runs


def _continues(previous: str, key: str, operands: list[dict]) -> bool:
    for d in operands:
        a, b = d[previous], d[key]
        if (not a.is_contiguous() or not b.is_contiguous() or a.dtype != b.dtype or a.device != b.device
                or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                or a.storage_offset() + a.numel() != b.storage_offset()):
            return False
    return True


def span_of(d: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    """The 1-D span of ``d``'s storage that ``d[keys]`` cover (contiguous, in this order)."""
    first = d[keys[0]]
    if len(keys) == 1:
        return first.reshape(-1)
    length = sum(d[k].numel() for k in keys)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (length,))
