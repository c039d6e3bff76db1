"""The device mesh every parallel transform shares: ``make_mesh(dp=, pp=, tp=)``.

A mesh arranges the world's ranks in a grid with three named dimensions,
outermost first (torchtitan's order):

- ``"dp"``: data parallelism (`shard`: ZeRO over the ranks of one dp slice),
- ``"pp"``: pipeline stages (`pipeline`),
- ``"tp"``: tensor parallelism (`tensor_parallel`), innermost, so the ranks of
  one tp group are neighbours (on a GPU box: the GPUs joined by NVLink).

Rank ``r`` sits at ``(dp, pp, tp) = (r // (pp * tp), (r // tp) % pp, r % tp)``.
Each transform takes the mesh and uses its own dimension (``mesh["dp"]``,
``mesh["pp"]``, ``mesh["tp"]``), whose process group holds the ranks that
differ only in that coordinate. The mesh is torch's own `DeviceMesh`
(``torch.distributed.device_mesh.init_device_mesh``), so the DTensor layouts
of `tensor_parallel` and the pipeline schedules of `pipeline` run on it
unchanged.
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "pp", "tp")


def make_mesh(dp: int = 1, pp: int = 1, tp: int = 1, device_type: str | None = None) -> DeviceMesh:
    """A `DeviceMesh` of shape ``(dp, pp, tp)`` over the whole world, dims named ``("dp", "pp", "tp")``.

    Args:
      dp, pp, tp: the size of each dimension (positive ints); their product must be the world size.
      device_type: "cuda" or "cpu" (default: "cuda" for an NCCL world, else "cpu").
    Returns:
      torch's `DeviceMesh`; ``mesh["dp"]`` (etc.) is the 1-D mesh of this rank's group along that dim.
    Raises:
      ValueError: a size that is not a positive int, or sizes whose product is not the world size
        (before any collective is issued, identically on every rank).
    """
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    for name, size in sizes.items():
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {size!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "make_mesh: torch.distributed is not initialized. Call torch.distributed.init_process_group('nccl' "
            "or 'gloo') first (under torchrun); a single process needs no mesh (leave mesh=None).")
    world = dist.get_world_size()
    if dp * pp * tp != world:
        hint = (f", e.g. make_mesh(dp={world // (pp * tp)}, pp={pp}, tp={tp})" if world % (pp * tp) == 0
                else f"; pp * tp = {pp * tp} does not divide {world}")
        raise ValueError(
            f"make_mesh(dp={dp}, pp={pp}, tp={tp}): the mesh has {dp * pp * tp} ranks but the world has {world} "
            f"(torch.distributed's world size). The sizes' product must be the world size{hint}.")
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=MESH_DIMS)


def mesh_dim(mesh: DeviceMesh, name: str, who: str) -> DeviceMesh:
    """``mesh[name]`` (the 1-D mesh of this rank's group along ``name``), refused clearly when ``mesh``
    is not a mesh with that dimension (``who`` names the transform asking)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{who}: mesh must be a torch DeviceMesh from zfunc.mesh.make_mesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names or ()
    if name not in names:
        raise ValueError(f"{who}: the mesh has dims {names}, not {name!r}; build it with zfunc.mesh.make_mesh")
    return mesh[name]


def dim_group(mesh: DeviceMesh, name: str, who: str):
    """The process group of dimension ``name`` of ``mesh`` that this rank belongs to."""
    return mesh_dim(mesh, name, who).get_group()


def describe_mesh(mesh: DeviceMesh) -> str:
    """``"dp2xpp1xtp2"``: a mesh's dims and sizes, the same on every rank (for reprs ranks compare)."""
    names = mesh.mesh_dim_names or tuple(f"d{i}" for i in range(mesh.ndim))
    return "x".join(f"{n}{s}" for n, s in zip(names, mesh.shape))
