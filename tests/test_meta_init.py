"""Models that don't fit: built on the meta device, given their values by step.init one unit at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import zfunc as zf
from tests.models import TinyLM, lm_loss, make_batch
from tests.shard_cases import local_batch, rank_and_world, to_numpy
from zfunc.testing import run_distributed
from zfunc.transforms import mixed_precision, offload, shard


class MetaLM(TinyLM):
    """TinyLM whose constructor-time constants (a frozen scale, a buffer) come from reset_parameters, so a
    meta-built copy can replay them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.frozen_scale.copy_(torch.linspace(0.5, 1.5, self.frozen_scale.numel()))
            self.offset.fill_(0.01)


def step_of(apply_fn):
    loss_fn = lm_loss(apply_fn)

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return train_step


STACKS = {
    "plain": lambda s: s,
    "mixed": lambda s: mixed_precision(s, "bf16"),
    "stage1": lambda s: shard(s, stage=1),
    "stage2+offload": lambda s: shard(offload(s), stage=2),
    "stage3": lambda s: shard(s, stage=3),
    "stage3+offload+mixed": lambda s: shard(offload(mixed_precision(s, "bf16")), stage=3),
}


def meta_vs_eager(seed_by_rank: bool):
    """Every stack: the meta-built model's initial and trained parameters equal the eager model's."""
    rank, world = rank_and_world()
    out = {}
    for name, wrap in STACKS.items():
        torch.manual_seed(0)
        eager = MetaLM(depth=4)
        eager_fn, eager_params = zf.functional(eager)
        with torch.device("meta"):
            meta = MetaLM(depth=4)
        apply_fn, params = zf.functional(meta)
        torch.manual_seed(100 + rank if seed_by_rank else 0)
        torch.manual_seed(0) if not seed_by_rank or rank == 0 else None
        step = wrap(step_of(apply_fn))
        state = zf.init(step, zf.TrainState.create(params, zf.optim.adamw(1e-2)))
        initial = to_numpy(zf.gather(step, state))
        ref_step = wrap(step_of(eager_fn))
        ref = zf.init(ref_step, zf.TrainState.create({k: v.clone() for k, v in eager_params.items()},
                                                     zf.optim.adamw(1e-2)))
        for i in range(2):
            batch = local_batch(i, rank, world)
            state, _ = step(state, batch)
            ref, _ = ref_step(ref, batch)
        out[name] = (initial, to_numpy(eager_params), to_numpy(zf.gather(step, state)),
                     to_numpy(zf.gather(ref_step, ref)), meta.frozen_scale.detach().clone(), meta.offset.clone())
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_meta_init_equals_eager_construction(world):
    for per_rank in run_distributed(meta_vs_eager, world, False):
        for name, (initial, eager, trained, ref, frozen, buffer) in per_rank.items():
            for k in eager:
                np.testing.assert_array_equal(initial[k], eager[k], err_msg=f"{name} {k}")  # bitwise
                np.testing.assert_allclose(trained[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=f"{name} {k}")
            assert torch.equal(frozen, torch.linspace(0.5, 1.5, 10)) and torch.equal(buffer, torch.full((10,), 0.01))


def test_ranks_seeded_differently_still_build_rank_zeros_model():
    results = run_distributed(meta_vs_eager, 2, True)
    for name in STACKS:
        if name.startswith("stage"):
            for k, v in results[0][name][0].items():
                np.testing.assert_array_equal(results[1][name][0][k], v, err_msg=f"{name} {k}")


def test_streaming_holds_one_unit_at_a_time():
    """The materializer holds the root unit and one block's values, never the whole model."""
    with torch.device("meta"):
        meta = MetaLM(depth=6, width=16, hidden=64)
    apply_fn, params = zf.functional(meta)
    state = zf.TrainState.create(params, zf.optim.adamw(1e-2))
    layout = zf.transforms.shard_layout.make_layout(state.params, 3, 1, 0, None, state.blocks)
    got = {}
    peak = state.materializer.run({u.name: frozenset(u.keys) for u in layout.units},
                                  lambda g, values: got.update(values))
    total = sum(p.numel() * 4 for p in params.values())
    root = sum(u.numel * 4 for u in layout.units if u.name == "")
    block = max(u.numel * 4 for u in layout.units if u.name)
    assert set(got) == set(params)
    assert peak <= root + block < total / 2, (peak, root, block, total)


def test_a_constructor_constant_that_cannot_be_replayed_is_an_error():
    with torch.device("meta"):
        meta = TinyLM()  # its frozen scale and buffer are set in __init__ only
    apply_fn, params = zf.functional(meta)
    with pytest.raises(ValueError, match="frozen_scale was computed by its module's constructor"):
        zf.init(mixed_precision(step_of(apply_fn), "bf16"), zf.TrainState.create(params, zf.optim.sgd(0.1)))


def test_an_uninitialized_parameter_is_an_error():
    class NoReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w

    with torch.device("meta"):
        meta = nn.Sequential(NoReset(), NoReset())
    apply_fn, params = zf.functional(meta)
    with pytest.raises(ValueError, match="'0.w', '1.w' were not initialized"):
        zf.init(lambda s, b: (s, {}), zf.TrainState.create(params, zf.optim.sgd(0.1)))
    _, params = zf.functional(meta, init=lambda m: m.w.data.fill_(2.0) if isinstance(m, NoReset) else None)
    state = zf.init(lambda s, b: (s, {}), zf.TrainState.create(params, zf.optim.sgd(0.1)))
    assert all(torch.equal(v, torch.full((3,), 2.0)) for v in state.params.values())


def test_an_initializer_writing_a_finished_unit_is_an_error():
    def init(module):
        if isinstance(module, MetaLM):  # the root, visited last: writes a block's weight
            module.blocks[0].up.weight.data.zero_()
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    with torch.device("meta"):
        meta = MetaLM()
    apply_fn, params = zf.functional(meta, init=init)
    with pytest.raises(RuntimeError, match="blocks.0.up.weight .* after its unit was complete"):
        shard(step_of(apply_fn), stage=3).init(zf.TrainState.create(params, zf.optim.sgd(0.1)))


def test_init_needs_a_meta_model_and_a_known_initializer():
    with pytest.raises(ValueError, match="meta device"):
        zf.functional(TinyLM(), init="reset_parameters")
    with torch.device("meta"):
        meta = TinyLM()
    with pytest.raises(ValueError, match="init must be"):
        zf.functional(meta, init="xavier")
    with pytest.raises(ValueError, match="Hugging Face model"):
        zf.functional(meta, init="hf")


def _hf_models():
    transformers = pytest.importorskip("transformers")
    return {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=3, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0, eos_token_id=0)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, tie_word_embeddings=True)),
    }


def _hf_meta_vs_eager(name):
    make = _hf_models()[name]
    torch.manual_seed(5)
    eager = make()  # the reference: the eager model, re-initialized by its own _init_weights under seed 0
    for module in eager.modules():
        module._is_hf_initialized = False
    eager.get_output_embeddings().weight = nn.Parameter(eager.get_output_embeddings().weight.detach().clone())
    torch.manual_seed(0)
    eager.initialize_weights()
    eager.tie_weights()
    with torch.device("meta"):
        meta = make()
    apply_fn, params = zf.functional(meta, init="hf")
    torch.manual_seed(0)
    step = shard(lambda s, b: (s, {}), stage=3)
    state = step.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
    full = to_numpy(step.gather(state))
    buffers = {k: b.clone() for k, b in meta.named_buffers()}
    return full, to_numpy({k: v for k, v in eager.named_parameters()}), buffers, dict(eager.named_buffers())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models_built_on_meta(name):
    _hf_models()
    for full, eager, buffers, eager_buffers in run_distributed(_hf_meta_vs_eager, 2, name):
        for k, v in full.items():
            np.testing.assert_array_equal(v, eager[k], err_msg=k)
        for k, b in buffers.items():
            torch.testing.assert_close(b, eager_buffers[k], rtol=0, atol=0, msg=k)
