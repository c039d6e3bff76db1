"""Helpers for the zfunc.io tests: rewrite a checkpoint the way an adversary (or a newer zfunc) would.

`rewrite_manifest` edits a manifest and then makes every checksum agree with
the edit (``manifest.sha256`` and ``latest``), so that a test reaches the
reader's validation rather than stopping at the checksum; `as_format_1`
turns a checkpoint into what zfunc's format 1 wrote.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple


def write_manifest_bytes(step_dir: Path, data: bytes, checksum: bool = True) -> str:
    """Replace ``step_dir``'s manifest with ``data``, its checksum file and the parent's ``latest`` to match."""
    digest = hashlib.sha256(data).hexdigest()
    (step_dir / "manifest.json").write_bytes(data)
    if checksum:
        (step_dir / "manifest.sha256").write_text(f"{digest}  manifest.json\n")
    latest = step_dir.parent / "latest"
    if latest.is_file() and latest.read_text().split()[0] == step_dir.name:
        latest.write_text(f"{step_dir.name} {digest}\n")
    return digest


class Replacement(NamedTuple):
    """Returned by a `rewrite_manifest` mutation: the whole manifest becomes ``value``."""

    value: Any


def rewrite_manifest(step_dir: Path, mutate: Callable[[dict], Any]) -> Any:
    """Apply ``mutate`` to the manifest (in place; a returned `Replacement` replaces it) and re-seal it."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    result = mutate(manifest)
    manifest = result.value if isinstance(result, Replacement) else manifest
    write_manifest_bytes(step_dir, json.dumps(manifest, indent=1).encode())
    return manifest


def as_format_1(step_dir: Path) -> None:
    """What zfunc's format 1 wrote: no ties, no manifest.sha256, ``latest`` holding the name alone."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["format_version"] = 1
    del manifest["ties"]
    (step_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (step_dir / "manifest.sha256").unlink()
    latest = step_dir.parent / "latest"
    if latest.is_file():
        latest.write_text(f"{step_dir.name}\n")


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    """Flip one bit of ``path`` (``offset`` from the end when negative): a cosmic ray, a bad disk."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


class PathSpy:
    """Records every path ``os.open``/``os.stat``/``os.lstat`` is called with while installed (via monkeypatch),
    to show that a refused path was never opened nor even looked at."""

    def __init__(self, monkeypatch) -> None:
        import os

        self.paths: list[str] = []
        for name in ("open", "stat", "lstat"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._spy(real))

    def _spy(self, real):
        def spy(path, *args, **kwargs):
            self.paths.append(str(path))
            return real(path, *args, **kwargs)
        return spy

    def touched(self, fragment: str) -> list[str]:
        return [p for p in self.paths if fragment in p]
