"""zfunc.hf.Trainer against transformers' own Trainer: the same weights, logs, evaluation and checkpoints.

Every run is a forked rank (`zfunc.testing.run_distributed`): a tiny GPT-2 (tied embeddings, 2 blocks of
width 12) on generated token data, fp32, 4 updates of 2 micro-batches of 2 sequences. At 2 ranks the
plain Trainer runs DDP on gloo; zfunc's shard reduces instead. Weights are compared element by element.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers
import transformers.trainer

from tests.hf_trainer_cases import dataset, tiny_gpt2, train
from zfunc.testing import run_distributed

TIMEOUT = 300


pytestmark = pytest.mark.usefixtures("no_process_group_left")


def _run(world: int, kind: str, out_dir, **kwargs):
    return run_distributed(lambda: train(kind, str(out_dir), **kwargs), world, timeout=TIMEOUT)


def _assert_weights_close(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, msg=lambda m, name=name: f"{name}: {m}", **(tol or
                                   {"rtol": 1e-5, "atol": 1e-6}))


def _train_logs(result: dict) -> list[dict]:
    return [e for e in result["log"] if "loss" in e and "train_runtime" not in e]


def _assert_logs_close(got: dict, want: dict) -> None:
    g, w = _train_logs(got), _train_logs(want)
    assert [e["step"] for e in g] == [e["step"] for e in w]
    for a, b in zip(g, w):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), (key, a, b)


_PLAIN: dict = {}


def plain(world: int, tmp_path_factory, **kwargs):
    """transformers' Trainer (DDP at 2 ranks), computed once per configuration."""
    key = (world, repr(sorted(kwargs.items())))
    if key not in _PLAIN:
        _PLAIN[key] = _run(world, "plain", tmp_path_factory.mktemp("plain"), **kwargs)
    return _PLAIN[key]


ZERO = {
    "none": {},
    "stage1": {"zfunc_stage": 1},
    "stage2": {"zfunc_stage": 2},
    "stage3": {"zfunc_stage": 3},
    "stage2-offload": {"zfunc_stage": 2, "zfunc_offload": "optimizer"},
    "stage3-offload": {"zfunc_stage": 3, "zfunc_offload": "optimizer_and_params"},
}
FAST = {"stage3-offload"}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("zero", [pytest.param(z, marks=() if z in FAST else pytest.mark.slow) for z in ZERO])
def test_weights_equal_plain_trainer(zero, world, tmp_path, tmp_path_factory):
    want = plain(world, tmp_path_factory)
    got = _run(world, "zfunc", tmp_path, **ZERO[zero])
    for rank in range(world):
        _assert_weights_close(got[rank]["weights"], want[0]["weights"])
    _assert_logs_close(got[0], want[0])
    assert got[0]["global_step"] == 4
    assert got[0]["callbacks"] == want[0]["callbacks"]  # every callback event, as often
    # the tied head is one tensor in the trained model, as in transformers'
    assert torch.equal(got[0]["weights"]["lm_head.weight"], got[0]["weights"]["transformer.wte.weight"])


def test_deepspeed_config_with_auto_values(tmp_path, tmp_path_factory):
    """The classic Hugging Face ZeRO-2 offload config, "auto" everywhere: zfunc reads it; DeepSpeed is not
    imported; AdamW + WarmupLR as the config says (not transformers' scheduler)."""
    config = {
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))

    def run():
        out = train("zfunc", str(tmp_path / "out"), deepspeed=str(path), warmup_steps=3)
        out["deepspeed_imported"] = "deepspeed" in sys.modules
        return out

    got = run_distributed(run, 1, timeout=TIMEOUT)[0]
    assert not got["deepspeed_imported"]
    assert got["setup"].startswith("stack:      shard(offload(train_step), stage=2)"), got["setup"]
    assert "'auto' -> learning_rate = 0.003" in got["setup"]
    # WarmupLR as DeepSpeed times it: the first two updates at warmup_min_lr (0), then log warmup to 3e-3
    rates = [e["learning_rate"] for e in _train_logs(got)]
    assert rates[:2] == [0.0, 0.0] and 0 < rates[2] < rates[3] == pytest.approx(3e-3)


def test_resume_is_exact_and_rotation_keeps_the_limit(tmp_path):
    """4 updates in one go == 2 updates, a checkpoint, and a resumed run of the last 2: bitwise. save_total_limit
    rotates the checkpoint-N directories (zfunc's state inside each)."""
    kwargs = {"zfunc_stage": 3, "zfunc_offload": "optimizer", "save_strategy": "steps", "save_steps": 1,
              "save_total_limit": 2}
    whole = _run(2, "zfunc", tmp_path / "whole", **kwargs)
    assert sorted(os.listdir(tmp_path / "whole")) == ["checkpoint-3", "checkpoint-4"]
    assert os.path.isdir(tmp_path / "whole" / "checkpoint-4" / "zfunc")
    first = _run(2, "zfunc", tmp_path / "resumed", **{**kwargs, "max_steps": 4, "save_total_limit": None})
    # drop the later checkpoints, then resume from checkpoint-2 in fresh processes
    for step in (3, 4):
        shutil.rmtree(tmp_path / "resumed" / f"checkpoint-{step}")
    resumed = _run(2, "zfunc", tmp_path / "resumed", resume=True, **{**kwargs, "save_total_limit": None})
    assert resumed[0]["global_step"] == 4
    for rank in range(2):
        for name, w in whole[rank]["weights"].items():
            assert torch.equal(resumed[rank]["weights"][name], w), name
            assert torch.equal(first[rank]["weights"][name], w), name
    assert [e["loss"] for e in _train_logs(resumed[0])][-2:] == [e["loss"] for e in _train_logs(whole[0])][-2:]


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_evaluate_and_predict_on_trained_weights(world, tmp_path, tmp_path_factory):
    want = plain(world, tmp_path_factory, evaluate=True, predict=True)[0]
    got = _run(world, "zfunc", tmp_path, zfunc_stage=3, evaluate=True, predict=True)[0]
    assert got["eval"]["eval_loss"] == pytest.approx(want["eval"]["eval_loss"], rel=1e-5)
    torch.testing.assert_close(got["predictions"], want["predictions"], rtol=1e-4, atol=1e-5)
    assert got["pred_metrics"]["test_loss"] == pytest.approx(want["pred_metrics"]["test_loss"], rel=1e-5)


def test_save_model_is_hugging_face_format(tmp_path):
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    out = tmp_path / "final"
    got = _run(2, "zfunc", tmp_path / "run", zfunc_stage=3, save_to=str(out))[0]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # the tie written once
    back = GPT2LMHeadModel.from_pretrained(out)
    assert back.lm_head.weight is back.transformer.wte.weight
    for name, t in back.state_dict().items():
        assert torch.equal(t, got["weights"][name]), name
    assert (out / "training_args.bin").exists()


@pytest.mark.slow
def test_opting_out_of_gathering_leaves_the_model_empty(tmp_path):
    def run():
        out = train("zfunc", str(tmp_path / "run"), zfunc_stage=3, zfunc_gather_model=False,
                    save_to=str(tmp_path / "final"))
        return out

    got = run_distributed(run, 2, timeout=TIMEOUT)[0]
    assert got["weights"]["transformer.h.0.attn.c_attn.weight"].numel() == 0
    from transformers import GPT2LMHeadModel

    gathered = _run(2, "zfunc", tmp_path / "other", zfunc_stage=3)[0]["weights"]
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "final").state_dict()
    for name, t in back.items():
        assert torch.equal(t, gathered[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {"lr_scheduler_type": "cosine", "warmup_steps": 2},
    # a warmup as a share of the run: warmup_steps < 1 in transformers 5, warmup_ratio in 4.x
    {"lr_scheduler_type": "constant_with_warmup",
     **({"warmup_steps": 0.5} if int(transformers.__version__.split(".")[0]) >= 5 else {"warmup_ratio": 0.5})},
    {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-4}},
    # transformers' activation checkpointing becomes zfunc's checkpoint transform (recompute: the same values)
    {"activation_checkpointing" if hasattr(transformers.TrainingArguments, "activation_checkpointing")
     else "gradient_checkpointing": True},
    # a short last window: 14 micro-batches per epoch of 4 => windows of 4, 4, 4, 2 (loss normalized per window)
    {"num_train_epochs": 1, "max_steps": -1, "gradient_accumulation_steps": 4, "n_data": 28},
])
def test_schedules_and_accumulation_match(overrides, tmp_path, tmp_path_factory):
    want = plain(1, tmp_path_factory, **overrides)[0]
    got = _run(1, "zfunc", tmp_path, zfunc_stage=2, **overrides)[0]
    _assert_weights_close(got["weights"], want["weights"])
    _assert_logs_close(got, want)


@pytest.mark.slow
def test_load_best_model_at_end(tmp_path):
    from safetensors.torch import load_file

    def run():
        return train("zfunc", str(tmp_path), zfunc_stage=2, eval_strategy="steps", eval_steps=1,
                     save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                     metric_for_best_model="eval_loss", greater_is_better=False, learning_rate=3e-2)

    got = run_distributed(run, 1, timeout=TIMEOUT)[0]
    evals = [(e["step"], e["eval_loss"]) for e in got["log"] if "eval_loss" in e]
    best_step = min(evals, key=lambda e: e[1])[0]
    saved = load_file(str(tmp_path / f"checkpoint-{best_step}" / "model.safetensors"))
    for name, t in saved.items():
        assert torch.equal(got["weights"][name], t), name


def _refusal(tmp_path, **kwargs) -> str:
    def run():
        try:
            train("zfunc", str(tmp_path), **kwargs)
        except Exception as err:  # noqa: BLE001 (the test reads the message)
            return f"{type(err).__name__}: {err}"
        return "no error"

    return run_distributed(run, 1, timeout=TIMEOUT)[0]


@pytest.mark.parametrize("kwargs, expected", [
    ({"deepspeed": {"zero_optimization": {"stage": 2, "overlap_comm": True, "bogus_knob": 1}}},
     "zero_optimization.bogus_knob"),
    ({"optim": "adafactor"}, "optim='adafactor'"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"}, "reduce_lr_on_plateau"),
    ({"deepspeed": {"train_micro_batch_size_per_gpu": 3}}, "train_micro_batch_size_per_gpu"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}, "zfunc_stage": 3}, "one place"),
])
def test_bad_input_is_refused_before_training(kwargs, expected, tmp_path):
    message = _refusal(tmp_path, **kwargs)
    assert expected in message, message
    assert not any(p.startswith("checkpoint-") for p in os.listdir(tmp_path)) if tmp_path.exists() else True


def test_torch_optimizers_and_plain_arguments_are_refused(tmp_path):
    import transformers

    from zfunc.hf import Trainer, TrainingArguments

    model = tiny_gpt2()
    with pytest.raises(TypeError, match="zfunc.hf.TrainingArguments"):
        Trainer(model=model, args=transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="zfunc runs the update itself"):
        Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                train_dataset=dataset(4), optimizers=(opt, None))


@pytest.mark.slow
def test_bf16_trains_with_zfuncs_mixed_precision(tmp_path, tmp_path_factory):
    """bf16=True: zfunc's mixed_precision (bf16 compute, fp32 master), not accelerate's autocast; the logged
    losses follow fp32 training within bf16 rounding, and the trained weights come back in fp32."""
    want = plain(1, tmp_path_factory)[0]
    got = _run(1, "zfunc", tmp_path, zfunc_stage=2, bf16=True)[0]
    assert "mixed_precision(train_step, policy='bf16')" in got["setup"].splitlines()[0], got["setup"]
    assert "'auto' -> bf16 = True" in got["setup"]
    for a, b in zip(_train_logs(got), _train_logs(want)):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2), (a, b)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-6)
    assert all(w.dtype == torch.float32 for w in got["weights"].values() if w.is_floating_point())
