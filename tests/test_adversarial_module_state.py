"""Module state a forward changes: buffers (in place, by assignment, counters) and frozen parameters.

In eager PyTorch a forward that updates a buffer (an exponential moving average,
a step counter) does so once per forward, and computes from the value it sees
then. zfunc must do exactly that, or refuse with an error that names the buffer
and says what to do: where a block is recomputed in backward (`checkpoint`,
``shard(stage=3, reshard="recompute")``) the update would run twice and the
recompute would compute from the changed value; where the buffer is a copy
swapped in for the call (``mixed_precision(cast_buffers=True)``) an assignment
would be undone when the call ends.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, single_thread  # noqa: F401 (a fixture)
from tests.models import make_batch
from zfunc.transforms import checkpoint, mixed_precision, offload, shard

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, WIDTH = 13, 10
UPDATES = ["assign", "in_place", "counter", "frozen"]


class Block(nn.Module):
    """Updates module state every forward, the way ``update`` says."""

    def __init__(self, update: str) -> None:
        super().__init__()
        self.update = update
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH), requires_grad=False)  # a frozen parameter
        self.register_buffer("ema", torch.zeros(WIDTH))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.update == "assign":
            self.ema = 0.9 * self.ema + 0.1 * x.detach().mean((0, 1))
        elif self.update == "in_place":
            self.ema.mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
        elif self.update == "counter":
            self.count += 1
        elif self.update == "frozen":
            with torch.no_grad():
                self.scale.mul_(0.99)
        return x + torch.tanh(self.lin(x)) * self.scale + 0.01 * self.ema * self.count.clamp(max=3)


class LM(nn.Module):
    def __init__(self, update: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(update) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(logits, batch):
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def eager(update: str) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = LM(update)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        batch = make_batch(seed=i)
        opt.zero_grad()
        _loss(model(batch["x"]), batch).backward()
        opt.step()
    return ({k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad},
            {k: v.clone() for k, v in [*model.named_buffers(), ("blocks.0.scale", model.blocks[0].scale)]})


def zfunc_run(update: str, wrap) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = LM(update)
    apply_fn, params = zf.functional(model)

    def step(state, batch):
        _, grads = zf.value_and_grad(lambda p, b: _loss(apply_fn(p, b["x"]), b))(state.params, batch)
        return state.apply_gradients(grads), {}

    stepped = wrap(step)
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    for i in range(3):
        state, _ = stepped(state, make_batch(seed=i))
    return (zf.gather(stepped, state),
            {k: v.clone() for k, v in [*model.named_buffers(), ("blocks.0.scale", model.blocks[0].scale)]})


AS_EAGER = {
    "plain": lambda s: s,
    "offload": offload,
    "shard1": lambda s: shard(s, stage=1),
    "shard3": lambda s: shard(s, stage=3),
}


@outcome("right")
@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("stack", list(AS_EAGER))
def test_state_updated_once_per_forward_as_in_eager_pytorch(stack, update):
    params, buffers = zfunc_run(update, AS_EAGER[stack])
    want_params, want_buffers = eager(update)
    assert_same(params, want_params, rtol=1e-6, atol=1e-7)
    assert_same(buffers, want_buffers, rtol=1e-6, atol=1e-7)


RECOMPUTING = {
    "checkpoint": checkpoint,
    "checkpoint-save_ops": lambda s: checkpoint(s, policy="save_ops"),
    "shard3-recompute": lambda s: shard(s, stage=3, reshard="recompute"),
}


@outcome("clear")
@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("stack", list(RECOMPUTING))
def test_state_a_recomputed_block_changes_is_refused(stack, update):
    """The recompute in backward would update the state a second time and compute from the new value."""
    name = {"assign": "ema", "in_place": "ema", "counter": "count", "frozen": "scale"}[update]
    clear_error(lambda: zfunc_run(update, RECOMPUTING[stack]), "blocks.0", name, "recompute", "second time",
                "modules=", exc=RuntimeError)


@outcome("clear")
def test_a_buffer_assigned_under_cast_buffers_is_refused():
    """cast_buffers=True swaps a compute-dtype copy into the buffer's slot: an assignment would be undone."""
    clear_error(lambda: zfunc_run("assign", lambda s: mixed_precision(s, "bf16", cast_buffers=True)),
                "blocks.0.ema", "assigns", "silently lost", "in place", exc=RuntimeError)


@outcome("right")
@pytest.mark.parametrize("update", ["in_place", "counter"])
def test_buffers_updated_in_place_under_cast_buffers_are_written_back(update):
    _, buffers = zfunc_run(update, lambda s: mixed_precision(s, "bf16", cast_buffers=True))
    _, want = eager(update)
    assert_same(buffers, want, rtol=2e-2, atol=2e-2)  # (computed in bf16, written back to float32)
    assert buffers["blocks.0.count"].item() == want["blocks.0.count"].item()


@outcome("clear")
def test_an_uncast_float_buffer_meeting_bf16_compute_says_cast_buffers():
    """By default buffers keep their dtype (as autocast and FSDP2 do); where the model then mixes a float32
    buffer into bf16 matmuls, torch's dtype error is explained."""
    clear_error(lambda: zfunc_run("in_place", lambda s: mixed_precision(s, "bf16")), "buffers", "ema",
                "cast_buffers=True", exc=RuntimeError)
