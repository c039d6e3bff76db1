"""Buffers and the compute dtype.

``mixed_precision("bf16")`` casts parameters, floating inputs and frozen
parameters to bf16, but keeps floating *buffers* in their own dtype unless
``cast_buffers=True`` (as autocast and FSDP2 do): Llama's rotary ``inv_freq`` in
bf16 puts the rotation angles at positions past 2048 off by up to 0.4 in cos.
The cases compare against ``torch.autocast`` (what a PyTorch user gets) and
check that ``cast_buffers=True`` does what it says.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc as zf
from tests.adversarial import copies, outcome, single_thread  # noqa: F401 (a fixture)
from zfunc.transforms import mixed_precision, shard

pytestmark = pytest.mark.usefixtures("single_thread")

POSITIONS = torch.arange(4096, 4104)[None]  # far past 2048, where bf16 angles go wrong


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8192)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _keep_cos(seen: dict):
    def hook(module, inputs, out):  # returns None: the output is left as it is
        seen.setdefault("cos", out[0].detach())
    return hook


def _rotary_under(stack: str, cast_buffers: bool):
    """The rotary embedding's cos (what every attention layer rotates with), the logits, and the module's
    buffers afterwards, from one forward inside a step of ``stack``."""
    model = _llama()
    seen = {}
    model.model.rotary_emb.register_forward_hook(_keep_cos(seen))
    apply_fn, params = zf.functional(model)
    tokens = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))

    def step(state, batch):
        return state, {"logits": apply_fn(state.params, input_ids=batch, position_ids=POSITIONS).logits}

    stepped = mixed_precision(step, "bf16", cast_buffers=cast_buffers)
    if stack == "shard3":
        stepped = shard(stepped, stage=3)
    state = stepped.init(zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    _, metrics = stepped(state, tokens)
    return seen["cos"], metrics["logits"], dict(model.named_buffers()), model, tokens


def _autocast_cos(model, tokens):
    seen = {}
    handle = model.model.rotary_emb.register_forward_hook(_keep_cos(seen))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=tokens, position_ids=POSITIONS)
    handle.remove()
    return seen["cos"]


@outcome("right")
@pytest.mark.parametrize("stack", ["mixed_precision", "shard3"])
def test_rotary_inv_freq_stays_fp32_and_matches_autocast(stack):
    cos, _, buffers, model, tokens = _rotary_under(stack, cast_buffers=False)
    assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    reference = _autocast_cos(model, tokens)  # fp32 angles; the model then rounds cos to its compute dtype
    assert cos.dtype == torch.bfloat16
    assert torch.equal(cos, reference.to(torch.bfloat16))


@outcome("right")
def test_a_hugging_face_output_gets_the_policys_output_dtype():
    _, logits, _, _, _ = _rotary_under("mixed_precision", cast_buffers=False)
    assert logits.dtype == torch.float32


@outcome("right")
def test_cast_buffers_casts_them():
    cos, _, buffers, model, tokens = _rotary_under("mixed_precision", cast_buffers=True)
    assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32  # the module's own stays as it was
    reference = _autocast_cos(model, tokens)
    inv_freq = buffers["model.rotary_emb.inv_freq"].to(torch.bfloat16).float()
    expected = torch.cat([POSITIONS[0, :, None].float() * inv_freq] * 2, dim=-1).cos().to(torch.bfloat16)
    assert torch.equal(cos[0], expected)  # computed from the bf16 inv_freq, as asked
    assert (cos.float() - reference.float()).abs().max() > 0.1  # which is why it is not the default


class Counting(nn.Module):
    """A float buffer updated in place by every forward (an EMA of the input's mean) and an int counter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.full((4,), 0.1234567))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0).to(self.ema.dtype))
            self.calls += 1
        return self.lin(x)


def _buffers_after(cast_buffers: bool | None) -> dict:
    torch.manual_seed(0)
    model = Counting()
    apply_fn, params = zf.functional(model)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def step(state, batch):
        _, grads = zf.value_and_grad(lambda p, b: apply_fn(p, b).square().mean())(state.params, batch)
        return state.apply_gradients(grads), {}

    stepped = step if cast_buffers is None else mixed_precision(step, "bf16", cast_buffers=cast_buffers)
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    for _ in range(3):
        state, _ = stepped(state, x)
    return {k: v.clone() for k, v in model.named_buffers()}, x


@outcome("right")
def test_a_float_buffer_updated_in_forward_keeps_fp32_by_default():
    plain, x = _buffers_after(None)
    mixed, _ = _buffers_after(False)
    # The buffer sees the bf16 input (the policy casts floating inputs), in fp32 arithmetic.
    expected = torch.full((4,), 0.1234567)
    for _ in range(3):
        expected = expected * 0.9 + 0.1 * x.to(torch.bfloat16).mean(0).float()
    assert mixed["ema"].dtype == torch.float32 and int(mixed["calls"]) == int(plain["calls"]) == 3
    torch.testing.assert_close(mixed["ema"], expected, rtol=1e-6, atol=1e-7)


@outcome("right")
def test_a_float_buffer_updated_in_forward_is_written_back_with_cast_buffers():
    mixed, x = _buffers_after(True)
    expected = torch.full((4,), 0.1234567).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    for _ in range(3):  # each forward updates a bf16 copy of the buffer, written back into the fp32 one
        expected = expected.float().to(torch.bfloat16).mul_(0.9).add_(0.1 * xb.mean(0)).float().to(torch.bfloat16)
    assert mixed["ema"].dtype == torch.float32 and int(mixed["calls"]) == 3
    assert torch.equal(mixed["ema"], expected.float())
