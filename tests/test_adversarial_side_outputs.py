"""Tensors that leave a recomputed block other than through its return value.

A forward hook that appends a sub-module's output to a list, a block that
stashes its gate logits on the side, Hugging Face's ``output_attentions=True``
and an MoE router's logits for the load-balancing loss (Mixtral with
``output_router_logits=True``): the loss uses tensors computed inside a block
that `checkpoint` or ``shard(stage=3)`` recomputes. Eagerly (zfunc's own
``value_and_grad``) the recompute keeps the ordinary autograd graph and drops only
its saved tensors (`zfunc.recompute_eager`), so those tensors get their gradients: the result equals the plain step's, bit for bit.
Where the recompute is an ``autograd.Function`` (under a torch.func transform)
a side output would get no gradient: zfunc watches what the block computes
and refuses, naming the remedies; a module's detached caches are not refused.
(checkpoint's ``offload_inputs`` policy takes the eager route too, with the
block inputs held in host memory.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, single_thread  # noqa: F401 (a fixture)
from tests.models import make_batch
from zfunc.testing import run_distributed
from zfunc.transforms import checkpoint, mixed_precision, shard

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, WIDTH = 13, 10


class SideBlock(nn.Module):
    def __init__(self, sink: list, mode: str) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, 3)
        self.sink, self.mode = sink, mode
        if mode == "hook":  # a hook on a sub-module inside the recomputed block
            self.gate.register_forward_hook(lambda module, inputs, out: self.sink.append(out))

    def forward(self, x):
        gate = self.gate(x)
        if self.mode == "list":
            self.sink.append(gate)
        out = x + torch.tanh(self.lin(x)) * torch.sigmoid(gate[..., :1])
        if self.mode == "returned":  # the very tensor the block returns, kept on the side too
            self.sink.append(out)
        return out


class SideLM(nn.Module):
    """The loss adds a term on every block's gate logits, which leave each block on the side."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.sink: list = []
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(SideBlock(self.sink, mode) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        self.sink.clear()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        side = list(self.sink)
        self.sink.clear()
        return self.head(x), side


def side_loss(apply_fn):
    def loss_fn(params, batch):
        logits, side = apply_fn(params, batch["x"])
        assert len(side) == 3  # once per block, never again from a recompute
        task = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
        return task + 0.1 * sum(s.square().mean() for s in side)
    return loss_fn


def run(mode: str, wrap, differentiate: str = "zfunc") -> dict:
    torch.manual_seed(0)
    apply_fn, params = zf.functional(SideLM(mode))
    loss_fn = side_loss(apply_fn)

    def step(state, batch):
        if differentiate == "torch.func":
            grads = torch.func.grad(loss_fn)(state.params, batch)
        else:
            _, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {}

    stepped = wrap(step)
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    for i in range(2):
        state, _ = stepped(state, make_batch(seed=i))
    return zf.gather(stepped, state)


RECOMPUTING = {
    "checkpoint": checkpoint,
    "checkpoint-save_ops": lambda s: checkpoint(s, policy="save_ops"),
    "shard3-recompute": lambda s: shard(s, stage=3, reshard="recompute"),
    "shard3-release": lambda s: shard(s, stage=3),
    "shard3-checkpoint": lambda s: shard(checkpoint(s), stage=3),
    "shard2-checkpoint-bf16": lambda s: shard(checkpoint(mixed_precision(s, "bf16")), stage=2),
}


@outcome("right")
@pytest.mark.parametrize("mode", ["list", "hook", "returned"])
@pytest.mark.parametrize("stack", list(RECOMPUTING))
def test_side_outputs_of_recomputed_blocks_get_their_gradients(stack, mode):
    reference = run(mode, (lambda s: mixed_precision(s, "bf16")) if "bf16" in stack else (lambda s: s))
    # ("returned": the block's output reaches the loss by two paths, whose gradients stage 3 sums in another
    # order: equal to the last bit or two.)
    tolerance = {"rtol": 1e-6, "atol": 1e-9} if mode == "returned" else {}
    assert_same(run(mode, RECOMPUTING[stack]), reference, **tolerance)


def run_stack(mode: str, stack: str) -> dict:
    """`run` of ``RECOMPUTING[stack]`` (on each of the ranks `run_distributed` forks)."""
    return run(mode, RECOMPUTING[stack])


@outcome("right")
@pytest.mark.parametrize("mode", ["list", "hook", "returned"])
@pytest.mark.parametrize("stack", [name for name in RECOMPUTING if name.startswith("shard")])
def test_side_outputs_on_two_ranks(stack, mode):
    """At one rank shard's stages 2 and 3 run the blocks on the shards themselves; at two they gather, release
    and refill (or recompute) each block, and reduce its gradients in one node per unit: the same gradients."""
    reference = run(mode, (lambda s: mixed_precision(s, "bf16")) if "bf16" in stack else (lambda s: s))
    tolerance = {"rtol": 1e-6, "atol": 1e-9} if mode == "returned" else {}
    for got in run_distributed(run_stack, 2, mode, stack):
        assert_same(got, reference, **tolerance)


@outcome("right")
def test_the_side_term_matters():
    """Guard of the cases above: without the side term the parameters come out different."""
    torch.manual_seed(0)
    with_side = run("list", lambda s: s)
    torch.manual_seed(0)
    apply_fn, params = zf.functional(SideLM("list"))

    def step(state, batch):
        _, grads = zf.value_and_grad(lambda p, b: F.cross_entropy(apply_fn(p, b["x"])[0].flatten(0, 1),
                                                                   b["y"].flatten()))(state.params, batch)
        return state.apply_gradients(grads), {}

    state = zf.TrainState.create(copies(params), zf.optim.sgd(0.1))
    for i in range(2):
        state, _ = step(state, make_batch(seed=i))
    assert not torch.allclose(state.params["blocks.0.gate.weight"], with_side["blocks.0.gate.weight"])


@outcome("right")
def test_side_outputs_under_checkpoint_offload_inputs():
    assert_same(run("list", lambda s: checkpoint(s, policy="offload_inputs")), run("list", lambda s: s))


@outcome("clear")
@pytest.mark.parametrize("mode", ["list", "hook", "returned"])
def test_side_outputs_under_torch_func_and_checkpoint_are_refused(mode):
    """Under torch.func the recompute is an autograd.Function that sees only the block's return value: a
    side output would reach the loss as a constant. zfunc watches what the block computes and refuses."""
    clear_error(lambda: run(mode, checkpoint, "torch.func"), "return value", "on the side", "zf.value_and_grad",
                exc=RuntimeError)


class CachingBlock(nn.Module):
    """Keeps detached copies of what it computed (a cache, as some attention implementations do) and a
    tensor made from a buffer only: neither carries a gradient in eager PyTorch, so neither is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.full((WIDTH,), 0.5))
        self.cache: dict = {}

    def forward(self, x):
        h = self.lin(x)
        self.cache["last"] = h.detach()
        self.cache["scale"] = self.scale * 2
        return x + torch.tanh(h) * self.cache["scale"]


class CachingLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(CachingBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@outcome("right")
@pytest.mark.parametrize("wrap", ["plain", "checkpoint"])
def test_module_caches_under_torch_func_and_checkpoint_are_not_refused(wrap):
    def trained(wrapper):
        torch.manual_seed(0)
        apply_fn, params = zf.functional(CachingLM())

        def loss_fn(p, batch):
            return F.cross_entropy(apply_fn(p, batch["x"]).flatten(0, 1), batch["y"].flatten())

        def step(state, batch):
            return state.apply_gradients(torch.func.grad(loss_fn)(state.params, batch)), {}

        stepped = wrapper(step)
        state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
        for i in range(2):
            state, _ = stepped(state, make_batch(seed=i))
        return zf.gather(stepped, state)

    assert_same(trained(checkpoint if wrap == "checkpoint" else (lambda s: s)), trained(lambda s: s))


@outcome("clear")
def test_torch_func_grad_under_stage_3_is_refused_clearly():
    with pytest.raises((RuntimeError, ValueError), match="zf.value_and_grad"):
        run("list", lambda s: shard(s, stage=3), "torch.func")


# -- Hugging Face: Mixtral's router logits, Llama's attentions ------------------------


def _mixtral():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def hf_run(kind: str, wrap, aux: bool = True) -> dict:
    model = _mixtral() if kind == "mixtral" else _llama()
    apply_fn, params = zf.functional(model)

    def loss_fn(p, tokens):
        if kind == "mixtral":  # the loss includes router_aux_loss_coef x the load-balancing loss
            return apply_fn(p, input_ids=tokens, labels=tokens, output_router_logits=aux, use_cache=False).loss
        out = apply_fn(p, input_ids=tokens, labels=tokens, output_attentions=True, use_cache=False)
        return out.loss + (sum(a.square().mean() for a in out.attentions) if aux else 0)

    def step(state, tokens):
        _, grads = zf.value_and_grad(loss_fn)(state.params, tokens)
        return state.apply_gradients(grads), {}

    stepped = wrap(step)
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    state, _ = stepped(state, tokens)
    return zf.gather(stepped, state)


HF_STACKS = {
    "checkpoint": checkpoint,
    "shard3-recompute": lambda s: shard(s, stage=3, reshard="recompute"),
    "shard3-checkpoint": lambda s: shard(checkpoint(s), stage=3),
}


@outcome("right")
@pytest.mark.parametrize("kind", ["mixtral", "llama"])
@pytest.mark.parametrize("stack", list(HF_STACKS))
def test_router_logits_and_attentions_of_recomputed_layers_get_their_gradients(stack, kind):
    assert_same(hf_run(kind, HF_STACKS[stack]), hf_run(kind, lambda s: s))


@outcome("right")
@pytest.mark.parametrize("kind", ["mixtral", "llama"])
def test_the_router_and_attention_terms_matter(kind):
    """Guard of the cases above: the side term changes the gradients it is meant to change."""
    with_aux, without = hf_run(kind, lambda s: s), hf_run(kind, lambda s: s, aux=False)
    key = "model.layers.0.mlp.gate.weight" if kind == "mixtral" else "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(with_aux[key], without[key])
