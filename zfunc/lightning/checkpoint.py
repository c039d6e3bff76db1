"""Lightning checkpoints as zfunc checkpoints: a directory per checkpoint, no pickle.

``ModelCheckpoint`` asks the strategy to save Lightning's checkpoint dict at a
path such as ``epoch=0-step=100.ckpt``. `ZfuncStrategy` makes that path a
`zfunc.io.save` directory (every rank writes its shard; atomic, checksummed):
the training state (parameters, optimizer state, the transforms' masters and
loss scale, the step) is zfunc's, and everything else Lightning put in the
dict (loop progress, callbacks' state, the LR schedulers, the torch
optimizer's param groups that the schedulers step, ``hyper_parameters``) is
the save's ``client_state``: JSON plus tensors, encoded here so that it comes
back as it went in (tuples, dicts with non-string keys) — and never through
pickle. A value JSON cannot carry is refused naming its key.

``convert_zero_checkpoint_to_fp32_state_dict(dir, "model.pt")`` writes the
full fp32 weights as one file in Lightning's checkpoint format (a
``torch.save`` of ``{"state_dict": ..., "hyper_parameters": ...}`` holding
only tensors and plain values, so ``torch.load(weights_only=True)`` and
``Model.load_from_checkpoint`` read it), as DeepSpeed's converter does.
"""

from __future__ import annotations

import enum
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from zfunc import io as zio
from zfunc.io.manifest import read_manifest

# Lightning's dict entries the zfunc state replaces (the module's weights, the torch optimizer's tensors).
REPLACED_BY_STATE = ("state_dict",)
_TAGS = ("__tuple__", "__items__", "__float__", "__enum__")


def encode(value: Any, where: str = "checkpoint") -> Any:
    """``value`` as `zfunc.io`'s client_state takes it (JSON, tensors), losslessly; raises TypeError naming
    ``where`` for anything else."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, enum.Enum):
        return {"__enum__": [type(value).__module__, type(value).__qualname__, encode(value.value, where)]}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _TAGS and k != "__tensor__" for k in value):
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"__items__": [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")]
                              for k, v in value.items()]}
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a zfunc checkpoint cannot hold: "
        "it stores Lightning's checkpoint as JSON and tensors and never pickles. Keep plain values there (numbers, "
        "strings, lists, dicts, tensors); for hyper_parameters, save_hyperparameters(ignore=[...]) the others")


def decode(value: Any) -> Any:
    """Inverse of `encode` (enums come back as their plain value)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"__tuple__"}:
        return tuple(decode(v) for v in value["__tuple__"])
    if set(value) == {"__items__"}:
        return {decode(k): decode(v) for k, v in value["__items__"]}
    if set(value) == {"__float__"}:
        return float(value["__float__"])
    if set(value) == {"__enum__"}:
        return decode(value["__enum__"][2])
    return {k: decode(v) for k, v in value.items()}


def client_state_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict without what the zfunc state holds, encoded for `zfunc.io.save`."""
    return {"lightning": encode({k: v for k, v in checkpoint.items() if k not in REPLACED_BY_STATE})}


def checkpoint_of(client_state: dict[str, Any] | None, path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's checkpoint dict back from a save's client_state."""
    if not isinstance(client_state, dict) or "lightning" not in client_state:
        raise ValueError(f"{os.fspath(path)} is a zfunc checkpoint, but not one ZfuncStrategy saved (its client_state "
                         "has no Lightning entries); restore it with zfunc.io.restore instead")
    return decode(client_state["lightning"])


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike,
                                               tag: int | None = None, *, model: torch.nn.Module | None = None
                                               ) -> dict[str, Any]:
    """Write the full fp32 weights of a `ZfuncStrategy` checkpoint to one file Lightning loads.

    Args:
      checkpoint_dir: a checkpoint the strategy saved (e.g. ``ckpts/last.ckpt``, a directory).
      output_file: the file to write: ``torch.save`` of Lightning's checkpoint dict with
        ``"state_dict"`` (parameter name -> fp32 tensor, tied weights under every name) and the
        plain entries of the checkpoint (``hyper_parameters``, ``epoch``, ``global_step``, ...),
        so ``Model.load_from_checkpoint(output_file)`` and ``torch.load(output_file,
        weights_only=True)`` read it.
      tag: the step of the checkpoint inside ``checkpoint_dir`` (default: its latest).
      model: the LightningModule trained; its frozen parameters and buffers are written too, so
        that ``load_state_dict`` loads strictly (without it they are absent: load with
        ``strict=False``, as for DeepSpeed's conversion without ``exclude_frozen_parameters``).
    Returns:
      The dict written.
    """
    from safetensors.torch import load_file

    directory = Path(checkpoint_dir)
    manifest = read_manifest(zio.locate(directory, tag))
    files = manifest.get("files") or [{}]
    client = files[0].get("client_state") if isinstance(files[0], dict) else None
    entries = checkpoint_of(client, directory)
    with tempfile.TemporaryDirectory(dir=Path(output_file).parent or ".") as scratch:
        weights = Path(scratch) / "weights.safetensors"
        zio.consolidate(directory, weights, step=tag, model=model, progress=False)
        state_dict = load_file(weights)
    out = {k: v for k, v in entries.items() if _plain(v)}
    out["state_dict"] = state_dict
    torch.save(out, output_file)
    return out


def _plain(value: Any) -> bool:
    """No client tensors (stored apart in the rank files, not worth reading for a weights file)."""
    if isinstance(value, dict):
        return "__tensor__" not in value and all(_plain(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return not isinstance(value, torch.Tensor)
