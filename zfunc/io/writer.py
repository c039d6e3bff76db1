"""`save`: every rank writes its file into a temporary directory; rank 0 commits it with renames."""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

import zfunc
from zfunc import dist
from zfunc.io.entries import (
    Spans,
    capture_rng,
    encode_client_state,
    escape,
    global_shapes,
    layout_of,
    walk,
    weights_path,
)
from zfunc.io.format import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    CheckpointError,
    dtype_name,
    fsync_dir,
    progress_bar,
    write_safetensors,
    write_text_atomic,
)
from zfunc.state import TrainState

STEP_DIR = re.compile(r"step_(\d+)")
PART_BYTES = 512 << 20  # bytes per rank file before a new part starts
STALE = re.compile(r"step_\d+\.(tmp|del|old)-[0-9a-f]+|latest\.tmp-[0-9a-f]+")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_file(rank: int, part: int = 0) -> str:
    return f"rank_{rank:05d}.safetensors" if part == 0 else f"rank_{rank:05d}.p{part:03d}.safetensors"


def all_gather(obj: Any, group: dist.Group) -> list[Any]:
    """``obj`` (JSON-able) of every rank of ``group``: through `zfunc.dist`, as JSON, never pickled."""
    return dist.all_gather_json(obj, group)


def raise_if_failed(what: str, errors: list[Any], rank: int) -> None:
    """Raise the same `CheckpointError` on every rank if any rank reported an error."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    own = errors[rank]
    if own and len(failed) == 1:
        raise CheckpointError(own)
    lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
    raise CheckpointError(f"{what} failed on {len(failed)} of {len(errors)} ranks:\n{lines}")


def save(directory: str | os.PathLike, state: TrainState, client_state: dict | None = None,
         keep: int | None = None, *, group: Any = None, progress: bool = False,
         part_bytes: int = PART_BYTES) -> Path:
    """Save ``state`` as ``directory/step_<state.step>/``; call it on every rank. Returns that path.

    See `zfunc.io` for the format and the guarantees. ``client_state`` is
    this rank's JSON-able dict (tensors allowed), returned by `restore`;
    ``keep=k`` deletes all but the newest ``k`` checkpoints (by step; the one
    just written always stays). ``group``: the process group the state is
    sharded over (default: the world). A rank's data is split into files of
    about ``part_bytes`` (a larger tensor gets a file of its own), written,
    hashed and later read in parallel threads.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save() takes a zf.TrainState, got {type(state).__name__}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None or an int >= 1, got {keep!r}")
    directory = Path(directory)
    g = dist.Group.resolve(group)
    step = error = None
    try:
        step = _step_of(state)
        layout = layout_of(state)
        if layout is not None and (layout.world_size, layout.rank) != (g.size, g.rank):
            raise CheckpointError(f"save: the state is sharded for rank {layout.rank} of {layout.world_size}, but "
                                  f"this process is rank {g.rank} of {g.size}")
        client_json, client_tensors = encode_client_state(client_state)
        json.dumps(client_json)
    except (CheckpointError, TypeError, ValueError) as e:
        error = f"save: {e}"
    views = all_gather((step, secrets.token_hex(6), error), g)
    raise_if_failed("save", [v[2] for v in views], g.rank)
    steps = [v[0] for v in views]
    if len(set(steps)) != 1:
        listed = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        raise CheckpointError(f"save: ranks disagree on state.step ({listed}); every rank must save the same step")
    token, name = views[0][1], step_name(step)
    tmp = directory / f"{name}.tmp-{token}"

    info, error = None, None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        info = _write_rank(tmp, state, layout, g.rank, client_tensors, progress, part_bytes)
        info["client_state"] = client_json
    except Exception as e:  # noqa: BLE001 (reported to every rank below, so none waits forever)
        error = f"save: rank {g.rank} could not write its files in {tmp}: {type(e).__name__}: {e}"
    results = all_gather((info, error), g)
    errors = [r[1] for r in results]
    outcome = None
    if g.rank == 0:
        try:
            if any(errors):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                manifest = _manifest(state, layout, step, g.size, [r[0] for r in results])
                _commit(directory, tmp, name, manifest, keep, token)
        except Exception as e:  # noqa: BLE001 (every rank raises it below)
            outcome = f"save: could not commit {directory / name}: {type(e).__name__}: {e}"
    raise_if_failed("save", errors, g.rank)
    outcome = all_gather(outcome, g)[0]
    if outcome:
        raise CheckpointError(outcome)
    return directory / name


def _step_of(state: TrainState) -> int:
    step = state.step
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_floating_point():
            raise CheckpointError(f"save: state.step must be an integer scalar, got {step!r}")
        step = int(step.item())
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"save: state.step must be a non-negative integer, got {step!r}")
    return step


def _write_rank(tmp: Path, state: TrainState, layout, rank: int, client_tensors, progress: bool,
                part_bytes: int) -> dict:
    groups, leaves = walk(state)
    spans = Spans(layout, global_shapes(state, layout))
    rng, rng_tensors = capture_rng()
    tensors: list[tuple[str, torch.Tensor]] = rng_tensors + client_tensors
    if rank == 0:
        tensors += list(leaves.items())
    if layout is not None or rank == 0:  # a plain state is the same on every rank: rank 0 writes it
        for path, group in groups.items():
            for key, t in group.items():
                if layout is None:
                    tensors.append((f"{path}/{escape(key)}", t))
                    continue
                a, b = spans.span(key, rank)
                spans.local(key, rank, t, f"save {path}")  # checks t is the whole parameter or this slice
                flat = t.detach().reshape(-1)  # stage 1/2 params are whole on every rank: save our slice
                tensors.append((f"{path}/{escape(key)}", flat[a:b] if flat.numel() != b - a else flat))
    parts: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if parts[-1] and size + nbytes > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append((name, t))
        size += nbytes
    total = sum(t.numel() * t.element_size() for _, t in tensors)

    def write(index: int) -> dict:
        items = parts[index]
        specs = [(name, t.dtype, list(t.shape)) for name, t in items]
        size, digest = write_safetensors(tmp / rank_file(rank, index), specs, bar.counting(t for _, t in items),
                                         {"format": FORMAT, "rank": str(rank), "part": str(index)})
        return {"file": rank_file(rank, index), "bytes": size, "sha256": digest}

    with progress_bar(progress, total, f"save rank {rank}") as bar, concurrent.futures.ThreadPoolExecutor(
            min(len(parts), os.cpu_count() or 1), thread_name_prefix="zfunc-io-write") as pool:
        written = list(pool.map(write, range(len(parts))))
    return {"rank": rank, "parts": written, "rng": rng}


def _manifest(state: TrainState, layout, step: int, world_size: int, infos: list[dict]) -> dict:
    groups, leaves = walk(state)
    layout_json = None
    if layout is not None:
        layout_json = layout.to_json()
        del layout_json["rank"]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "zfunc_version": zfunc.__version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": step, "world_size": world_size, "stage": layout.stage if layout is not None else 0,
        "layout": layout_json,
        "params": {k: list(s) for k, s in global_shapes(state, layout).items()},
        "weights": weights_path(groups),
        "groups": {path: {k: dtype_name(t.dtype) for k, t in g.items()} for path, g in groups.items()},
        "leaves": {path: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for path, t in leaves.items()},
        "files": infos,
    }


def _commit(directory: Path, tmp: Path, name: str, manifest: dict, keep: int | None, token: str) -> None:
    """Make ``tmp`` the checkpoint ``name`` and point ``latest`` at it; every moment leaves a complete one."""
    with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    final = directory / name
    old = None
    if final.exists():  # the same step saved again: swap, keeping the old one until the new one is in place
        old = directory / f"{name}.old-{token}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(directory)
    write_text_atomic(directory / LATEST, name + "\n", token)
    if old is not None:
        _remove(old, token)
    if keep is not None:
        done = sorted((int(m.group(1)), p) for p in directory.iterdir()
                      if (m := STEP_DIR.fullmatch(p.name)) and (p / MANIFEST).exists() and p.name != name)
        for _, p in done[:max(0, len(done) - (keep - 1))]:
            _remove(p, token)
    for p in directory.iterdir():  # debris of saves killed earlier (one writer per directory)
        if STALE.fullmatch(p.name) and token not in p.name:
            _remove(p, token)


def _remove(path: Path, token: str) -> None:
    """Delete a file or a checkpoint: renamed out of sight first, so a half-deleted one is never taken for whole."""
    if path.is_dir():
        gone = path.with_name(f"{STEP_DIR.match(path.name).group(0)}.del-{token}") if STEP_DIR.match(path.name) \
            else path
        if gone != path:
            os.replace(path, gone)
        shutil.rmtree(gone, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
