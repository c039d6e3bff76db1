"""The examples people start from (BERT MLM from a DeepSpeed config, Hugging Face fine-tuning, per-example
gradients): each runs in-process with tiny settings, and the pieces they teach are checked element-wise."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import zfunc as zf
from examples import per_example_grads as peg
from tests.shard_cases import rank_and_world
from zfunc.testing import run_distributed
from zfunc.transforms import mixed_precision, shard

# -- bert_mlm.py ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bert_mlm_from_a_deepspeed_config(capsys):
    pytest.importorskip("transformers")
    from examples.bert_mlm import main

    # (the first run of the host Adam kernel compiles it: ~10 s once per machine)
    out = main(["--steps", "8", "--lr", "2e-2", "--micro-batch-size", "8", "--accumulation", "2", "--corpus-chars",
                "30000", "--hidden", "32", "--seq-len", "16", "--eval-batches", "1", "--no-progress", "--device", "cpu"])
    assert out["ok"] and len(out["losses"]) == 8
    assert out["last_loss"] < out["first_loss"] - 0.1, out["losses"]
    assert out["val_loss"] < out["val_loss_start"] - 0.1
    printed = capsys.readouterr().out
    # the config's translation is shown, key by key, and the stack is the classic ZeRO-1 + offload + fp16 one
    assert "DeepSpeed config:" in printed and "zero_optimization.offload_optimizer.device" in printed
    assert "shard(offload(mixed_precision(accumulate(train_step, micro_batches=2), policy='fp16'" in printed
    assert out["setup"].train_batch_size == 16 and out["setup"].micro_batches == 2
    assert " -> " in printed and "tokens/s" in printed and "masked-token accuracy" in printed


def test_bert_masking_follows_bert():
    from examples.mlm_data import CLS, MASK, SEP, SPECIAL, load_mlm_dataset, mask_tokens

    tok, train, _ = load_mlm_dataset(40_000, 32)
    assert (train[:, 0] == CLS).all() and (train[:, -1] == SEP).all()
    ids = train[:200]
    inputs, labels = mask_tokens(ids, tok.vocab_size, torch.Generator().manual_seed(0))
    chosen = labels != -100
    assert 0.12 < chosen.float().mean() < 0.18  # 15% of the positions
    assert not chosen[:, 0].any() and not chosen[:, -1].any()  # never [CLS] / [SEP]
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    masked = (inputs[chosen] == MASK).float().mean()
    kept = (inputs[chosen] == ids[chosen]).float().mean()
    assert 0.75 < masked < 0.85 and 0.05 < kept < 0.16
    assert (inputs[chosen] >= len(SPECIAL)).logical_or(inputs[chosen] == MASK).all()


# -- finetune_hf.py ---------------------------------------------------------------------------------

TINY_FINETUNE = ["--steps", "12", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--no-progress",
                 "--device", "cpu"]


@pytest.mark.slow
def test_finetune_hf_creates_loads_trains_exports(tmp_path, capsys):
    pytest.importorskip("transformers")
    from examples.finetune_hf import main

    model_dir = tmp_path / "tiny-llama"
    out = main(["--model-dir", str(model_dir), *TINY_FINETUNE])
    assert (model_dir / "model.safetensors").exists()  # the stand-in for a downloaded model
    assert out["ok"] and out["equal"] and out["tensors"] == 20  # the export equals the trained weights
    assert out["last_loss"] < out["first_loss"] - 0.3, out["losses"]
    assert out["val_loss"] < out["val_loss_start"]
    assert out["report"].mode == "units" and out["report"].tied == {"lm_head.weight": "model.embed_tokens.weight"}
    printed = capsys.readouterr().out
    assert "is absent: saving a small Llama" in printed and "load_pretrained" in printed
    assert "shard(offload(mixed_precision(train_step, policy='bf16')), stage=3)" in printed
    # the fine-tuned model is a model directory like any other: fine-tune it again
    again = main(["--model-dir", str(out["out_dir"]), "--out-dir", str(tmp_path / "again"), *TINY_FINETUNE])
    assert again["ok"] and again["first_loss"] < out["first_loss"] - 0.3
    assert "is absent" not in capsys.readouterr().out


def finetune_on_ranks(model_dir, out_dir):
    from examples.finetune_hf import main

    _, world = rank_and_world()
    return main(["--model-dir", str(model_dir), "--out-dir", f"{out_dir}-{world}", *TINY_FINETUNE,
                 "--mixed-precision", "none", "--no-verify"])["losses"]


@pytest.mark.slow
def test_finetune_hf_on_two_ranks_follows_one(tmp_path):
    """ZeRO-3 on two ranks, each on half the global batch, trains like one process (fp32 compute)."""
    pytest.importorskip("transformers")
    from examples.finetune_hf import main

    model_dir = tmp_path / "tiny-llama"
    main(["--model-dir", str(model_dir), *TINY_FINETUNE, "--steps", "1", "--no-verify"])  # create it once
    one = run_distributed(finetune_on_ranks, 1, model_dir, tmp_path / "out")[0]
    two = run_distributed(finetune_on_ranks, 2, model_dir, tmp_path / "out")
    assert two[0] == two[1]  # every rank reports the mean over ranks
    np.testing.assert_allclose(two[0], one, rtol=2e-4, atol=1e-5)


# -- per_example_grads.py ---------------------------------------------------------------------------


def tiny_mlp():
    torch.manual_seed(0)
    model = peg.NGramMLP(vocab=11, context=3, embed=4, hidden=16)
    apply_fn, params = zf.functional(model)
    g = torch.Generator().manual_seed(1)
    return apply_fn, params, torch.randint(0, 11, (6, 3), generator=g), torch.randint(0, 11, (6,), generator=g)


def test_per_example_gradients_equal_one_example_at_a_time():
    apply_fn, params, x, y = tiny_mlp()
    per = peg.per_example_grads(apply_fn, params, x, y)
    for i in range(len(x)):
        one = zf.grad(lambda p, xi, yi: torch.nn.functional.cross_entropy(apply_fn(p, xi), yi))(
            params, x[i:i + 1], y[i:i + 1])
        for k, v in one.items():
            torch.testing.assert_close(per[k][i], v, rtol=1e-5, atol=1e-7, msg=k)


def test_clipping_bounds_each_example_then_averages():
    apply_fn, params, x, y = tiny_mlp()
    per = peg.per_example_grads(apply_fn, params, x, y)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per.values()]).sum(0).sqrt()
    clip = float(norms.median())
    mean, got_norms = peg.clip_and_average(per, clip)
    torch.testing.assert_close(got_norms, norms)
    for k, g in per.items():
        expected = sum(g[i] * min(1.0, clip / (float(norms[i]) + 1e-6)) for i in range(len(x))) / len(x)
        torch.testing.assert_close(mean[k], expected, rtol=1e-5, atol=1e-7, msg=k)


def plain_step(apply_fn):
    def step(state, batch):
        x, y = batch
        loss, grads = zf.value_and_grad(lambda p: torch.nn.functional.cross_entropy(apply_fn(p, x), y))(state.params)
        return state.apply_gradients(grads), {"loss": loss}
    return step


def test_gradient_noise_transform():
    apply_fn, params, x, y = tiny_mlp()
    fresh = lambda: zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.sgd(0.1))
    ref, _ = plain_step(apply_fn)(fresh(), (x, y))
    grads = zf.grad(lambda p: torch.nn.functional.cross_entropy(apply_fn(p, x), y))(params)
    quiet = peg.GradientNoise(plain_step(apply_fn), std=0.0)
    state, metrics = quiet(quiet.init(fresh()), (x, y))
    for k in params:  # no noise: exactly the plain step, and the norm reported is the gradient's
        assert torch.equal(state.params[k], ref.params[k]), k
    expected_norm = torch.stack([g.square().sum() for g in grads.values()]).sum().sqrt()
    torch.testing.assert_close(metrics["grad_norm"], expected_norm)
    noisy = peg.GradientNoise(plain_step(apply_fn), std=0.5, seed=3)
    runs = [noisy(noisy.init(fresh()), (x, y))[0] for _ in range(2)]
    for k in params:  # reproducible, and the update moved by -lr × noise around the plain one
        assert torch.equal(runs[0].params[k], runs[1].params[k]), k
    noise = torch.cat([((ref.params[k] - runs[0].params[k]) / 0.1).flatten() for k in params])
    assert abs(float(noise.std()) - 0.5) < 0.05 and abs(float(noise.mean())) < 0.05
    with pytest.raises(ValueError, match="std must be >= 0"):
        peg.GradientNoise(plain_step(apply_fn), std=-1.0)


def noise_under_shard():
    """The custom transform inside zfunc's own: under shard it sees gradient shards and psum adds their norms."""
    rank, world = rank_and_world()
    apply_fn, params, x, y = tiny_mlp()
    step = shard(mixed_precision(peg.GradientNoise(plain_step(apply_fn), std=0.0), "bf16"), stage=2)
    state = step.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.sgd(0.1)))
    _, metrics = step(state, (x.chunk(world)[rank], y.chunk(world)[rank]))
    return float(metrics["grad_norm"]), repr(step)


def test_gradient_noise_composes_with_shard_and_mixed_precision():
    one = run_distributed(noise_under_shard, 1)[0]
    two = run_distributed(noise_under_shard, 2)
    assert two[0] == two[1] and "gradient_noise(step, std=0.0, seed=0)" in one[1]
    assert math.isclose(two[0][0], one[0], rel_tol=2e-2)  # bf16 gradients, reduced in another order


@pytest.mark.slow
def test_per_example_grads_example_trains(capsys):
    out = peg.main(["--steps", "60", "--batch-size", "16", "--lr", "1e-2", "--no-progress", "--device", "cpu"])
    assert out["ok"] and out["last_loss"] < out["first_loss"] - 0.3, out["losses"]
    assert out["val_loss"] < out["val_loss_start"]
    printed = capsys.readouterr().out
    assert "gradient_noise(dp_step, std=0.03125, seed=0)" in printed and "examples clipped" in printed
