"""A small synthetic corpus, a character tokenizer and a seeded batch iterator.

The corpus is generated, not downloaded: a few hundred KB of sentences from a
tiny English-like grammar (with subject-verb agreement, so there is something
beyond spelling to learn) mixed with short sums such as ``12+34=46.``. The same
seed always gives the same text, on every machine and every rank.

A character-level model starts at about ln(vocab) ≈ 3.4 nats per character and
learns the spelling of the ~100 words within a couple of hundred steps, which is
what makes the loss fall visibly in a minute on a laptop CPU.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

# The whole alphabet of the corpus; its order fixes the token ids.
ALPHABET = "\n .,?+=0123456789abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Characters of `ALPHABET` <-> token ids ``0 .. vocab_size-1``."""

    def __init__(self, alphabet: str = ALPHABET):
        self.alphabet = alphabet
        self.stoi = {c: i for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet") from None

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.alphabet[i] for i in ids)


# --- the grammar -------------------------------------------------------------

_ADJ = ["small", "big", "red", "old", "quiet", "happy", "lazy", "bright", "green", "clever"]
# (singular, plural)
_NOUN = [("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"), ("child", "children"),
         ("farmer", "farmers"), ("robot", "robots"), ("teacher", "teachers"), ("horse", "horses"),
         ("mouse", "mice")]
_OBJ = ["the river", "a tree", "the house", "the garden", "a ball", "the moon", "the market",
        "a book", "the hill", "the bridge"]
# (third person singular, plural)
_VERB_T = [("sees", "see"), ("likes", "like"), ("finds", "find"), ("watches", "watch"),
           ("paints", "paint"), ("follows", "follow"), ("visits", "visit"), ("draws", "draw")]
_VERB_I = [("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"),
           ("jumps", "jump"), ("laughs", "laugh")]
_ADV = ["slowly", "quickly", "today", "again", "at night", "in the rain", "every day"]
_BE = ("is", "are")
_HAVE = ("has", "have")


def _noun_phrase(rng: random.Random, plural: bool) -> str:
    det = rng.choice(["the", "some", "two"] if plural else ["the", "a", "one"])
    words = [rng.choice(_ADJ)] if rng.random() < 0.5 else []
    words.append(rng.choice(_NOUN)[plural])
    if det == "a" and words[0][0] in "aeiou":
        det = "an"
    return " ".join([det, *words])


def _clause(rng: random.Random) -> str:
    plural = rng.random() < 0.5
    subj = _noun_phrase(rng, plural)
    kind = rng.random()
    if kind < 0.4:
        s = f"{subj} {rng.choice(_VERB_T)[plural]} {rng.choice(_OBJ)}"
    elif kind < 0.65:
        s = f"{subj} {rng.choice(_VERB_I)[plural]}"
    elif kind < 0.85:
        return f"{subj} {_BE[plural]} {rng.choice(_ADJ)}"
    else:
        s = f"{subj} {_HAVE[plural]} {rng.choice(_OBJ)}"
    if rng.random() < 0.4:
        s += " " + rng.choice(_ADV)
    return s


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.1:
        plural = rng.random() < 0.5
        return f"{_BE[plural]} {_noun_phrase(rng, plural)} {rng.choice(_ADJ)}?"
    s = _clause(rng)
    while rng.random() < 0.2:
        s += ", and " + _clause(rng)
    return s + "."


def _sum(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}={a + b}."


def make_corpus(n_chars: int = 300_000, seed: int = 0) -> str:
    """Deterministic text of at least ``n_chars`` characters, lines of 1-4 statements."""
    rng = random.Random(seed)
    lines, total = [], 0
    while total < n_chars:
        parts = [_sum(rng) if rng.random() < 0.15 else _sentence(rng) for _ in range(rng.randint(1, 4))]
        line = " ".join(parts) + "\n"
        lines.append(line)
        total += len(line)
    return "".join(lines)


def load_dataset(n_chars: int = 300_000, val_fraction: float = 0.1, seed: int = 0):
    """``(tokenizer, train_ids, val_ids)``: the corpus encoded, split by position."""
    tok = CharTokenizer()
    ids = tok.encode(make_corpus(n_chars, seed))
    n_val = int(len(ids) * val_fraction)
    return tok, ids[:-n_val], ids[-n_val:]


def batches(
    ids: torch.Tensor,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[dict]:
    """Endless ``{"x": LongTensor[b, T], "y": LongTensor[b, T]}`` of random windows.

    ``y`` is ``x`` shifted by one character. Every rank draws the same *global*
    batch of ``batch_size`` windows from the same seeded generator and keeps
    its own slice of ``batch_size // world_size`` rows, so the concatenation of
    the ranks' batches does not depend on the world size (which is what lets a
    sharded run be compared with a single-process one).
    """
    if batch_size % world_size:
        raise ValueError(f"batch size {batch_size} is not divisible by world size {world_size}")
    if len(ids) <= seq_len + 1:
        raise ValueError(f"corpus of {len(ids)} tokens is too short for seq_len {seq_len}")
    local = batch_size // world_size
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(len(ids) - seq_len - 1, (batch_size,), generator=g)
        starts = starts[rank * local:(rank + 1) * local]
        chunk = ids[starts[:, None] + offsets]
        yield {"x": chunk[:, :-1].contiguous(), "y": chunk[:, 1:].contiguous()}
