"""ZeRO edge cases as small models: what `shard` must compute exactly like eager PyTorch.

Each `Scenario` is a model shape that broke some ZeRO implementation once: a layer
run twice in one forward, a block's parameter read outside the block, a block that
returns its own parameter, a branch or MoE expert that runs on only some ranks,
units that are containers nobody calls, frozen and tied parameters, unused ones,
several forward calls per step, non-tensor and structured block outputs, odd sizes
that leave a rank with an empty slice. They are re-expressed (in our own code) from
the shapes of the models in DeepSpeed's tests, mostly:

- ``tests/unit/simple_model.py``: ``SimpleModel`` (layers reused at two positions:
  ``linears[i // 2](x) + l(x)``), ``SimpleFrozenModel``, ``UnusedParametersModel``,
  ``SimpleMoEModel`` (two MoE layers interleaved with dense ones);
- ``tests/unit/v1/zero/test_zero.py``: ``TestZero3RepeatForwardLoop`` (one layer
  looped), ``TestZeroToFP32`` (uneven sizes, a frozen first layer),
  ``EltwiseMultiplication*`` (dict / namedtuple / tuple / list outputs),
  ``TestZero3ParamPartitioningLargeParam`` and ``...ManyParams`` (one long 1-D
  parameter; many tiny ones), ``TestZero3DictFwd`` (dict outputs with non-tensors),
  ``TestZeroFrozenWeights``, ``TestZeroUnbalancedGradients`` (``requires_grad``
  changed between steps);
- ``tests/unit/runtime/zero/test_zero_context_return.py``: ``DanglingBias``,
  ``DanglingBiasClass`` (a module returning its own bias, bare or in an object);
- ``tests/unit/runtime/zero/test_zero_context.py``: ``ExtLinear`` (a layer's weight
  used again by ``F.linear`` outside it), ``ConvNet``;
- ``tests/unit/runtime/zero/test_zero_leaf_module.py``: ``ChooseModuleByRankModel``
  (a layer chosen by rank), ``FineGrainedBlock`` (blocks holding a ``ModuleList`` of
  MLPs);
- ``tests/unit/runtime/zero/test_zero_tiled.py``: ``TiledLinear`` (a linear layer
  cut into a grid of tiles held in nested ``ModuleList``s);
- ``tests/unit/v1/zero/test_zero_activation_checkpoint_lifecycle.py``: a block that
  calls itself recursively, frozen layers inside checkpointed blocks, a checkpointed
  producer that returns its bias to the consumer;
- ``tests/unit/v1/zero/test_zero2_offload_multi_backward.py``: several backward
  passes per optimizer step;
- ``tests/unit/runtime/zero/test_zero_empty_param.py``: zero-element parameters beside
  sized ones, and blocks holding only zero-element parameters.

What "equal" means (DDP semantics, as `shard` documents): rank r trains on slice r
of the global batch, the gradient is the mean over ranks; the reference is eager
PyTorch on one process with ``torch.optim.AdamW`` (``foreach=False, fused=False``)
on the *mean of the per-slice losses* (for a mean loss that is the loss of the
concatenated batch; for a loss that is not linear in the batch, like an MoE
load-balancing term, it is what data parallelism computes). Under
``accumulate(micro_batches=k)`` each rank's slice is cut again into k pieces.
A parameter that gets no gradient gets a zero gradient (zfunc's
``value_and_grad`` convention) and is still decayed and moved by AdamW's moments.

A batch is a dict of tensors with the examples along dim 0; ``batch["who"]`` holds,
per example, the rank that trains on it, so that a model whose control flow depends
on the rank (``ChooseModuleByRankModel``) gives the same numbers in the reference.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple
from unittest import mock

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

import zfunc as zf
import zfunc.testing
from zfunc import dist as zdist
from zfunc.testing import DistributedError, run_distributed
from zfunc.transforms import accumulate, checkpoint, offload, shard

WIDTH = 6  # features of most models
CLASSES = 6
BATCH = 8  # global examples per step: a multiple of 2 and 4 ranks x 2 micro-batches
STEPS = 2  # optimizer steps per run; parameters are compared after each


# ----------------------------------------------------------------------------
# Batches


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * seed + step)


def owners(world: int, n: int = BATCH) -> torch.Tensor:
    """``who``: the rank that trains on each of ``n`` examples (contiguous slices)."""
    return torch.arange(n) // (n // world)


def classification(seed: int = 0, width: int = WIDTH, classes: int = CLASSES) -> Callable[[int, int], dict]:
    """Batches ``{"x": (B, width), "y": (B,), "who": (B,)}``."""
    def make(step: int, world: int) -> dict:
        g = _generator(seed, step)
        return {"x": torch.randn(BATCH, width, generator=g), "y": torch.randint(0, classes, (BATCH,), generator=g),
                "who": owners(world)}
    return make


def tokens(seed: int = 0, vocab: int = 11, seq: int = 5) -> Callable[[int, int], dict]:
    """Batches ``{"x": (B, seq) token ids, "y": next tokens, "who"}``."""
    def make(step: int, world: int) -> dict:
        g = _generator(seed, step)
        ids = torch.randint(0, vocab, (BATCH, seq + 1), generator=g)
        return {"x": ids[:, :-1], "y": ids[:, 1:], "who": owners(world)}
    return make


def ce(run: Callable, b: dict) -> torch.Tensor:
    """Cross-entropy of ``run(x)`` against ``y`` (logits may carry a sequence dim)."""
    logits = run(b["x"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["y"].reshape(-1))


def split(batch: dict, pieces: int) -> list[dict]:
    """``batch`` cut into ``pieces`` equal slices along dim 0 (non-tensors copied to each)."""
    cut = {k: v.chunk(pieces) if isinstance(v, torch.Tensor) else None for k, v in batch.items()}
    return [{k: (cut[k][i] if cut[k] is not None else v) for k, v in batch.items()} for i in range(pieces)]


# ----------------------------------------------------------------------------
# Building blocks


class Mlp(nn.Module):
    """``x + down(tanh(up(x)))``."""

    def __init__(self, width: int = WIDTH, hidden: int = 7) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    """``head(blocks[order[0]] ... blocks[order[-1]](x))``: blocks may repeat in ``order``."""

    def __init__(self, depth: int = 3, order: tuple[int, ...] | None = None, block=Mlp) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, CLASSES)
        self.order = tuple(range(depth)) if order is None else order

    def forward(self, x):
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(x)


def seeded(build: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(seed)
        return build()
    return make


# ----------------------------------------------------------------------------
# Models (one per DeepSpeed pattern; see the module docstring)


class ReusedLayers(nn.Module):
    """simple_model.SimpleModel(nlayers=4): ``x = linears[i // 2](x) + linears[i](x)``: each
    of the first layers runs at two positions in one forward."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))

    def forward(self, x):
        for i, layer in enumerate(self.linears):
            x = self.linears[i // 2](x) + layer(x)
        return x


class LoopedLayer(nn.Module):
    """TestZero3RepeatForwardLoop: one root layer run three times in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for _ in range(3):
            x = x + self.linear(x)
        return x


class SharedPosition(nn.Module):
    """One block object at two positions of a ModuleList (``[a, b, a]``): a tie by module."""

    def __init__(self) -> None:
        super().__init__()
        a, b = Mlp(), Mlp()
        self.blocks = nn.ModuleList([a, b, a])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class WeightOutside(nn.Module):
    """test_zero_context ExtLinear: after the blocks ran, block 0's weight is used again by
    ``F.linear`` outside any block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x):
        h = x
        for block in self.blocks:
            h = torch.tanh(block(h))
        return F.linear(h, self.blocks[0].weight)


class DanglingLinear(nn.Linear):
    """test_zero_context_return DanglingBias: returns ``(out, self.bias)``."""

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class DanglingPair:
    """test_zero_context_return DataClass: an opaque (non-pytree) object carrying tensors."""

    def __init__(self, out, bias) -> None:
        self.out, self.bias = out, bias


class DanglingLinearObject(nn.Linear):
    """DanglingBiasClass: returns its output and its own bias inside a `DanglingPair`."""

    def forward(self, x):
        return DanglingPair(F.linear(x, self.weight), self.bias)


class DanglingStack(nn.Module):
    """Blocks that return their own bias; the caller adds it (the bias is used outside)."""

    def __init__(self, wrap_in_object: bool = False) -> None:
        super().__init__()
        kind = DanglingLinearObject if wrap_in_object else DanglingLinear
        self.blocks = nn.ModuleList(kind(WIDTH, WIDTH) for _ in range(2))
        self.wrap_in_object = wrap_in_object

    def forward(self, x):
        for block in self.blocks:
            if self.wrap_in_object:
                pair = block(x)
                out, bias = pair.out, pair.bias
            else:
                out, bias = block(x)
            x = torch.tanh(out + bias)
        return x


class ReturnsParameter(nn.Module):
    """The model itself returns one of its parameters beside its output (DanglingExt)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, CLASSES)
        self.temperature = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        return self.linear(x), self.temperature


class ChooseByRank(nn.Module):
    """test_zero_leaf_module ChooseModuleByRankModel: rank r runs only ``linears[r % 2]``."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(WIDTH, CLASSES, bias=False) for _ in range(2))

    def forward(self, x, who: int):
        return torch.relu(self.linears[who % 2](x))


class SkipOnRankZero(nn.Module):
    """A block skipped on rank 0 only (data-dependent depth): a unit some ranks never run."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, who: int):
        for i, block in enumerate(self.blocks):
            if not (i == 1 and who == 0):
                x = block(x)
        return self.head(x)


class Expert(nn.Module):
    def __init__(self, width: int = WIDTH, hidden: int = 5) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden)
        self.w2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class TopOneMoE(nn.Module):
    """DeepSpeed's MoE(k=1) shape: a gate picks one expert per token; an expert that gets
    no token is not run (as every sparse MoE does), so its parameters get no gradient.

    The gate starts as a scaled projection on the first ``experts`` features, so the
    batches decide the routing (see `moe_batches`); it learns like any other weight.
    """

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, experts, bias=False)
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.weight[:, :experts] = 4 * torch.eye(experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]) * weight[rows, None])
        return x + out


class MoEModel(nn.Module):
    """simple_model.SimpleMoEModel: dense, MoE, dense, MoE, dense (residual, so that both MoE
    layers route on what the batch leans to)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(WIDTH, WIDTH)
        self.moe_1 = TopOneMoE()
        self.linear2 = nn.Linear(WIDTH, WIDTH)
        self.moe_2 = TopOneMoE()
        self.linear3 = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        h = self.moe_1(x + 0.3 * self.linear1(x))
        h = self.moe_2(h + 0.3 * self.linear2(h))
        return self.linear3(h)


def expert_load(scenario: Scenario, world: int, steps: int = STEPS) -> torch.Tensor:
    """Tokens routed to each expert: ``[step, rank, moe layer, expert]``, initial weights."""
    model = scenario.build()
    layers = [m for m in model.modules() if isinstance(m, TopOneMoE)]
    out = torch.zeros(steps, world, len(layers), len(layers[0].experts), dtype=torch.long)
    for i in range(steps):
        for rank, piece in enumerate(split(scenario.batch(i, world), world)):
            seen: list = []
            hooks = [m.gate.register_forward_hook(lambda mod, a, o, seen=seen: seen.append(o.argmax(-1)))
                     for m in layers]
            with torch.no_grad():
                model(piece["x"])
            for h in hooks:
                h.remove()
            for j, choice in enumerate(seen):
                out[i, rank, j] = torch.bincount(choice, minlength=out.shape[-1])
    return out


def moe_batches(starve: bool, seed: int = 3, experts: int = 4, size: int = 16) -> Callable[[int, int], dict]:
    """Batches of ``size`` examples; example i leans to expert ``plan[i]`` (+3 on that feature).

    Balanced: every rank's slice (and every micro-batch's, at the same positions on every
    rank) leans to the experts in turn. ``starve``: rank 0's examples never lean to the last
    expert, so with top-1 routing it gets no token there on rank 0 (see `expert_load`).
    """
    def make(step: int, world: int) -> dict:
        g = _generator(seed, step)
        x = 0.3 * torch.randn(size, WIDTH, generator=g)
        who = owners(world, size)
        i = torch.arange(size)
        plan = i % experts
        if starve:
            plan = torch.where(who == 0, i % (experts - 1), experts - 2 + i % 2)
        x[i, plan] += 3.0
        return {"x": x, "y": torch.randint(0, CLASSES, (size,), generator=g), "who": who}
    return make


class NestedLists(nn.Module):
    """A ModuleList of ModuleLists (the shape of TiledLinear's grid): only the innermost layers are called."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
                                    for _ in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        for pair in self.layers:
            for layer in pair:
                x = torch.tanh(layer(x))
        return self.head(x)


class TiledLinear(nn.Module):
    """test_zero_tiled TiledLinear: ``Linear(in, out)`` cut into ``out_splits x in_splits``
    tiles, ``linears[o][i]`` (only the last column of tiles has a bias); the containers
    ``linears[o]`` are never called themselves."""

    def __init__(self, in_features: int = 7, out_features: int = 8, in_splits: int = 2, out_splits: int = 3) -> None:
        super().__init__()
        self.in_parts = _parts(in_features, in_splits)
        self.out_parts = _parts(out_features, out_splits)
        self.linears = nn.ModuleList(
            nn.ModuleList(nn.Linear(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o],
                                    bias=(i == in_splits - 1)) for i in range(in_splits))
            for o in range(out_splits))

    def forward(self, x):
        pieces = [x[..., a:b] for a, b in zip(self.in_parts, self.in_parts[1:])]
        rows = [sum(tile(piece) for tile, piece in zip(row, pieces)) for row in self.linears]
        return torch.cat(rows, dim=-1)


def _parts(n: int, k: int) -> list[int]:
    return [round(i * n / k) for i in range(k + 1)]


class TiledModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tiled = TiledLinear(WIDTH, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.tiled(x)))


class Eltwise(nn.Module):
    """test_zero EltwiseMultiplicationModule: ``weight * x`` with a 1-D weight."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, size))

    def forward(self, x):
        return self.weight * x


Outputs = collections.namedtuple("Outputs", ["hidden", "scale"])


class StructuredBlock(nn.Module):
    """EltwiseMultiplicationTestNetwork_*: a block whose output is a dict, a namedtuple, a
    tuple or a list, with a non-tensor and a ``None`` beside the tensors (TestZero3DictFwd)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mlp = Mlp()
        self.gain = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        h = self.mlp(x)
        if self.kind == "dict":
            return {"hidden": h, "scale": self.gain, "step": 1, "none": None}
        if self.kind == "namedtuple":
            return Outputs(h, self.gain)
        if self.kind == "tuple":
            return (h, self.gain, None)
        return [h, self.gain]


class StructuredStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(StructuredBlock(k) for k in ("dict", "namedtuple", "tuple", "list"))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            out = block(x)
            if isinstance(out, dict):
                h, scale = out["hidden"], out["scale"]
            elif isinstance(out, Outputs):
                h, scale = out.hidden, out.scale
            else:
                h, scale = out[0], out[1]
            x = h * scale
        return {"logits": self.head(x), "depth": len(self.blocks)}


class ManySmall(nn.Module):
    """test_zero ...ManyParams: ten 1-D weights of 3 elements (4 ranks: some own only padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Eltwise(3) for _ in range(10))
        self.head = nn.Linear(3, CLASSES)

    def forward(self, x):
        x = x[..., :3]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LongParam(nn.Module):
    """test_zero ...LargeParam: one 1-D parameter of an odd size (8101), ``x * param``."""

    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.linspace(-1, 1, 8101))
        self.proj = nn.Linear(8101, CLASSES)

    def forward(self, x):
        return self.proj(x.repeat(1, 8101 // WIDTH + 1)[:, :8101] * self.param)


class TiedEmbedding(nn.Module):
    """An embedding tied to the output head, blocks between them (a GPT)."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.blocks = nn.ModuleList(Mlp() for _ in range(2))
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedAcrossBlocks(nn.Module):
    """Block 1's ``up`` weight is block 0's (ALBERT-style sharing of one tensor between blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(3))
        self.blocks[1].up.weight = self.blocks[0].up.weight
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class WithEmpty(nn.Module):
    """A block holding a zero-size parameter (DeepSpeed's empty-parameter fixes)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.mlp(x) * (1 + self.empty.sum())


class OnlyEmpty(nn.Module):
    """test_zero_empty_param OnlyEmptyBlock: a block whose parameters all have zero elements
    (a unit of numel 0), used in the output (``x @ p.t()`` is ``(B, 0)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.empty(0, WIDTH))
        self.second = nn.Parameter(torch.empty(0, WIDTH))

    def forward(self, x):
        return x + (x @ self.first.t()).sum() + (x @ self.second.t()).sum()


class DenseThenEmpty(nn.Module):
    """test_zero_empty_param MixedModel: a dense layer, then blocks holding only empty parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(WIDTH, CLASSES)
        self.only_empty = nn.ModuleList(OnlyEmpty() for _ in range(3))

    def forward(self, x):
        for block in self.only_empty:
            x = block(x)
        return self.dense(x)


class ConvBlock(nn.Module):
    """test_zero_context ConvNet: Conv1d layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, kernel_size=3, padding=1)

    def forward(self, x):
        return x + torch.tanh(self.conv(x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ConvBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        h = x.view(x.shape[0], 2, WIDTH // 2)
        for block in self.blocks:
            h = block(h)
        return self.head(h.reshape(x.shape[0], WIDTH))


class Recursive(nn.Module):
    """activation_checkpoint_lifecycle _RecursiveFrozenBlock (trainable here): a block that
    calls itself ``depth`` times."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, depth: int = 2):
        x = torch.tanh(self.linear(x))
        return self(x, depth - 1) if depth else x


class FrozenInside(nn.Module):
    """activation_checkpoint_lifecycle _NoGradInputModel: a frozen layer, then a trainable
    adapter, in each block."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.adapter = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.adapter(torch.tanh(self.frozen(x)))


class FrozenFirst(nn.Module):
    """TestZeroToFP32(freeze_params) / TestZeroFrozenWeights: the whole first layer frozen,
    uneven sizes (3-wide layers, a 4 -> 1 classifier)."""

    def __init__(self) -> None:
        super().__init__()
        self.ll = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
        self.ll[0].requires_grad_(False)
        self.classifier = nn.Linear(3, CLASSES)

    def forward(self, x):
        h = x[..., :3]
        for layer in self.ll:
            h = torch.relu(layer(h))
        return self.classifier(h)


class Unused(nn.Module):
    """simple_model.UnusedParametersModel: a layer never used, beside blocks and a block never run."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(3))
        self.unused_linear = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[2](x)  # blocks[1] never runs, on any rank
        return self.head(x)


class KwargsBlock(nn.Module):
    """A block called with keyword arguments (a mask, a float, None) that returns a tuple
    with a ``None`` and an int (Curriculum_SimpleModel's extra kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x, *, mask=None, scale: float = 1.0, extra=None):
        h = self.mlp(x) * scale
        if mask is not None:
            h = h * mask
        return h, None, 3


class KwargsStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(KwargsBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        mask = (x > -1.5).float()
        for i, block in enumerate(self.blocks):
            x, _, _ = block(x, mask=mask, scale=0.5 + i, extra=None)
        return self.head(x)


class FineGrained(nn.Module):
    """test_zero_leaf_module FineGrainedBlock: layers, each a ModuleList of gated MLPs."""

    class GatedMlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(WIDTH, WIDTH, bias=False)
            self.up_proj = nn.Linear(WIDTH, WIDTH, bias=False)
            self.down_proj = nn.Linear(WIDTH, WIDTH, bias=False)

        def forward(self, x):
            return x + self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp_layers = nn.ModuleList(FineGrained.GatedMlp() for _ in range(3))

        def forward(self, x):
            for mlp in self.mlp_layers:
                x = mlp(x)
            return x

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FineGrained.Layer() for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ExternalBiasCheckpointed(nn.Module):
    """activation_checkpoint_lifecycle _ExternalCheckpointModel: inside each block a
    producer returns its bias and the block's consumer adds it."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.producer = DanglingLinear(WIDTH, WIDTH)

        def forward(self, x):
            out, bias = self.producer(x)
            return torch.tanh(out + bias)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ExternalBiasCheckpointed.Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ----------------------------------------------------------------------------
# Losses that do more than one forward, or use more than the logits


def two_forwards(run: Callable, b: dict) -> torch.Tensor:
    """Two calls of the model in one loss (two views of the batch)."""
    return ce(run, b) + 0.5 * F.cross_entropy(run(b["x"].flip(-1)), b["y"])


def squared_twice(run: Callable, b: dict) -> torch.Tensor:
    """The brief's minimal case: ``f(x1).pow(2).mean() + f(x2).pow(2).mean()``, f a bare Linear."""
    return run(b["x"]).pow(2).mean() + run(b["x"] * 0.5 - 1).pow(2).mean()


def tempered_ce(run: Callable, b: dict) -> torch.Tensor:
    logits, temperature = run(b["x"])
    return F.cross_entropy(logits / temperature, b["y"])


def by_rank(run: Callable, b: dict) -> torch.Tensor:
    logits = run(b["x"], int(b["who"][0]))
    return F.cross_entropy(logits, b["y"])


def dict_ce(run: Callable, b: dict) -> torch.Tensor:
    out = run(b["x"])
    return F.cross_entropy(out["logits"], b["y"]) * (out["depth"] / 4)


def regress(run: Callable, b: dict) -> torch.Tensor:
    return (run(b["x"]) - b["x"].roll(1, dims=-1)).pow(2).mean()


def toggle_frozen(model: nn.Module) -> None:
    """After `zf.functional`: freeze a layer (DeepSpeed's TestZeroUnbalancedGradients toggles
    ``requires_grad`` between steps); zfunc decided what is trainable when it was built."""
    model.blocks[0].up.weight.requires_grad_(False)


# ----------------------------------------------------------------------------
# transformers MoE models
#
# transformers 5 differs from 4.x where it matters here: the experts of a sparse MoE layer
# are one module holding 3-D parameters (``mlp.experts.gate_up_proj`` [experts, 2 x ffn,
# hidden], ``mlp.experts.down_proj``), not a ModuleList of expert MLPs, so an expert that
# gets no token is a slice nobody indexes, not a module nobody calls; the experts' kernel is
# chosen by ``experts_implementation`` (like ``attn_implementation``); and the router logits
# behind the load-balancing loss are captured by forward hooks on the router modules
# (``output_router_logits=True``), not returned through each layer's outputs.

HF_VOCAB = 32


def hf_moe(kind: str) -> nn.Module:
    """A tiny Mixtral or Qwen2-MoE causal LM: hidden 16, 2 layers, 4 experts, top-2, the
    router's load-balancing loss in the loss (``output_router_logits``), eager attention and
    experts, no key/value cache."""
    common = {"vocab_size": HF_VOCAB, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts_per_tok": 2,
              "output_router_logits": True, "router_aux_loss_coef": 0.1, "max_position_embeddings": 16,
              "attn_implementation": "eager", "experts_implementation": "eager", "use_cache": False}
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM  # optional, slow to import: only when used

        return MixtralForCausalLM(MixtralConfig(num_local_experts=4, **common))
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(num_experts=4, moe_intermediate_size=12, decoder_sparse_step=1,
                                              shared_expert_intermediate_size=20, **common))


def hf_tokens(starve: bool, seq: int = 6, seed: int = 5) -> Callable[[int, int], dict]:
    """Token batches. ``starve``: every token of rank 0's slice is one id, so all its positions
    have the same hidden state and route to the same 2 experts: the other 2 get no token on
    rank 0 (see `hf_expert_load`)."""
    def make(step: int, world: int) -> dict:
        g = _generator(seed, step)
        ids = torch.randint(0, HF_VOCAB, (BATCH, seq), generator=g)
        who = owners(world)
        if starve:
            ids[who == 0] = 7
        return {"x": ids, "who": who}
    return make


def hf_loss(run: Callable, b: dict) -> torch.Tensor:
    """The model's own loss: next-token cross-entropy + coef x load-balancing loss."""
    return run(input_ids=b["x"], labels=b["x"], use_cache=False).loss


def hf_expert_load(scenario: Scenario, world: int, steps: int = STEPS) -> torch.Tensor:
    """Top-2 assignments per expert, ``[step, rank, layer, expert]``, with the initial weights."""
    model = scenario.build()
    rows = []
    for i in range(steps):
        per_rank = []
        for piece in split(scenario.batch(i, world), world):
            with torch.no_grad():
                logits = model(input_ids=piece["x"], use_cache=False).router_logits
            experts = logits[0].shape[-1]
            top = [torch.topk(layer, 2, dim=-1).indices.flatten() for layer in logits]
            per_rank.append(torch.stack([torch.bincount(t, minlength=experts) for t in top]))
        rows.append(torch.stack(per_rank))
    return torch.stack(rows)


# ----------------------------------------------------------------------------
# The scenarios


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A model, its batches and loss, and what `shard` must do with it.

    Attributes:
      name: the test id.
      build: a fresh model (seeded: every call gives the same weights).
      batch: ``(step, world) -> global batch`` (see the module docstring).
      loss: ``(run, batch) -> scalar``; ``run(*args, **kwargs)`` runs the model (the module
        itself in the reference, ``apply_fn(params, ...)`` under zfunc).
      units: ``shard(units=...)``; None: shard's default.
      expect: at the stages in ``refuse_at``, ``"compute"`` (the reference, element-wise),
        ``"refuse"`` (every rank raises an error whose message matches ``cause``, and none
        hangs) or ``"either"`` (one of the two); at the other stages, ``"compute"``.
      cause: the regex a refusal's message must match (it names what to change).
      refuse_at: the stages ``expect`` applies to (stage 1 has no per-unit collective during
        forward and backward, so what breaks stages 2 and 3 computes there).
      prepare: called on the model after `zf.functional` (and on the reference model before
        its optimizer is built), e.g. to change ``requires_grad``.
      checkpoint: whether the model has repeated blocks (then the ``checkpoint`` variant runs).
      plan: the `Config`s to run, if not the default of `configs`.
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], dict]
    loss: Callable[[Callable, dict], torch.Tensor] = ce
    units: tuple[str, ...] | None = None
    expect: Literal["compute", "refuse", "either"] = "compute"
    cause: str | None = None
    refuse_at: tuple[int, ...] = (2, 3)
    prepare: Callable[[nn.Module], None] | None = None
    checkpoint: bool = True
    plan: tuple | None = None

    def expectation(self, stage: int) -> str:
        return self.expect if stage in self.refuse_at else "compute"


class Config(NamedTuple):
    """One way of running a scenario: ``shard(<variant>(step), stage)``.

    Variants: ``plain``; ``offload``; ``accumulate`` (2 micro-batches); ``checkpoint``
    (the model's repeated blocks); ``recompute`` (``shard(reshard="recompute")``).
    """

    stage: int
    variant: str

    @property
    def micro_batches(self) -> int:
        return 2 if self.variant == "accumulate" else 1

    def __str__(self) -> str:
        return f"s{self.stage}-{self.variant}"

    @classmethod
    def parse(cls, text: str) -> Config:
        stage, variant = text.split("-")
        return cls(int(stage[1:]), variant)


HF_PLAN = (Config(2, "plain"), Config(3, "plain"), Config(3, "checkpoint"))
# Units that run on only some ranks: what matters is the collectives of stages 2 and 3
# (offload and checkpoint issue the same ones), and each hang costs a timeout.
DIVERGENT_PLAN = (Config(1, "plain"), Config(2, "plain"), Config(3, "plain"), Config(2, "accumulate"))


def configs(scenario: Scenario) -> list[Config]:
    """The configurations a scenario runs under: every stage, stage 3 with `offload`,
    `accumulate` (stage 2) and, for models with repeated blocks, `checkpoint` (stage 3)."""
    if scenario.plan is not None:
        return list(scenario.plan)
    out = [Config(1, "plain"), Config(2, "plain"), Config(3, "plain"), Config(3, "offload"), Config(2, "accumulate")]
    if scenario.checkpoint:
        out.append(Config(3, "checkpoint"))
    return out


def scenarios() -> dict[str, Scenario]:
    """Every scenario, by name."""
    cls = classification()
    moe_units = tuple(f"moe_{i}.experts.{e}" for i in (1, 2) for e in range(4))
    items = [
        # baselines
        Scenario("stack", seeded(Stack), cls),
        Scenario("looped_root_layer", seeded(LoopedLayer), cls, regress, checkpoint=False),
        # a unit run twice in one forward
        Scenario("reused_layers", seeded(ReusedLayers), cls, regress),
        Scenario("looped_blocks", seeded(lambda: Stack(2, order=(0, 1, 0, 1))), cls),
        Scenario("shared_position", seeded(SharedPosition), cls),
        Scenario("apply_twice_linear", seeded(lambda: nn.Linear(WIDTH, WIDTH)), cls, squared_twice, checkpoint=False),
        Scenario("two_forwards_blocks", seeded(Stack), cls, two_forwards),
        # a block's parameter used outside the block
        Scenario("weight_outside_block", seeded(WeightOutside), cls),
        Scenario("dangling_bias", seeded(DanglingStack), cls, regress),
        Scenario("dangling_bias_object", seeded(lambda: DanglingStack(wrap_in_object=True)), cls, regress),
        Scenario("returns_parameter", seeded(ReturnsParameter), cls, tempered_ce, checkpoint=False),
        Scenario("external_bias_in_block", seeded(ExternalBiasCheckpointed), cls),
        # units that run on only some ranks
        Scenario("choose_by_rank", seeded(ChooseByRank), cls, by_rank, expect="either", cause=r"linears\.[01]",
                 plan=DIVERGENT_PLAN),
        Scenario("choose_by_rank_units", seeded(ChooseByRank), cls, by_rank, units=("linears.0", "linears.1"),
                 expect="refuse", cause=r"linears\.[01]", plan=DIVERGENT_PLAN),
        Scenario("skip_block_on_rank0", seeded(SkipOnRankZero), cls, by_rank, expect="either", cause=r"blocks\.1",
                 plan=DIVERGENT_PLAN),
        Scenario("moe_balanced", seeded(MoEModel), moe_batches(starve=False), checkpoint=False),
        Scenario("moe_starved", seeded(MoEModel), moe_batches(starve=True), plan=DIVERGENT_PLAN),
        Scenario("moe_starved_expert_units", seeded(MoEModel), moe_batches(starve=True), units=moe_units,
                 expect="refuse", cause=r"moe_\d\.experts\.\d", plan=DIVERGENT_PLAN),
        # containers that are units but never called themselves
        Scenario("nested_module_lists", seeded(NestedLists), cls),
        Scenario("tiled_linear", seeded(TiledModel), cls),
        Scenario("tiled_linear_units", seeded(TiledModel), cls, checkpoint=False,
                 units=("tiled.linears.0", "tiled.linears.1", "tiled.linears.2"), expect="either",
                 cause=r"tiled\.linears\.\d"),
        Scenario("fine_grained_layers", seeded(FineGrained), cls),
        # frozen, tied, unused, empty parameters
        Scenario("frozen_first_layer", seeded(FrozenFirst), cls),
        Scenario("frozen_inside_blocks", seeded(lambda: Stack(block=FrozenInside)), cls),
        Scenario("requires_grad_toggled", seeded(Stack), cls, prepare=toggle_frozen, expect="refuse",
                 cause=r"requires_grad", refuse_at=(1, 2, 3)),
        Scenario("tied_embedding", seeded(TiedEmbedding), tokens()),
        Scenario("tied_across_blocks", seeded(TiedAcrossBlocks), cls),
        Scenario("tied_across_blocks_units", seeded(TiedAcrossBlocks), cls, checkpoint=False,
                 units=("blocks.0", "blocks.1", "blocks.2"), expect="either", cause=r"tied"),
        Scenario("unused_parameters", seeded(Unused), cls),
        Scenario("empty_parameter", seeded(lambda: Stack(block=WithEmpty)), cls),
        Scenario("only_empty_blocks", seeded(DenseThenEmpty), cls),
        # sizes, structures, call conventions
        Scenario("many_small_params", seeded(ManySmall), cls,
                 plan=(*configs(Scenario("", Stack, cls)), Config(3, "recompute"))),
        Scenario("one_long_param", seeded(LongParam), cls, checkpoint=False),
        Scenario("structured_block_outputs", seeded(StructuredStack), cls, dict_ce),
        Scenario("keyword_block_args", seeded(KwargsStack), cls),
        Scenario("conv_blocks", seeded(ConvNet), cls),
        Scenario("recursive_block", seeded(lambda: Stack(block=lambda: Recursive())), cls),
        # transformers MoE models (transformers 5 fuses the experts into 3-D parameters)
        Scenario("hf_mixtral", seeded(lambda: hf_moe("mixtral")), hf_tokens(starve=False), hf_loss, plan=HF_PLAN),
        Scenario("hf_mixtral_starved", seeded(lambda: hf_moe("mixtral")), hf_tokens(starve=True), hf_loss,
                 plan=HF_PLAN),
        Scenario("hf_qwen2_moe_starved", seeded(lambda: hf_moe("qwen2_moe")), hf_tokens(starve=True), hf_loss,
                 plan=HF_PLAN),
    ]
    return {s.name: s for s in items}


# Adam hyperparameters of both sides (eps well above the float rounding of a gradient
# that should be exactly zero, which Adam would otherwise normalize into a full step).
HYPER = {"lr": 1e-2, "b1": 0.9, "b2": 0.99, "eps": 1e-6, "weight_decay": 0.1}
RTOL, ATOL = 1e-5, 1e-6


def reference(scenario: Scenario, world: int, micro_batches: int = 1, steps: int = STEPS) -> list[dict]:
    """Eager PyTorch + ``torch.optim.AdamW``: the trainable parameters after each step."""
    model = scenario.build()
    if scenario.prepare is not None:
        scenario.prepare(model)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(named.values()), lr=HYPER["lr"], betas=(HYPER["b1"], HYPER["b2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], foreach=False, fused=False)
    history = []
    for i in range(steps):
        pieces = split(scenario.batch(i, world), world * micro_batches)
        opt.zero_grad(set_to_none=True)
        loss = sum(scenario.loss(model, piece) for piece in pieces) / len(pieces)
        loss.backward()
        for p in named.values():  # zfunc's convention: an unused parameter's gradient is zero
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        history.append({n: p.detach().clone() for n, p in named.items()})
    return history


# ----------------------------------------------------------------------------
# Running a scenario under zfunc, on every rank


def zfunc_step(scenario: Scenario, config: Config, model: nn.Module, group: Any = None):
    """``(step, state)``: the scenario's train step under ``config`` (sharded over ``group``),
    and its plain state."""
    apply_fn, params = zf.functional(model)
    if scenario.prepare is not None:
        scenario.prepare(model)

    def loss_fn(p, batch):
        return scenario.loss(lambda *a, **kw: apply_fn(p, *a, **kw), batch)

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    wrap = {"plain": lambda s: s, "recompute": lambda s: s, "offload": offload, "checkpoint": checkpoint,
            "accumulate": lambda s: accumulate(s, micro_batches=2)}[config.variant]
    reshard = "recompute" if config.variant == "recompute" else "release"
    step = shard(wrap(train_step), stage=config.stage, group=group, units=scenario.units, reshard=reshard)
    tx = zf.optim.adamw(HYPER["lr"], HYPER["b1"], HYPER["b2"], HYPER["eps"], HYPER["weight_decay"])
    return step, zf.TrainState.create(params, tx)


def first_mismatch(got: dict, want: dict) -> dict | None:
    """The worst element-wise violation of ``|got - want| <= ATOL + RTOL |want|`` (a NaN or
    inf where the reference is finite violates it), if any."""
    if set(got) != set(want):
        return {"key": "(keys)", "detail": f"got {sorted(got)}, want {sorted(want)}"}
    worst = None
    for key, ref in want.items():
        value = got[key].detach().to(ref.dtype).reshape(ref.shape)
        err = (value - ref).abs()
        bad = ~(err <= ATOL + RTOL * ref.abs())
        if bad.any():
            excess = (err - ATOL - RTOL * ref.abs()).nan_to_num(float("inf"))[bad].max().item()
            if worst is None or excess > worst["excess"]:
                worst = {"key": key, "excess": excess, "bad_elements": int(bad.sum()),
                         "max_abs_err": err.nan_to_num(float("inf")).max().item(),
                         "ref_max": ref.abs().max().item(), "got_max": value.abs().max().item()}
    return worst


def train_and_compare(scenario: Scenario, config: Config, world: int, rank: int, refs: list[dict] | None,
                      group: Any = None) -> dict:
    """One configuration on this rank: `STEPS` steps, the gathered params compared with
    ``refs`` after each (``refs`` None: just run)."""
    step, state = zfunc_step(scenario, config, scenario.build(), group)
    state = step.init(state)
    for i in range(STEPS):
        local = split(scenario.batch(i, world), world)[rank]
        state, _ = step(state, local)
        gathered = step.gather(state)
        bad = None if refs is None else first_mismatch(gathered, refs[i])
        if bad is not None:
            return {"status": "ok", "mismatch": {"step": i, **bad}}
    return {"status": "ok", "mismatch": None}


class Pair(NamedTuple):
    """One scenario under one config, and the gloo timeout its collectives get."""

    name: str
    config: Config
    timeout_s: float


class _Group(NamedTuple):
    handle: Any  # a torch.distributed process group
    timeout_s: float


def run_on_rank(pairs: list[Pair], log_path: str) -> list[dict]:
    """Every rank: each `Pair` in turn; returns every rank's record of each (the same list
    on every rank).

    A pair shards over a gloo group whose collectives give up after its ``timeout_s`` (as
    do zfunc's own waits, through ``$ZFUNC_TIMEOUT_S``), so ranks that issue mismatched
    collectives fail with a timeout instead of hanging, and the default group stays clean.
    The group is reused only after a pair that passed everywhere: one that went wrong may
    have left a collective without its partner. An exception is recorded (type and
    message). The ranks then exchange their records on the default group; rank 0 appends
    them to ``log_path`` (one JSON line per pair) so that the parent keeps what was done if
    a later pair kills the call (a segfault, gloo's abort on a size mismatch). If the ranks
    disagree (one raised, another did not) they stop: the parent runs the rest anew.
    """
    rank, world = tdist.get_rank(), tdist.get_world_size()
    default = zdist.Group.resolve(None, timeout=2 * max(p.timeout_s for p in pairs) + 10)
    table = scenarios()
    refs: dict = {}
    out = []
    group = None
    for pair in pairs:
        scenario, config = table[pair.name], pair.config
        os.environ["ZFUNC_TIMEOUT_S"] = str(pair.timeout_s)
        start = time.perf_counter()
        if group is None or group.timeout_s != pair.timeout_s:
            if group is not None:
                tdist.destroy_process_group(group.handle)
            handle = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=pair.timeout_s))
            group = _Group(handle, pair.timeout_s)
        try:
            key = (pair.name, config.micro_batches)
            if key not in refs:
                refs[key] = reference(scenario, world, config.micro_batches)
            record = train_and_compare(scenario, config, world, rank, refs[key], group.handle)
        except Exception as err:  # noqa: BLE001 (recorded and judged by the parent)
            record = {"status": "raised", "type": type(err).__name__, "error": str(err)[:2000]}
        record["seconds"] = round(time.perf_counter() - start, 3)
        records = zdist.all_gather_json(record, default, f"comparing outcomes of {pair.name} {config}")
        out.append(records)
        if rank == 0:
            with open(log_path, "a") as log:
                log.write(json.dumps(records) + "\n")
        if len({r["status"] for r in records}) > 1:
            break
        if not all(r["status"] == "ok" and r["mismatch"] is None for r in records):
            tdist.destroy_process_group(group.handle)
            group = None
    return out


# ----------------------------------------------------------------------------
# Judging outcomes (in the parent)


class Outcome(NamedTuple):
    """What one (scenario, world, config) did. ``kind``:

    - ``"pass"``: every rank computed the reference after every step;
    - ``"wrong"``: it ran, but a parameter differs (``detail`` says where, by how much);
    - ``"error"``: every rank raised (``messages``: each rank's);
    - ``"crash"``: some ranks raised, or a rank died (a segfault, gloo's abort on a
      size mismatch);
    - ``"hang"``: ranks waited for each other until a collective timed out.
    """

    kind: str
    detail: str = ""
    messages: tuple[str, ...] = ()
    seconds: float = 0.0  # the slowest rank's wall time


def judge(per_rank: list[dict]) -> Outcome:
    """The `Outcome` of one configuration from every rank's record."""
    return _judge(per_rank)._replace(seconds=max(r.get("seconds", 0.0) for r in per_rank))


def _judge(per_rank: list[dict]) -> Outcome:
    raised = [r for r in per_rank if r["status"] == "raised"]
    messages = tuple(f"{r['type']}: {r['error']}" for r in raised)
    timed_out = [m for m in messages if "never joined" in m or "Timed out" in m]
    if timed_out:
        return Outcome("hang", "a collective timed out (ranks waited for each other):\n" + timed_out[0], messages)
    if raised and (len(raised) < len(per_rank) or any("Connection closed" in m for m in messages)):
        return Outcome("crash", f"{len(raised)} of {len(per_rank)} ranks raised:\n" + messages[0], messages)
    if raised:
        return Outcome("error", messages[0], messages)
    bad = [(rank, r["mismatch"]) for rank, r in enumerate(per_rank) if r["mismatch"] is not None]
    if bad:
        rank, m = bad[0]
        return Outcome("wrong", f"rank {rank}, after step {m['step'] + 1}: {m}")
    return Outcome("pass")


# gloo timeouts: for configurations expected to work (generous: 4 ranks share 2 cores),
# and for those expected to hang today (each hang costs this much).
TIMEOUT_S = 6.0
HANG_TIMEOUT_S = 1.5


def collect(pairs: list[Pair], world: int) -> dict[tuple[str, Config], Outcome]:
    """``{(scenario name, config): Outcome}`` of every pair on ``world`` ranks.

    As few harness calls as possible: a call runs the pairs in order until one kills it (a
    rank died, or a collective without a timeout hung); that pair is recorded as a crash
    or a hang, and the next call resumes after it.
    """
    results: dict[tuple[str, Config], Outcome] = {}
    todo = list(pairs)
    while todo:
        fd, log_path = tempfile.mkstemp(prefix="zero-scenarios-", suffix=".jsonl")
        os.close(fd)
        limit = 30 + sum(3 * p.timeout_s + 2 * world for p in todo)
        try:
            # A rank that dies takes the others down within milliseconds (gloo: "connection
            # closed"); the harness's 1 s grace for their reports would cost a second per crash.
            with mock.patch.object(zfunc.testing, "FAILURE_GRACE_S", 0.3):
                records = run_distributed(run_on_rank, world, todo, log_path, timeout=limit)[0]
            failed = None
        except (TimeoutError, DistributedError) as err:
            with open(log_path) as log:
                records = [json.loads(line) for line in log if line.strip()]
            failed = err
        finally:
            os.unlink(log_path)
        for pair, per_rank in zip(todo, records):
            results[(pair.name, pair.config)] = judge(per_rank)
        done = len(records)
        if failed is not None:
            text = str(failed)
            hung = isinstance(failed, TimeoutError) or "Timed out" in text or "never joined" in text
            results[(todo[done].name, todo[done].config)] = Outcome("hang" if hung else "crash", _tail(text))
            done += 1
        todo = todo[done:]
    return results


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def warm_up(transformers: bool = False) -> None:
    """Pay one-time costs in the calling process before it forks the ranks (workers inherit
    it warm): torch's optimizer set-up (~2.5 s), numba's compilation of offload's kernel
    (~1.4 s) and (``transformers``) transformers' lazy imports would otherwise be paid in
    every rank, and skew the ranks against each other's collective timeouts."""
    table = scenarios()
    reference(table["stack"], 1, steps=1)
    train_and_compare(table["stack"], Config(3, "offload"), 1, 0, None)
    if transformers:
        for name in ("hf_mixtral", "hf_qwen2_moe_starved"):
            reference(table[name], 1, steps=1)
            train_and_compare(table[name], Config(3, "plain"), 1, 0, None)


def has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


class EveryRankRaised(RuntimeError):
    """A scenario that must compute raised on every rank (see `check`)."""


def check(scenario: Scenario, config: Config, outcome: Outcome) -> None:
    """Raise unless ``outcome`` is what ``scenario`` must do under ``config``.

    The exception type says what went wrong, so that an ``xfail(raises=...)`` mark names
    today's failure exactly: AssertionError (wrong numbers, a refusal that does not name
    its cause, or a silent computation where a refusal is due), `EveryRankRaised` (an
    error where the reference must be computed), DistributedError (a crash: some ranks
    raised, or one died), TimeoutError (a hang).
    """
    expect = scenario.expectation(config.stage)
    where = f"{scenario.name} {config}"
    if outcome.kind == "hang":
        raise TimeoutError(f"{where}: {outcome.detail}")
    if outcome.kind == "crash":
        raise DistributedError(f"{where}: {outcome.detail}")
    if outcome.kind == "error":
        if expect == "compute":
            raise EveryRankRaised(f"{where}: {outcome.detail}")
        unclear = [m for m in outcome.messages if not re.search(scenario.cause, m)]
        assert not unclear, f"{where}: refused, but the error does not name the cause ({scenario.cause!r}): {unclear[0]}"
        return
    assert expect != "refuse", (f"{where} must be refused (an error naming {scenario.cause!r} on every rank), but it "
                                f"computed{' correctly' if outcome.kind == 'pass' else ' wrong numbers: ' + outcome.detail}")
    assert outcome.kind == "pass", f"{where}: {outcome.detail}"


def table(world: int = 2, names: list[str] | None = None) -> str:
    """The outcome matrix (scenario x config) as text: ``python -m tests.zero_scenarios [WORLD...]``.

    ``computed`` marks a silent computation where a refusal is due.
    """
    every_scenario = scenarios()
    chosen = names or [n for n in every_scenario if has_transformers() or not n.startswith("hf_")]
    plans = {n: configs(every_scenario[n]) for n in chosen}
    columns = sorted({c for p in plans.values() for c in p}, key=lambda c: (c.variant != "plain", c.variant, c.stage))
    got = collect([Pair(n, c, TIMEOUT_S) for n in chosen for c in plans[n]], world)
    rows = [["scenario", *map(str, columns)]]
    for n in chosen:
        cells = []
        for c in columns:
            kind = got[(n, c)].kind if (n, c) in got else "-"
            if kind in ("pass", "wrong") and every_scenario[n].expectation(c.stage) == "refuse":
                kind = "computed"
            cells.append(kind)
        rows.append([n, *cells])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    warm_up(transformers=has_transformers())
    for w in [int(a) for a in sys.argv[1:]] or [2]:
        print(f"world {w}\n{table(w)}\n", flush=True)
