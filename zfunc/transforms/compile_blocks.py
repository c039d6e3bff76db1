"""`compile_blocks`: regional compilation, the model's blocks under torch.compile, the step eager.

``compile_blocks(step, modules=None, **compile_kwargs)`` runs each chosen
block's own forward (the computation inside the block, on the parameters the
other transforms hand it) through one ``torch.compile``-d function; everything
around it stays eager: the step's autograd, `shard`'s gathers, releases and
reductions, `checkpoint`'s recompute, `offload`'s host update.

Why: compiling the whole step (``torch.compile(step, fullgraph=True)``)
unrolls every block of the model into one graph, and compile time grows with
the depth (239 s for GPT-2 medium's step against 32.5 s for ``torch.compile``
of the model alone, on an H200). A transformer's blocks are identical: dynamo
treats a block passed as an argument like any input (its parameters are the
graph's inputs, guarded by shape, dtype and stride, not by which block it is),
so the first block's graph serves every other — the compile time of one
block's forward and backward, whatever the depth. With the FX graph and
AOTAutograd caches (on by default) a second process compiles from the cache.

And what the whole-step compile cannot do, this does: the step's memory is
the eager step's. Stage 3 releases each block's gathered parameters after
its forward and gathers again for its backward; ``checkpoint`` recomputes a
block (the compiled forward again, inside the eager recompute) and re-gathers
its parameters in backward, so a block's full parameters are alive only while
it runs.

Blocks (``modules``) as `checkpoint` takes them: None for the model's blocks
(`zfunc.blocks.find_blocks`), a class or tuple of classes, a predicate on
qualified names, or a list of names. ``compile_kwargs`` go to
``torch.compile`` (``backend``, ``mode``, ``dynamic``, ``options``);
``fullgraph`` defaults to True, so a block that dynamo cannot trace is an
error, not a silent fall back to eager. Under a whole-step
``torch.compile`` trace this transform steps aside (the trace takes the
blocks as they are).

Why a whole-step trace does not compile identical blocks once in its graph:
torch's tool for that, ``torch.compiler.nested_compile_region`` (a region
traced once and called through ``invoke_subgraph``), and dynamo's automatic
form (``use_graph_deduplication``) both refuse the functorch wrappers that
the compiled step's ``torch.func.vjp`` puts around every tensor of the loss
(torch 2.11 and 2.13; ``tests/test_compile_regions.py`` pins the errors, and
fails when a torch release lifts them).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from zfunc.compiled import tracing
from zfunc.interpret import Transform


def _block_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's own forward, with whatever parameters are in its slots now."""
    return type(block).forward(block, *args, **kwargs)


def _unchanged(name: str, body: Callable) -> Callable:
    """A wrapper that changes nothing: it makes a block that no other transform wraps go through
    zfunc's block routing (`zfunc.model_structure.BlockDispatch`), which runs ``ModelCall.block_forward``."""
    return body


class compile_blocks(Transform):  # noqa: N801 (a transform reads like a function)
    """Compile the chosen blocks' forward (regional compile); the rest of the step stays eager.

    Args:
      step: the step to transform.
      modules: which blocks (see the module doc); default the model's blocks.
      **compile_kwargs: passed to ``torch.compile`` (``fullgraph`` defaults to True).
    """

    name = "compile_blocks"
    level = 0

    def __init__(self, step: Callable, modules: Any = None, **compile_kwargs: Any) -> None:
        super().__init__(step)
        self.modules = modules
        self.compile_kwargs = {"fullgraph": True, **compile_kwargs}
        # One compiled function for every block and call: dynamo's cache of it holds one graph per
        # distinct block signature (one for a transformer's identical blocks).
        self.forward = torch.compile(_block_forward, **self.compile_kwargs)

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.compile_kwargs)
        if self.modules is not None:
            out["modules"] = self.modules
        return out

    def apply(self, next, call):
        if tracing():  # the whole step is being compiled: the blocks are part of its graph
            return next(call)
        names = call.structure.select(self.modules)
        for name in names:
            if any(name.startswith(other + ".") for other in names):
                continue  # inside another chosen block, which compiles it with itself
            if isinstance(call.model.get_submodule(name), (nn.ModuleList, nn.ModuleDict)):
                raise ValueError(f"compile_blocks: {name!r} is a container that is never called; select the "
                                 f"blocks in it instead (e.g. modules=['{name}.0', ...] or their class)")
            call.wrap_block(name, _unchanged, kind="materialize")
        call.block_forward = self.forward
        return next(call)
