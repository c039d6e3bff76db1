"""`mixed_precision`'s ``apply``: one model call run on the compute copy, its outputs in the output dtype.

`run_in_compute_dtype` casts the call's parameters, floating inputs and frozen
parameters (and floating buffers with ``cast_buffers=True``), writes back the
buffers the forward updated, and refuses a forward that wrote into a
parameter in place (`refuse_parameter_writes`): what each of these means for
the user is in `zfunc.transforms.mixed_precision`'s module doc (``apply``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from zfunc.compiled import all_true, tracing
from zfunc.transforms.mixed_precision_policy import Policy
from zfunc.tree import dtype_of, read_in_c, tree_map_tensors, version_of


def run_in_compute_dtype(next: Callable, call, policy: Policy, cast_buffers: bool, who: object):
    """``next(call)`` (the rest of the ``apply`` primitive) on ``call`` cast to ``policy``'s compute dtype,
    its floating outputs cast to the output dtype; ``who`` (the transform) names the errors."""
    compute, output = policy.compute, policy.output
    if compute == torch.float32 and output == torch.float32 and policy.param == torch.float32:
        return next(call)  # fp32: nothing to cast (bitwise the plain step)

    def cast_in(t):
        return t.to(compute) if t.is_floating_point() and t.dtype != compute else t

    params = call.params
    if _needs_cast(list(params.values()), compute):
        params = {k: cast_in(v) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    # (A compiled step has no version counters to read: there the check is not made.)
    versions = None if tracing() else versions_of(params)
    with call.structure.lock:  # the module's slots are shared with other threads' calls
        constants, buffers = _constants(call, compute, cast_buffers)
    call = call.replace(params=params, args=tree_map_tensors(cast_in, call.args),
                        kwargs=tree_map_tensors(cast_in, call.kwargs), constants=constants)
    try:
        out = next(call)
    except RuntimeError as err:
        _explain_running_statistics(call, err, policy, cast_buffers, who)
        raise
    if versions is not None:
        refuse_parameter_writes(params, versions, "mixed_precision keeps an fp32 master the write never reaches")
    with call.structure.lock:
        _write_back_buffers(call, buffers)
    return tree_map_tensors(
        lambda t: t.to(output) if t.is_floating_point() and t.dtype != output else t, out)


def _needs_cast(values: list, compute: torch.dtype) -> bool:
    """Whether a floating tensor of ``values`` is not in ``compute`` (under a master, the state's params are
    the compute copy already: never, in the common case, decided from their few distinct dtypes)."""
    if read_in_c(values):
        return any(d.is_floating_point and d != compute for d in set(map(dtype_of, values)))
    if tracing() and all_true(map(isinstance, values, itertools.repeat(torch.Tensor))):
        # (The same from the distinct dtypes, read by ``map`` over ``getattr``, which dynamo runs natively.)
        return any(d.is_floating_point and d != compute
                   for d in frozenset(map(getattr, values, itertools.repeat("dtype"))))
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != compute for v in values)


def _explain_running_statistics(call, err: RuntimeError, policy: Policy, cast_buffers: bool, who: object) -> None:
    """Re-raise torch's dtype error from a norm whose running statistics stayed in their own dtype
    (``cast_buffers=False``) while its weight and input are in the compute dtype, saying what to pass."""
    text = str(err)
    if cast_buffers or not ("expected scalar type" in text or "same dtype" in text):
        return
    norms = [name for name, m in call.model.named_modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]
    if not norms:
        kept = [name for name, b in call.model.named_buffers() if b.is_floating_point() and b.dtype != policy.compute]
        if kept:
            raise RuntimeError(
                f"{who!r}: the model computes with floating buffers that stay in their own dtype by default "
                f"(cast_buffers=False: {', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''}), and one met "
                f"a {policy.compute_dtype} tensor where torch needs one dtype. Pass cast_buffers=True (the "
                "buffers are then used in the compute dtype, as the parameters are), or cast the buffer where "
                f"the model uses it (buffer.to(x.dtype)). torch said: {text.splitlines()[0][:200]}") from err
        return
    raise RuntimeError(
        f"{who!r}: {type(call.model).__name__} has norms with running statistics ({', '.join(norms[:4])}"
        f"{' ...' if len(norms) > 4 else ''}), which stay in their own dtype by default (cast_buffers=False) "
        f"while their weight and input are {policy.compute_dtype}; torch cannot mix the two. Pass "
        "cast_buffers=True (running statistics then kept in the compute dtype and written back), or put "
        f"the norms in eval mode. torch said: {text.splitlines()[0][:200]}") from err


def _write_back_buffers(call, buffers) -> None:
    """Write the module's buffers that the forward updated in place (in their compute copy) back into it."""
    for original, copy, version, running_stat in buffers:
        # Running statistics are updated in place without a version bump: write them back always.
        if running_stat or (version is not None and copy._version != version):
            try:
                with torch.no_grad():
                    original.copy_(copy)
            except RuntimeError as err:
                if "captured" not in str(err):
                    raise
                raise RuntimeError(
                    f"{type(call.model).__name__} updates a buffer in place during its forward (e.g. "
                    "BatchNorm running statistics). Inside zf.value_and_grad the step is a pure function "
                    "and cannot mutate module state: put such modules in eval mode, use "
                    "track_running_stats=False, or a norm without running statistics.") from err


def _constants(call, compute: torch.dtype, cast_buffers: bool):
    """Compute-dtype copies of the frozen parameters (and floating buffers with ``cast_buffers``),
    keyed by qualified name."""
    constants = dict(call.constants)
    buffers = []
    cast: dict[int, torch.Tensor] = {}
    # (where the frozen parameters and buffers live: found once per model, `model_structure.constant_slots`)
    for name, where, attr, is_buffer, norm in call.structure.constant_slots:
        if is_buffer and not cast_buffers:
            continue
        tensor = where.get(attr)
        source = constants.get(name, tensor)
        if source is None or not source.is_floating_point() or source.dtype == compute:
            continue
        if id(source) not in cast:
            cast[id(source)] = copy = source.detach().to(compute)
            if is_buffer and source is tensor:  # the module's own buffer: write in-place updates back
                running = norm is not None and norm.training and norm.track_running_stats \
                    and attr in ("running_mean", "running_var")
                buffers.append((tensor, copy, None if tracing() else copy._version, running))
        constants[name] = cast[id(source)]
    return constants, buffers


def versions_of(params: dict) -> tuple[list, list]:
    """The keys of ``params`` and the version counter of each value (None for one that is not a tensor), as
    `refuse_parameter_writes` compares them after a forward (read in C for plain tensors: this runs for every
    parameter at every call)."""
    values = list(params.values())
    if read_in_c(values):
        return list(params), list(map(version_of, values))
    return list(params), [v._version if isinstance(v, torch.Tensor) else None for v in values]


def refuse_parameter_writes(params: dict, versions: tuple[list, list], why: str) -> None:
    """Raise if the forward wrote into one of ``params`` in place: its version counter moved from
    ``versions`` (`versions_of` before the forward)."""
    if versions_of(params) == versions:  # (the common case: one comparison)
        return
    before = {k: n for k, n in zip(*versions) if n is not None}
    for k, v in params.items():
        if isinstance(v, torch.Tensor) and v._version != before.get(k, v._version):
            raise RuntimeError(
                f"the model's forward wrote into parameter {k!r} in place (e.g. nn.Embedding(max_norm=...) "
                f"renormalizes its weight during forward), but here the model runs on a copy of it: {why}, so "
                "the change would be lost and training would silently diverge from eager PyTorch. Make the "
                "forward pure (renormalize functionally, e.g. F.embedding(..., max_norm=None) and scale the "
                "rows yourself) or run without this transform.")
