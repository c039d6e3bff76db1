"""`tensor_parallel`: Megatron-style tensor parallelism on torch's DTensor engine, over a mesh's "tp" dim.

The model's large matrices are split over the tp ranks of one group
(``mesh["tp"]``), which all see the same batch:

- column-parallel linears (attention's query/key/value, the MLP's first
  projections, the LM head): rank r holds output features r; its output is
  this rank's heads / hidden slice, no communication;
- row-parallel linears (attention's output projection, the MLP's last one):
  rank r holds input features r, computes a partial output, and the partial
  outputs are summed over tp (one all-reduce of the activations);
- the vocabulary-parallel embedding: rank r holds rows (token ids) r, looks up
  those it holds, and the partial embeddings are summed (one all-reduce);
- the LM head's logits stay split over the vocabulary and the cross entropy
  runs on the split logits (torch's ``loss_parallel``: max, sum of exponentials
  and the target logit reduced over tp, never the whole logits);
- norms, position embeddings and biases of row-parallel layers are replicated;
  with sequence parallelism (the Llama plan's ``sequence_parallel=True``) the
  norms run on this rank's slice of the sequence instead, the row-parallel
  outputs are reduce-scattered onto it and the attention/MLP inputs
  all-gathered from it.

Which module is split how is a plan (`zfunc.transforms.tp_plans.tp_plan`: the
defaults for Hugging Face GPT-2, Llama and BERT, or a dict of name pattern ->
torch ParallelStyle); the styles are torch's (`ColwiseParallel`,
`RowwiseParallel`, `SequenceParallel`, through ``distribute_module``), so the
collectives are DTensor's.

The state holds this rank's shards as plain tensors (``state.params[k]`` of
shape 1/tp of the full one along its split dim; replicated ones whole), and so
do the gradients, the optimizer state and `mixed_precision`'s master: every
transform inside or outside sees ordinary tensors of the local shapes, and
`shard` partitions them further over "dp". The model runs on them as DTensors
(`tp_plans._LocalToDTensor`); gradients come back local and exact: the
gradient of a shard is that slice of the full gradient, and a replicated
parameter's gradient is whole and equal on every tp rank.

Collectives per step, over the tp group, for L layers with R row-parallel and
C column-parallel modules each (GPT-2: R=2, C=2; Llama: R=2, C=5 (q, k, v,
gate, up); BERT: R=2, C=4), batch b x sequence s, hidden h, vocabulary V:

==============================  ==============================  ============================
where                           collective                      count x elements per rank
==============================  ==============================  ============================
vocab-parallel embedding (fwd)  all-reduce of the embeddings    1 x b·s·h
row-parallel outputs (fwd)      all-reduce (partial sums)       L·R x b·s·h
column-parallel inputs (bwd)    all-reduce (partial input       L·C x b·s·h
                                gradients)
LM head input (bwd)             all-reduce                      1 x b·s·h
loss_parallel (fwd)             all-reduce of max, Σexp,        3 x b·s
                                target logit
  or, without loss_parallel     all-gather of the logits        1 x b·s·V
``psum`` (zfunc)                all-reduce: the NaN-loss count  1 each
                                and, with clipping, ‖g‖²
==============================  ==============================  ============================

So ``2 + L·(R + C)`` activation all-reduces (+3 small ones for loss_parallel),
as Megatron's 4 per layer when C = 2. Under `shard` the dp collectives come on
top, on 1/tp of the parameters. ``tests/test_tensor_parallel.py`` counts them
with torch's ``CommDebugMode``.

Clipping by the global norm: ``‖g‖² = Σ over tp of (Σ over this rank's shards
+ Σ over replicated parameters on tp rank 0 only)``: the `sum_of_squares`
primitive leaves replicated parameters out on the other tp ranks, and ``psum``
all-reduces over tp (and over dp under `shard`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from zfunc import dist
from zfunc.facts import Facts
from zfunc.interpret import Transform
from zfunc.mesh import describe_mesh, mesh_dim
from zfunc.transforms.shard_layout import map_param_shaped
from zfunc.transforms.tp_plans import ParamSplit, TPPlan, prepare
from zfunc.tree import tree_map, tree_map_tensors


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How a state's param-shaped tensors are split over tp (``state.extras["tensor_parallel"]``):
    ``size`` and ``rank`` of the tp group, and each parameter's `ParamSplit` by key."""

    size: int
    rank: int
    splits: tuple[tuple[str, ParamSplit], ...]

    def split(self, key: str) -> ParamSplit | None:
        return dict(self.splits).get(key)

    def replicated(self, keys) -> set[str]:
        split = dict(self.splits)
        return {k for k in keys if k not in split or split[k].dim is None}


class tensor_parallel(Transform):  # noqa: N801
    """Tensor parallelism over the ``"tp"`` dimension of ``mesh`` (see the module docstring).

    Args:
      step: the step to transform; compute transforms (`checkpoint`, `mixed_precision`, `accumulate`) go
        inside, `offload`, `pipeline` and `shard` outside:
        ``shard(offload(pipeline(tensor_parallel(checkpoint(mixed_precision(step))))), stage=..., mesh=mesh)``.
      plan: a `TPPlan` from ``tp_plan(apply_fn, ...)`` (`zfunc.transforms.tp_plans`).
      mesh: the device mesh (`zfunc.mesh.make_mesh`); tensor_parallel uses ``mesh["tp"]``.

    The model is prepared here, before the first step (its planned modules' parameters become DTensors,
    torch's styles install their hooks, the functional model's spec becomes tp-local): tp must divide every
    split dimension and head count, or this raises ValueError naming it.
    """

    name = "tensor_parallel"
    level = 0.5  # outside the compute transforms, inside offload, pipeline and shard

    def __init__(self, step: Callable, plan: TPPlan, mesh: Any) -> None:
        if not isinstance(plan, TPPlan):
            raise TypeError("tensor_parallel: plan must be a TPPlan from zfunc.transforms.tp_plans.tp_plan(apply_fn)")
        self.tp_mesh = mesh_dim(mesh, "tp", "tensor_parallel")
        super().__init__(step)
        self.plan, self.mesh = plan, mesh
        self.group = self.tp_mesh.get_group()
        self.size, self.rank = self.tp_mesh.size(), self.tp_mesh.get_local_rank()
        self.splits: dict[str, ParamSplit] = prepare(plan, self.tp_mesh)

    def settings(self) -> dict[str, Any]:
        return {"plan": self.plan.name, "mesh": describe_mesh(self.mesh)}

    def declare(self, facts: Facts) -> Facts:
        return facts.replace(tp=self.size)

    def check(self, facts: Facts) -> None:
        dp = self.mesh["dp"].size() if "dp" in (self.mesh.mesh_dim_names or ()) else 1
        if dp > 1 and facts.stage == 0:
            # Each dp slice would train its own copy on its own batches, with nothing averaging their gradients.
            raise ValueError(f"tensor_parallel: the mesh has dp={dp}, but no shard(...) averages the gradients over "
                             "dp; wrap the step: shard(tensor_parallel(step, plan, mesh), stage=..., mesh=mesh)")

    def _group(self) -> dist.Group:
        return dist.Group.resolve(self.group)

    # -- layout --------------------------------------------------------------
    def init_state(self, state):
        if "tensor_parallel" in state.extras:
            raise ValueError("tensor_parallel.init: this state is already split; pass the plain state from "
                             "TrainState.create")
        if getattr(state, "materializer", None) is not None:
            raise ValueError("tensor_parallel: a model built on the meta device is not supported yet; build it "
                             "with values")
        keys = set(state.params)
        for key, split in self.splits.items():
            if key in state.params and tuple(state.params[key].shape) != split.shape:
                raise ValueError(f"tensor_parallel.init: params[{key!r}] has shape {tuple(state.params[key].shape)}, "
                                 f"the model's full parameter {split.shape}; pass the full parameters from "
                                 "zf.functional (taken before tensor_parallel was built)")
        group = self._group()
        state = _from_tp_rank_zero(state, group)
        splits = {k: s for k, s in self.splits.items() if k in keys}

        def cut(tree: dict) -> dict:
            return {k: splits[k].local(v, self.size, self.rank) if k in splits else v for k, v in tree.items()}

        layout = TPLayout(self.size, self.rank, tuple(sorted(splits.items())))
        return state.replace(params=cut(state.params), opt_state=map_param_shaped(state.opt_state, keys, cut),
                             extras={**map_param_shaped(dict(state.extras), keys, cut), "tensor_parallel": layout})

    def _layout(self, state) -> TPLayout:
        layout = state.extras.get("tensor_parallel")
        if not isinstance(layout, TPLayout):
            raise ValueError("this state is not in tensor_parallel's layout: call step.init(state) on the plain state")
        if (layout.size, layout.rank) != (self.size, self.rank):
            raise ValueError(f"this state was split for tp rank {layout.rank} of {layout.size}, but this process is "
                             f"tp rank {self.rank} of {self.size}; restore it with zfunc.io.restore(dir, "
                             "like=step.init(...)) to reshard it for this mesh")
        return layout

    def complete_gather(self, params: dict[str, torch.Tensor], state) -> dict[str, torch.Tensor]:
        layout = self._layout(state)
        group = self._group()
        out = dict(params)
        for key, split in layout.splits:
            if split.dim is None or key not in out:
                continue
            local = group.place(out[key].detach().contiguous())
            gathered = [torch.empty_like(local) for _ in range(self.size)]
            dist.wait(tdist.all_gather(gathered, local, group=self.group, async_op=True), group,
                      f"gathering {key!r} over tp")
            out[key] = split.full([g.to(out[key].device) for g in gathered])
        return out

    def rank_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: torch.empty(self.splits[k].local_shape(self.size), dtype=v.dtype, device="meta")
                if k in self.splits else v for k, v in params.items()}

    # -- the step ------------------------------------------------------------
    def start(self, ctx, state) -> None:
        layout = self._layout(state)
        return layout.replicated(layout_keys(state))

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        def local_loss(*a, **kw):  # DTensor results (the loss of loss_parallel) as plain local tensors
            return tree_map(_to_local, fn(*a, **kw))

        with loss_parallel() if self.plan.loss_parallel else contextlib.nullcontext():
            return next(local_loss, params, args, kwargs, has_aux)

    def psum(self, next, x):
        if self.size == 1:
            return next(x)
        # (Comm waits on the host within the timeout on gloo, and only orders the stream on NCCL.)
        return next(dist.Comm(self._group()).all_reduce_sum(x))

    def sum_of_squares(self, next, tree):
        replicated = self.call_scratch()
        if self.rank != 0 and isinstance(tree, dict) and replicated & tree.keys():
            device = next(iter(tree.values())).device
            tree = {k: v for k, v in tree.items() if k not in replicated}  # counted on tp rank 0 only
            if not tree:  # (on the leaves' device: this partial sum is all-reduced with the other ranks')
                return torch.zeros((), dtype=torch.float32, device=device)
        return next(tree)


def layout_keys(state) -> set[str]:
    return set(state.params)


def _to_local(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _from_tp_rank_zero(state, group: dist.Group):
    """Every tp rank starts from tp rank 0's values (ranks seeded alike build the same model anyway)."""
    if group.size == 1:
        return state
    source = tdist.get_global_rank(group.handle, 0)

    def broadcast(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t
        placed = group.place(t).clone()
        dist.wait(tdist.broadcast(placed, src=source, group=group.handle, async_op=True), group,
                  "sending tp rank 0's initial parameters")
        return placed.to(t.device)

    return tree_map_tensors(broadcast, state)
