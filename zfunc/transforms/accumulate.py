"""`accumulate`: gradient accumulation over micro-batches.

``accumulate(step, micro_batches=k)`` runs the step's ``value_and_grad`` on k
equal slices of its batch, one after another, and hands the *mean* of the k
gradients to a single optimizer update. For a loss that is a mean over
examples this equals the full-batch step (up to the order of float sums),
with the activation memory of one micro-batch.

The sum is taken in fp32 whenever the model computes in bf16 or fp16 (as
Megatron-LM's ``main_grad``, DeepSpeed's BF16_Optimizer and FSDP2 with an fp32
``reduce_dtype`` do): summing k bf16 gradients in bf16 rounds every partial
sum to 8 bits of mantissa, an error that grows with k (13x the whole batch's
at k = 256 on an MLP), while the fp32 sum of the same bf16 gradients stays
as accurate as the whole-batch bf16 gradient. Where the sum lives, and how
`shard` feeds it unit by unit as backward makes the gradients, is
`zfunc.transforms.grad_accumulator`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from numbers import Integral
from typing import Any, Callable

import torch

from zfunc.compiled import tracing
from zfunc.facts import Facts
from zfunc.interpret import Transform
from zfunc.step_context import current
from zfunc.transforms.grad_accumulator import (
    FLOAT_DTYPES,
    GradAccumulator,
    accumulation_dtype,
    keyed_grads,
    kept_host_buffers,
    narrower,
    optimizer_devices,
)
from zfunc.tree import tree_flatten, tree_map, tree_unflatten


class accumulate(Transform):  # noqa: N801 (a transform reads like a function)
    """Gradient accumulation: ``micro_batches`` forward/backward passes, one update.

    Splitting rule: every tensor in the arguments after ``params`` of the
    ``value_and_grad`` call is split along dim 0 into ``micro_batches`` equal
    parts (a dim-0 size that does not divide raises), inside dicts, lists,
    tuples, other mappings (a Hugging Face ``BatchEncoding``) and dataclasses.
    Other non-tensor arguments are passed to every micro-batch unchanged; an
    object that holds tensors in another way is refused.

    Results: ``loss`` = mean of micro-batch losses; ``grads`` = mean of
    micro-batch gradients, i.e. for ``L = 1/k Σ_i L_i`` exactly ``∇L``;
    floating-point tensors in ``aux`` are averaged, other aux leaves are
    taken from the last micro-batch.

    ``dtype``: what the gradients are summed in, ``acc ← acc + g_i`` for
    i = 1..k, then ``acc / k``; the update receives ``acc / k`` in this dtype.
    None (the default): fp32 when the stack computes in a narrower dtype
    (``mixed_precision`` bf16/fp16), else the compute dtype; the error of the
    mean is then that of the k bf16 gradients themselves (no growth with k).
    ``dtype=torch.bfloat16`` under bf16 compute sums in place in bf16, as
    zfunc did before: half the accumulator's memory, but every partial sum is
    rounded to bf16, so the error grows with k (about k^(1/2) times the whole
    batch's for independent roundings; measured 13x at k = 256). A dtype
    narrower than the compute dtype is refused. Under `shard` stages 2/3 the
    gradients go through the reduce dtype (`mixed_precision`'s
    ``reduce_dtype``, bf16 by default) on the wire; the sum is in ``dtype``.
    The fp16 loss scaler and gradient clipping see the accumulated gradient;
    the returned gradients are the step's own buffers, which
    ``state.apply_gradients`` may consume in place (fp16 unscales them there).
    """

    name = "accumulate"
    level = 0

    def __init__(self, step: Callable, micro_batches: int, dtype: torch.dtype | None = None) -> None:
        if not isinstance(micro_batches, Integral) or isinstance(micro_batches, bool) or micro_batches < 1:
            raise ValueError(f"accumulate: micro_batches must be a positive int (the number of slices each batch "
                             f"is split into), got {micro_batches!r}")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise ValueError(f"accumulate: dtype must be None (fp32 under bf16/fp16 compute) or a floating torch "
                             f"dtype (torch.float32, torch.bfloat16, ...), got {dtype!r}")
        super().__init__(step)
        self.micro_batches = int(micro_batches)
        self.dtype = dtype

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"micro_batches": self.micro_batches}
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out

    def declare(self, facts: Facts) -> Facts:
        return facts.replace(micro_batches=facts.micro_batches * self.micro_batches, accumulates=True,
                             accumulate_dtype=self.dtype)

    def check(self, facts: Facts) -> None:
        if self.dtype is not None and facts.compute_dtype is not None:
            self._refuse_narrower(facts.compute_dtype)

    def _refuse_narrower(self, compute: torch.dtype) -> None:
        if narrower(self.dtype, compute):
            raise ValueError(
                f"accumulate(dtype={self.dtype}) would sum gradients computed in {compute} in a narrower dtype, "
                f"losing what {compute} holds on every micro-batch; use dtype=None (fp32 under bf16/fp16 compute) "
                f"or dtype={compute}")

    def start(self, ctx, state) -> GradAccumulator:
        # Transforms that reduce gradients unit by unit during backward (`shard`) feed this accumulator as each
        # unit's reduction lands: it is this call's gradient sink.
        dtype = accumulation_dtype(self.dtype, ctx.facts.compute_dtype)
        # (Without shard, offload's update runs on the full gradients: summed on its tier, the host.)
        on_tier = ctx.facts.stage == 0 and ctx.facts.optimizer_tier != "device" and not tracing()
        ctx.grad_sink = GradAccumulator(dtype, lambda: optimizer_devices(state), tree_on_optimizer_tier=on_tier,
                                        host_buffers=kept_host_buffers(ctx))
        return ctx.grad_sink

    def run(self, state, batch):
        acc: GradAccumulator = self.call_scratch()
        try:
            return self.step(state, batch)
        finally:
            acc.release()

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        k = self.micro_batches
        acc: GradAccumulator = self.call_scratch()
        compute = current().facts.compute_dtype
        acc.begin()
        micro_batches = _split((args, kwargs), k) if k > 1 else [(args, kwargs)]
        total_value = grads = None
        for micro_args, micro_kwargs in micro_batches:
            value, grads = next(fn, params, micro_args, micro_kwargs, has_aux)
            keyed, rebuild = keyed_grads(grads)
            if self.dtype is not None and compute is None:
                self._refuse_narrower(_grad_dtype(keyed, self.dtype))
            acc.add_tree(keyed)  # (what `shard` fed during backward is summed already)
            total_value = value if total_value is None else _add_values(total_value, value, has_aux)
        return _mean_value(total_value, k, has_aux), rebuild(acc.mean(k, keyed))


def split_micro_batches(tree: Any, k: int) -> list:
    """``k`` micro-batches of ``tree`` (the arguments of a loss function): `accumulate`'s splitting rule
    (also `pipeline`'s)."""
    return _split(tree, k)


def _split(tree: Any, k: int) -> list:
    """``k`` copies of ``tree`` in which every tensor is replaced by its i-th slice along dim 0.

    Containers that zfunc's pytrees do not open are opened here when they hold the batch: a mapping
    (e.g. a Hugging Face ``BatchEncoding``, rebuilt with its own type) and a dataclass. Anything else
    that carries tensors is refused: passed whole to every micro-batch, it would silently make each one
    the full batch (k times the compute and the full batch's activation memory).
    """
    leaves, treedef = tree_flatten(tree)
    parts = [_split_leaf(leaf, k) for leaf in leaves]
    return [tree_unflatten(treedef, [p[i] for p in parts]) for i in range(k)]


def _split_leaf(leaf: Any, k: int) -> list:
    if isinstance(leaf, torch.Tensor):
        if leaf.dim() == 0 or leaf.shape[0] % k:
            raise ValueError(
                f"accumulate(micro_batches={k}) splits every batch tensor along dim 0, but got one "
                f"of shape {tuple(leaf.shape)}; make the batch size a multiple of {k}")
        return list(leaf.chunk(k))
    if isinstance(leaf, Mapping):
        return [_rebuilt(leaf, part) for part in _split(dict(leaf), k)]
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf) if f.init}
        return [dataclasses.replace(leaf, **part) for part in _split(fields, k)]
    held = [name for name, value in getattr(leaf, "__dict__", {}).items() if isinstance(value, torch.Tensor)]
    if held:
        raise ValueError(
            f"accumulate(micro_batches={k}) cannot split a {type(leaf).__name__} (it holds tensors: "
            f"{', '.join(held[:4])}): pass the batch as a dict, tuple, list or dataclass of tensors (and an "
            "object that every micro-batch should see whole through a closure of the loss function)")
    return [leaf] * k


def _rebuilt(original: Mapping, data: dict) -> Mapping:
    """``data`` in ``original``'s mapping type."""
    try:
        rebuilt = type(original)(data)
    except Exception as err:  # noqa: BLE001 (any failure means the same: we cannot rebuild it)
        raise ValueError(f"accumulate cannot split a {type(original).__name__} batch (its type does not rebuild "
                         f"from a dict: {err}); pass dict(batch) instead") from None
    if not isinstance(rebuilt, Mapping) or set(rebuilt.keys()) != set(data):
        raise ValueError(f"accumulate cannot split a {type(original).__name__} batch; pass dict(batch) instead")
    return rebuilt


def _grad_dtype(grads: dict, default: torch.dtype) -> torch.dtype:
    """The dtype of the floating gradients (the compute dtype when no transform declared one)."""
    return next((g.dtype for g in grads.values() if isinstance(g, torch.Tensor) and g.is_floating_point()), default)


def _add_values(total, value, has_aux):
    if not has_aux:
        return total + value
    (loss_t, aux_t), (loss, aux) = total, value
    aux_sum = tree_map(lambda a, b: a + b if _averaged(a) else b, aux_t, aux)
    return loss_t + loss, aux_sum


def _mean_value(total, k, has_aux):
    if k == 1:
        return total
    if not has_aux:
        return total / k
    loss, aux = total
    return loss / k, tree_map(lambda a: a / k if _averaged(a) else a, aux)


def _averaged(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
