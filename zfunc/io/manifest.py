"""The manifest: written with its checksum, trusted only once the checksum and every field check out.

``manifest.json`` says what a checkpoint holds (see `zfunc.io`). Beside it,
``manifest.sha256`` holds the SHA-256 of its bytes, in the form ``sha256sum``
prints (``sha256sum -c manifest.sha256`` checks it), so a flipped bit in the
manifest (client_state, RNG states, shapes, the rank files' own checksums) is
an error, never a silently different restore. ``latest`` records the same
digest next to the name it points at, which binds it to one exact checkpoint:
from ``latest`` down to every byte of every rank file, each link is checked.

A manifest is untrusted input until `validate` accepted it: the type and
range of every field, the cross-references (layout vs. params, groups vs.
params, ties, the files' names and sizes), and a budget: the bytes its
shapes describe must fit in the bytes its files hold, so a crafted shape
cannot make a reader allocate more than the checkpoint's files could fill.
Each problem is a `CheckpointError` naming the file and the field.

What zfunc may delete or replace (`why_not_ours`, `is_debris`) is decided
here too: only what it provably wrote.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from zfunc.io.format import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    SECTIONS,
    CheckpointError,
    MissingFile,
    dtype_name,
    read_small,
)

MANIFEST_SUM = "manifest.sha256"
MAX_MANIFEST = 256 << 20   # bytes; client_state lives in the manifest, but a manifest this large is not one
MAX_INT = 1 << 62          # above any real size, step or count; keeps products far from overflow
MAX_RANKS = 1 << 20
MAX_NDIM = 64
HEX64 = re.compile(r"[0-9a-f]{64}")
SUM_LINE = re.compile(r"([0-9a-f]{64})  " + re.escape(MANIFEST) + r"\n?")
LATEST_LINE = re.compile(r"(step_\d+)(?: ([0-9a-f]{64}))?\n?")
ZFUNC_FILE = re.compile(r"rank_\d{5,}(?:\.p\d{3,})?\.safetensors|" + re.escape(MANIFEST) + "|"
                        + re.escape(MANIFEST_SUM))
DTYPE_NAMES = {dtype_name(d): d for d in DTYPES}

COMMON_FIELDS = ("format", "format_version", "zfunc_version", "torch_version", "created", "step", "world_size",
                 "stage", "layout", "params", "weights", "groups", "leaves", "files")
# What each format version's manifest holds. Format 3 adds one of the `SECTIONS`: "tensor_parallel" (a state
# split by `tensor_parallel`: its split and each rank's (dp, tp) coordinates) or "pipeline" (a `pipeline`
# state: the rank holding each parameter, the rank of its stage). Format 4 adds "mesh" (the sizes of dp, pp
# and tp, each rank's coordinates) and allows either section or both (tp without coords, pipeline holders
# by pipeline rank).
FIELDS = {1: COMMON_FIELDS, 2: (*COMMON_FIELDS, "ties"), 3: (*COMMON_FIELDS, "ties"), 4: (*COMMON_FIELDS, "ties", "mesh")}


def rank_file(rank: int, part: int = 0) -> str:
    """The name of part ``part`` of rank ``rank``'s file (the only names a manifest may list)."""
    return f"rank_{rank:05d}.safetensors" if part == 0 else f"rank_{rank:05d}.p{part:03d}.safetensors"


# --------------------------------------------------------------------------
# Writing and reading


def write_manifest(step_dir: Path, manifest: dict) -> str:
    """Write ``manifest.json`` and ``manifest.sha256`` (each fsynced); returns the manifest's SHA-256."""
    data = json.dumps(manifest, indent=1).encode()
    digest = hashlib.sha256(data).hexdigest()
    for name, content in ((MANIFEST, data), (MANIFEST_SUM, f"{digest}  {MANIFEST}\n".encode())):
        with open(step_dir / name, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    return digest


def read_manifest(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of one checkpoint directory, checked against its checksum and validated.

    Raises `CheckpointError` naming the file (and the field) for a missing,
    damaged, newer-format or malformed manifest.
    """
    step_dir = Path(step_dir)
    path = step_dir / MANIFEST
    try:
        data = read_small(path, MAX_MANIFEST)
    except MissingFile:
        raise CheckpointError(f"{path}: missing; {step_dir} is not a complete zfunc checkpoint") from None
    digest = hashlib.sha256(data).hexdigest()
    recorded = recorded_digest(step_dir)
    if recorded is not None and recorded != digest:
        raise CheckpointError(f"{path}: checksum mismatch: its SHA-256 is {digest}, {MANIFEST_SUM} records "
                              f"{recorded}; the manifest is corrupted (or was edited)")
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt (not JSON: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a zfunc checkpoint manifest (format is "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    version = manifest.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path}: corrupt (format_version is {version!r})")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: written in checkpoint format version {version} by zfunc {manifest.get('zfunc_version')}, "
            f"newer than this zfunc reads (up to version {FORMAT_VERSION}); upgrade zfunc to read it")
    if recorded is None and version >= 2:
        raise CheckpointError(f"{step_dir / MANIFEST_SUM}: missing; a format {version} checkpoint has one (the "
                              "manifest's checksum), so this one was damaged or assembled by hand")
    try:
        validate(manifest, path)
    except RecursionError:
        raise CheckpointError(f"{path}: corrupt (nested too deeply)") from None
    return manifest


def recorded_digest(step_dir: Path) -> str | None:
    """The manifest digest ``manifest.sha256`` records (None: there is none, as in format 1)."""
    path = step_dir / MANIFEST_SUM
    try:
        text = read_small(path, 200)
    except MissingFile:
        return None
    match = SUM_LINE.fullmatch(text.decode("ascii", errors="replace"))
    if match is None:
        raise CheckpointError(f"{path}: corrupt (expected one line '<sha256>  {MANIFEST}')")
    return match.group(1)


# --------------------------------------------------------------------------
# Validation


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class Fields:
    """Typed reads of a manifest's fields: each failure is a `CheckpointError` naming the file and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, field: str, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt or not written by zfunc: field {field} {what}")

    def record(self, value: Any, field: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        """A JSON object with exactly ``keys``, and any of ``optional``."""
        if not isinstance(value, dict):
            raise self.fail(field, f"must be an object, got {_kind(value)}")
        missing = [k for k in keys if k not in value]
        if missing:
            raise self.fail(field, f"lacks {', '.join(map(repr, missing))}")
        extra = [k for k in value if k not in keys and k not in optional]
        if extra:
            raise self.fail(field, f"has unexpected {', '.join(map(repr, extra[:5]))}")
        return value

    def mapping(self, value: Any, field: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(field, f"must be an object, got {_kind(value)}")
        return value

    def array(self, value: Any, field: str, length: int | None = None) -> list:
        if not isinstance(value, list):
            raise self.fail(field, f"must be a list, got {_kind(value)}")
        if length is not None and len(value) != length:
            raise self.fail(field, f"must have {length} entries, has {len(value)}")
        return value

    def integer(self, value: Any, field: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"must be an integer, got {_kind(value)} {_short(value)}")
        if not lo <= value <= hi:
            raise self.fail(field, f"must be in [{lo}, {hi}], got {_short(value)}")
        return value

    def number(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"must be a number, got {_kind(value)}")
        return value

    def string(self, value: Any, field: str, limit: int = 4096) -> str:
        if not isinstance(value, str):
            raise self.fail(field, f"must be a string, got {_kind(value)}")
        if len(value) > limit:
            raise self.fail(field, f"is a string of {len(value)} characters, more than {limit}")
        return value

    def shape(self, value: Any, field: str) -> tuple[int, ...]:
        dims = self.array(value, field)
        if len(dims) > MAX_NDIM:
            raise self.fail(field, f"has {len(dims)} dimensions")
        shape = tuple(self.integer(d, f"{field}[{i}]") for i, d in enumerate(dims))
        if math.prod(shape) > MAX_INT:
            raise self.fail(field, f"describes {math.prod(shape)} elements")
        return shape

    def dtype(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or value not in DTYPE_NAMES:
            raise self.fail(field, f"must name a dtype ({', '.join(sorted(DTYPE_NAMES))}), got {_short(value)}")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate(m: dict, path: Path) -> None:
    """Raise `CheckpointError` naming the field unless ``m`` is a well-formed manifest (format and version read).

    Beyond types and ranges: the layout describes exactly the params, every
    group holds exactly the params, ties point at params, each rank file has
    the one name zfunc gives it, and the tensors the shapes describe fit in
    the bytes the files hold.
    """
    f = Fields(path)
    version = m["format_version"]
    f.record(m, "(the manifest)", FIELDS[version], optional=SECTIONS if version >= 3 else ())
    if version == 3:
        present = [k for k in SECTIONS if k in m]
        if len(present) != 1:
            raise f.fail("(the manifest)", f"a format-3 manifest has one of {' or '.join(map(repr, SECTIONS))}; this "
                                           f"one has {' and '.join(map(repr, present)) or 'neither'}")
    for key in ("zfunc_version", "torch_version", "created"):
        f.string(m[key], key)
    f.integer(m["step"], "step")
    world = f.integer(m["world_size"], "world_size", 1, MAX_RANKS)
    stage = f.integer(m["stage"], "stage", 0, 3)
    params = {k: f.shape(v, f"params[{k!r}]") for k, v in f.mapping(m["params"], "params").items()}
    dims = _validate_mesh(f, m, world, stage) if version >= 4 else None
    tp = _validate_tensor_parallel(f, m["tensor_parallel"], world, params, m["layout"], dims) \
        if "tensor_parallel" in m else None
    _validate_layout(f, m["layout"], stage, dims[0] if dims else world // (tp or 1), _local_shapes(params, m, tp))
    groups = f.mapping(m["groups"], "groups")
    described = 0  # bytes of tensors the manifest says its files hold
    for name, group in groups.items():
        keys = f.mapping(group, f"groups[{name!r}]")
        if keys.keys() != params.keys():
            raise f.fail(f"groups[{name!r}]", "must hold exactly the parameters in params")
        for key, dtype in keys.items():
            f.dtype(dtype, f"groups[{name!r}][{key!r}]")
            described += math.prod(params[key]) * DTYPE_NAMES[dtype].itemsize
    weights = f.string(m["weights"], "weights")
    if params and weights not in groups:
        raise f.fail("weights", f"names {weights!r}, which is not among groups")
    for name, leaf in f.mapping(m["leaves"], "leaves").items():
        f.record(leaf, f"leaves[{name!r}]", ("dtype", "shape"))
        dtype = f.dtype(leaf["dtype"], f"leaves[{name!r}].dtype")
        described += math.prod(f.shape(leaf["shape"], f"leaves[{name!r}].shape")) * DTYPE_NAMES[dtype].itemsize
    if version >= 2:
        _validate_ties(f, m["ties"], params)
    if "pipeline" in m:
        _validate_pipeline(f, m["pipeline"], world, params, stage, dims)
    held = _validate_files(f, m["files"], world)
    if described > held:
        raise CheckpointError(f"{path}: corrupt or crafted: its shapes describe {described} bytes of tensors, but "
                              f"the files it lists hold {held} bytes in all")


def _local_shapes(params: dict[str, tuple[int, ...]], m: dict, tp: int | None) -> dict[str, tuple[int, ...]]:
    """The shapes one tp rank holds (what a shard layout over dp records)."""
    if tp is None:
        return params
    splits = m["tensor_parallel"]["splits"]
    return {k: tuple(n // tp if k in splits and d == splits[k][0] else n for d, n in enumerate(s))
            for k, s in params.items()}


def _validate_mesh(f: Fields, m: dict, world: int, stage: int) -> tuple[int, int, int]:
    """The mesh of a format-4 manifest: sizes whose product is the world size, each rank's (dp, pp, tp)
    coordinates in range, each place once, a section for each dimension beyond 1 (and none for a dimension
    of 1), a layout exactly when sharded. Returns the sizes ``(dp, pp, tp)``."""
    mesh = f.record(m["mesh"], "mesh", ("dp", "pp", "tp", "coords"))
    dims = tuple(f.integer(mesh[d], f"mesh.{d}", 1, MAX_RANKS) for d in ("dp", "pp", "tp"))
    if math.prod(dims) != world:
        raise f.fail("mesh", f"is dp{dims[0]} x pp{dims[1]} x tp{dims[2]}, not the world size {world}")
    seen = set()
    for r, c in enumerate(f.array(mesh["coords"], "mesh.coords", world)):
        place = tuple(f.integer(x, f"mesh.coords[{r}][{i}]", 0, n - 1)
                      for i, (x, n) in enumerate(zip(f.array(c, f"mesh.coords[{r}]", 3), dims)))
        if place in seen:
            raise f.fail(f"mesh.coords[{r}]", f"repeats {list(place)}")
        seen.add(place)
    for name, size in (("tensor_parallel", dims[2]), ("pipeline", dims[1])):
        if (name in m) != (size > 1):
            raise f.fail("mesh", f"has {'tp' if name == 'tensor_parallel' else 'pp'}={size}, but the manifest "
                                 f"{'has' if name in m else 'lacks'} a {name!r} section")
    if stage == 0 and dims[0] != 1:
        raise f.fail("mesh.dp", f"is {dims[0]} for stage-0 (unsharded) state")
    return dims


def _validate_tensor_parallel(f: Fields, tp: Any, world: int, params: dict[str, tuple[int, ...]],
                              layout: Any, dims: tuple[int, int, int] | None) -> int:
    """The tp record: its size divides the world (format 4: is the mesh's tp), each split is (dim, parts) of
    a parameter the size divides, and (format 3) every rank has (dp, tp) coordinates in range, each pair once."""
    f.record(tp, "tensor_parallel", ("size", "splits") if dims else ("size", "splits", "coords"))
    size = f.integer(tp["size"], "tensor_parallel.size", 1, MAX_RANKS)
    if world % size or (dims is not None and size != dims[2]):
        raise f.fail("tensor_parallel.size", f"{size} does not divide the world size {world}" if world % size
                     else f"{size} is not the mesh's tp {dims[2]}")
    for key, split in f.mapping(tp["splits"], "tensor_parallel.splits").items():
        where = f"tensor_parallel.splits[{_short(key)}]"
        if key not in params:
            raise f.fail(where, "is not a parameter")
        dim, parts = f.array(split, where, 2)
        dim = f.integer(dim, f"{where}[0]", 0, max(0, len(params[key]) - 1))
        parts = f.integer(parts, f"{where}[1]", 1, MAX_INT)
        if len(params[key]) == 0 or params[key][dim] % (size * parts):
            raise f.fail(where, f"splits dim {dim} of {list(params[key])} in {parts} parts over {size} ranks")
    if dims is not None:  # (format 4: the coordinates are the mesh's)
        return size
    coords = f.array(tp["coords"], "tensor_parallel.coords", world)
    dp_world = world // size
    seen = set()
    for r, c in enumerate(coords):
        dp, tp_rank = f.array(c, f"tensor_parallel.coords[{r}]", 2)
        pair = (f.integer(dp, f"tensor_parallel.coords[{r}][0]", 0, dp_world - 1),
                f.integer(tp_rank, f"tensor_parallel.coords[{r}][1]", 0, size - 1))
        if pair in seen:
            raise f.fail(f"tensor_parallel.coords[{r}]", f"repeats {list(pair)}")
        seen.add(pair)
    if layout is None and dp_world != 1:
        raise f.fail("tensor_parallel.size", f"{size} is not the world size {world} of an unsharded state")
    return size


def _validate_layout(f: Fields, layout: Any, stage: int, world: int, params: dict[str, tuple[int, ...]]) -> None:
    if (layout is None) != (stage == 0):
        raise f.fail("layout", f"must be {'null' if stage == 0 else 'an object'} for stage {stage}")
    if layout is None:
        return
    f.record(layout, "layout", ("stage", "world_size", "units"))
    if f.integer(layout["stage"], "layout.stage") != stage or \
            f.integer(layout["world_size"], "layout.world_size") != world:
        raise f.fail("layout", f"is for stage {layout['stage']!r} on {layout['world_size']!r} ranks, the manifest "
                               f"for stage {stage} on {world}")
    seen: set[str] = set()
    for i, unit in enumerate(f.array(layout["units"], "layout.units")):
        where = f"layout.units[{i}]"
        f.record(unit, where, ("name", "keys", "shapes"))
        f.string(unit["name"], f"{where}.name")
        keys = f.array(unit["keys"], f"{where}.keys")
        shapes = f.array(unit["shapes"], f"{where}.shapes", len(keys))
        for j, (key, shape) in enumerate(zip(keys, shapes)):
            if not isinstance(key, str) or key not in params or key in seen:
                raise f.fail(f"{where}.keys[{j}]", f"{_short(key)} is not a parameter, or is listed twice")
            seen.add(key)
            if f.shape(shape, f"{where}.shapes[{j}]") != params[key]:
                raise f.fail(f"{where}.shapes[{j}]", f"is {shape}, params has {list(params[key])} for {key!r}")
    if seen != params.keys():
        raise f.fail("layout.units", f"leave out parameters {sorted(params.keys() - seen)[:5]}")


def _validate_pipeline(f: Fields, pipeline: Any, world: int, params: dict, stage: int,
                       dims: tuple[int, int, int] | None) -> None:
    """The pipeline record: (format 3) pipeline alone, the world's ranks its ranks; (format 4) the mesh's pp
    ranks. Every parameter is held by one pipeline rank."""
    f.record(pipeline, "pipeline", ("pp", "holders", "stage_blocks"))
    pp = f.integer(pipeline["pp"], "pipeline.pp", 1, MAX_RANKS)
    if dims is not None and pp != dims[1]:
        raise f.fail("pipeline.pp", f"is {pp}, the mesh's pp {dims[1]}")
    if dims is None and (pp != world or stage != 0):
        raise f.fail("pipeline", f"is for {pp} pipeline ranks of stage-0 state, the manifest for {world} ranks, "
                                 f"stage {stage}")
    holders = f.mapping(pipeline["holders"], "pipeline.holders")
    if holders.keys() != params.keys():
        raise f.fail("pipeline.holders", "must name the rank of exactly the parameters in params")
    for key, rank in holders.items():
        f.integer(rank, f"pipeline.holders[{_short(key)}]", 0, pp - 1)
    for i, blocks in enumerate(f.array(pipeline["stage_blocks"], "pipeline.stage_blocks")):
        for j, block in enumerate(f.array(blocks, f"pipeline.stage_blocks[{i}]")):
            f.string(block, f"pipeline.stage_blocks[{i}][{j}]")


def _validate_ties(f: Fields, ties: Any, params: dict) -> None:
    aliases: set[str] = set()
    for i, tie in enumerate(f.array(ties, "ties")):
        alias, key = f.array(tie, f"ties[{i}]", 2)
        f.string(alias, f"ties[{i}][0]")
        f.string(key, f"ties[{i}][1]")
        if key not in params or alias in params or alias in aliases:
            raise f.fail(f"ties[{i}]", f"{alias!r} -> {key!r} must tie a new name to a parameter, once")
        aliases.add(alias)


def _validate_files(f: Fields, files: Any, world: int) -> int:
    """Validate ``files``; returns the bytes they hold in all."""
    held = 0
    for rank, info in enumerate(f.array(files, "files", world)):
        where = f"files[{rank}]"
        f.record(info, where, ("rank", "parts", "rng", "client_state"))
        if info["rank"] != rank:
            raise f.fail(f"{where}.rank", f"must be {rank}, got {_short(info['rank'])}")
        parts = f.array(info["parts"], f"{where}.parts")
        if not parts:
            raise f.fail(f"{where}.parts", "is empty")
        for index, part in enumerate(parts):
            at = f"{where}.parts[{index}]"
            f.record(part, at, ("file", "bytes", "sha256"))
            if part["file"] != rank_file(rank, index):  # the one name: nothing outside the checkpoint, no link
                raise f.fail(f"{at}.file", f"must be {rank_file(rank, index)!r}, got {_short(part['file'])}")
            held += f.integer(part["bytes"], f"{at}.bytes", 8)
            if not isinstance(part["sha256"], str) or not HEX64.fullmatch(part["sha256"]):
                raise f.fail(f"{at}.sha256", f"must be 64 hex digits, got {_short(part['sha256'])}")
        _validate_rng(f, info["rng"], f"{where}.rng")
        _validate_client_state(f, info["client_state"], f"{where}.client_state")
    return held


def _validate_rng(f: Fields, rng: Any, where: str) -> None:
    f.record(rng, where, ("cuda_devices", "python", "numpy"))
    f.integer(rng["cuda_devices"], f"{where}.cuda_devices", 0, 4096)
    version, gauss = f.array(rng["python"], f"{where}.python", 2)
    f.integer(version, f"{where}.python[0]", 3, 3)
    if gauss is not None:
        f.number(gauss, f"{where}.python[1]")
    kind, pos, has_gauss, cached = f.array(rng["numpy"], f"{where}.numpy", 4)
    if kind != "MT19937":
        raise f.fail(f"{where}.numpy[0]", f"must be 'MT19937', got {_short(kind)}")
    f.integer(pos, f"{where}.numpy[1]", 0, 624)
    f.integer(has_gauss, f"{where}.numpy[2]", 0, 1)
    f.number(cached, f"{where}.numpy[3]")


def _validate_client_state(f: Fields, value: Any, where: str) -> None:
    """JSON, whose tensor references name client tensors (``client/<i>``) and nothing else of the file."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            ref = value["__tensor__"]
            if len(value) != 1 or not isinstance(ref, str) or not re.fullmatch(r"client/\d+", ref):
                raise f.fail(where, f"holds a malformed tensor reference {_short(value)}")
            return
        for k, v in value.items():
            _validate_client_state(f, v, f"{where}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _validate_client_state(f, v, f"{where}[{i}]")


# --------------------------------------------------------------------------
# latest


def latest_text(name: str, digest: str) -> str:
    """``latest``'s content: the checkpoint's name and its manifest's SHA-256, on one line."""
    return f"{name} {digest}\n"


def read_latest(directory: Path) -> tuple[str, str | None] | None:
    """``(name, manifest digest or None)`` from ``directory/latest``; None when there is none.

    A format-1 ``latest`` holds the name alone. Anything else there (a link, a
    directory, other text) was not written by zfunc: `CheckpointError`.
    """
    path = directory / LATEST
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size > 200:
        raise _foreign_latest(path, "a link" if stat.S_ISLNK(info.st_mode) else
                              "not a regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size} bytes")
    match = LATEST_LINE.fullmatch(read_small(path, 200).decode("ascii", errors="replace"))
    if match is None:
        raise _foreign_latest(path, "other content")
    return match.group(1), match.group(2)


def _foreign_latest(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: not in the format zfunc writes ({what}; zfunc's holds one line 'step_<n> "
                           "<sha256>'): damaged, or not written by zfunc. zfunc neither reads nor replaces it: move "
                           "it away (or restore with step=), or use another directory")


# --------------------------------------------------------------------------
# What zfunc wrote


def why_not_ours(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be shown to be zfunc's own (None: it is).

    Ours: a real directory (not a link) whose manifest checks out (its
    checksum, its fields) and that holds nothing but the manifest, its
    checksum and the rank files the manifest lists.
    """
    try:
        if stat.S_ISLNK(path.lstat().st_mode):
            return "it is a symbolic link"
        if not path.is_dir():
            return "it is not a directory"
        manifest = read_manifest(path)
    except (OSError, CheckpointError) as e:
        return str(e)
    allowed = {MANIFEST, MANIFEST_SUM} | {p["file"] for info in manifest["files"] for p in info["parts"]}
    return _strangers(path, allowed.__contains__)


def is_debris(path: Path) -> bool:
    """Whether ``path`` is what a killed save left (a temporary, parked or half-deleted checkpoint, a
    temporary ``latest``) and nothing else: only zfunc's file names, no links, no subdirectories."""
    try:
        info = path.lstat()
        if stat.S_ISREG(info.st_mode):  # latest.tmp-<token>
            return info.st_size <= 200 and LATEST_LINE.fullmatch(
                read_small(path, 200).decode("ascii", errors="replace")) is not None
        return stat.S_ISDIR(info.st_mode) and _strangers(path, ZFUNC_FILE.fullmatch) is None
    except (OSError, CheckpointError):
        return False


def _strangers(path: Path, allowed) -> str | None:
    with os.scandir(path) as entries:
        for entry in entries:
            if not allowed(entry.name) or not entry.is_file(follow_symlinks=False):
                return f"it holds {entry.name!r}, which zfunc did not write there"
    return None
