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

Path components are dict keys (with ``%`` and ``/`` escaped), NamedTuple field
names and tuple/list indices, joined by ``/``.
"""

from __future__ import annotations

import math
import random
from typing import Any, NamedTuple

import numpy as np
import torch

from zfunc.io.format import CheckpointError
from zfunc.state import TrainState
from zfunc.transforms.pipeline_layout import PipelineLayout
from zfunc.transforms.shard_layout import ShardLayout, is_param_shaped

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
    """Full shape of every parameter, in params order."""
    if layout is None:
        return {k: tuple(v.shape) for k, v in state.params.items()}
    shapes = {k: tuple(s) for u in layout.units for k, s in zip(u.keys, u.shapes)}
    return {k: shapes[k] for k in state.params}


def pipeline_of(state: TrainState) -> PipelineLayout | None:
    layout = state.extras.get("pipeline") if isinstance(state.extras, dict) else None
    return layout if isinstance(layout, PipelineLayout) else None


def all_shapes(state: TrainState, layout: ShardLayout | None) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter of the model, in its order: under `pipeline`, of every stage's."""
    stages = pipeline_of(state)
    return dict(stages.shapes) if stages is not None else global_shapes(state, layout)


def holders_of(state: TrainState) -> dict[str, int] | None:
    """Under `pipeline` (alone): the rank holding each parameter (its stage's); None otherwise."""
    stages = pipeline_of(state)
    return None if stages is None else {k: stages.rank_of(s) for k, s in stages.owner}


class Spans:
    """Which flat element range ``[a, b)`` of each parameter a rank holds, for a layout (None: plain; with
    ``holders``, a pipeline's: each parameter whole on the rank of its stage)."""

    def __init__(self, layout: ShardLayout | None, shapes: dict[str, tuple[int, ...]],
                 holders: dict[str, int] | None = None) -> None:
        self.layout, self.holders = layout, holders
        self.numel = {k: math.prod(s) for k, s in shapes.items()}
        self._where = {k: (u, i) for u in layout.units for i, k in enumerate(u.keys)} if layout else {}

    def span(self, key: str, rank: int) -> tuple[int, int]:
        if self.holders is not None:
            return (0, self.numel[key]) if self.holders[key] == rank else (0, 0)
        if self.layout is None:
            return (0, self.numel[key]) if rank == 0 else (0, 0)
        unit, index = self._where[key]
        return unit.local_range(index, rank)

    def local(self, key: str, rank: int, tensor: torch.Tensor, what: str) -> tuple[int, int]:
        """The range ``tensor`` (held by ``rank``) covers: all of the parameter or this rank's slice."""
        n = self.numel[key]
        if tensor.numel() == n:
            return 0, n
        a, b = self.span(key, rank) if self.layout is not None else (0, n)
        if tensor.numel() != b - a:
            raise CheckpointError(
                f"{what}: {key!r} has {tensor.numel()} elements, but the parameter has {n} and this rank's "
                f"shard of it {b - a}; the state does not match its own shard layout")
        return a, b


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


def refuse_tensor_parallel(state: TrainState, what: str) -> None:
    """Refuse (on every rank alike, before any exchange) a state split by `tensor_parallel`: the manifest does
    not record tp placements yet, so its tp-local shards would be saved as if they were whole parameters."""
    if "tensor_parallel" in getattr(state, "extras", {}):
        raise ValueError(
            f"zfunc.io.{what}: this state is split by tensor_parallel, whose placements checkpoints do not record "
            "yet; its tp-local shards would be saved as whole parameters. Save full parameters instead: "
            "full = step.gather(state) (every rank), then on rank 0 safetensors.torch.save_file(full, path), and "
            "start from them with step.init(zf.TrainState.create(full, tx)).")


def refuse_pipeline(state: TrainState, what: str, world_size: int, rank: int) -> None:
    """Refuse (on every rank alike, before any exchange) a pipeline state checkpoints cannot record yet: one
    with `shard` or `tensor_parallel` besides (each stage's own layout over dp or tp), or whose pipeline ranks
    are not the ranks of the world in order."""
    stages = pipeline_of(state)
    if stages is None:
        return
    if "shard" in state.extras or "tensor_parallel" in state.extras or \
            (stages.pp, stages.rank) != (world_size, rank):
        raise ValueError(
            f"zfunc.io.{what}: this state is split into pipeline stages and also over other ranks (shard or "
            "tensor_parallel besides pipeline, or pipeline ranks that are not the world's), which checkpoints "
            "do not record yet. Save full parameters instead: full = step.gather(state) (every rank), then on "
            "rank 0 safetensors.torch.save_file(full, path), and start from them with "
            "step.init(zf.TrainState.create(full, tx)).")
