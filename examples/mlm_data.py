"""Masked-language-model data from the generated corpus: a word tokenizer, fixed-length sequences, BERT masking.

The text is `data.make_corpus`'s (sentences of a small grammar and sums such
as ``12+34=46.``), split into words, numbers and punctuation. Sequences are
windows of the token stream wrapped in ``[CLS] ... [SEP]``. Masking follows
BERT: 15% of the positions (never ``[CLS]``/``[SEP]``) are predicted; of
those, 80% become ``[MASK]``, 10% a random word, 10% stay as they are. The
labels are the original ids at the predicted positions and -100 elsewhere
(ignored by the loss).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

try:
    from .data import make_corpus
except ImportError:
    from data import make_corpus

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(len(SPECIAL))
WORD = re.compile(r"[a-z]+|\d|[^\sa-z\d]")  # numbers digit by digit


class WordTokenizer:
    """Words, numbers and punctuation marks of a text <-> ids; the five special tokens first."""

    def __init__(self, text: str) -> None:
        self.vocab = SPECIAL + sorted(set(WORD.findall(text)))
        self.ids = {w: i for i, w in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.ids.get(w, UNK) for w in WORD.findall(text)], dtype=torch.long)

    def decode(self, ids) -> str:
        return " ".join(self.vocab[i] for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))


def load_mlm_dataset(n_chars: int, seq_len: int, val_fraction: float = 0.1, seed: int = 0):
    """``(tokenizer, train, val)``: ``[N, seq_len]`` id tensors of ``[CLS] window [SEP]``."""
    text = make_corpus(n_chars, seed)
    tok = WordTokenizer(text)
    stream = tok.encode(text)
    body = seq_len - 2
    n = len(stream) // body
    windows = stream[:n * body].view(n, body)
    seqs = torch.cat([torch.full((n, 1), CLS), windows, torch.full((n, 1), SEP)], dim=1)
    n_val = max(1, int(n * val_fraction))
    return tok, seqs[:-n_val], seqs[-n_val:]


def mask_tokens(ids: torch.Tensor, vocab_size: int, generator: torch.Generator, prob: float = 0.15):
    """``(inputs, labels)`` with BERT's masking of ``ids`` (see the module docstring)."""
    labels = ids.clone()
    special = ids < len(SPECIAL)
    chosen = (torch.rand(ids.shape, generator=generator) < prob) & ~special
    labels[~chosen] = -100
    inputs = ids.clone()
    roll = torch.rand(ids.shape, generator=generator)
    inputs[chosen & (roll < 0.8)] = MASK
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = torch.randint(len(SPECIAL), vocab_size, ids.shape, generator=generator)[swap]
    return inputs, labels


def mlm_batches(seqs: torch.Tensor, batch_size: int, vocab_size: int, seed: int = 0, rank: int = 0,
                world_size: int = 1) -> Iterator[dict]:
    """Endless ``{"input_ids", "labels"}`` batches: every rank draws the same global batch of ``batch_size``
    sequences (and masks) and keeps its ``batch_size // world_size`` rows, so any world size sees the same data."""
    if batch_size % world_size:
        raise ValueError(f"batch size {batch_size} is not divisible by world size {world_size}")
    local = batch_size // world_size
    g = torch.Generator().manual_seed(seed)
    while True:
        rows = torch.randint(len(seqs), (batch_size,), generator=g)
        inputs, labels = mask_tokens(seqs[rows], vocab_size, g)
        keep = slice(rank * local, (rank + 1) * local)
        yield {"input_ids": inputs[keep], "labels": labels[keep]}
