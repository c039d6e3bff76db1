"""Small models for the tests: uneven sizes, a frozen parameter, tied weights, a buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.dropout(self.down(F.gelu(self.up(self.norm(x)))))


class TinyLM(nn.Module):
    """Embedding tied to the output head, blocks with odd widths, a frozen
    parameter and a buffer: every case the transforms must carry."""

    def __init__(self, vocab: int = 13, width: int = 10, hidden: int = 23, depth: int = 3,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, hidden, dropout) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen_scale = nn.Parameter(torch.linspace(0.5, 1.5, width), requires_grad=False)
        self.register_buffer("offset", torch.full((width,), 0.01))

    def forward(self, tokens):
        # The buffer joins the compute dtype explicitly, as real models do (mixed_precision
        # keeps buffers in their own dtype by default, as autocast and FSDP2 do).
        x = self.embed(tokens) * self.frozen_scale + self.offset.to(self.frozen_scale.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


class Wide(nn.Module):
    """Weight-heavy square blocks (``blocks`` of ``width`` x ``width``, tanh) and a head to one output: with a
    short batch, what a step keeps is mostly weights (the compiled steps' memory tests and benchmark)."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(apply_fn):
    def loss_fn(params, batch):
        logits = apply_fn(params, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
    return loss_fn


def make_batch(batch: int = 8, seq: int = 5, vocab: int = 13, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"x": x, "y": y}


def tiny_lm_step(dropout: float = 0.0, **model_kw):
    """``(model, params, train_step)``: TinyLM built under seed 0, its trainable params, and the
    plain step (one `zf.value_and_grad` of `lm_loss`, then ``apply_gradients``)."""
    torch.manual_seed(0)
    model = TinyLM(dropout=dropout, **model_kw)
    apply_fn, params = zf.functional(model)
    loss_fn = lm_loss(apply_fn)

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return model, params, train_step

