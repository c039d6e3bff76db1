"""Hugging Face weights in and out: `load_pretrained` streams a safetensors checkpoint into a training state.

    with torch.device("meta"):                                   # no values anywhere yet
        model = transformers.AutoModelForCausalLM.from_config(config)
    apply_fn, params = zf.functional(model, init="hf")
    step = shard(offload(mixed_precision(train_step, "bf16")), stage=3)

    # (a) values placed unit by unit while step.init builds the state (no random draw):
    state, report = zf.io.load_pretrained("llama-dir", like=zf.TrainState.create(params, opt), step=step)
    # (b) or into a state step.init already made (its values are overwritten):
    state, report = zf.io.load_pretrained("llama-dir", like=step.init(zf.TrainState.create(params, opt)))
    print(report)                                                # what came from where

    zf.io.export_hf("out-dir", state, model=model)                # config.json + model.safetensors
    transformers.AutoModelForCausalLM.from_pretrained("out-dir")

**Memory.** No process ever holds the checkpoint. In (b) each rank reads
only the element ranges its shards hold (the mapping `restore` uses:
`zfunc.io.entries.Spans` of the state's `ShardLayout`), straight from the
file into the state's own tensors — the fp32 master and the compute copy
under `mixed_precision`, on the host under `offload` — so the extra memory
is at most one staging buffer (8 MiB) per file read when a dtype is converted. In (a) the
model is never given random values: `step.init` asks for one unit (a block)
at a time and each rank reads that unit's tensors whole, keeps its shard and
drops the rest, so its peak is one unit beyond its share, as for a meta
model's random init. (a) reads every tensor on every rank, (b) only the
rank's share; (a) skips the initializer's work.

**Names.** Checkpoint names are matched to the model's (`zfunc.io.hf_names`):
``rename=`` (a dict or a function; None drops a tensor), then the name
itself, then with the model's base prefix (Hugging Face's
``base_model_prefix``, or ``prefix=``) added or removed. Tied weights are
filled from whichever name the checkpoint holds (``save_pretrained`` keeps
one). Model tensors the checkpoint lacks and checkpoint tensors the model
lacks are errors unless ``allow_missing`` / ``allow_unexpected`` (True or
glob patterns) allow them; an allowed missing parameter keeps its value (in
(a): its module's initializer draws it, e.g. a new classifier head). Shapes
must agree. A cast that loses nothing (bf16 -> fp32) is done and reported, a
lossy one (fp32 checkpoint into a bf16 model) needs ``allow_lossy_cast=True``.
The compute copy of `mixed_precision` is not a cast the caller chose: it
gets the master's values rounded, as the transform itself makes it.

**The module.** A training state holds only trainable parameters. Frozen
parameters and persistent buffers live in the module: pass ``model=`` in (b)
to load them too (in (a) the state knows its model). Non-persistent buffers
(rotary frequencies, position ids) are not in checkpoints; a meta-built
model gets them from its initializer (``init="hf"``).

**Ranks.** Call it on every rank of the group, like `restore`: every check
(names, shapes, dtypes, the files' headers) runs before anything is written,
every rank learns of any rank's failure (`CheckpointError` naming it), and
ranks that opened different checkpoints are refused.

Never unpickled: only safetensors files are read (``pytorch_model.bin`` is
refused with a message on converting it). See `export_hf` for the reverse.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from zfunc import dist
from zfunc.interpret import check_alive, forget_copies
from zfunc.interpret import init as init_step
from zfunc.io.entries import Spans, global_shapes, layout_of, pipeline_of, tp_layout_of, walk, weights_path
from zfunc.io.format import CheckpointError, progress_bar
from zfunc.io.hf_export import export_hf
from zfunc.io.hf_files import HFCheckpoint
from zfunc.io.hf_names import Allow, Plan, Rename, Target, module_names, resolve
from zfunc.io.ranks import exchange, raise_if_failed
from zfunc.materialize import Materializer, is_meta
from zfunc.state import TrainState
from zfunc.state_check import refusal
from zfunc.tree import tree_leaves

__all__ = ["LoadReport", "export_hf", "load_pretrained"]

MASTER = re.compile(r"extras/[^/]+/master")


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What `load_pretrained` did (``print`` it).

    Attributes:
      source: the checkpoint (directory or file).
      loaded: ``{model name: checkpoint name}`` of every tensor filled (tied groups once, by their key).
      tied: ``{alias: key}``: model names filled through their tie.
      copies: checkpoint tensors of tied names not read (their group came from another name).
      missing: model names the checkpoint lacks (allowed): they kept their values.
      unexpected: checkpoint names the model lacks (allowed): not read.
      dropped: checkpoint names ``rename`` dropped.
      casts: ``{model name: (checkpoint dtype, model dtype)}``.
      mode: ``"ranges"`` (into an initialized state: each rank read its shards' ranges) or ``"units"``
        (placed while ``step.init`` built the state, unit by unit).
      bytes_read: bytes this rank read from the checkpoint.
    """

    source: str
    loaded: dict[str, str]
    tied: dict[str, str]
    copies: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    dropped: tuple[str, ...]
    casts: dict[str, tuple[str, str]]
    mode: Literal["ranges", "units"]
    bytes_read: int

    @property
    def renamed(self) -> dict[str, str]:
        """``{model name: checkpoint name}`` where the two differ."""
        return {m: c for m, c in self.loaded.items() if m != c}

    def __str__(self) -> str:
        how = "each rank its shards' ranges" if self.mode == "ranges" else "unit by unit in step.init"
        lines = [(f"load_pretrained {self.source}: {len(self.loaded)} tensors loaded ({how}, "
                  f"{self.bytes_read / 2**20:,.1f} MiB read here)")]
        sections = [("renamed", [f"{c} -> {m}" for m, c in self.renamed.items()]),
                    ("tied", [f"{a} = {k}" for a, k in self.tied.items()]),
                    ("tied copies not read", list(self.copies)),
                    ("cast", [f"{m}: {a} -> {b}" for m, (a, b) in self.casts.items()]),
                    ("missing (kept their values)", list(self.missing)),
                    ("unexpected (not read)", list(self.unexpected)),
                    ("dropped by rename", list(self.dropped))]
        for title, items in sections:
            if items:
                shown = items[:6] + ([f"... ({len(items) - 6} more)"] if len(items) > 6 else [])
                lines.append(f"  {title} ({len(items)}): " + ", ".join(shown))
        return "\n".join(lines)


def load_pretrained(directory: str | os.PathLike, like: TrainState, *, step: Callable | None = None,
                    model: nn.Module | None = None, rename: Rename = None, prefix: str | None = "auto",
                    allow_missing: Allow = False, allow_unexpected: Allow = False, allow_lossy_cast: bool = False,
                    init_device: torch.device | str = "cpu", group: Any = None,
                    progress: bool = True) -> tuple[TrainState, LoadReport]:
    """Load a Hugging Face safetensors checkpoint into a training state, streaming; ``(state, report)``.

    Args:
      directory: a ``save_pretrained`` directory (``model.safetensors``, or shards and
        ``model.safetensors.index.json``) or one ``.safetensors`` file.
      like: either a state ``step.init`` made (any world size, stage, mixed precision,
        offload): its weights are overwritten in place and it is returned; or, with
        ``step``, the fresh ``TrainState.create`` state of a meta-built model.
      step: with a meta-built ``like``: the step whose ``init`` builds the state; values
        are placed unit by unit as it does, none drawn at random (see the module docstring).
      model: the module trained, for its frozen parameters and persistent buffers and its
        base prefix (default: the meta-built model ``like`` records, if any).
      rename: ``{checkpoint name: model name}`` or a function of a checkpoint name (None
        drops the tensor).
      prefix: the base-model prefix tried when a name does not match (``"auto"``: the
        model's ``base_model_prefix``, or without a model the first name component that
        matches the most names; None: none).
      allow_missing: True, or patterns (glob strings, compiled regexes) of model names
        the checkpoint may lack.
      allow_unexpected: likewise, for checkpoint names the model lacks.
      allow_lossy_cast: allow rounding a checkpoint dtype into a narrower model dtype.
      init_device: where a meta-built model's values are staged (with ``step``).
      group: the process group (default: the world).
      progress: a progress bar (bytes read) on rank 0.
    Returns:
      ``(state, report)``: the loaded state and a `LoadReport`.
    Raises:
      CheckpointError: the checkpoint is not safetensors, does not fit the model (every
        problem listed), or a rank failed to read it.
    """
    if not isinstance(like, TrainState):
        raise TypeError(refusal(like, "zfunc.io.load_pretrained(dir, like=...)"))
    check_alive(like, "load_pretrained")
    g = dist.Group.resolve(group)
    meta = like.materializer is not None and is_meta(tree_leaves(like.params))
    if model is None and like.materializer is not None:
        model = like.materializer.model
    if meta and step is None:
        raise TypeError("load_pretrained: like is a meta-built model's state that has no values yet: pass step= "
                        "(the step whose init builds the state; values are then placed unit by unit), or load "
                        "into step.init(state)")
    if not meta and step is not None:
        raise TypeError("load_pretrained: step= is for a meta-built state that step.init has not built yet; "
                        "this state has its values (it was initialized): leave step out")
    ckpt = error = plan = ops = None
    total = 0
    layout = None if meta else layout_of(like)
    if not meta and tp_layout_of(like) is not None:  # (the same on every rank: raised before any exchange)
        raise ValueError("load_pretrained: this state is split by tensor_parallel; load the pretrained weights "
                         "into the plain state first (before step.init), then build it with the tensor_parallel "
                         "step's init")
    if not meta and pipeline_of(like) is not None:  # (likewise: each rank holds its stages' parameters only)
        raise ValueError("load_pretrained: this state is split into pipeline stages; load the pretrained weights "
                         "into the plain state first (before step.init), then build it with the pipeline step's "
                         "init")
    try:
        if layout is not None and (layout.world_size, layout.rank) != (g.size, g.rank):
            raise CheckpointError(f"load_pretrained: the state is sharded for rank {layout.rank} of "
                                  f"{layout.world_size}, but this process is rank {g.rank} of {g.size}")
        ckpt = HFCheckpoint(directory)
        targets = _targets(like, layout, model, meta)
        plan = resolve({n: (e.dtype, e.shape) for n, e in ckpt.entries.items()}, targets, rename=rename,
                       prefix=_prefixes(prefix, model, targets, ckpt.entries), allow_missing=allow_missing,
                       allow_unexpected=allow_unexpected, allow_lossy_cast=allow_lossy_cast, where=str(directory),
                       hint="" if model is not None else "without model= the module's frozen parameters and "
                       "buffers are unknown: pass the model to load them; or ")
        if meta:  # every rank reads every tensor it places, whole
            total = sum(ckpt.entries[s].numel * ckpt.entries[s].dtype.itemsize for s in plan.sources.values())
        else:
            ops = _range_ops(plan, like, layout, g.rank) + _constant_ops(plan, model)
            total = sum(flat.numel() * ckpt.entries[src].dtype.itemsize for src, _, _, flat in ops)
    except Exception as e:  # noqa: BLE001 (reported to every rank, so none waits for this one)
        error = _describe(e, g)
    try:
        views = exchange("load_pretrained", "check", [ckpt.fingerprint() if ckpt else None, error], g)
        raise_if_failed("load_pretrained", [v[1] for v in views], g.rank)
        if any(v[0] != views[0][0] for v in views):
            raise CheckpointError(f"load_pretrained: the ranks opened different checkpoints ({directory} here); "
                                  "every rank must load the same files")
        error, nbytes = None, 0
        with progress_bar(progress and g.rank == 0, total, "load_pretrained") as bar:
            try:
                if meta:
                    like, nbytes = _load_by_units(ckpt, plan, like, step, bar, init_device)
                else:
                    nbytes = _load_ranges(ckpt, ops, bar)
            except Exception as e:  # noqa: BLE001
                error = _describe(e, g)
        raise_if_failed("load_pretrained", exchange("load_pretrained", "read", error, g), g.rank)
    finally:
        if ckpt is not None:
            ckpt.close()
    tied = {a: k for k, t in targets.items() for a in t.aliases}
    forget_copies(like)  # (written consistently here; the next step records the compute copy and master afresh)
    return like, LoadReport(str(directory), {k: plan.sources[k] for k in targets if k in plan.sources}, tied,
                            plan.copies, plan.missing, plan.unexpected, plan.dropped, plan.casts,
                            "units" if meta else "ranges", nbytes)


def _prefixes(prefix: str | None, model: nn.Module | None, targets: dict, names) -> list[str | None]:
    """The base prefixes to try: the given one; for "auto" the model's ``base_model_prefix``, or without a
    model every first component of a model or checkpoint name (`resolve` keeps the one matching most)."""
    if prefix != "auto":
        return [prefix]
    if model is not None:
        return [getattr(model, "base_model_prefix", None) or None]
    return [None, *sorted({n.split(".")[0] for n in [*targets, *names] if "." in n})]


def _describe(e: Exception, g: dist.Group) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"load_pretrained: rank {g.rank}: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------
# The model's tensors


def _targets(like: TrainState, layout, model: nn.Module | None, meta: bool) -> dict[str, Target]:
    """Every tensor of the model to fill, keyed by canonical name (tied names as its aliases)."""
    shapes = {k: tuple(v.shape) for k, v in like.params.items()} if meta else global_shapes(like, layout)
    if meta:
        dtypes = {k: v.dtype for k, v in like.params.items()}
    else:
        groups, _ = walk(like)
        dtypes = {k: v.dtype for k, v in groups[weights_path(groups)].items()}
    aliases = dict(like.ties)
    constants: dict[str, Target] = {}
    if model is not None:
        trainable, constant_names = module_names(model)
        for alias, key in trainable.items():
            if alias != key and aliases.setdefault(alias, key) != key:
                raise CheckpointError(f"load_pretrained: the state ties {alias!r} to {aliases[alias]!r}, the model to "
                                      f"{key!r}: is model= the model this state was made from?")
        unknown = sorted(set(trainable.values()) ^ set(shapes))
        if unknown:
            raise CheckpointError(f"load_pretrained: model= is not the model of this state: their trainable "
                                  f"parameters differ ({', '.join(unknown[:5])})")
        for name, (tensor, others) in constant_names.items():
            kind = "buffer" if not isinstance(tensor, nn.Parameter) else "frozen"
            constants[name] = Target(kind, tuple(tensor.shape), tensor.dtype, others)
    by_key: dict[str, list[str]] = {}
    for alias, key in sorted(aliases.items()):
        by_key.setdefault(key, []).append(alias)
    targets = {k: Target("param", shapes[k], dtypes[k], tuple(by_key.get(k, ()))) for k in shapes}
    return {**targets, **constants}


# --------------------------------------------------------------------------
# (b) into an initialized state: each rank its ranges


def _weight_groups(groups: dict) -> list[str]:
    """The groups that hold weights: ``params`` and the masters of the transforms (not optimizer moments)."""
    return [p for p in groups if p == "params" or MASTER.fullmatch(p)]


def _range_ops(plan: Plan, like: TrainState, layout, rank: int) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """``(checkpoint name, first element, destination tensor, its flat view)`` for every weight tensor."""
    groups, _ = walk(like)
    spans = Spans(layout, global_shapes(like, layout))
    ops = []
    for path in _weight_groups(groups):
        for key, t in groups[path].items():
            src = plan.sources.get(key)
            if src is None:
                continue
            a, b = spans.local(key, rank, t, f"load_pretrained: the state's {path}")
            if b > a:
                ops.append((src, a, t, _flat(t)))
    return ops


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype, device=t.device)


def _constant_ops(plan: Plan, model: nn.Module | None) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    if model is None:
        return []
    _, constants = module_names(model)
    ops = []
    for name, (t, _) in constants.items():
        if name in plan.sources:
            if t.is_meta:
                raise CheckpointError(f"load_pretrained: the model's {name} is on the meta device (it has no "
                                      "memory to load into): give the module its frozen tensors first, e.g. by "
                                      "building the state with step= (load_pretrained(..., step=step))")
            ops.append((plan.sources[name], 0, t, _flat(t)))
    return ops


def _load_ranges(ckpt: HFCheckpoint, ops: list, bar) -> int:
    """Each op's range read into its destination, one thread per file (in file order); returns bytes read."""
    by_file: dict[Any, list] = {}
    for op in ops:
        by_file.setdefault(ckpt.file_of(op[0]), []).append(op)

    def read(f) -> int:
        n = 0
        with torch.no_grad():
            for src, begin, t, flat in sorted(by_file[f], key=lambda op: f.entries[op[0]].start + op[1]):
                ckpt.read_range(src, begin, flat)
                if flat.data_ptr() != t.data_ptr() or flat.device != t.device:  # a non-contiguous destination
                    t.copy_(flat.view(t.shape))
                done = flat.numel() * f.entries[src].dtype.itemsize
                bar.update(done)
                n += done
        return n

    workers = max(1, min(len(by_file), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="zfunc-hf-read") as pool:
        return sum(pool.map(read, by_file))


# --------------------------------------------------------------------------
# (a) a meta-built model: placed unit by unit while step.init builds the state


def _load_by_units(ckpt: HFCheckpoint, plan: Plan, like: TrainState, step: Callable, bar,
                   init_device) -> tuple[TrainState, int]:
    """``step``'s init of ``like`` with the model's initializer replaced by one that reads the checkpoint."""
    old = like.materializer
    loader = _ModuleLoader(ckpt, plan, old, bar)
    state = init_step(step, like.replace(materializer=Materializer(old.model, old.aliases, loader)),
                      init_device=init_device)
    return state, loader.nbytes


class _ModuleLoader:
    """An initializer ``fn(module)`` for `zfunc.materialize.Materializer` that reads each module's own
    tensors from the checkpoint; the model's own initializer runs first only on modules holding a tensor
    the checkpoint does not fill (a non-persistent buffer, an allowed missing parameter)."""

    def __init__(self, ckpt: HFCheckpoint, plan: Plan, original: Materializer, bar) -> None:
        self.ckpt, self.bar, self.nbytes = ckpt, bar, 0
        model = original.model
        self.trainable = original.aliases
        self.sources = dict(plan.sources)
        _, constants = module_names(model)
        for name, (_, others) in constants.items():  # shared constants: every name from the same tensor
            for other in others:
                if name in plan.sources:
                    self.sources[other] = plan.sources[name]
        self.name_of: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self.name_of.setdefault(id(module), name)
        self.base = _base_initializers(model, original.init)
        self.done: set[int] = set()

    def __call__(self, module: nn.Module) -> None:
        if id(module) in self.done:  # a module reached twice (shared) is loaded once
            return
        self.done.add(id(module))
        prefix = self.name_of[id(module)]
        slots = []
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if self.trainable.get(name, name) != name:
                continue  # a tied alias: its key's module fills the one tensor
            slots.append((t, self.sources.get(name)))
        base = self.base.get(id(module))
        if base is not None and any(src is None for _, src in slots):
            base(module)
        for t, src in slots:
            if src is not None:
                self.ckpt.read_range(src, 0, t.detach().view(-1))
                done = t.numel() * self.ckpt.entries[src].dtype.itemsize
                self.nbytes += done
                self.bar.update(done)


def _base_initializers(model: nn.Module, init) -> dict[int, Callable[[nn.Module], Any]]:
    """``{id(module): what the model's own initializer runs on it}`` (as `zfunc.materialize` orders it)."""
    out: dict[int, Callable] = {}

    def visit(module: nn.Module, fn) -> None:
        if init == "hf" and callable(getattr(module, "_init_weights", None)):
            fn = module._init_weights  # a sub-model initializes its own modules
        for child in module.children():
            visit(child, fn)
        if init == "reset_parameters":
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                out.setdefault(id(module), lambda m: m.reset_parameters())
        elif fn is not None:
            out.setdefault(id(module), fn)

    visit(model, model._init_weights if init == "hf" else (None if init == "reset_parameters" else init))
    return out
