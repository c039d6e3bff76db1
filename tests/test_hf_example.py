"""examples/hf_trainer_token_classification.py trains (a tiny Longformer under the classic ZeRO-2 offload config)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.hf_trainer_token_classification import main
from zfunc.testing import run_distributed


@pytest.mark.slow
def test_token_classification_example_loss_falls(tmp_path, capsys):
    def run():
        from tests.hf_trainer_cases import reset_accelerate

        reset_accelerate()
        return main(["--steps", "15", "--no-progress", "--output-dir", str(tmp_path)])

    out = run_distributed(run, 1, timeout=300)[0]
    assert out["ok"], out
    assert out["global_step"] == 15
    assert all(math.isfinite(x) for x in out["losses"])
    assert out["losses"][0] > 0.8 and out["losses"][-1] < out["losses"][0] - 0.3, out["losses"]
    assert out["eval_after"] < out["eval_before"] - 0.3
