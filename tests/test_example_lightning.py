"""The Lightning GPT example (examples/lightning_gpt.py) trains under zfunc's strategy names."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.lightning_gpt import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_process_group_left")


# ~5 s per run on 2 CPU cores.
TINY = ["--steps", "40", "--batch-size", "8", "--seq-len", "32", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
        "--lr", "1e-2", "--warmup", "4", "--corpus-chars", "30000", "--print-every", "10", "--no-progress",
        "--sample-chars", "8"]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--strategy", "zfunc_stage_2"],
                                   ["--strategy", "zfunc_stage_3_offload", "--precision", "bf16-mixed",
                                    "--accumulate", "2"]])
def test_lightning_example_loss_falls(flags, capsys, tmp_path):
    out = main(TINY + flags + ["--ckpt-dir", str(tmp_path)])
    assert out["ok"] and out["steps"] == 40
    assert all(math.isfinite(x) for x in out["losses"])
    assert out["first_loss"] > 3.3   # ln(43) ≈ 3.76 at the start
    assert out["last_loss"] < out["first_loss"] - 0.8, out["losses"]
    assert out["test_loss"] < out["first_loss"] - 0.8
    assert (tmp_path / "last.ckpt" / "latest").is_file()
    printed = capsys.readouterr().out
    assert "step   10  loss" in printed and f"strategy {flags[1]}" in printed and " -> " in printed
