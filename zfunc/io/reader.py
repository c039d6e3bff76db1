"""`restore`: read a checkpoint into a template state's own tensors, in whatever layout the template has."""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from zfunc import dist
from zfunc.interpret import check_alive, forget_copies
from zfunc.io.commit import PARKED, STEP_DIR
from zfunc.io.entries import (
    MESH_ADVICE,
    Mesh,
    Spans,
    all_shapes,
    apply_rng,
    decode_client_state,
    escape,
    layout_of,
    overlaps,
    read_rng,
    walk,
    weights_path,
)
from zfunc.io.format import (
    LATEST,
    MANIFEST,
    CheckpointError,
    RankFiles,
    check_size,
    dtype_name,
    progress_bar,
    read_small,
    verify_checksums,
)
from zfunc.io.manifest import MAX_MANIFEST, read_latest, read_manifest, recorded_digest
from zfunc.io.ranks import exchange, io_seconds, raise_if_failed
from zfunc.io.writer import step_name
from zfunc.state import TrainState
from zfunc.state_check import refusal
from zfunc.transforms.mixed_precision import MixedPrecisionState, describe_policy_codes
from zfunc.transforms.shard_layout import ShardLayout
from zfunc.tree import describe_mismatch


def restore(directory: str | os.PathLike, like: TrainState, step: int | None = None, *, strict: bool = True,
            verify: bool = True, rng: bool = True, group: Any = None,
            progress: bool = False, cast: bool = False) -> tuple[TrainState, dict | None]:
    """Load a checkpoint into ``like``'s tensors (in place); returns ``(state, client_state)``.

    ``like`` is the state the target step's ``.init`` made (any world size,
    stage and placement); its tensors are overwritten with ``copy_`` and it
    is returned. See `zfunc.io` for the options and the guarantees. Call it
    on every rank of ``group``: a rank that never does makes the others
    raise `zfunc.dist.CollectiveError` after ``$ZFUNC_TIMEOUT_S`` seconds.

    A tensor the template holds in a narrower dtype than the checkpoint (fp32
    saved, fp16 template) is refused unless ``cast=True``: the cast would round
    the saved values without a word. (The compute copy of a template with a
    master, e.g. bf16 params under mixed_precision, is a cast of the master
    by definition and is always allowed.)
    """
    if not isinstance(like, TrainState):
        raise TypeError(refusal(like, "zf.io.restore(dir, like=...)"))
    g = dist.Group.resolve(group)
    layout = layout_of(like)
    step_dir = error = None
    try:
        # A consumed template shares its buffers with the state its step returned: restoring into it would
        # overwrite that live state behind the caller's back.
        check_alive(like, "zfunc.io.restore(like=...)")
        mesh = Mesh.of_state(like, g.rank)
        if mesh.trivial() and layout is not None and (layout.world_size, layout.rank) != (g.size, g.rank):
            raise CheckpointError(f"restore: the template is sharded for rank {layout.rank} of {layout.world_size}, "
                                  f"but this process is rank {g.rank} of {g.size}; build it with this world's "
                                  "step.init")
        if not mesh.replicated() and mesh.size != g.size:
            raise CheckpointError(f"restore: the template is split {mesh.describe()} ({mesh.size} ranks: shard over "
                                  f"dp, pipeline over pp, tensor_parallel over tp), but {g.size} ranks restore it. "
                                  f"{MESH_ADVICE}")
        step_dir = locate(directory, step)
    except Exception as e:  # noqa: BLE001 (reported to every rank below, so none waits for this one)
        error = _describe(e, g)
    views = exchange("restore", "locate", [str(step_dir) if step_dir else None, error], g)
    found = [r for r, v in enumerate(views) if v[0]]
    raise_if_failed("restore", [v[1] for v in views], g.rank, hint=(
        f"\n(rank(s) {found} found the checkpoint: if the others saw no such directory, do all ranks see the same "
        "filesystem?)" if found else ""))
    if len({v[0] for v in views}) != 1:
        raise CheckpointError("restore: ranks resolved different checkpoints ("
                              + ", ".join(f"rank {r}: {v[0]}" for r, v in enumerate(views))
                              + "); was a save running? pass step= to pick one")
    reader = error = None
    try:
        reader = _Reader(step_dir, like, layout, g, strict, verify, cast)
    except Exception as e:  # noqa: BLE001 (as above)
        error = _describe(e, g)
    try:
        raise_if_failed("restore", exchange("restore", "check", error, g, io_seconds(_bytes_in(step_dir))), g.rank)
        client_state = reader.load(rng, g.size, progress)
    finally:
        if reader is not None:
            reader.close()
    forget_copies(like)  # (the step's record of its compute copy and master described the replaced values)
    return like, client_state


def _describe(e: Exception, g: dist.Group) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"restore: rank {g.rank}: {type(e).__name__}: {e}"


def _bytes_in(step_dir: Path) -> int:
    """What a rank may read and hash of a checkpoint: the size of its files (bounds how long others wait)."""
    try:
        with os.scandir(step_dir) as entries:
            return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


# --------------------------------------------------------------------------
# Which directory


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints (those with a manifest) under ``directory``, as ``(step, path)``, oldest first.

    Symbolic links are not checkpoints: zfunc reads only what it wrote inside ``directory``.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir()
                  if (m := STEP_DIR.fullmatch(p.name)) and not p.is_symlink() and (p / MANIFEST).is_file())


def locate(directory: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint directory to read: ``directory`` itself, its ``step_<step>``, or what ``latest`` names.

    ``latest`` records the name and the manifest checksum of the checkpoint
    it points at; when the two disagree (a damaged ``latest``, or a save
    killed while it swapped a re-saved step) the checkpoint whose manifest
    matches the checksum is used, and failing that, if the named one is
    missing, the newest complete one (with a warning).
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a zfunc checkpoint directory (it does not exist or is not a directory)")
    if os.path.lexists(d / MANIFEST):
        return d
    if STEP_DIR.fullmatch(d.name) or ".tmp-" in d.name:
        raise CheckpointError(f"{d}: incomplete checkpoint (no {MANIFEST}); was its save interrupted?")
    done = list_checkpoints(d)
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
        found = [p for s, p in done if s == step]
        if not found:
            if (d / step_name(step)).is_symlink():
                raise CheckpointError(f"{d / step_name(step)}: is a symbolic link; zfunc reads only the "
                                      "checkpoints it wrote inside the directory, never through links")
            have = ", ".join(str(s) for s, _ in done) or "none"
            raise CheckpointError(f"{d}: no complete checkpoint of step {step} (there is no {step_name(step)}/"
                                  f"{MANIFEST}); steps present: {have}")
        return found[0]
    parked = [(int(m.group(1)), p) for p in d.iterdir()
              if (m := PARKED.fullmatch(p.name)) and not p.is_symlink() and (p / MANIFEST).is_file()]
    latest = read_latest(d)
    if latest is not None:
        chosen = _follow_latest(d, *latest, done + parked)
        if chosen is not None:
            return chosen
    # `latest` is missing or names an incomplete checkpoint (a save killed between its two renames):
    # the newest complete one, including a checkpoint parked aside while the same step was re-saved.
    candidates = sorted(done + parked, key=lambda sp: (sp[0], ".old-" not in sp[1].name))
    if not candidates:
        raise CheckpointError(f"{d}: not a zfunc checkpoint directory (no '{LATEST}' file, no complete "
                              f"step_*/{MANIFEST})")
    if latest is not None:
        warnings.warn(f"{d / LATEST} names a missing or incomplete checkpoint; using {candidates[-1][1]}",
                      stacklevel=3)
    return candidates[-1][1]


def _follow_latest(d: Path, name: str, digest: str | None, complete: list[tuple[int, Path]]) -> Path | None:
    """The checkpoint ``latest`` (``name``, ``digest``) designates; None if it names none that is complete."""
    target = d / name
    if target.is_symlink():
        raise CheckpointError(f"{d / LATEST}: names {name}, which is a symbolic link; zfunc reads only the "
                              "checkpoints it wrote inside the directory, never through links")
    exists = (target / MANIFEST).is_file()
    if digest is None:  # format 1: the name alone
        return target if exists else None
    actual = _digest(target) if exists else None
    if actual == digest:
        return target
    for _, p in complete:  # a re-save swapped out, or a damaged name
        if p != target and _digest(p) == digest:
            return p
    if not exists:
        return None
    try:
        recorded = recorded_digest(target)
    except CheckpointError:
        recorded = None
    if actual is None or recorded != actual:
        return target  # its manifest is damaged itself: reading it says so, naming the file
    raise CheckpointError(f"{d / LATEST}: records manifest checksum {digest} for {name}, but its manifest has "
                          f"another, and no checkpoint here has this one: '{LATEST}' is damaged or {name} was "
                          "replaced after it was saved. Pass step= (or the step directory) to choose explicitly")


def _digest(step_dir: Path) -> str | None:
    try:
        return hashlib.sha256(read_small(step_dir / MANIFEST, MAX_MANIFEST)).hexdigest()
    except CheckpointError:
        return None


# --------------------------------------------------------------------------
# Planning and reading


class _Reader:
    """Everything ``restore`` will read, validated (manifest, names, shapes, headers, checksums) before any write."""

    def __init__(self, step_dir: Path, like: TrainState, layout: ShardLayout | None, group: dist.Group,
                 strict: bool, verify: bool, cast: bool = False) -> None:
        self.dir, self.like, self.rank = step_dir, like, group.rank
        self.manifest = read_manifest(step_dir)
        if self.manifest["format_version"] == 1:
            warnings.warn(f"restore from {step_dir}: a format-1 checkpoint: its manifest has no checksum, so damage "
                          "to it cannot be detected; save it again to upgrade it", stacklevel=4)
        self.same_world = self.manifest["world_size"] == group.size
        self.files: dict[int, RankFiles] = {}
        try:
            self._plan(layout, strict)
            self._open(verify)
            self._reconcile_policies(strict)
            if not cast:
                self._refuse_narrowing()
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.dir}: {what}")

    def _plan(self, layout: ShardLayout | None, strict: bool) -> None:
        m, like = self.manifest, self.like
        shapes = all_shapes(like, layout)  # (under pipeline: every stage's, compared with the checkpoint's)
        saved = {k: tuple(s) for k, s in m["params"].items()}
        problems = describe_mismatch({k: torch.empty(s, device="meta") for k, s in shapes.items()},
                                     {k: torch.empty(s, device="meta") for k, s in saved.items()}, what="checkpoint")
        if problems:
            raise self._fail(f"the checkpoint's parameters differ from the template's:\n{problems}")
        self.src = Spans.of_manifest(m)  # (any saved layout: dp x pp x tp, ...)
        dst = Spans.of_state(like, self.rank, shapes)  # (... into any other)
        groups, leaves = walk(like)
        source = {p: p for p in groups if p in m["groups"]}
        mine = weights_path(groups)
        if not strict and mine != m["weights"] and m["weights"] in m["groups"]:
            # A master on one side only: the template's weights come from the checkpoint's weights
            # (what step.gather returned), e.g. plain fp32 params from a mixed_precision fp32 master.
            source[mine] = m["weights"]
        missing = [p for p in groups if p not in source] + [p for p in leaves if p not in m["leaves"]]
        unexpected = [p for p in m["groups"] if p not in source.values()] + [p for p in m["leaves"]
                                                                           if p not in leaves]
        wrong = [f"  {p}: template {list(t.shape)}, checkpoint {m['leaves'][p]['shape']}" for p, t in leaves.items()
                 if p in m["leaves"] and list(t.shape) != m["leaves"][p]["shape"]]
        if wrong or (strict and (missing or unexpected)):
            lines = wrong + [f"  missing from checkpoint: {p}" for p in missing] + \
                [f"  not in template: {p}" for p in unexpected]
            raise self._fail("the checkpoint's state does not match the template's (a different optimizer or "
                             "transform stack?):\n" + "\n".join(lines) +
                             ("\nPass strict=False to restore what both hold (a master copy then stands in for "
                              "params and vice versa)." if not wrong else ""))
        if missing or unexpected:
            warnings.warn(f"restore from {self.dir}: kept the template's values of {missing or 'nothing'}; ignored "
                          f"{unexpected or 'nothing'}", stacklevel=4)
        self.source, self.groups, self.leaves = source, groups, leaves
        # ops: (source rank, tensor name, first source element, target flat view, first target element, count)
        self.ops: list[tuple[int, str, int, torch.Tensor, int, int]] = []
        self.sizes: dict[tuple[int, str], int] = {}  # (source rank, tensor name) -> elements it must hold
        self.finish: list[tuple[torch.Tensor, torch.Tensor]] = []  # (template tensor, staging) if not contiguous
        self.dst = dst
        for path, group in groups.items():
            if path in source:
                self._read_group(path, source[path])
        for path, t in leaves.items():
            if path in m["leaves"]:
                self.ops.append((0, path, 0, self._flat(t), 0, t.numel()))
                self.sizes[0, path] = t.numel()

    def _read_group(self, path: str, source: str) -> None:
        """Plan reading the template's group ``path`` (param-shaped) from the checkpoint's group ``source``."""
        name = lambda key: f"{source}/{escape(key)}"  # noqa: E731
        for key, t in self.groups[path].items():
            a, b = self.dst.local(key, self.rank, t, f"template {path}")
            out = self._flat(t)
            held, saved = [], {}  # runs of the full parameter each source rank saved (one each without tp)
            for s in range(self.manifest["world_size"]):
                sa, sb = self.src.span(key, s)
                held += [(start, count, offset, s) for start, count, offset in self.src.runs(key, s, sa, sb)]
                saved[s] = sb - sa
            for s, begin, at, count in overlaps(self.dst.runs(key, self.rank, a, b), held):
                self.ops.append((s, name(key), begin, out, at, count))
                self.sizes[s, name(key)] = saved[s]

    def _reconcile_policies(self, strict: bool) -> None:
        """A checkpoint made under another mixed-precision policy than the template's (read its policy codes
        first, before anything is written): with ``strict`` refused; without, only the master weights are
        restored, and the template keeps its own policy, loss scaler and a compute copy cast from the master."""
        for name, mp in (self.like.extras or {}).items():
            prefix = f"extras/{name}/"
            codes = f"{prefix}policy"
            if not isinstance(mp, MixedPrecisionState) or codes not in self.manifest["leaves"]:
                continue
            saved = self.files[0].read(codes)
            if saved.shape == mp.policy.shape and saved.tolist() == mp.policy.tolist():
                continue
            made, want = describe_policy_codes(saved.tolist()), describe_policy_codes(mp.policy.tolist())
            if strict:
                raise self._fail(
                    f"the checkpoint was made under another mixed-precision policy ({made}) than the template's "
                    f"({want}). To continue that run, build the template with the step that saved it; to move "
                    "its weights to this policy, pass restore(..., strict=False): the fp32 master weights are "
                    "restored and the template keeps its policy and a fresh loss scaler.")
            scaler = {f"{prefix}{field}" for field in MixedPrecisionState._fields if field != "master"}
            self.ops = [op for op in self.ops if op[1] not in scaler]
            master = f"{prefix}master"
            if "params" in self.source and master in self.source and master in self.manifest["groups"]:
                # The compute copy is a cast of the master by definition: not the other policy's rounding.
                self.ops = [op for op in self.ops if not op[1].startswith(f"{self.source['params']}/")]
                self._read_group("params", master)
                self.source["params"] = master
                for (rank, tensor), size in self.sizes.items():
                    if self.files[rank].entry(tensor).numel != size:
                        raise self._fail(f"{tensor!r} of rank {rank} holds {self.files[rank].entry(tensor).numel} "
                                         f"elements, the manifest's layout says {size}")
            warnings.warn(f"restore from {self.dir}: made under another mixed-precision policy ({made}); restored "
                          f"the master weights into this one ({want}), with this template's loss scaler",
                          stacklevel=4)

    def _refuse_narrowing(self) -> None:
        """Refuse reading a saved tensor into a template tensor of a narrower dtype (see `restore`)."""
        m = self.manifest
        compute_copy = "params" if weights_path(self.groups) != "params" else None  # cast of the template's master
        narrowed = []
        for path, group in self.groups.items():
            if path not in self.source or path == compute_copy:
                continue
            saved = m["groups"][self.source[path]]
            narrowed += [(f"{path}/{k}", saved[k], t.dtype) for k, t in group.items()
                         if k in saved and _narrows(saved[k], t.dtype)]
        narrowed += [(path, m["leaves"][path]["dtype"], t.dtype) for path, t in self.leaves.items()
                     if path in m["leaves"] and _narrows(m["leaves"][path]["dtype"], t.dtype)]
        if narrowed:
            listed = "\n".join(f"  {p}: checkpoint {a}, template {dtype_name(b)}" for p, a, b in narrowed[:8])
            more = f"\n  ... and {len(narrowed) - 8} more" if len(narrowed) > 8 else ""
            raise self._fail(
                f"{len(narrowed)} tensor(s) of the checkpoint would be cast to a narrower dtype, rounding the saved "
                f"values:\n{listed}{more}\nBuild the template in the checkpoint's dtypes (as the run that saved "
                "it did), or pass restore(..., cast=True) to round them on purpose.")

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.is_contiguous():
            return t.view(-1)
        staging = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        self.finish.append((t, staging))
        return staging

    def _open(self, verify: bool) -> None:
        m = self.manifest
        check_files(self.dir, m)  # all present, of the right size: cheap, and catches a lost rank on every rank
        self.files = open_ranks(self.dir, m, {op[0] for op in self.ops} | {0, self._own_rank()}, verify)
        for (s, name), size in self.sizes.items():
            entry = self.files[s].entry(name)
            if entry.numel != size:
                raise CheckpointError(f"{self.files[s].file_of(name).path}: {name!r} holds {entry.numel} elements, "
                                      f"the manifest's layout says {size}")
        # Read and check this rank's own small records now, so that damage there is found before any write.
        own = self.files[self._own_rank()]
        info = m["files"][self._own_rank()]
        try:
            self.rng = read_rng(info["rng"], own.read) if self.same_world else None
        except CheckpointError as e:
            raise CheckpointError(f"{own.parts[0].path}: rank {own.rank}'s generator state is damaged: {e}") from None
        self.client_state = decode_client_state(info["client_state"], own.read)

    def _own_rank(self) -> int:
        return self.rank if self.same_world and self.rank < self.manifest["world_size"] else 0

    def load(self, rng: bool, world: int, progress: bool) -> Any:
        by_file: dict[Any, list] = {}  # each part file read by one thread, in file order
        for s, name, begin, out, at, count in self.ops:
            f = self.files[s].file_of(name)
            by_file.setdefault(f, []).append((f.entries[name].start + begin, name, begin, out, at, count))
        total = sum(op[3].element_size() * op[5] for op in self.ops)

        def read(f) -> None:
            with torch.no_grad():
                for _, name, begin, out, at, count in sorted(by_file[f], key=lambda op: op[0]):
                    f.read_into(name, begin, out[at:at + count])
                    bar.update(out.element_size() * count)

        with progress_bar(progress, total, f"restore rank {self.rank}") as bar, \
                concurrent.futures.ThreadPoolExecutor(max(1, min(len(by_file), os.cpu_count() or 1)),
                                                      thread_name_prefix="zfunc-io-read") as pool:
            list(pool.map(read, by_file))
        with torch.no_grad():
            for t, staging in self.finish:
                t.copy_(staging.view(t.shape))
        if rng:
            if self.rng is not None:
                for note in apply_rng(self.rng):
                    warnings.warn(f"restore from {self.dir}: {note}", stacklevel=3)
            else:
                warnings.warn(f"restore from {self.dir}: saved on {self.manifest['world_size']} ranks, restored on "
                              f"{world}: RNG states not restored (there is no exact resume across world sizes)",
                              stacklevel=3)
        return self.client_state

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _narrows(saved: str, template: torch.dtype) -> bool:
    """Whether casting a tensor of dtype ``saved`` (the manifest's name) into ``template`` may change values:
    anything but a cast to a dtype that holds every value of the saved one (bf16 -> fp32, int32 -> int64)."""
    source = getattr(torch, saved, None)
    if not isinstance(source, torch.dtype) or source == template:
        return False
    if source == torch.bool:
        return False
    if source.is_floating_point or source.is_complex:
        return torch.promote_types(source, template) != template or not (template.is_floating_point or
                                                                         template.is_complex)
    # an integer: into a wider integer, or a float whose mantissa holds it (int32 -> float64)
    if template.is_floating_point or template.is_complex:
        mantissa = {torch.float64: 53, torch.float32: 24, torch.complex128: 53, torch.complex64: 24}.get(template, 11)
        return torch.iinfo(source).bits > mantissa
    return torch.promote_types(source, template) != template


def check_files(step_dir: Path, manifest: dict) -> None:
    """Every file the manifest lists exists and has the size it records (cheap: no reads)."""
    for info in manifest["files"]:
        for part in info["parts"]:
            check_size(step_dir / part["file"], part["bytes"], info["rank"])


def open_ranks(step_dir: Path, manifest: dict, ranks, check: bool) -> dict[int, RankFiles]:
    """The files of ``ranks``, opened (headers validated) and, with ``check``, verified against their SHA-256."""
    files: dict[int, RankFiles] = {}
    try:
        for s in sorted(ranks):
            files[s] = RankFiles(step_dir, manifest["files"][s])
        if check:
            verify_checksums(files.values())
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return files


def check_entries(manifest: dict, files: dict[int, RankFiles], groups, records: bool = False) -> None:
    """Every tensor the manifest promises for ``groups`` is in the opened ``files`` with the element count and
    dtype it says (and, with ``records``, rank 0 holds every leaf and each rank's generator states and
    client tensors read back): what `zfunc verify` checks beyond the checksums."""
    spans = Spans.of_manifest(manifest)
    for path in groups:
        for key, dtype in manifest["groups"][path].items():
            name = f"{path}/{escape(key)}"
            for s, f in files.items():
                a, b = spans.span(key, s)
                if b > a:
                    _expect(f, name, b - a, dtype)
    if not records:
        return
    for path, leaf in manifest["leaves"].items():
        _expect(files[0], path, math.prod(leaf["shape"]), leaf["dtype"])
    for s, f in files.items():
        info = manifest["files"][s]
        try:
            read_rng(info["rng"], f.read)
        except CheckpointError as e:
            raise CheckpointError(f"{f.parts[0].path}: rank {s}'s generator state is damaged: {e}") from None
        decode_client_state(info["client_state"], f.read)


def _expect(files: RankFiles, name: str, numel: int, dtype: str) -> None:
    entry = files.entry(name)
    if entry.numel != numel or dtype_name(entry.dtype) != dtype:
        raise CheckpointError(f"{files.file_of(name).path}: {name!r} holds {entry.numel} elements of "
                              f"{dtype_name(entry.dtype)}; the manifest says {numel} of {dtype}")
