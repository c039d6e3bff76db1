"""The GPT example (examples/train_gpt.py) trains: run its main() in-process with tiny settings."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.train_gpt import main

# ~2 s per run on 2 CPU cores: 2 blocks of width 64, batches of 8 x 32 characters.
TINY = ["--steps", "30", "--batch-size", "8", "--seq-len", "32", "--n-layer", "2", "--n-embd", "64",
        "--n-head", "2", "--lr", "1e-2", "--corpus-chars", "40000", "--eval-every", "0",
        "--sample-chars", "8", "--no-progress", "--device", "cpu"]


def _transform_available(name: str) -> bool:
    try:
        import zfunc.transforms as t
    except ImportError:
        return False
    return hasattr(t, name)


@pytest.mark.slow
def test_example_loss_falls(capsys):
    out = main(TINY)
    assert out["ok"]
    assert len(out["losses"]) == 30
    assert all(math.isfinite(x) for x in out["losses"])
    # from ln(43) ≈ 3.76 to well below: the model has learnt character frequencies at least
    assert out["first_loss"] > 3.3
    assert out["last_loss"] < out["first_loss"] - 0.6, out["losses"]
    assert out["val_loss"] < out["first_loss"] - 0.6
    printed = capsys.readouterr().out
    assert "step: train_step" in printed  # the step it ran is shown
    assert " -> " in printed and "tokens/s" in printed  # the summary line
    assert out["sample"].startswith("the ")


@pytest.mark.slow
@pytest.mark.parametrize("flags, needs", [
    (["--micro-batches", "2"], None),
    (["--mixed-precision", "bf16", "--checkpoint"], ("mixed_precision", "checkpoint")),
    (["--zero-stage", "3", "--offload"], ("shard", "offload")),
])
def test_example_with_transforms_loss_falls(flags, needs, capsys):
    for name in needs or ():
        if not _transform_available(name):
            pytest.skip(f"zfunc.transforms.{name} is not available yet")
    out = main(TINY + ["--steps", "20"] + flags)
    assert out["ok"]
    assert out["last_loss"] < out["first_loss"] - 0.4, out["losses"]
    printed = capsys.readouterr().out
    assert repr(out["step"]) in printed


@pytest.mark.slow
def test_example_transforms_follow_the_plain_step():
    """Transforms change how the step runs, not what it computes: same losses as the plain step."""
    plain = main(TINY + ["--steps", "5", "--sample-chars", "0"])
    accumulated = main(TINY + ["--steps", "5", "--sample-chars", "0", "--micro-batches", "4"])
    assert accumulated["losses"] == pytest.approx(plain["losses"], rel=1e-4, abs=1e-5)
    if _transform_available("shard"):
        sharded = main(TINY + ["--steps", "5", "--sample-chars", "0", "--zero-stage", "2"])
        assert sharded["losses"] == pytest.approx(plain["losses"], rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_example_reports_nan():
    """A diverging run stops and reports failure (the script then exits non-zero)."""
    out = main(TINY + ["--steps", "10", "--lr", "1e38", "--warmup", "0", "--sample-chars", "0"])
    assert not out["ok"]
    assert len(out["losses"]) < 10
