"""`consolidate`: a checkpoint's full weights as one safetensors file, streamed parameter by parameter."""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from zfunc.io.entries import Spans, escape
from zfunc.io.format import CheckpointError, dtype_name, progress_bar, read_manifest, write_safetensors
from zfunc.io.reader import check_files, locate, open_ranks
from zfunc.transforms.shard_layout import ShardLayout


def consolidate(directory: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.float32, *,
                step: int | None = None, aliases: nn.Module | dict[str, str] | None = None, verify: bool = True,
                progress: bool = True) -> Path:
    """Write the checkpoint's full weights to ``out`` (safetensors), keyed by parameter name, in ``dtype``.

    The weights are what ``step.gather`` returns: the fp32 master under
    `mixed_precision` (or offload's own master), else ``params``. Only
    trainable parameters are in a state, so load with
    ``model.load_state_dict(safetensors.torch.load_file(out), strict=False)``.
    A tied weight is written once, under its canonical name (the first one
    ``named_parameters`` lists); ``aliases`` (a model, or ``{alias: name}``)
    also writes every tied alias (e.g. ``head.weight``) as a copy.
    Host memory stays near one parameter: each is assembled from the rank
    files' slices, written, and dropped. Returns ``out``.
    """
    step_dir = locate(directory, step)
    manifest = read_manifest(step_dir)
    check_files(step_dir, manifest)
    shapes = {k: tuple(s) for k, s in manifest["params"].items()}
    layout = ShardLayout.from_json({**manifest["layout"], "rank": 0}) if manifest["layout"] is not None else None
    spans = Spans(layout, shapes)
    group = manifest["weights"]
    if group not in manifest["groups"]:
        raise CheckpointError(f"{step_dir}: corrupt manifest: its weights {group!r} are not among its groups")
    names = [(k, k) for k in shapes]
    for alias, key in sorted(_aliases(aliases).items()):
        if key not in shapes:
            raise CheckpointError(f"consolidate: alias {alias!r} -> {key!r}, but the checkpoint has no "
                                  f"parameter {key!r}")
        names.append((alias, key))
    order = {k: i for i, k in enumerate(shapes)}
    names.sort(key=lambda nk: order[nk[1]])  # an alias right after its parameter: built once
    holders = [s for s in range(manifest["world_size"]) if any(spans.span(k, s)[1] > spans.span(k, s)[0]
                                                                 for k in shapes)]
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    files = {}
    try:
        files = open_ranks(step_dir, manifest, holders, verify)
        specs = [(name, dtype, list(shapes[key])) for name, key in names]
        total = sum(math.prod(shapes[key]) * dtype.itemsize for _, key in names)
        meta = {"format": "pt", "zfunc_step": str(manifest["step"]), "zfunc_weights": group,
                "zfunc_dtype": dtype_name(dtype)}
        with progress_bar(progress, total, f"consolidate {step_dir.name}") as bar:
            write_safetensors(tmp, specs, bar.counting(_weights(files, spans, group, names, shapes, dtype)), meta)
        os.replace(tmp, out)
    finally:
        for f in files.values():
            f.close()
        tmp.unlink(missing_ok=True)
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
                if b > a:
                    name = f"{group}/{escape(key)}"
                    f.file_of(name).read_into(name, 0, flat[a:b])
            built = (key, full)
        yield built[1]


def _aliases(aliases: nn.Module | dict[str, str] | None) -> dict[str, str]:
    if aliases is None:
        return {}
    if isinstance(aliases, nn.Module):
        from zfunc.functional import FunctionalModel  # noqa: PLC0415
        return {name: key for name, key in FunctionalModel(aliases).aliases.items() if name != key}
    if isinstance(aliases, dict):
        return dict(aliases)
    raise TypeError(f"aliases must be None, a model or a dict alias -> parameter name, got {type(aliases).__name__}")
