"""`export_hf`: weights in the layout ``from_pretrained`` loads, streamed one parameter at a time.

The weights come from a training state (every rank calls; each parameter is
assembled from the ranks' shards by one all-gather, and rank 0 writes it), a
zfunc checkpoint directory (assembled from the rank files, as `consolidate`
does, by one process), or a dict of full tensors (``step.gather(state)``).
Only one parameter is held at a time beyond what the source already holds.

Written into ``out_dir``: ``config.json`` (the model's config, with
``dtype`` set to what was written and ``architectures`` to the model's
class, as ``save_pretrained`` writes them), ``generation_config.json`` when
the model has one, and ``model.safetensors`` — or, past ``max_shard_size``,
``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json``.
Tied weights are written once, under the parameter's own name, as
``save_pretrained`` does (``aliases="all"`` writes every name). With
``model=``, its frozen parameters and persistent buffers are written too.

Files are written under temporary names and renamed into place when all are
complete. Existing weight files are never deleted: a directory that already
holds weights is refused unless ``overwrite=True``, and even then any weight
file the export would not replace (stale shards of another layout) is an
error naming it, since ``from_pretrained`` might read it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from zfunc import dist
from zfunc.io.entries import Spans, escape, global_shapes, layout_of, pipeline_of, tp_layout_of, walk, weights_path
from zfunc.io.format import CheckpointError, dtype_from_name, dtype_name, progress_bar, write_safetensors
from zfunc.io.hf_files import CONFIG, INDEX, WEIGHTS
from zfunc.io.hf_names import module_names
from zfunc.io.manifest import read_manifest
from zfunc.io.ranks import exchange, raise_if_failed
from zfunc.io.reader import check_entries, check_files, locate, open_ranks
from zfunc.state import TrainState

GENERATION = "generation_config.json"
WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
         "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor to write: its name, dtype and shape, and how to build it (``collective``: every rank builds)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]
    collective: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def export_hf(out_dir: str | os.PathLike, source: TrainState | str | os.PathLike | Mapping[str, torch.Tensor], *,
              model: nn.Module | None = None, config: Any = "auto", dtype: torch.dtype | None = None,
              max_shard_size: int | str = "5GB", aliases: Literal["none", "all"] = "none", step: int | None = None,
              overwrite: bool = False, group: Any = None, verify: bool = True, progress: bool = True) -> Path:
    """Write ``source``'s weights as a Hugging Face model directory (see the module docstring); returns it.

    Args:
      out_dir: the directory to write (created if absent).
      source: a `TrainState` in any layout (call on every rank of ``group``; rank 0 writes),
        a zfunc checkpoint directory (its latest step, or ``step``), or ``{name: full tensor}``.
      model: the model trained: its config, its tied names, its frozen parameters and
        persistent buffers (written too), its class name for ``architectures``.
      config: ``"auto"`` (``model.config``), a transformers config, a dict, or None (no config.json).
      dtype: the floating dtype to write (default: the weights' own, fp32 masters included).
      max_shard_size: bytes per file (an int, or ``"5GB"``, ``"500MiB"``...); larger exports are sharded.
      aliases: ``"none"``: tied weights once, as ``save_pretrained`` writes them; ``"all"``: every name.
      step: with a checkpoint directory, the step to export (default: the latest).
      overwrite: replace the weights and config an earlier export wrote into ``out_dir``.
      group: the process group (a state source).
      verify: with a checkpoint directory, check the rank files' SHA-256 first.
      progress: a progress bar (bytes written).
    Returns:
      ``out_dir``.
    """
    if aliases not in ("none", "all"):
        raise ValueError(f"aliases must be 'none' or 'all', got {aliases!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch dtype or None, got {dtype!r}")
    limit = shard_bytes(max_shard_size)
    out = Path(out_dir)
    if isinstance(source, TrainState):
        g = dist.Group.resolve(group)
        error = tensors = None
        try:
            tensors = _from_state(source, g, dtype, aliases, model)
            if g.rank == 0:
                _check_output(out, overwrite)
        except Exception as e:  # noqa: BLE001 (reported to every rank, so none waits for this one)
            error = str(e) if isinstance(e, CheckpointError) else f"export_hf: rank {g.rank}: {type(e).__name__}: {e}"
        raise_if_failed("export_hf", exchange("export_hf", "check", error, g), g.rank)
        error = None
        if g.rank == 0:
            try:
                _write(out, tensors, limit, model, config, progress)
            except Exception as e:  # noqa: BLE001
                error = str(e) if isinstance(e, CheckpointError) else \
                    f"export_hf: rank 0 could not write {out}: {type(e).__name__}: {e}"
        else:
            for t in tensors:  # the other ranks take part in every gather, in rank 0's order
                if t.collective:
                    t.make()
        raise_if_failed("export_hf", exchange("export_hf", "write", error, g), g.rank)
        return out
    if isinstance(source, Mapping):
        tensors = _from_dict(source, dtype, aliases, model)
        _check_output(out, overwrite)
        _write(out, tensors, limit, model, config, progress)
        return out
    step_dir = locate(source, step)
    real, checkpoint = Path(os.path.realpath(out)), Path(os.path.realpath(step_dir))
    if real == checkpoint or checkpoint in real.parents:
        raise CheckpointError(f"export_hf: {out} is inside the checkpoint it reads ({step_dir}); choose a directory "
                              "outside it")
    _check_output(out, overwrite)
    with _CheckpointSource(step_dir, verify) as ck:
        _write(out, ck.tensors(dtype, aliases, model), limit, model, config, progress)
    return out


def shard_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a string with a unit (``"5GB"`` = 5e9, ``"2GiB"`` = 2**31)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
        if m:
            return int(float(m.group(1)) * UNITS[m.group(2)])
    raise ValueError(f"max_shard_size must be a positive number of bytes or a size such as '5GB', got {size!r}")


# --------------------------------------------------------------------------
# Sources


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _out_dtype(d: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and d.is_floating_point else d


def _names(keys: list[str], ties: Mapping[str, str], aliases: str) -> list[tuple[str, str]]:
    """``(name written, key)``: every key, then (``aliases="all"``) each alias right after its key."""
    by_key: dict[str, list[str]] = {}
    if aliases == "all":
        for alias, key in sorted(ties.items()):
            by_key.setdefault(key, []).append(alias)
    return [(n, k) for k in keys for n in (k, *by_key.get(k, ()))]


def _model_constants(model: nn.Module | None, keys: set[str], ties: dict[str, str], dtype) -> list[_Tensor]:
    """The model's frozen parameters and persistent buffers, after checking its trainable ones are ``keys``."""
    if model is None:
        return []
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    trainable, constants = module_names(model)
    differ = sorted(set(trainable.values()) ^ keys)
    if differ:
        raise CheckpointError(f"export_hf: model= is not the model these weights were trained from: their trainable "
                              f"parameters differ ({', '.join(differ[:5])})")
    ties.update({a: k for a, k in trainable.items() if a != k})
    out = []
    for name, (t, others) in constants.items():
        if t.is_meta:
            raise CheckpointError(f"export_hf: the model's {name} is on the meta device, so it has no value to write")
        for n in (name, *others):
            out.append(_Tensor(n, _out_dtype(t.dtype, dtype), tuple(t.shape), lambda t=t: _cast(t.detach(), dtype)))
    return out


def _from_dict(weights: Mapping[str, torch.Tensor], dtype, aliases: str, model) -> list[_Tensor]:
    """Full tensors by name; with ``model``, its parameters (tied ones once) and then its constants."""
    def one(name: str, key: str) -> _Tensor:
        t = weights[key]
        return _Tensor(name, _out_dtype(t.dtype, dtype), tuple(t.shape), lambda: _cast(t.detach(), dtype))

    if model is None:
        return [one(k, k) for k in weights]
    trainable, _ = module_names(model)
    keys = list(dict.fromkeys(trainable.values()))
    ties: dict[str, str] = {}
    constants = _model_constants(model, set(keys), ties, dtype)
    lacking = [k for k in keys if k not in weights]
    foreign = [k for k in weights if k not in trainable and k not in {t.name for t in constants}]
    if lacking or foreign:
        raise CheckpointError("export_hf: the weights are not the model's: " + "; ".join(filter(None, [
            f"they lack {lacking[:5]}" if lacking else "", f"the model has no {foreign[:5]}" if foreign else ""])))
    return [one(n, k) for n, k in _names(keys, ties, aliases)] + constants


def _from_state(state: TrainState, g: dist.Group, dtype, aliases: str, model) -> list[_Tensor]:
    """Each weight assembled from the ranks' shards (one all-gather per parameter under `shard`)."""
    if tp_layout_of(state) is not None:
        raise ValueError("export_hf: this state is split by tensor_parallel; export its full parameters: "
                         "export_hf(out_dir, step.gather(state), model=...) (every rank calls step.gather)")
    if pipeline_of(state) is not None:  # each rank holds its stages' parameters only
        raise ValueError("export_hf: this state is split into pipeline stages; export its full parameters: "
                         "export_hf(out_dir, step.gather(state), model=...) (every rank calls step.gather)")
    layout = layout_of(state)
    if layout is not None and (layout.world_size, layout.rank) != (g.size, g.rank):
        raise CheckpointError(f"export_hf: the state is sharded for rank {layout.rank} of {layout.world_size}, but "
                              f"this process is rank {g.rank} of {g.size}")
    groups, _ = walk(state)
    path = weights_path(groups)
    shapes = global_shapes(state, layout)
    spans = Spans(layout, shapes)
    whole = layout is None or g.size == 1 or (path == "params" and layout.stage < 3)  # every rank has all of it
    comm = None if whole else dist.Comm(g)

    def make(key: str) -> torch.Tensor:
        t = groups[path][key]
        if whole:
            return _cast(t.detach().reshape(shapes[key]), dtype)
        a, _ = spans.local(key, g.rank, t, f"export_hf: the state's {path}")
        ranges = [spans.span(key, r) for r in range(g.size)]
        width = max(hi - lo for lo, hi in ranges)
        lo, hi = ranges[g.rank]
        piece = torch.zeros(width, dtype=t.dtype, device=g.device)
        piece[:hi - lo] = t.detach().reshape(-1)[lo - a:hi - a]
        gathered = comm.all_gather(piece, tag=f"export_hf:{key}")
        full = torch.empty(math.prod(shapes[key]), dtype=t.dtype, device=gathered.device)
        for r, (lo, hi) in enumerate(ranges):
            full[lo:hi] = gathered[r * width:r * width + hi - lo]
        del gathered, piece
        return _cast(full.view(shapes[key]), dtype)

    ties = dict(state.ties)
    constants = _model_constants(model, set(shapes), ties, dtype)
    weights = groups[path]
    return [_Tensor(n, _out_dtype(weights[k].dtype, dtype), shapes[k], lambda k=k: make(k), collective=not whole)
            for n, k in _names(list(shapes), ties, aliases)] + constants


class _CheckpointSource:
    """A zfunc checkpoint's full weights, one parameter at a time (`consolidate`'s reading)."""

    def __init__(self, step_dir: Path, verify: bool) -> None:
        self.manifest = m = read_manifest(step_dir)
        check_files(step_dir, m)
        self.shapes = {k: tuple(s) for k, s in m["params"].items()}
        self.spans = Spans.of_manifest(m)  # (any layout: shard over dp, pipeline stages, tensor-parallel shards)
        self.group = m["weights"]
        holders = [s for s in range(m["world_size"]) if any(self.spans.span(k, s)[1] > self.spans.span(k, s)[0]
                                                              for k in self.shapes)]
        self.files = open_ranks(step_dir, m, holders, verify)
        try:
            if self.shapes:
                check_entries(m, self.files, [self.group])
        except BaseException:
            self.close()
            raise

    def tensors(self, dtype, aliases: str, model) -> list[_Tensor]:
        ties = dict(self.manifest.get("ties", []))
        constants = _model_constants(model, set(self.shapes), ties, dtype)
        stored = {k: dtype_from_name(d) for k, d in self.manifest["groups"][self.group].items()}

        def make(key: str) -> torch.Tensor:
            full = torch.empty(self.shapes[key], dtype=stored[key])
            flat = full.view(-1)
            name = f"{self.group}/{escape(key)}"
            for s, f in self.files.items():
                a, b = self.spans.span(key, s)
                for start, count, offset in self.spans.runs(key, s, a, b):  # (one run each without tp)
                    f.file_of(name).read_into(name, offset, flat[start:start + count])
            return _cast(full, dtype)

        return [_Tensor(n, _out_dtype(stored[k], dtype), self.shapes[k], lambda k=k: make(k))
                for n, k in _names(list(self.shapes), ties, aliases)] + constants

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> _CheckpointSource:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------
# Writing


def _check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export_hf: {out} exists and is not a directory")
    if not out.exists():
        if not out.parent.is_dir():
            raise CheckpointError(f"export_hf: cannot create {out}: {out.parent} does not exist")
        return
    present = sorted(p.name for p in out.iterdir() if WEIGHT_FILE.fullmatch(p.name) or p.name == CONFIG)
    if present and not overwrite:
        raise CheckpointError(f"export_hf: {out} already holds {', '.join(present[:4])}; pass overwrite=True to "
                              "replace an earlier export, or choose an empty directory")


def _shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Consecutive groups of at most ``limit`` bytes (a larger tensor gets a file of its own)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _write(out: Path, tensors: list[_Tensor], limit: int, model, config, progress: bool) -> None:
    shards = _shards(tensors, limit)
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(len(shards))]
    index = None if len(shards) == 1 else {
        "metadata": {"total_size": sum(t.nbytes for t in tensors)},
        "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
    dtypes = {t.dtype for t in tensors if t.dtype.is_floating_point}
    texts = {}
    cfg = _config(config, model, dtypes.pop() if len(dtypes) == 1 else None)
    if cfg is not None:
        texts[CONFIG] = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
        generation = getattr(model, "generation_config", None)
        if generation is not None and callable(getattr(generation, "to_json_string", None)):
            texts[GENERATION] = generation.to_json_string(use_diff=True)
    if index is not None:
        texts[INDEX] = json.dumps(index, indent=2) + "\n"
    stale = sorted(p.name for p in out.iterdir() if WEIGHT_FILE.fullmatch(p.name) and p.name not in
                   {*names, *texts}) if out.is_dir() else []
    if stale:
        raise CheckpointError(f"export_hf: {out} holds {', '.join(stale[:4])}, which this export would not replace "
                              "and from_pretrained might read: remove them (zfunc deletes only what it wrote)")
    out.mkdir(exist_ok=True)
    token = secrets.token_hex(4)
    written: list[tuple[Path, Path]] = []
    pending = iter(tensors)  # what the other ranks still expect gathers for, if a write fails
    try:
        with progress_bar(progress, sum(t.nbytes for t in tensors), f"export_hf {out.name}") as bar:
            for name, shard in zip(names, shards):
                tmp = out / f".{name}.tmp-{token}"
                written.append((tmp, out / name))
                specs = [(t.name, t.dtype, list(t.shape)) for t in shard]
                write_safetensors(tmp, specs, bar.counting(_made(shard, pending)), {"format": "pt"})
        for name, text in texts.items():
            tmp = out / f".{name}.tmp-{token}"
            written.append((tmp, out / name))
            tmp.write_text(text, encoding="utf-8")
        for tmp, final in written:  # weights first, then the index and config that point at them
            os.replace(tmp, final)
    except BaseException:
        for t in pending:  # keep the other ranks' gathers paired, so they fail with this error, not a hang
            if t.collective:
                t.make()
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        raise


def _made(shard: list[_Tensor], pending: Iterator[_Tensor]) -> Iterator[torch.Tensor]:
    for t in shard:
        next(pending)
        yield t.make()


def _config(config: Any, model: nn.Module | None, dtype: torch.dtype | None) -> dict | None:
    if isinstance(config, str) and config == "auto":
        config = getattr(model, "config", None)
    if config is None:
        return None
    if isinstance(config, Mapping):
        out = dict(config)
    elif callable(getattr(config, "to_json_string", None)):
        out = json.loads(config.to_json_string(use_diff=True))
    else:
        raise TypeError(f"config must be 'auto', a transformers config, a dict or None, got {type(config).__name__}")
    if dtype is not None:
        out["dtype"] = dtype_name(dtype)  # what from_pretrained(dtype="auto") builds the model in
        out.pop("torch_dtype", None)
    if model is not None and not out.get("architectures") and hasattr(model, "config"):
        out["architectures"] = [type(model).__name__]
    return out
