"""A Hugging Face safetensors checkpoint on disk: which files, which tensors, read by element ranges.

`HFCheckpoint` opens a directory written by ``save_pretrained`` (one
``model.safetensors``, or shards listed by ``model.safetensors.index.json``)
or a single ``.safetensors`` file. Only the headers are read on open; tensor
bytes are read later, element range by element range, straight into the
caller's tensors (`HFCheckpoint.read_range`). Nothing is ever unpickled:
directories that hold only pickled weights (``pytorch_model.bin`` and the
like) are refused with a message saying how to convert them.

Unlike zfunc's own checkpoints, a Hugging Face directory may be made of
symbolic links (the hub cache links ``snapshots/<rev>/model.safetensors`` to
a blob), so links are followed here; the index may only name plain file
names inside the directory.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import torch

from zfunc.io.format import CheckpointError, Entry, TensorFile

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
MAX_JSON = 64 << 20  # an index or config larger than this is not one
CAST_CHUNK = 8 << 20  # bytes of staging when a tensor is read into another dtype
PICKLED = re.compile(r".*\.(bin|pt|pth|ckpt|pkl)(\.index\.json)?")
SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\.safetensors")


class HFCheckpoint:
    """The tensors of a safetensors checkpoint (headers read and validated; bytes read on demand).

    Attributes:
      path: what was opened (a directory or a file).
      files: the safetensors files, in the order their tensors are listed.
      entries: ``{tensor name: Entry}`` (dtype, shape) in file order.
      config: the directory's ``config.json`` as a dict, or None.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.files: list[TensorFile] = []
        self._file_of: dict[str, TensorFile] = {}
        self._local = threading.local()
        try:
            names, index = _weight_files(self.path)
            for name in names:
                f = TensorFile(Path(os.path.realpath(name)))
                f.path = Path(name)  # errors name the file the user knows, not the blob a link points at
                self.files.append(f)
            self._index(index)
            self.config = _read_json(self.path / CONFIG) if self.path.is_dir() and (self.path / CONFIG).exists() \
                else None
        except BaseException:
            self.close()
            raise
        self.entries: dict[str, Entry] = {n: f.entries[n] for n, f in self._file_of.items()}

    def _index(self, index: dict[str, str] | None) -> None:
        if index is None:
            for f in self.files:
                for name in f.entries:
                    if name in self._file_of:
                        raise CheckpointError(f"{f.path}: tensor {name!r} is also in {self._file_of[name].path}")
                    self._file_of[name] = f
            return
        by_name = {f.path.name: f for f in self.files}
        for name, file in index.items():
            f = by_name[file]
            if name not in f.entries:
                raise CheckpointError(f"{self.path / INDEX}: lists {name!r} in {file}, which has no such tensor")
            self._file_of[name] = f
        for f in self.files:
            extra = [n for n in f.entries if index.get(n) != f.path.name]
            if extra:
                raise CheckpointError(f"{f.path}: holds {extra[:3]}, which {INDEX} does not list in this file: the "
                                      "index and the files disagree (an interrupted save or a mix of two models?)")

    def file_of(self, name: str) -> TensorFile:
        """The file that holds tensor ``name``."""
        return self._file_of[name]

    def fingerprint(self) -> list:
        """What identifies the checkpoint across ranks: its file names, sizes and tensor count."""
        return [[f.path.name, f.size] for f in self.files] + [len(self.entries)]

    def read_range(self, name: str, begin: int, out: torch.Tensor) -> None:
        """Elements ``[begin, begin + out.numel())`` of tensor ``name`` (flattened) into ``out`` (1-D).

        Straight into ``out``'s memory when it has the stored dtype (and is a
        contiguous CPU tensor); otherwise through a bounded staging buffer
        (`CAST_CHUNK` bytes), cast piece by piece, so converting a
        large tensor never holds a second copy of it.
        """
        f = self._file_of[name]
        entry = f.entries[name]
        if out.dtype == entry.dtype and out.is_contiguous():
            f.read_into(name, begin, out)
            return
        count = out.numel()
        per = max(1, CAST_CHUNK // entry.dtype.itemsize)
        staging = self._staging().view(entry.dtype)
        for i in range(0, count, per):
            n = min(per, count - i)
            f.read_into(name, begin + i, staging[:n])
            out[i:i + n].copy_(staging[:n])

    def _staging(self) -> torch.Tensor:
        """This thread's staging bytes (allocated once: reallocating per tensor lets the heap grow)."""
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = self._local.staging = torch.empty(CAST_CHUNK, dtype=torch.uint8)
        return buf

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> HFCheckpoint:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """``(files, index or None)`` of the checkpoint at ``path`` (a directory or a ``.safetensors`` file)."""
    if path.is_file():
        if not path.name.endswith(".safetensors"):
            raise _not_safetensors(path, [path.name])
        return [path], None
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint (neither a directory nor a .safetensors file)")
    if (path / INDEX).exists():
        return _from_index(path, path / INDEX)
    if (path / WEIGHTS).exists():
        return [path / WEIGHTS], None
    names = sorted(p.name for p in path.iterdir())
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    single = [n for n in names if n.endswith(".safetensors")]
    if len(indexes) == 1:
        return _from_index(path, path / indexes[0])
    if not indexes and len(single) == 1:
        return [path / single[0]], None
    if indexes or single:
        raise CheckpointError(f"{path}: holds several safetensors checkpoints ({', '.join((indexes or single)[:5])}) "
                              f"and no {WEIGHTS} or {INDEX}; pass the path of the one to load")
    raise _not_safetensors(path, [n for n in names if PICKLED.fullmatch(n)])


def _not_safetensors(path: Path, pickled: list[str]) -> CheckpointError:
    if pickled:
        return CheckpointError(
            f"{path}: holds pickled weights ({', '.join(pickled[:3])}), which zfunc never loads: unpickling runs "
            "code from the file. Convert them to safetensors once, with a tool you trust on files you trust, e.g. "
            "transformers: AutoModel.from_pretrained(dir).save_pretrained(out) (safetensors is its default "
            "format), or the hub's 'convert to safetensors' space")
    return CheckpointError(f"{path}: no safetensors weights ({WEIGHTS}, {INDEX} or a *.safetensors file) found")


def _from_index(root: Path, index_path: Path) -> tuple[list[Path], dict[str, str]]:
    raw = _read_json(index_path)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: not a safetensors index (no 'weight_map' object of tensor -> file)")
    files: list[str] = []
    for name, file in weight_map.items():
        if not isinstance(file, str) or not SHARD_NAME.fullmatch(file):
            raise CheckpointError(f"{index_path}: {name!r} -> {file!r}: an index may name only .safetensors files "
                                  "inside its directory (a plain file name)")
        if file not in files:
            files.append(file)
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise CheckpointError(f"{index_path}: lists {', '.join(missing[:3])}, which {'is' if len(missing) == 1 else 'are'} "
                              f"not in {root} (an incomplete download?)")
    return [root / f for f in files], weight_map


def _read_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > MAX_JSON:
        raise CheckpointError(f"{path}: larger than {MAX_JSON >> 20} MiB: not an index or a config")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
