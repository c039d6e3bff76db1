"""Why a whole-step compile cannot compile a model's identical blocks once, pinned to the torch that has it.

Issue 25 asks that the whole-step compile (``torch.compile(step, fullgraph=True)``) compile identical
blocks once inside its graph. torch's tool for that is ``torch.compiler.nested_compile_region`` (a
region traced once and called through the ``invoke_subgraph`` operator; torch 2.11 and 2.13 have it),
and dynamo's automatic form of it (``torch._dynamo.config.use_graph_deduplication``). Neither traces
under zfunc's compiled step, which differentiates with ``torch.func.vjp``: dynamo traces ``vjp`` by
running functorch's transforms on its fake tensors, so inside the loss every tensor is a functorch
wrapper (a GradTrackingTensor) around a FakeTensor, and

- ``nested_compile_region``: ``invoke_subgraph`` collects its inputs' fake values and refuses a
  wrapper (``AssertionError: Expected FakeTensor, got <class 'torch.Tensor'>``, in
  ``torch._higher_order_ops.utils._collect_fake_inputs``), on 2.11 and 2.13, whether the region is
  called directly or from inside an ``autograd.Function``'s forward;
- ``use_graph_deduplication``: ``InternalTorchDynamoError: Cannot access storage of TensorWrapper``;
- differentiating with ``torch.autograd.grad`` instead (2.13 traces it under
  ``torch._dynamo.config.trace_autograd_ops``; 2.11 does not): the region's output in dynamo's fake
  run carries no gradient ("The differentiated Tensor ... appears to not have been used in the graph").

The tests below pin these facts on the installed torch, with a two-matrix block and no zfunc code
in the way: if a torch release lifts one, its test fails and says so, and the region can then be
adopted (see ``zfunc.transforms.compile_blocks``).
"""

from __future__ import annotations

import torch

DEPTH, WIDTH = 3, 8


def _block(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x + torch.tanh(x @ w1) @ w2


def _weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(WIDTH, WIDTH, generator=g) * 0.1, torch.randn(WIDTH, WIDTH, generator=g) * 0.1)
            for _ in range(DEPTH)]


def _vjp_step(block):
    """zfunc's compiled route: the loss over the blocks differentiated with torch.func.vjp."""

    def step(weights, x):
        def loss(weights):
            h = x
            for w1, w2 in weights:
                h = block(w1, w2, h)
            return h.square().mean()

        value, pullback = torch.func.vjp(loss, weights)
        return value, pullback(torch.ones_like(value))[0]

    return step


def _compile_vjp_step(block, **dynamo_config) -> str:
    """``"traced"``, or the message of the error dynamo raised (in a forked rank: see below)."""
    import torch._dynamo

    torch._dynamo.reset()
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(1))
    try:
        with torch._dynamo.config.patch(**dynamo_config):
            torch.compile(_vjp_step(block), fullgraph=True, backend="eager")(_weights(), x)
    except Exception as err:  # noqa: BLE001 (what dynamo raises differs between versions: its message is the fact)
        return f"{type(err).__name__}: {err}"
    return "traced"


# (Each case in a forked rank: a backward in the test process would start autograd's threads, after
# which torch 2.11's CUDA build refuses to fork the ranks of the tests that follow.)


def test_the_blocks_unrolled_trace_under_vjp(dist):
    """The control: the same step without a region traces (what zfunc's whole-step compile does)."""
    assert dist(_compile_vjp_step, 1, _block, timeout=300)[0] == "traced"


def test_nested_compile_region_does_not_trace_under_vjp(dist):
    found = dist(_compile_vjp_step, 1, torch.compiler.nested_compile_region(_block), timeout=300)[0]
    assert found != "traced", (
        "nested_compile_region now traces under torch.func.vjp in a compiled step: the whole-step compile "
        "can compile identical blocks once (issue 25, item 4); adopt it in compile_blocks")
    assert "Expected FakeTensor" in found, found


def test_graph_deduplication_does_not_trace_under_vjp(dist):
    found = dist(_compile_vjp_step, 1, _block, timeout=300, use_graph_deduplication=True)[0]
    assert found != "traced", (
        "dynamo's use_graph_deduplication now traces under torch.func.vjp: the whole-step compile can "
        "compile identical blocks once (issue 25, item 4)")
    assert "TensorWrapper" in found, found
