"""`consolidate`: a checkpoint's full weights as one safetensors file, streamed parameter by parameter."""

from __future__ import annotations

import math
import os
import secrets
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from zfunc.io.commit import LOCK, STALE, STEP_DIR
from zfunc.io.entries import Spans, escape
from zfunc.io.format import DTYPES, LATEST, CheckpointError, dtype_name, progress_bar, write_safetensors
from zfunc.io.manifest import read_manifest
from zfunc.io.reader import check_entries, check_files, locate, open_ranks

AliasChoice = Literal["recorded", "none"]


def consolidate(directory: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.float32, *,
                step: int | None = None, aliases: AliasChoice | nn.Module | dict[str, str] = "recorded",
                model: nn.Module | None = None, verify: bool = True, progress: bool = True) -> Path:
    """Write the checkpoint's full weights to ``out`` (safetensors), keyed by parameter name, in ``dtype``.

    The weights are what ``step.gather`` returns: the fp32 master under
    `mixed_precision` (or offload's own master), else ``params``. Host memory
    stays near one parameter: each is assembled from the rank files' slices,
    written, and dropped.

    Args:
      directory: a save directory (its latest checkpoint, or ``step``'s) or one ``step_*`` directory.
      out: the file to write (replaced atomically: a temporary file, then a rename). Refused inside
        the checkpoint it reads, or onto ``latest`` or a ``step_*`` entry of its save directory.
      dtype: the floating dtype of the weights written.
      step: the checkpoint's step (default: the latest).
      aliases: the other names of tied weights, each written as a copy of its parameter (e.g.
        ``head.weight`` of ``embed.weight``): ``"recorded"`` (default) the ties the checkpoint
        recorded (``TrainState.ties``, from `zf.functional`'s params) and ``model``'s;
        ``"none"`` the canonical names only; a model or ``{alias: name}``: those.
      model: the model the checkpoint was trained from. A training state holds only trainable
        parameters; the model's frozen parameters and persistent buffers are written too, from
        its current values (floating ones in ``dtype``), so that ``model.load_state_dict(
        safetensors.torch.load_file(out))`` loads with ``strict=True``. Its trainable parameters
        must be the checkpoint's (names and shapes).
      verify: check each rank file read against its SHA-256 first.
      progress: show a progress bar (bytes written).

    Returns:
      ``out``. Without ``model`` the file lacks frozen parameters and buffers: load it with
      ``strict=False``, or pass ``model``.
    """
    step_dir = locate(directory, step)
    manifest = read_manifest(step_dir)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype not in DTYPES:
        raise CheckpointError(f"consolidate: dtype must be a floating dtype safetensors stores, got {dtype!r}")
    out = _output(Path(out), Path(directory), step_dir)
    check_files(step_dir, manifest)
    shapes = {k: tuple(s) for k, s in manifest["params"].items()}
    spans = Spans.of_manifest(manifest)  # (any layout: shard over dp, pipeline stages, tensor-parallel shards)
    group = manifest["weights"]
    if group not in manifest["groups"] and shapes:
        raise CheckpointError(f"{step_dir}: corrupt manifest: its weights {group!r} are not among its groups")
    tied = _aliases(aliases, manifest, model, shapes, step_dir)
    extras = _model_extras(model, shapes, tied, dtype) if model is not None else []
    order = {k: i for i, k in enumerate(shapes)}
    names = sorted([(k, k) for k in shapes] + sorted(tied.items()), key=lambda nk: order[nk[1]])  # alias after key
    holders = [s for s in range(manifest["world_size"]) if any(spans.span(k, s)[1] > spans.span(k, s)[0]
                                                                 for k in shapes)]
    tmp = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    files = {}
    try:
        files = open_ranks(step_dir, manifest, holders, verify)
        if shapes:  # each slice as large as the manifest says: every allocation below is bounded by the files
            check_entries(manifest, files, [group])
        specs = [(name, dtype, list(shapes[key])) for name, key in names]
        specs += [(name, t.dtype, list(t.shape)) for name, t in extras]
        total = sum(math.prod(shape) * dt.itemsize for _, dt, shape in specs)
        meta = {"format": "pt", "zfunc_step": str(manifest["step"]), "zfunc_weights": group,
                "zfunc_dtype": dtype_name(dtype)}
        tensors = _weights(files, spans, group, names, shapes, dtype)
        with progress_bar(progress, total, f"consolidate {step_dir.name}") as bar:
            try:
                write_safetensors(tmp, specs, bar.counting(_chain(tensors, (t for _, t in extras))), meta)
                os.replace(tmp, out)
            except OSError as e:
                raise CheckpointError(f"consolidate: cannot write {out} ({e.strerror or e})") from None
    finally:
        for f in files.values():
            f.close()
        tmp.unlink(missing_ok=True)
    return out


def _chain(*iterables: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    for it in iterables:
        yield from it


def _output(out: Path, directory: Path, step_dir: Path) -> Path:
    """``out``, unless writing it would replace part of the checkpoint being read (or of its save directory)."""
    real = Path(os.path.realpath(out))
    checkpoint = Path(os.path.realpath(step_dir))
    if real == checkpoint or checkpoint in real.parents:
        raise CheckpointError(f"consolidate: {out} is inside the checkpoint it reads ({step_dir}): writing it would "
                              "replace the checkpoint's own files. Choose a path outside it")
    # The save directory the checkpoint lives in (when it is one of its step_* entries): its own entries too.
    root = checkpoint.parent if STEP_DIR.fullmatch(checkpoint.name) else Path(os.path.realpath(directory))
    if root != checkpoint and root in real.parents:
        first = real.relative_to(root).parts[0]
        if first in (LATEST, LOCK) or STEP_DIR.fullmatch(first) or STALE.fullmatch(first):
            raise CheckpointError(f"consolidate: {out} would replace {root / first}, which belongs to the "
                                  f"checkpoints in {directory}. Choose another name")
    if real.is_dir():
        raise CheckpointError(f"consolidate: {out} is a directory; give the path of the file to write")
    if not real.parent.is_dir():
        raise CheckpointError(f"consolidate: cannot write {out}: the directory {out.parent} does not exist")
    return out


def _weights(files, spans: Spans, group: str, names, shapes, dtype) -> Iterator[torch.Tensor]:
    built: tuple[str, torch.Tensor] | None = None
    for _, key in names:
        if built is None or built[0] != key:
            built = full = flat = None  # drop the previous parameter before building the next
            full = torch.empty(shapes[key], dtype=dtype)
            flat = full.view(-1)
            for s, f in files.items():
                a, b = spans.span(key, s)
                name = f"{group}/{escape(key)}"
                for start, count, offset in spans.runs(key, s, a, b):  # (one run each without tensor_parallel)
                    f.file_of(name).read_into(name, offset, flat[start:start + count])
            built = (key, full)
        yield built[1]


def _aliases(aliases: AliasChoice | nn.Module | dict[str, str], manifest: dict, model: nn.Module | None,
             shapes: dict, step_dir: Path) -> dict[str, str]:
    """``{alias: parameter}`` to write, checked against the checkpoint's parameters."""
    if isinstance(aliases, nn.Module):
        chosen = _model_ties(aliases)
    elif isinstance(aliases, dict):
        chosen = dict(aliases)
    elif aliases == "none":
        chosen = {}
    elif aliases == "recorded":
        chosen = dict(manifest.get("ties", []))
        if model is not None:
            for alias, key in _model_ties(model).items():
                if chosen.setdefault(alias, key) != key:
                    raise CheckpointError(f"consolidate: the checkpoint ties {alias!r} to {chosen[alias]!r}, the "
                                          f"model to {key!r}: not the model this checkpoint was trained from?")
        elif "ties" not in manifest:
            warnings.warn(f"consolidate {step_dir}: a format-1 checkpoint records no tied weights; pass "
                          "aliases=model (or model=) to write their other names", stacklevel=3)
    else:
        raise TypeError(f"aliases must be 'recorded' (the default: the tied names the checkpoint recorded), 'none', "
                        f"a model or a dict alias -> parameter name, got {aliases!r}")
    for alias, key in chosen.items():
        if not isinstance(alias, str) or key not in shapes:
            raise CheckpointError(f"consolidate: alias {alias!r} -> {key!r}, but the checkpoint has no parameter "
                                  f"{key!r}")
        if alias in shapes:
            raise CheckpointError(f"consolidate: alias {alias!r} -> {key!r}, but {alias!r} is a parameter of its "
                                  "own in the checkpoint")
    return chosen


def _model_ties(model: nn.Module) -> dict[str, str]:
    from zfunc.functional import FunctionalModel  # noqa: PLC0415 (functional imports the transforms)
    return {name: key for name, key in FunctionalModel(model).aliases.items() if name != key}


def _model_extras(model: nn.Module, shapes: dict, tied: dict[str, str], dtype: torch.dtype) -> list:
    """``(name, tensor)`` of ``model``'s state_dict entries a training state does not hold (frozen parameters,
    persistent buffers), after checking its trainable parameters are the checkpoint's."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    state = model.state_dict(keep_vars=True)
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    other_names = set(_model_ties(model)) | set(tied)
    wrong = [f"{k}: checkpoint {list(s)}, model {list(state[k].shape)}" for k, s in shapes.items()
             if k in state and tuple(state[k].shape) != s]
    missing = [k for k in shapes if k not in state]
    unsaved = sorted(trainable - shapes.keys() - other_names)
    frozen = [k for k in shapes if k in state and k not in trainable]
    if wrong or missing or unsaved or frozen:
        raise CheckpointError("consolidate: the model is not the one this checkpoint was trained from: "
                              + "; ".join(filter(None, [
                                  f"shapes differ ({', '.join(wrong[:5])})" if wrong else "",
                                  f"the model lacks {missing[:5]}" if missing else "",
                                  f"its trainable {unsaved[:5]} are not in the checkpoint" if unsaved else "",
                                  f"it has {frozen[:5]} frozen, the checkpoint trained them" if frozen else ""])))
    extras = []
    for name, t in state.items():
        if name not in trainable and name not in shapes and name not in tied:
            t = t.detach()
            extras.append((name, t.to(dtype) if t.is_floating_point() else t))
    return extras
