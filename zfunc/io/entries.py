"""What of a `TrainState` is saved, under which names, and which elements each rank holds.

A state is walked into

- **groups**: the param-shaped dicts (keys == ``state.params``' keys), by
  path: ``params``, ``opt_state/0/mu``, ``extras/mixed_precision/master``...
  Under `shard` each rank holds a contiguous element range ``[a, b)`` of every
  flattened parameter (`UnitLayout.local_range`), and that is what it saves,
  1-D, under ``<group path>/<key>``;
- **leaves**: every other tensor (step, counts, learning rate, loss scale),
  replicated over ranks: rank 0 saves them;
- non-tensor leaves (Python numbers, ``None``, the `ShardLayout`) are static
  configuration of the step and are neither saved nor restored.

Under `tensor_parallel` a rank holds, of each split parameter, its tp shard
(the full tensor's slices along one dim, `ParamSplit`), and of that its dp
range; under `pipeline` only its stages' parameters. It saves that range
(`Spans.span`), and `Spans.runs` maps it to the runs of the full parameter's
flat elements it covers, so restore reshards by global offsets across any
(dp, pp, tp) layout (`Mesh`: each rank's coordinates). Parameters tp
replicates are saved by tp rank 0.

Path components are dict keys (with ``%`` and ``/`` escaped), NamedTuple field
names and tuple/list indices, joined by ``/``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from typing import Any, NamedTuple

import numpy as np
import torch

from zfunc.io.format import CheckpointError
from zfunc.state import TrainState
from zfunc.transforms.pipeline_layout import PipelineLayout
from zfunc.transforms.shard_layout import ShardLayout, is_param_shaped
from zfunc.transforms.tensor_parallel import TPLayout

SEP = "/"


def escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _children(node: Any) -> list[tuple[str, Any]] | None:
    if isinstance(node, TrainState):
        return [("step", node.step), ("params", node.params), ("opt_state", node.opt_state),
                ("extras", node.extras)]
    if isinstance(node, dict):
        return [(escape(str(k)), v) for k, v in node.items()]
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return list(zip(node._fields, node))
    if isinstance(node, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(node)]
    return None


def walk(state: TrainState) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """``(groups, leaves)`` of ``state``, each keyed by path, in a deterministic order."""
    keys = set(state.params)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    leaves: dict[str, torch.Tensor] = {}

    def visit(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            leaves[path] = node
        elif keys and is_param_shaped(node, keys):
            groups[path] = node
        else:
            for name, child in _children(node) or []:
                visit(child, f"{path}{SEP}{name}" if path else name)

    visit(state, "")
    return groups, leaves


def weights_path(groups: dict[str, Any]) -> str:
    """The group that ``step.gather`` returns: a transform's ``extras/<name>/master`` if there is one, else params."""
    masters = [p for p in groups if p.startswith("extras/") and p.endswith("/master") and p.count(SEP) == 2]
    return masters[0] if len(masters) == 1 else "params"


def layout_of(state: TrainState) -> ShardLayout | None:
    layout = state.extras.get("shard") if isinstance(state.extras, dict) else None
    return layout if isinstance(layout, ShardLayout) else None


def global_shapes(state: TrainState, layout: ShardLayout | None) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter, in params order (under `tensor_parallel`: the whole parameter's, not
    the tp shard's)."""
    if layout is None:
        shapes = {k: tuple(v.shape) for k, v in state.params.items()}
    else:
        units = {k: tuple(s) for u in layout.units for k, s in zip(u.keys, u.shapes)}
        shapes = {k: units[k] for k in state.params}
    tp = tp_layout_of(state)
    if tp is not None:
        shapes.update({k: tuple(split.shape) for k, split in tp.splits if split.dim is not None and k in shapes})
    return shapes


def tp_layout_of(state: TrainState) -> TPLayout | None:
    layout = state.extras.get("tensor_parallel") if isinstance(state.extras, dict) else None
    return layout if isinstance(layout, TPLayout) else None


@dataclasses.dataclass(frozen=True)
class TPInfo:
    """How a checkpoint's parameters are split over tensor-parallel ranks (the manifest's ``tensor_parallel``):
    the tp ``size`` and each split parameter's ``(dim, parts)`` (`ParamSplit`; the others are replicated)."""

    size: int
    splits: dict[str, tuple[int, int]]

    @classmethod
    def of_state(cls, state: TrainState) -> TPInfo | None:
        tp = tp_layout_of(state)
        if tp is None:
            return None
        return cls(tp.size, {k: (s.dim, s.parts) for k, s in tp.splits if s.dim is not None})

    def to_json(self) -> dict:
        return {"size": self.size, "splits": {k: list(v) for k, v in self.splits.items()}}

    @classmethod
    def from_json(cls, data: dict | None) -> TPInfo | None:
        if data is None:
            return None
        return cls(data["size"], {k: (v[0], v[1]) for k, v in data["splits"].items()})

    def local_shape(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if key not in self.splits:
            return tuple(shape)
        dim = self.splits[key][0]
        return tuple(n // self.size if d == dim else n for d, n in enumerate(shape))


MESH_ADVICE = ("A checkpoint records a state split over all the ranks that save or restore it: shard's dp, "
               "pipeline's pp and tensor_parallel's tp ranks together must be those ranks (a mesh's dp dimension "
               "needs shard(..., mesh=mesh) around the step, else its dp replicas are not one state), or pass "
               "group= the ranks the state is split over. To move weights between unrelated layouts, save "
               "full = step.gather(state) instead and start from step.init(zf.TrainState.create(full, tx)).")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """How a state is split over the ranks that save or restore it: the sizes of its ``dp`` (`shard`), ``pp``
    (`pipeline`) and ``tp`` (`tensor_parallel`) dimensions and each world rank's ``(dp, pp, tp)`` coordinates
    (``coords``; a template knows its own only). The manifest's ``mesh`` (format 4)."""

    dp: int
    pp: int
    tp: int
    coords: dict[int, tuple[int, int, int]]

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def describe(self) -> str:
        return f"dp{self.dp} x pp{self.pp} x tp{self.tp}"

    @classmethod
    def of_state(cls, state: TrainState, rank: int) -> Mesh:
        """The state's own dimensions (1 for a transform it was not built by), this rank at its coordinates."""
        layout, stages, tp = layout_of(state), pipeline_of(state), tp_layout_of(state)
        sizes = [(layout.world_size, layout.rank) if layout is not None else (1, 0),
                 (stages.pp, stages.rank) if stages is not None else (1, 0),
                 (tp.size, tp.rank) if tp is not None else (1, 0)]
        if all(n == 1 for n, _ in sizes):  # split by nothing: the same on every rank, as dp replicas are
            return cls(1, 1, 1, {rank: (rank, 0, 0)})
        return cls(*(n for n, _ in sizes), {rank: tuple(r for _, r in sizes)})

    def replicated(self) -> bool:
        """Whether the state is split by nothing (saved by rank 0 on any number of ranks)."""
        return self.size == 1

    def to_json(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "coords": [list(self.coords[r]) for r in
                                                                         sorted(self.coords)]}

    @classmethod
    def of_manifest(cls, m: dict) -> Mesh:
        """Every saved rank's coordinates: format 4's ``mesh``; before it, a tp section's ``(dp, tp)``
        coordinates, a pipeline section's ranks (pp alone: world rank = pipeline rank) or dp alone."""
        world = m["world_size"]
        if "mesh" in m:
            mesh = m["mesh"]
            return cls(mesh["dp"], mesh["pp"], mesh["tp"], {r: tuple(c) for r, c in enumerate(mesh["coords"])})
        if "tensor_parallel" in m:
            tp = m["tensor_parallel"]
            return cls(world // tp["size"], 1, tp["size"], {r: (c[0], 0, c[1]) for r, c in enumerate(tp["coords"])})
        if "pipeline" in m:
            return cls(1, world, 1, {r: (0, r, 0) for r in range(world)})
        return cls(world, 1, 1, {r: (r, 0, 0) for r in range(world)})

    def trivial(self) -> bool:
        """Whether this is data parallelism alone (what formats 1 and 2 describe)."""
        return self.pp == self.tp == 1


def pipeline_of(state: TrainState) -> PipelineLayout | None:
    layout = state.extras.get("pipeline") if isinstance(state.extras, dict) else None
    return layout if isinstance(layout, PipelineLayout) else None


def all_shapes(state: TrainState, layout: ShardLayout | None) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter of the model, in its order: under `pipeline`, of every stage's (under
    `tensor_parallel` too: the whole parameter's, not the tp shard's)."""
    stages = pipeline_of(state)
    if stages is None:
        return global_shapes(state, layout)
    shapes = dict(stages.shapes)  # (under tensor_parallel, which splits before pipeline does: tp-local shapes)
    tp = tp_layout_of(state)
    if tp is not None:
        shapes.update({k: tuple(split.shape) for k, split in tp.splits if split.dim is not None and k in shapes})
    return shapes


def holders_of(state: TrainState) -> dict[str, int] | None:
    """Under `pipeline`: the pipeline rank holding each parameter (its stage's); None otherwise."""
    stages = pipeline_of(state)
    return None if stages is None else {k: stages.rank_of(s) for k, s in stages.owner}


class Spans:
    """Which elements of each parameter a rank holds, for a shard ``layout`` (None: none), a tp split (None:
    none), pipeline ``holders`` (None: none; else each parameter on the pipeline rank of its stage) and the
    ranks' ``mesh`` coordinates (None: dp alone, world rank = dp rank).

    ``span`` is the flat range ``[a, b)`` of the rank's tp shard (the whole parameter without tp) that the
    rank saves: nothing unless its pipeline rank holds the parameter, nothing on tp ranks but 0 for a
    parameter tp replicates, else its dp range in the layout (the layout of a pipeline checkpoint holds
    every stage's units: a parameter is in its own stage's). ``runs`` maps such a range to the full
    parameter's flat elements.
    """

    def __init__(self, layout: ShardLayout | None, shapes: dict[str, tuple[int, ...]],
                 tp: TPInfo | None = None, holders: dict[str, int] | None = None, mesh: Mesh | None = None) -> None:
        self.layout, self.tp, self.holders, self.shapes, self.mesh = layout, tp, holders, shapes, mesh
        local = {k: tp.local_shape(k, s) for k, s in shapes.items()} if tp is not None else shapes
        self.numel = {k: math.prod(s) for k, s in local.items()}
        self._where = {k: (u, i) for u in layout.units for i, k in enumerate(u.keys)} if layout else {}

    @classmethod
    def of_manifest(cls, m: dict) -> Spans:
        """Where every saved rank's elements are, from a (validated) manifest of any format."""
        layout = ShardLayout.from_json({**m["layout"], "rank": 0}) if m["layout"] is not None else None
        return cls(layout, {k: tuple(s) for k, s in m["params"].items()}, TPInfo.from_json(m.get("tensor_parallel")),
                   (m.get("pipeline") or {}).get("holders"), Mesh.of_manifest(m))

    @classmethod
    def of_state(cls, state: TrainState, rank: int, shapes: dict[str, tuple[int, ...]]) -> Spans:
        """Where a state's own elements are (this ``rank``'s), for parameters of full ``shapes``."""
        return cls(layout_of(state), shapes, TPInfo.of_state(state), None, Mesh.of_state(state, rank))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp rank, pp rank, tp rank)`` of world rank ``rank``."""
        return self.mesh.coords[rank] if self.mesh is not None else (rank, 0, 0)

    def span(self, key: str, rank: int) -> tuple[int, int]:
        dp, pp, tp_rank = self.coords(rank)
        if self.holders is not None and self.holders[key] != pp:
            return (0, 0)  # another stage's parameter
        if self.tp is not None and key not in self.tp.splits and tp_rank != 0:
            return (0, 0)  # replicated over tp: its tp rank 0 saves it
        return self._held(key, dp)

    def _held(self, key: str, dp: int) -> tuple[int, int]:
        if self.layout is None:
            return (0, self.numel[key]) if dp == 0 else (0, 0)
        unit, index = self._where[key]
        return unit.local_range(index, dp)

    def local(self, key: str, rank: int, tensor: torch.Tensor, what: str) -> tuple[int, int]:
        """The range ``tensor`` (held by ``rank``) covers: all of its tp shard or this rank's slice."""
        n = self.numel[key]
        if tensor.numel() == n:
            return 0, n
        a, b = self._held(key, self.coords(rank)[0]) if self.layout is not None else (0, n)
        if tensor.numel() != b - a:
            raise CheckpointError(
                f"{what}: {key!r} has {tensor.numel()} elements, but the parameter has {n} and this rank's "
                f"shard of it {b - a}; the state does not match its own shard layout")
        return a, b

    def runs(self, key: str, rank: int, a: int, b: int) -> list[tuple[int, int, int]]:
        """``[(first element in the full parameter, count, offset from a)]`` of the flat range ``[a, b)`` of
        ``rank``'s tp shard of ``key``: one run without tp, else one per contiguous block of the split."""
        if b <= a:
            return []
        if self.tp is None or key not in self.tp.splits:
            return [(a, b - a, 0)]
        dim, parts = self.tp.splits[key]
        shape, size, tp_rank = self.shapes[key], self.tp.size, self.coords(rank)[2]
        inner = math.prod(shape[dim + 1:])
        full_d = shape[dim]
        block = full_d // (parts * size)  # rows of dim that stay contiguous: one part's slice on one rank
        local_d = full_d // size
        seg = block * inner
        out, i = [], a
        while i < b:
            end = min(b, (i // seg + 1) * seg)
            outer, rem = divmod(i, local_d * inner)
            j, within = divmod(rem, inner)
            part, jj = divmod(j, block)
            row = part * (full_d // parts) + tp_rank * block + jj
            out.append((outer * full_d * inner + row * inner + within, end - i, i - a))
            i = end
        return out


def overlaps(targets: list[tuple[int, int, int]], sources: list[tuple[int, int, int, Any]]):
    """For target runs ``(start, count, offset)`` and source runs ``(start, count, offset, tag)`` (each
    element of the full parameter in at most one source run), yield ``(tag, source offset, target offset,
    count)`` of every overlap."""
    sources = sorted(sources, key=lambda r: r[0])
    starts = [r[0] for r in sources]
    for t_start, t_count, t_off in targets:
        k = max(0, bisect.bisect_right(starts, t_start) - 1)
        while k < len(sources) and sources[k][0] < t_start + t_count:
            s_start, s_count, s_off, tag = sources[k]
            lo, hi = max(t_start, s_start), min(t_start + t_count, s_start + s_count)
            if hi > lo:
                yield tag, s_off + lo - s_start, t_off + lo - t_start, hi - lo
            k += 1


# --------------------------------------------------------------------------
# client_state: JSON with tensors stored beside it


def encode_client_state(client_state: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """``(json_value, [(name, tensor)])``: tensors become ``{"__tensor__": name}``."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def enc(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            name = f"client/{len(tensors)}"
            tensors.append((name, x.detach()))
            return {"__tensor__": name}
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x
        if isinstance(x, dict):
            for k in x:
                if not isinstance(k, str):
                    raise TypeError(f"client_state{where}: dict keys must be str (JSON), got {k!r}")
            if "__tensor__" in x:
                raise TypeError(f"client_state{where}: the key '__tensor__' is reserved")
            return {k: enc(v, f"{where}[{k!r}]") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]
        raise TypeError(f"client_state{where}: {type(x).__name__} is not JSON-able; use dicts, lists, str, "
                        "numbers, bools, None and tensors")

    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict (JSON-able, tensors allowed), got {type(client_state).__name__}")
    return enc(client_state, ""), tensors


def decode_client_state(value: Any, read) -> Any:
    """Inverse of `encode_client_state`; ``read(name)`` returns a stored tensor."""
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return read(value["__tensor__"])
        return {k: decode_client_state(v, read) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_client_state(v, read) for v in value]
    return value


# --------------------------------------------------------------------------
# RNG state, per rank


def capture_rng() -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """``(json, tensors)`` of this process's RNGs: torch CPU (and CUDA if in use), Python, NumPy."""
    tensors = [("rng/torch_cpu", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors += [(f"rng/cuda/{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    cuda_devices = len(tensors) - 1
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors += [("rng/python", torch.tensor(internal, dtype=torch.int64)),
                ("rng/numpy", torch.from_numpy(keys.astype(np.int64)))]
    info = {"cuda_devices": cuda_devices, "python": [version, gauss],
            "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    return info, tensors


class SavedRng(NamedTuple):
    """A rank's generator states, read and checked, ready to be set (`apply_rng`)."""

    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor]
    python: tuple
    numpy: tuple


def read_rng(info: dict[str, Any], read) -> SavedRng:
    """The generator states `capture_rng` saved, checked (dtype, size, range): `CheckpointError` if damaged."""
    cpu = _rng_tensor(read, "rng/torch_cpu", torch.uint8, tuple(torch.get_rng_state().shape))
    python = _rng_tensor(read, "rng/python", torch.int64, (625,))
    numpy = _rng_tensor(read, "rng/numpy", torch.int64, (624,))
    if not (0 <= int(python[:624].min()) and int(python[:624].max()) < 1 << 32 and 0 <= int(python[624]) <= 624):
        raise CheckpointError("rng/python: not a state of Python's generator (words out of range)")
    if not (0 <= int(numpy.min()) and int(numpy.max()) < 1 << 32):
        raise CheckpointError("rng/numpy: not a state of NumPy's generator (words out of range)")
    cuda = [read(f"rng/cuda/{i}") for i in range(info["cuda_devices"])]
    version, gauss = info["python"]
    kind, pos, has_gauss, cached = info["numpy"]
    return SavedRng(cpu, cuda, (version, tuple(python.tolist()), gauss),
                    (kind, numpy.numpy().astype(np.uint32), pos, has_gauss, cached))


def apply_rng(saved: SavedRng) -> list[str]:
    """Set this process's RNGs; returns warnings (what could not be set)."""
    notes = []
    torch.set_rng_state(saved.torch_cpu)
    if saved.cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(saved.cuda):
            torch.cuda.set_rng_state_all(saved.cuda)
        else:
            notes.append(f"the checkpoint holds CUDA RNG states of {len(saved.cuda)} devices, this process sees "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: CUDA RNG not restored")
    random.setstate(saved.python)
    np.random.set_state(saved.numpy)
    return notes


def _rng_tensor(read, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = read(name)
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise CheckpointError(f"{name}: {t.dtype} of shape {list(t.shape)}, not the {dtype} of shape {list(shape)} "
                              "a generator state is")
    return t
