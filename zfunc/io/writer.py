"""`save`: every rank writes its file into a temporary directory; rank 0 commits it with renames."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zfunc import dist
from zfunc._version import VERSION
from zfunc.interpret import check_alive
from zfunc.io.commit import SaveLock, commit, prepare
from zfunc.io.entries import (
    MESH_ADVICE,
    Mesh,
    Spans,
    TPInfo,
    all_shapes,
    capture_rng,
    encode_client_state,
    escape,
    global_shapes,
    holders_of,
    layout_of,
    pipeline_of,
    walk,
    weights_path,
)
from zfunc.io.format import (
    FORMAT,
    MESH_VERSION,
    WRITTEN_VERSION,
    CheckpointError,
    dtype_name,
    progress_bar,
    write_safetensors,
)
from zfunc.io.manifest import rank_file
from zfunc.io.ranks import exchange, io_seconds, raise_if_failed
from zfunc.state import TrainState
from zfunc.state_check import refusal
from zfunc.transforms.shard_layout import ShardLayout

PART_BYTES = 512 << 20  # bytes per rank file before a new part starts
SHOW_PATIENCE = 1.0     # seconds a shared filesystem may take to show one node the files another wrote


def step_name(step: int) -> str:
    return f"step_{step:06d}"


class _Plan(NamedTuple):
    """What this rank will write: checked, before any rank writes anything."""

    step: int
    layout: ShardLayout | None
    tp: TPInfo | None  # the tensor-parallel split
    mesh: Mesh  # the state's dp x pp x tp split (coords: this rank's own until every rank's are exchanged)
    tensors: list[tuple[str, torch.Tensor]]
    rng: dict
    client_state: Any
    state: TrainState | None = None
    stages: Any = None  # the state's `PipelineLayout`, if pipeline split it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


def save(directory: str | os.PathLike, state: TrainState, client_state: dict | None = None,
         keep: int | None = None, *, group: Any = None, progress: bool = False,
         part_bytes: int = PART_BYTES) -> Path:
    """Save ``state`` as ``directory/step_<state.step>/``; call it on every rank. Returns that path.

    See `zfunc.io` for the format and the guarantees. ``client_state`` is
    this rank's JSON-able dict (tensors allowed), returned by `restore`;
    ``keep=k`` deletes all but the newest ``k`` of the checkpoints zfunc
    wrote there (by step; the one just written always stays). ``group``: the
    process group the state is sharded over (default: the world). A rank's
    data is split into files of about ``part_bytes`` (a larger tensor gets a
    file of its own), written, hashed and later read in parallel threads.

    Raises `CheckpointError` (on every rank alike) when the state cannot be
    saved, another save holds the directory, something there was not written
    by zfunc, or the ranks do not share the directory's filesystem; and
    `zfunc.dist.CollectiveError` when some rank never calls `save`.
    """
    if not isinstance(state, TrainState):
        raise TypeError(refusal(state, "zf.io.save(dir, state)"))
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None or an int >= 1, got {keep!r}")
    directory = Path(directory)
    g = dist.Group.resolve(group)
    plan = error = None
    try:
        plan = _plan(state, client_state, g)
    except Exception as e:  # noqa: BLE001 (reported to every rank below, so none waits for this one)
        error = f"save: {e}" if isinstance(e, (CheckpointError, TypeError, ValueError)) else \
            f"save: rank {g.rank}: {type(e).__name__}: {e}"
    place = [plan.mesh.describe(), plan.mesh.coords[g.rank]] if plan is not None else None
    views = exchange("save", "check", [plan.step if plan else None, error, plan.nbytes if plan else 0, place], g)
    raise_if_failed("save", [v[1] for v in views], g.rank)
    if len({v[3][0] for v in views}) != 1:
        listed = ", ".join(f"rank {r}: {v[3][0]}" for r, v in enumerate(views))
        raise CheckpointError(f"save: the ranks' states are split differently ({listed}); every rank saves the state "
                              "its own step of one stack returned")
    # Every rank's (dp, pp, tp) coordinates, for the manifest: each place of the mesh once.
    plan = plan._replace(mesh=dataclasses.replace(plan.mesh, coords={r: tuple(v[3][1]) for r, v in enumerate(views)}))
    if len(set(plan.mesh.coords.values())) != g.size:
        listed = ", ".join(f"rank {r}: {list(c)}" for r, c in plan.mesh.coords.items())
        raise CheckpointError(f"save: the ranks' (dp, pp, tp) coordinates in the state's {plan.mesh.describe()} "
                              f"split repeat ({listed}): the states were not made by one step.init over these ranks")
    steps = [v[0] for v in views]
    if len(set(steps)) != 1:
        listed = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        raise CheckpointError(f"save: ranks disagree on state.step ({listed}); every rank must save the same step")
    name, nbytes = step_name(plan.step), sum(v[2] for v in views)
    lock, token = _lock(directory, name, g)
    try:
        tmp = directory / f"{name}.tmp-{token}"
        try:
            infos = _write(tmp, plan, g, progress, part_bytes, nbytes)
            _check_shared(directory, tmp, infos, g)
            outcome = None
            if g.rank == 0:
                try:
                    commit(directory, tmp, name, _manifest(state, plan, g.size, infos), keep, token)
                except Exception as e:  # noqa: BLE001 (every rank raises it below)
                    outcome = f"save: could not commit {directory / name}: {type(e).__name__}: {e}"
            outcome = exchange("save", "commit", outcome, g, io_seconds(nbytes))[0]
            if outcome:
                raise CheckpointError(outcome)
        except BaseException:
            _discard(tmp)
            raise
    finally:
        if lock is not None:
            lock.release()
    return directory / name


def _lock(directory: Path, name: str, g: dist.Group) -> tuple[SaveLock | None, str]:
    """Rank 0 locks the directory and checks nothing foreign is in the way; returns ``(its lock, this save's
    token)`` on every rank, or raises rank 0's `CheckpointError` on every rank."""
    lock = token = error = None
    if g.rank == 0:
        token = secrets.token_hex(6)
        try:
            lock = prepare(directory, name)
        except Exception as e:  # noqa: BLE001 (reported to every rank below)
            error = str(e) if isinstance(e, CheckpointError) else f"save: {type(e).__name__}: {e}"
    try:
        token, error = exchange("save", "lock", [token, error], g)[0]
        if error:
            raise CheckpointError(error)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, token


def _plan(state: TrainState, client_state: Any, g: dist.Group) -> _Plan:
    # A state a transformed step consumed shares its buffers with the state that step returned: saving
    # it would write the new parameters under the old step number.
    check_alive(state, "zfunc.io.save")
    step = _step_of(state)
    layout = layout_of(state)
    mesh = Mesh.of_state(state, g.rank)
    if mesh.trivial() and layout is not None and (layout.world_size, layout.rank) != (g.size, g.rank):
        raise CheckpointError(f"the state is sharded for rank {layout.rank} of {layout.world_size}, but this "
                              f"process is rank {g.rank} of {g.size}")
    if not mesh.replicated() and mesh.size != g.size:
        raise CheckpointError(f"the state is split {mesh.describe()} ({mesh.size} ranks: shard over dp, pipeline "
                              f"over pp, tensor_parallel over tp), but {g.size} ranks save it. {MESH_ADVICE}")
    for alias, key in state.ties:
        if key not in state.params or alias in state.params:
            raise CheckpointError(f"state.ties has {alias!r} -> {key!r}: a tie names a parameter ({key!r} must be "
                                  "one) by another name (which must not be one)")
    client_json, client_tensors = encode_client_state(client_state)
    json.dumps(client_json)
    rng, rng_tensors = capture_rng()
    return _Plan(step, layout, TPInfo.of_state(state), mesh, _tensors(state, layout, mesh, g.rank) + rng_tensors
                 + client_tensors, rng, client_json, state, pipeline_of(state))


def _write(tmp: Path, plan: _Plan, g: dist.Group, progress: bool, part_bytes: int, nbytes: int) -> list[dict]:
    """Every rank writes its files into ``tmp``; returns every rank's entry of the manifest's ``files``."""
    info = error = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        info = _write_rank(tmp, plan.tensors, g.rank, progress, part_bytes)
        info.update(rng=plan.rng, client_state=plan.client_state)
        dp, _, tp = plan.mesh.coords[g.rank]
        if plan.stages is not None and dp == tp == 0:
            # One rank of each pipeline rank tells rank 0, which writes the manifest, what its stages hold.
            groups, _ = walk(plan.state)
            info["stage"] = {"groups": {p: {k: dtype_name(t.dtype) for k, t in grp.items()}
                                        for p, grp in groups.items()}, "ties": [list(t) for t in plan.state.ties],
                             "units": plan.layout.to_json()["units"] if plan.layout is not None else None}
    except Exception as e:  # noqa: BLE001 (reported to every rank below, so none waits forever)
        error = f"save: rank {g.rank} could not write its files in {tmp}: {type(e).__name__}: {e}"
    results = exchange("save", "write", [info, error], g, io_seconds(nbytes))
    raise_if_failed("save", [r[1] for r in results], g.rank)
    return [r[0] for r in results]


def _check_shared(directory: Path, tmp: Path, infos: list[dict], g: dist.Group) -> None:
    """Every rank sees the files the others wrote (rank 0 all of them, the others rank 0's), before anything
    is committed or deleted: ranks on separate disks would each "save" and `keep` would delete every
    restorable checkpoint."""
    if g.size == 1:
        return
    ranks = range(g.size) if g.rank == 0 else [0]
    expected = {f"rank {r}'s {p['file']}": (tmp / p["file"], p["bytes"]) for r in ranks if r != g.rank
                for p in infos[r]["parts"]}
    unseen = _unseen(expected)
    report = f"rank {g.rank} does not see {', '.join(unseen[:3])}{' ...' if len(unseen) > 3 else ''}" \
        if unseen else None
    failed = [e for e in exchange("save", "shared", report, g, SHOW_PATIENCE) if e]
    if failed:
        raise CheckpointError(
            f"save: the ranks do not share {directory}: {'; '.join(failed[:4])} in {tmp.name}. Every rank writes "
            "its own files into the same directory, so it must be on a filesystem all ranks share (NFS, Lustre, "
            "GPFS...), not a disk local to each node. Nothing was committed and no checkpoint was deleted.")


def _unseen(expected: dict[str, tuple[Path, int]], patience: float = SHOW_PATIENCE) -> list[str]:
    """Which of ``expected`` (label: (path, size)) are not there with their size, allowing a shared
    filesystem ``patience`` seconds to show files another node wrote."""
    deadline = time.monotonic() + patience
    while True:
        unseen = [label for label, (path, size) in expected.items() if not _has_size(path, size)]
        if not unseen or time.monotonic() > deadline:
            return unseen
        time.sleep(0.05)


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _discard(tmp: Path) -> None:
    """Remove a failed save's temporary directory (its name has this save's token: it is ours)."""
    try:
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # the next save removes it as debris


def _step_of(state: TrainState) -> int:
    step = state.step
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_floating_point():
            raise CheckpointError(f"save: state.step must be an integer scalar, got {step!r}")
        step = int(step.item())
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"save: state.step must be a non-negative integer, got {step!r}")
    return step


def _tensors(state: TrainState, layout, mesh: Mesh, rank: int) -> list[tuple[str, torch.Tensor]]:
    """What of ``state`` this rank writes: replicated leaves (rank 0) and, of each param-shaped group, the
    flat range `Spans.span` gives it: its dp slice (`shard`) of its tp shard (`tensor_parallel`; replicated
    parameters from tp rank 0 only) of its stages' parameters (`pipeline`). A plain state is the same on
    every rank: rank 0 writes it, whole."""
    groups, leaves = walk(state)
    spans = Spans(layout, global_shapes(state, layout), TPInfo.of_state(state), None, mesh)
    tensors: list[tuple[str, torch.Tensor]] = list(leaves.items()) if rank == 0 else []
    for path, group in groups.items():
        for key, t in group.items():
            a, b = spans.span(key, rank)
            if b <= a:
                continue
            la, _ = spans.local(key, rank, t, f"save {path}")  # (checks t is its tp shard or this rank's slice)
            whole = layout is None and b - a == t.numel()  # (unsharded: in its shape; stage 1/2 params are whole
            flat = t.detach().reshape(-1)                   # on every rank, of which this rank saves its slice)
            tensors.append((f"{path}/{escape(key)}", t.detach() if whole else flat[a - la:b - la]))
    return tensors


def _write_rank(tmp: Path, tensors: list[tuple[str, torch.Tensor]], rank: int, progress: bool,
                part_bytes: int) -> dict:
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
    return {"rank": rank, "parts": written}


def _manifest(state: TrainState, plan: _Plan, world_size: int, infos: list[dict]) -> dict:
    groups, leaves = walk(state)
    layout, layout_json = plan.layout, None
    if layout is not None:
        layout_json = layout.to_json()
        del layout_json["rank"]
    stage_infos = [info.pop("stage", None) for info in infos]  # (not part of a rank's entry of files)
    stage_infos = [info for info in stage_infos if info is not None]
    pipeline = None
    groups_json = {path: {k: dtype_name(t.dtype) for k, t in g.items()} for path, g in groups.items()}
    ties = [list(tie) for tie in state.ties]
    if plan.stages is not None:
        # Every stage's groups, ties and shard units, in the model's order; which pipeline rank holds each
        # parameter. The layout is one over the dp ranks whose units are every pipeline rank's: each parameter
        # is in one unit, of its own stage, and its dp ranges are the same as in that stage's own layout.
        shapes = all_shapes(state, layout)
        groups_json = {path: {k: d for info in stage_infos for k, d in info["groups"][path].items()}
                       for path in groups_json}
        groups_json = {path: {k: g[k] for k in shapes} for path, g in groups_json.items()}
        ties = sorted({tuple(t) for info in stage_infos for t in info["ties"]})
        ties = [list(t) for t in ties]
        pipeline = {"pp": plan.stages.pp, "holders": holders_of(state),
                    "stage_blocks": [list(b) for b in plan.stages.stage_blocks]}
        if layout_json is not None:
            layout_json["units"] = [u for info in stage_infos for u in info["units"]]
    # Version 2 unless the state is split by tensor_parallel or pipeline: what a zfunc without them reads.
    manifest = {
        "format": FORMAT, "format_version": WRITTEN_VERSION, "zfunc_version": VERSION,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": plan.step, "world_size": world_size, "stage": layout.stage if layout is not None else 0,
        "layout": layout_json,
        "params": {k: list(s) for k, s in all_shapes(state, layout).items()},
        "weights": weights_path(groups),
        "groups": groups_json,
        "leaves": {path: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for path, t in leaves.items()},
        "ties": ties,
        "files": infos,
    }
    if not plan.mesh.trivial():  # format 4: the mesh, and the sections of the dimensions beyond dp
        manifest.update(format_version=MESH_VERSION, mesh=plan.mesh.to_json())
        if plan.tp is not None:
            manifest["tensor_parallel"] = plan.tp.to_json()
        if pipeline is not None:
            manifest["pipeline"] = pipeline
    return manifest
