"""The eager recompute (`zfunc.recompute_eager`): a block's saved tensors dropped in forward and recomputed
in backward, with the gradients of the plain (not recomputed) computation, element for element."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import zfunc.recompute_eager as eager
from zfunc.recompute import recompute
from zfunc.recompute_eager import run_recomputed


class Block(nn.Module):
    """Dropout, a matmul, a nonlinearity, a normalisation: tensors saved for backward of several kinds."""

    def __init__(self, width: int = 6, p: float = 0.3) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.norm, self.drop = nn.LayerNorm(width), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


def _grads(blocks, x, recomputed: bool, seed: int = 3, side: list | None = None):
    """Gradients of a loss through ``blocks`` (recomputed or plain) w.r.t. the parameters and ``x``."""
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    h = x
    for block in blocks:
        h = run_recomputed(lambda b=block, h=h: b(h), {x.device}) if recomputed else block(h)
    loss = h.square().sum() + (sum(t.sin().sum() for t in side) if side else 0)
    params = [p for b in blocks for p in b.parameters()]
    return torch.autograd.grad(loss, [*params, x])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_equals_the_plain_backward_with_dropout_replayed(device):
    """On CUDA the CUDA generator's state is captured and replayed too (the CPU's alone would leave GPU dropout
    masks different in the recompute)."""
    torch.manual_seed(0)
    blocks = [Block().to(device) for _ in range(3)]
    x = torch.randn(4, 5, 6, device=device)
    plain = _grads(blocks, x, recomputed=False)
    again = _grads(blocks, x, recomputed=True)
    for a, b in zip(again, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The masks matter: another seed gives other gradients (so the replay is what makes them equal).
    other = _grads(blocks, x, recomputed=False, seed=4)
    assert any(not torch.equal(a, b) for a, b in zip(other, plain))


def test_a_side_output_gets_its_exact_gradient():
    """A forward hook carries a tensor made inside the block out of it; the loss uses it."""
    torch.manual_seed(0)
    blocks = [Block(p=0.0) for _ in range(2)]
    side: list = []
    for b in blocks:
        b.up.register_forward_hook(lambda m, i, out: side.append(out))
    x = torch.randn(3, 6)
    plain = _grads(blocks, x, recomputed=False, side=side)
    side.clear()
    again = _grads(blocks, x, recomputed=True, side=side)
    for a, b in zip(again, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_record_is_dropped_as_backward_unpacks_it():
    """Each recomputed tensor leaves the record when unpacked; after backward none is alive."""
    frames, alive_during = [], []
    real_init = eager._Frame.__init__

    def init(self, *args):
        real_init(self, *args)
        frames.append(self)

    torch.manual_seed(0)
    block = Block(p=0.0)
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager._Frame, "__init__", init)

        def body():
            h = torch.tanh(block.up(block.norm(x)))
            # Backward reaches this hook between the block's last ops and its first: by then part of the
            # record has been unpacked.
            h.register_hook(lambda g: alive_during.append(sum(t is not None for t in frames[0].recomputed)))
            return block.down(h)

        out = run_recomputed(body, ())
    (frame,) = frames
    saved = len(frame.numels)
    assert saved >= 5 and frame.recomputed == []  # nothing recomputed before backward
    recorded: list = []
    real_recompute = eager._Frame._recompute

    def watching(self, task):
        real_recompute(self, task)
        recorded.extend(weakref.ref(t) for t in self.recomputed)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager._Frame, "_recompute", watching)
        out.square().sum().backward()
    assert len(recorded) == saved
    assert 0 < alive_during[0] < saved  # some unpacked and dropped, some still to come
    assert all(t is None for t in frame.recomputed)
    del out
    assert all(r() is None for r in recorded)  # freed with the nodes that unpacked them


def test_a_second_backward_through_a_retained_graph_recomputes_again():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 6)
    runs = []

    def body():
        runs.append(1)
        return block(x)

    torch.manual_seed(5)
    out = run_recomputed(body, ()).square().sum()
    first = torch.autograd.grad(out, list(block.parameters()), retain_graph=True)
    second = torch.autograd.grad(out, list(block.parameters()))
    assert len(runs) == 3  # forward, then once per backward pass
    torch.manual_seed(5)
    plain = torch.autograd.grad(block(x).square().sum(), list(block.parameters()))
    for a, b, c in zip(first, second, plain):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, c, rtol=0, atol=0)


def test_a_recompute_that_saves_fewer_tensors_is_refused():
    w = torch.randn(4, 4, requires_grad=True)
    calls = []

    def body():  # the second run skips a multiplication that saved tensors
        calls.append(1)
        x = torch.randn(3, 4) @ w
        return (x * w[0]).sum() if len(calls) == 1 else x.sum()

    out = run_recomputed(body, ())
    with pytest.raises(RuntimeError, match=r"recompute of a block saved only 1 of the 3 tensors its forward "
                                           r"saved for backward: the block took another path"):
        out.backward()


def test_a_recompute_that_saves_another_size_is_refused():
    w = torch.randn(4, 4, requires_grad=True)
    rows = [3]

    def body():
        return (torch.ones(rows[0], 4) @ w).sum()

    out = run_recomputed(body, ())
    rows[0] = 2  # the block's input shape changes between forward and backward
    with pytest.raises(RuntimeError, match=r"saved, as its tensor 0 for backward, a \(2, 4\) torch.float32 "
                                           r"tensor where the forward saved one of 12 elements of torch.float32"):
        out.backward()


def test_a_saved_tensor_unpacked_twice_is_refused():
    class ReadsTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            ctx.saved_tensors  # noqa: B018
            ctx.saved_tensors  # noqa: B018 (a second read of the same saved tensor)
            return g * 2

    x = torch.randn(3, requires_grad=True)
    out = run_recomputed(lambda: ReadsTwice.apply(x.sin()), ())
    with pytest.raises(RuntimeError, match="unpacked twice in one backward pass"):
        out.sum().backward()


def test_autocast_is_replayed():
    """The recompute runs under the forward's autocast (backward runs outside it): same dtypes, same
    gradients as the plain autocast computation."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = lin(x).float().square().sum()
        out = run_recomputed(lambda: lin(x), ()).float().square().sum()
    want = torch.autograd.grad(plain, list(lin.parameters()))
    got = torch.autograd.grad(out, list(lin.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_grad_it_only_runs():
    with torch.no_grad():
        out = run_recomputed(lambda: torch.ones(2) * 3, ())
    assert out.tolist() == [3.0, 3.0]


def test_the_recompute_route_refuses_a_parameter_changed_in_place():
    """Through `recompute` (the route `checkpoint` and stage 3 take): the parameters reach the body by
    closure, so a change between forward and backward is refused rather than recomputed from."""
    w = torch.randn(4, 4, requires_grad=True)
    leaf = w.detach().requires_grad_()
    out = recompute(lambda p, x: (x @ p["w"]).tanh(), {"w": leaf}, torch.randn(2, 4))
    with torch.no_grad():
        leaf.add_(1.0)
    with pytest.raises(RuntimeError, match="a parameter of a recomputed block changed"):
        out.sum().backward()


def test_the_recompute_stops_after_the_last_saved_tensor():
    """What the block does after its last op that saves for backward is not run again in backward."""
    w = torch.randn(4, 4, requires_grad=True)
    reached = []

    def body():
        y = (torch.ones(3, 4) @ w).tanh()  # saves the ones and tanh's output
        reached.append(1)
        return y + 1.0  # saves nothing

    (got,) = torch.autograd.grad(run_recomputed(body, ()).sum(), [w])
    assert len(reached) == 1  # the forward's; the recompute stopped at tanh
    (want,) = torch.autograd.grad(body().sum(), [w])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
