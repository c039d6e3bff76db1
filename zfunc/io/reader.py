"""`restore`: read a checkpoint into a template state's own tensors, in whatever layout the template has."""

from __future__ import annotations

import concurrent.futures
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from zfunc import dist
from zfunc.io.entries import (
    Spans,
    apply_rng,
    decode_client_state,
    escape,
    global_shapes,
    layout_of,
    walk,
    weights_path,
)
from zfunc.io.format import (
    LATEST,
    MANIFEST,
    CheckpointError,
    RankFiles,
    check_size,
    progress_bar,
    read_manifest,
    verify_checksums,
)
from zfunc.io.writer import STEP_DIR, all_gather, raise_if_failed, step_name
from zfunc.state import TrainState
from zfunc.transforms.shard_layout import ShardLayout
from zfunc.tree import describe_mismatch


def restore(directory: str | os.PathLike, like: TrainState, step: int | None = None, *, strict: bool = True,
            verify: bool = True, rng: bool = True, group: Any = None,
            progress: bool = False) -> tuple[TrainState, dict | None]:
    """Load a checkpoint into ``like``'s tensors (in place); returns ``(state, client_state)``.

    ``like`` is the state the target step's ``.init`` made (any world size,
    stage and placement); its tensors are overwritten with ``copy_`` and it
    is returned. See `zfunc.io` for the options and the guarantees.
    """
    if not isinstance(like, TrainState):
        raise TypeError(f"restore(like=...) takes a zf.TrainState made by step.init(...), got {type(like).__name__}")
    g = dist.Group.resolve(group)
    layout = layout_of(like)
    if layout is not None and (layout.world_size, layout.rank) != (g.size, g.rank):
        raise CheckpointError(f"restore: the template is sharded for rank {layout.rank} of {layout.world_size}, but "
                              f"this process is rank {g.rank} of {g.size}; build it with this world's step.init")
    reader = error = None
    try:
        reader = _Reader(locate(directory, step), like, layout, g, strict, verify)
    except CheckpointError as e:
        error = str(e)
    views = all_gather((str(reader.dir) if reader else None, error), g)
    try:
        raise_if_failed("restore", [v[1] for v in views], g.rank)
        if len({v[0] for v in views}) != 1:
            raise CheckpointError("restore: ranks resolved different checkpoints ("
                                  + ", ".join(f"rank {r}: {v[0]}" for r, v in enumerate(views))
                                  + "); was a save running? pass step= to pick one")
        client_state = reader.load(rng, g.size, progress)
    finally:
        if reader is not None:
            reader.close()
    return like, client_state


# --------------------------------------------------------------------------
# Which directory


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints (those with a manifest) under ``directory``, as ``(step, path)``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir()
                  if (m := STEP_DIR.fullmatch(p.name)) and (p / MANIFEST).is_file())


def locate(directory: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint directory to read: ``directory`` itself, its ``step_<step>``, or what ``latest`` names."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a zfunc checkpoint directory (it does not exist or is not a directory)")
    if (d / MANIFEST).exists():
        return d
    if STEP_DIR.fullmatch(d.name) or ".tmp-" in d.name:
        raise CheckpointError(f"{d}: incomplete checkpoint (no {MANIFEST}); was its save interrupted?")
    done = list_checkpoints(d)
    if step is not None:
        found = [p for s, p in done if s == step]
        if not found:
            have = ", ".join(str(s) for s, _ in done) or "none"
            raise CheckpointError(f"{d}: no complete checkpoint of step {step} (there is no {step_name(step)}/"
                                  f"{MANIFEST}); steps present: {have}")
        return found[0]
    latest = d / LATEST
    if latest.is_file():
        name = latest.read_text(encoding="utf-8", errors="replace").strip()
        if STEP_DIR.fullmatch(name) and (d / name / MANIFEST).is_file():
            return d / name
    # `latest` is missing or names an incomplete checkpoint (a save killed between its two renames):
    # the newest complete one, including a checkpoint parked aside while the same step was re-saved.
    parked = [(int(p.name[5:p.name.index(".")]), p) for p in d.glob("step_*.old-*") if (p / MANIFEST).is_file()]
    candidates = sorted(done + parked, key=lambda sp: (sp[0], ".old-" not in sp[1].name))
    if not candidates:
        raise CheckpointError(f"{d}: not a zfunc checkpoint directory (no '{LATEST}' file, no complete "
                              f"step_*/{MANIFEST})")
    if latest.is_file():
        warnings.warn(f"{latest} names a missing or incomplete checkpoint; using {candidates[-1][1]}", stacklevel=3)
    return candidates[-1][1]


# --------------------------------------------------------------------------
# Planning and reading


class _Reader:
    """Everything ``restore`` will read, validated (manifest, names, shapes, headers, checksums) before any write."""

    def __init__(self, step_dir: Path, like: TrainState, layout: ShardLayout | None, group: dist.Group,
                 strict: bool, verify: bool) -> None:
        self.dir, self.like, self.rank = step_dir, like, group.rank
        self.manifest = read_manifest(step_dir)
        self.same_world = self.manifest["world_size"] == group.size
        self.files: dict[int, RankFiles] = {}
        try:
            self._plan(layout, strict)
            self._open(verify)
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.dir}: {what}")

    def _plan(self, layout: ShardLayout | None, strict: bool) -> None:
        m, like = self.manifest, self.like
        shapes = global_shapes(like, layout)
        saved = {k: tuple(s) for k, s in m["params"].items()}
        problems = describe_mismatch({k: torch.empty(s, device="meta") for k, s in shapes.items()},
                                     {k: torch.empty(s, device="meta") for k, s in saved.items()}, what="checkpoint")
        if problems:
            raise self._fail(f"the checkpoint's parameters differ from the template's:\n{problems}")
        src_layout = ShardLayout.from_json({**m["layout"], "rank": 0}) if m["layout"] is not None else None
        self.src = Spans(src_layout, saved)
        dst = Spans(layout, shapes)
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
        # ops: (source rank, tensor name, first source element, target flat view, first target element, count)
        self.ops: list[tuple[int, str, int, torch.Tensor, int, int]] = []
        self.sizes: dict[tuple[int, str], int] = {}  # (source rank, tensor name) -> elements it must hold
        self.finish: list[tuple[torch.Tensor, torch.Tensor]] = []  # (template tensor, staging) if not contiguous
        world = m["world_size"]
        for path, group in groups.items():
            if path not in source:
                continue
            for key, t in group.items():
                a, b = dst.local(key, self.rank, t, f"template {path}")
                out = self._flat(t)
                for s in range(world):
                    sa, sb = self.src.span(key, s)
                    lo, hi = max(a, sa), min(b, sb)
                    if hi > lo:
                        name = f"{source[path]}/{escape(key)}"
                        self.ops.append((s, name, lo - sa, out, lo - a, hi - lo))
                        self.sizes[s, name] = sb - sa
        for path, t in leaves.items():
            if path in m["leaves"]:
                self.ops.append((0, path, 0, self._flat(t), 0, t.numel()))
                self.sizes[0, path] = t.numel()

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
        own = self.files[self._own_rank()]
        info = self.manifest["files"][self._own_rank()]
        if rng:
            if self.same_world:
                for note in apply_rng(info["rng"], own.read):
                    warnings.warn(f"restore from {self.dir}: {note}", stacklevel=3)
            else:
                warnings.warn(f"restore from {self.dir}: saved on {self.manifest['world_size']} ranks, restored on "
                              f"{world}: RNG states not restored (there is no exact resume across world sizes)",
                              stacklevel=3)
        return decode_client_state(info.get("client_state"), own.read)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


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
