"""Tensor-parallel plans: which module is split how, and the model prepared to run on tp-local shards.

A plan maps module names to torch's parallel styles
(``torch.distributed.tensor.parallel``): `ColwiseParallel` (a linear's output
features split over the tp ranks; an embedding's columns), `RowwiseParallel`
(a linear's input features split, its partial outputs summed; an
embedding's rows, i.e. the vocabulary) and `SequenceParallel` (a norm run on
this rank's slice of the sequence). A pattern matches a module's qualified
name, or its tail (``"h.*.mlp.c_fc"`` matches ``"transformer.h.3.mlp.c_fc"``);
``*`` stands for one name component.

`tp_plan` resolves a plan against the model, and `prepare` rewrites the model
once for a mesh: each planned module's parameters become DTensors of this
rank's shard (so the styles' input and output hooks, which torch installs
through ``distribute_module``, run the model with DTensor math), and every
call converts the tp-local tensors zfunc swaps into the module's slots into
DTensors of the same placement just before the module runs (`_LocalToDTensor`).
zfunc's state therefore holds plain tensors, this rank's shards, and
``zf.functional``'s pure apply keeps working on them.

Hugging Face GPT-2's ``Conv1D`` is a linear with a transposed weight (``[in,
out]``): column-parallel splits its dim 1, row-parallel its dim 0. Its fused
query/key/value projection (``c_attn``, output ``[q | k | v]``) is split part by
part (`FusedColwise`): rank r holds ``[q_r | k_r | v_r]``, so its local output
splits into its own heads.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

try:  # Hugging Face's transposed linear (GPT-2); the plans work without transformers installed
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    class Conv1D(nn.Module):  # type: ignore[no-redef]
        pass


class FusedColwise(ColwiseParallel):
    """Column-parallel for a projection whose output is ``parts`` equal blocks side by side (GPT-2's
    ``c_attn``: ``[q | k | v]``): each block is split over the tp ranks, and rank r holds the r-th slice
    of every block, concatenated."""

    def __init__(self, parts: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parts = parts

    def __repr__(self) -> str:
        return f"FusedColwise(parts={self.parts})"


_STYLE_NAMES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """How one parameter is held on the tp ranks: split along ``dim`` into ``parts`` blocks each cut in
    tp slices (``dim=None``: replicated), and its full ``shape``."""

    dim: int | None
    parts: int
    shape: tuple[int, ...]

    def local(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        """This rank's shard of ``full`` (a copy)."""
        if self.dim is None:
            return full.clone()
        blocks = full.chunk(self.parts, self.dim)
        return torch.cat([b.chunk(size, self.dim)[rank] for b in blocks], self.dim).contiguous()

    def local_shape(self, size: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return tuple(n // size if d == self.dim else n for d, n in enumerate(self.shape))

    def full(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full parameter from every rank's shard (rank order)."""
        if self.dim is None:
            return shards[0]
        pieces = [s.chunk(self.parts, self.dim) for s in shards]
        return torch.cat([pieces[r][p] for p in range(self.parts) for r in range(len(shards))], self.dim)


@dataclasses.dataclass
class TPPlan:
    """A plan resolved against one model: ``styles`` (module name -> style), ``loss_parallel`` (the output
    projection's logits stay split over the vocabulary and the loss runs under torch's ``loss_parallel``),
    ``heads`` (attention modules whose head counts tp must divide: name -> {what: count}) and
    ``split_size`` (GPT-2 attention modules whose ``split_size`` becomes the local width)."""

    apply_fn: Any
    styles: dict[str, ParallelStyle]
    loss_parallel: bool
    name: str
    heads: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    split_size: list[str] = dataclasses.field(default_factory=list)

    @property
    def model(self) -> nn.Module:
        return self.apply_fn.model


def tp_plan(apply_fn, plan: str | Mapping[str, Any] | None = None, loss_parallel: bool = True) -> TPPlan:
    """The tensor-parallel plan of ``apply_fn``'s model (from ``zf.functional``), checked against it.

    Args:
      apply_fn: the functional model (`zfunc.functional.FunctionalModel`).
      plan: None (the default plan of a Hugging Face GPT-2, Llama or BERT model, found from its
        ``config.model_type``), one of "gpt2", "llama", "bert", or a dict ``{name pattern: style}`` where a
        style is a torch ParallelStyle (ColwiseParallel(), RowwiseParallel(), SequenceParallel(),
        `FusedColwise`) or "colwise" / "rowwise" / "sequence".
      loss_parallel: in the default plans, keep the logits split over the vocabulary and compute the loss
        with torch's ``loss_parallel`` (no all-gather of the logits); False gathers the logits.
    Raises:
      ValueError: a pattern that names no module (the message lists similar names), a module two
        patterns claim, a style on a module kind it cannot split, an unknown model for plan=None.
    """
    model = getattr(apply_fn, "model", None)
    if not isinstance(model, nn.Module):
        raise TypeError("tp_plan takes the apply_fn returned by zf.functional(model)")
    names = [n for n, _ in model.named_modules() if n]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if plan is None:
        if model_type not in _DEFAULTS:
            raise ValueError(f"tp_plan: no default plan for {type(model).__name__} (model_type {model_type!r}); "
                             f"defaults exist for {sorted(_DEFAULTS)}: pass a plan {{module name pattern: style}}")
        plan = model_type
    if isinstance(plan, str):
        if plan not in _DEFAULTS:
            raise ValueError(f"tp_plan: unknown plan {plan!r}; the named plans are {sorted(_DEFAULTS)}")
        name, patterns = plan, _DEFAULTS[plan](loss_parallel)
        optional = True  # a default plan's optional parts (an LM head) may be absent
    elif isinstance(plan, Mapping):
        name, patterns, optional = "custom", dict(plan), False
    else:
        raise TypeError(f"tp_plan: plan must be None, a plan name or a dict of name pattern -> style, got {plan!r}")
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in patterns.items():
        style = _as_style(style, pattern)
        matched = [n for n in names if _matches(n, pattern)]
        if not matched:
            if optional and pattern in _OPTIONAL:
                continue
            close = [n for n in names if pattern.split(".")[-1] in n][:6]
            raise ValueError(f"tp_plan: the pattern {pattern!r} names no module of {type(model).__name__}"
                             f"{'; modules with a similar name: ' + ', '.join(close) if close else ''}. "
                             "A pattern matches a module's qualified name or its tail; '*' is one name component.")
        for n in matched:
            if n in styles:
                raise ValueError(f"tp_plan: the module {n!r} is matched by two patterns; give it one style")
            _check_kind(model.get_submodule(n), n, style)
            styles[n] = style
    resolved = TPPlan(apply_fn, styles, loss_parallel, name)
    _attention_facts(resolved, model, model_type)
    return resolved


def _as_style(style: Any, pattern: str) -> ParallelStyle:
    if isinstance(style, str):
        if style not in _STYLE_NAMES:
            raise ValueError(f"tp_plan: {pattern!r}: unknown style {style!r} (use {sorted(_STYLE_NAMES)} or a torch "
                             "ParallelStyle)")
        return _STYLE_NAMES[style]()
    if not isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)):
        raise ValueError(f"tp_plan: {pattern!r}: style {style!r} is not ColwiseParallel, RowwiseParallel, "
                         "SequenceParallel (or FusedColwise)")
    return style


def _matches(name: str, pattern: str) -> bool:
    regex = r"(?:.*\.)?" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")) + "$"
    return re.match(regex, name) is not None


def _check_kind(module: nn.Module, name: str, style: ParallelStyle) -> None:
    if isinstance(style, SequenceParallel):
        return
    if not isinstance(module, (nn.Linear, nn.Embedding, Conv1D)):
        raise ValueError(f"tp_plan: {name!r} is a {type(module).__name__}; {type(style).__name__} splits an "
                         "nn.Linear, nn.Embedding or transformers' Conv1D")
    if isinstance(style, FusedColwise) and isinstance(module, nn.Embedding):
        raise ValueError(f"tp_plan: FusedColwise on {name!r}, an embedding; it splits fused linear projections")


def split_of(module: nn.Module, style: ParallelStyle, attr: str, param: torch.Tensor) -> tuple[int | None, int]:
    """``(dim, parts)`` of parameter ``attr`` of ``module`` under ``style`` (dim None: replicated)."""
    parts = style.parts if isinstance(style, FusedColwise) else 1
    transposed = isinstance(module, Conv1D)  # weight [in, out]
    if isinstance(style, SequenceParallel):
        return None, 1
    if isinstance(module, nn.Embedding):  # weight [vocab, dim]: colwise splits dim, rowwise the vocabulary
        return (1 if isinstance(style, ColwiseParallel) else 0), 1
    if isinstance(style, ColwiseParallel):  # output features
        return ((1 if transposed else 0) if attr == "weight" else 0), parts
    if attr == "weight":  # row-parallel: input features; the bias is added once, replicated
        return (0 if transposed else 1), 1
    return None, 1


def _attention_facts(plan: TPPlan, model: nn.Module, model_type: str | None) -> None:
    """Head counts tp must divide, and GPT-2 attention modules whose width attribute becomes local."""
    config = getattr(model, "config", None)
    split = {n.rsplit(".", 1)[0] for n, s in plan.styles.items() if isinstance(s, ColwiseParallel)}
    for name, module in model.named_modules():
        if name not in split:
            continue
        if model_type == "gpt2" and hasattr(module, "split_size") and hasattr(module, "num_heads"):
            plan.heads[name] = {"attention heads (n_head)": module.num_heads}
            plan.split_size.append(name)
        elif model_type == "llama" and config is not None and name.endswith("self_attn"):
            plan.heads[name] = {"attention heads (num_attention_heads)": config.num_attention_heads,
                                "key/value heads (num_key_value_heads)": config.num_key_value_heads}
        elif model_type == "bert" and config is not None and name.endswith("attention.self"):
            plan.heads[name] = {"attention heads (num_attention_heads)": config.num_attention_heads}


def _gpt2(loss_parallel: bool) -> dict:
    return {"wte": RowwiseParallel(input_layouts=Replicate()), "h.*.attn.c_attn": FusedColwise(3),
            "h.*.attn.c_proj": RowwiseParallel(), "h.*.mlp.c_fc": ColwiseParallel(),
            "h.*.mlp.c_proj": RowwiseParallel(), "lm_head": _head(loss_parallel)}


def _llama(loss_parallel: bool) -> dict:
    return {"embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "layers.*.self_attn.q_proj": ColwiseParallel(), "layers.*.self_attn.k_proj": ColwiseParallel(),
            "layers.*.self_attn.v_proj": ColwiseParallel(), "layers.*.self_attn.o_proj": RowwiseParallel(),
            "layers.*.mlp.gate_proj": ColwiseParallel(), "layers.*.mlp.up_proj": ColwiseParallel(),
            "layers.*.mlp.down_proj": RowwiseParallel(), "lm_head": _head(loss_parallel)}


def _bert(loss_parallel: bool) -> dict:
    layer = "encoder.layer.*."
    return {"embeddings.word_embeddings": RowwiseParallel(input_layouts=Replicate()),
            layer + "attention.self.query": ColwiseParallel(), layer + "attention.self.key": ColwiseParallel(),
            layer + "attention.self.value": ColwiseParallel(), layer + "attention.output.dense": RowwiseParallel(),
            layer + "intermediate.dense": ColwiseParallel(), layer + "output.dense": RowwiseParallel(),
            "cls.predictions.decoder": _head(loss_parallel)}


def _head(loss_parallel: bool) -> ColwiseParallel:
    """The output projection: logits split over the vocabulary (a DTensor for torch's loss_parallel), or
    gathered into plain full logits."""
    if loss_parallel:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(output_layouts=Replicate())


_DEFAULTS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}
_OPTIONAL = {"lm_head", "cls.predictions.decoder"}


# --------------------------------------------------------------------------
# Preparing the model for a mesh.


def prepare(plan: TPPlan, tp_mesh) -> dict[str, ParamSplit]:
    """Rewrite ``plan``'s model for the 1-D tp mesh ``tp_mesh`` (once) and return how each trainable
    parameter (by params key) is split; the functional model's spec becomes the tp-local shapes.

    Raises ValueError, before anything is changed, when tp does not divide a split dimension or a head count.
    """
    size = tp_mesh.size()
    model = plan.model
    done = getattr(model, "_zfunc_tensor_parallel", None)
    if done is not None:
        raise ValueError("tensor_parallel: this model was already prepared for tensor parallelism by another "
                         "tensor_parallel(...) step; build one step per model (build a new model for another plan)")
    for attention, counts in plan.heads.items():
        for what, count in counts.items():
            if count % size:
                raise ValueError(f"tensor_parallel: tp={size} does not divide the {count} {what} of {attention!r}; "
                                 f"each tp rank computes whole heads: choose a tp that divides {count}")
    aliases = plan.apply_fn.aliases
    splits: dict[str, ParamSplit] = {}
    by_object: dict[int, tuple[ParamSplit, nn.Parameter]] = {}
    planned = []  # (name, module, style, {attr: DTensor spec})
    for name, style in plan.styles.items():
        module = plan.model.get_submodule(name)
        for attr, p in module._parameters.items():
            if p is None:
                continue
            dim, parts = split_of(module, style, attr, p)
            split = ParamSplit(dim, parts, tuple(p.shape))
            if dim is not None and p.shape[dim] % (size * parts):
                what = f"{parts} blocks of {p.shape[dim] // parts}" if parts > 1 else str(p.shape[dim])
                raise ValueError(f"tensor_parallel: tp={size} does not divide dim {dim} ({what}) of {name}.{attr}, "
                                 f"which {type(style).__name__} splits; choose a tp that divides it (or pad the "
                                 "model's size, e.g. the vocabulary, to a multiple of tp)")
            key = aliases.get(f"{name}.{attr}")
            if key is not None:
                if key in splits and splits[key] != split:
                    raise ValueError(f"tensor_parallel: {key!r} is tied to {name}.{attr}, which the plan splits "
                                     f"differently ({splits[key]} vs {split}); tied weights need one split")
                splits[key] = split
            previous = by_object.get(id(p))
            if previous is not None and previous[0] != split:
                raise ValueError(f"tensor_parallel: {name}.{attr} is shared with another module the plan splits "
                                 "differently; shared weights need one split")
        planned.append((name, module, style))
    rank = tp_mesh.get_local_rank()
    for name, module, style in planned:
        specs = {}
        for attr, p in list(module._parameters.items()):
            if p is None:
                continue
            dim, parts = split_of(module, style, attr, p)
            if id(p) not in by_object:
                split = ParamSplit(dim, parts, tuple(p.shape))
                placement = [Replicate()] if dim is None else [Shard(dim)]
                local = split.local(p.detach(), size, rank)
                converted = nn.Parameter(DTensor.from_local(local, tp_mesh, placement, run_check=False,
                                                            shape=p.shape, stride=_contiguous_stride(p.shape)),
                                         requires_grad=p.requires_grad)
                by_object[id(p)] = (split, converted)
            converted = by_object[id(p)][1]
            module._parameters[attr] = converted
            specs[attr] = (converted.placements, converted.shape, converted.stride())
        input_fn, output_fn = _hooks(style, module)
        distribute_module(module, tp_mesh, _nothing_to_partition, input_fn, output_fn)
        _LocalToDTensor(module, tp_mesh, specs).install()
    for module in model.modules():  # keep ties: every slot of a converted tensor holds the same DTensor
        for attr, p in list(module._parameters.items()):
            if p is not None and id(p) in by_object and not isinstance(p, DTensor):
                module._parameters[attr] = by_object[id(p)][1]
    for name in plan.split_size:
        attention = model.get_submodule(name)
        attention.split_size //= size
    spec = plan.apply_fn.structure.spec
    for key, split in splits.items():
        shape, dtype = spec[key]
        spec[key] = (torch.Size(split.local_shape(size)), dtype)
    model._zfunc_tensor_parallel = tp_mesh
    return splits


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _nothing_to_partition(name, module, mesh) -> None:
    """The parameters were converted to this rank's shards already (`prepare`)."""


def _hooks(style: ParallelStyle, module: nn.Module):
    """The input and output functions torch's ``style._apply`` installs, for the module kinds zfunc adds
    (``Conv1D``) too: the same static functions of the style, bound as its ``_apply`` binds them."""
    if isinstance(style, SequenceParallel):
        return (partial(style._prepare_input_fn, style.sequence_sharding),
                partial(style._prepare_output_fn, style.use_local_output))
    if isinstance(style, RowwiseParallel):
        # a row-parallel linear computes on inputs split on their last dim; an embedding on replicated ids
        desired = (Replicate(),) if isinstance(module, nn.Embedding) else (Shard(-1),)
        style.desired_input_layouts = desired
    return (partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
            partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


class _LocalToDTensor:
    """Forward hooks of one planned module: the tp-local tensors swapped into its parameter slots for a
    call (zfunc's state, a compute copy, a gathered unit) become DTensors of the placement the module was
    prepared with just before it runs, and are put back when it returns (or raises), so the swap that put
    them there finds its own tensors. Gradients flow to the local tensors through ``DTensor.from_local``."""

    def __init__(self, module: nn.Module, mesh, specs: dict[str, tuple]) -> None:
        self.module, self.mesh, self.specs = module, mesh, specs
        self.saved: list[dict[str, torch.Tensor]] = []

    def install(self) -> None:
        self.module.register_forward_pre_hook(self.before, prepend=True)
        self.module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args) -> None:
        saved = {}
        for attr, (placements, shape, stride) in self.specs.items():
            t = module._parameters.get(attr)
            if t is not None and not isinstance(t, DTensor):
                saved[attr] = t
                module._parameters[attr] = DTensor.from_local(t, self.mesh, placements, run_check=False,
                                                              shape=shape, stride=stride)
        self.saved.append(saved)

    def after(self, module: nn.Module, args, output) -> None:
        if self.saved:
            module._parameters.update(self.saved.pop())
