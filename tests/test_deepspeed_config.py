"""zfunc.deepspeed.from_config: DeepSpeed configs -> zfunc stacks, optimizers, schedules and batch sizes.

DeepSpeed is not installed here: its semantics are written out below (its
schedulers' ``get_lr`` and the engine's scheduler timing, FusedLamb's update)
from DeepSpeed's sources, and the configs under tests/data/deepspeed/ restate
the examples of its documentation and of transformers' DeepSpeed tests.
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import zfunc as zf
from tests.models import make_batch, tiny_lm_step
from zfunc import deepspeed as zds
from zfunc.deepspeed import DeepSpeedConfigError, TransformCall, from_config
from zfunc.deepspeed.report import leaf_paths
from zfunc.deepspeed.stack import build_transform
from zfunc.testing import run_distributed
from zfunc.transforms import Policy, accumulate, checkpoint, mixed_precision, offload, shard

DATA = Path(__file__).parent / "data" / "deepspeed"
LR_TOL = {"rtol": 2e-7, "atol": 1e-12}

HF_ARGS = dict(learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6, weight_decay=0.01,
               warmup_steps=10, max_steps=100, per_device_train_batch_size=4, gradient_accumulation_steps=2,
               fp16=True, bf16=False, max_grad_norm=0.5)


def assert_report_covers(config: dict, report) -> None:
    """Every leaf of the config appears exactly once, mapped or ignored with a reason."""
    keys = report.keys()
    assert len(keys) == len(set(keys))
    assert set(keys) == {path for path, _ in leaf_paths(config)}
    for entry in report:
        assert entry.status in ("mapped", "ignored") and entry.to


def rates(schedule, n: int) -> list[float]:
    return [float(schedule(torch.tensor(c, dtype=torch.int64))) for c in range(n)]


def assert_rates(got: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               **LR_TOL)


# --------------------------------------------------------------------------
# DeepSpeed's schedulers, written out: get_lr(i) at last_batch_iteration = i; i = -1 is the rate the
# scheduler sets when built. The engine steps the scheduler after each applied update, so update c runs
# at get_lr(c - 1).


def ds_warmup_gamma(i: int, w: int, kind: str) -> float:
    return math.log(i + 1) / math.log(w) if kind == "log" else i / w


def ds_warmup_lr(i, lo, hi, num, kind="log", total=None):
    if i < 0:
        return lo
    w = max(2, num)
    if i < w:
        gamma = ds_warmup_gamma(i, w, kind)
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - i) / max(1.0, total - w))
    return lo + (hi - lo) * gamma


def ds_warmup_cosine_lr(i, peak, total, wmr=0.0, num=1000, cmr=1e-4, kind="log"):
    if i < 0:
        return 0.0
    w = max(2, num)
    if i < w:
        return peak * (wmr + (1 - wmr) * ds_warmup_gamma(i, w, kind))
    ratio = (1 + math.cos(math.pi * (i - w + 1) / (total - w))) / 2
    return peak * max(0.0, cmr + (1 - cmr) * ratio)


def ds_one_cycle_lr(i, lo, hi, first, second=None, decay_rate=0.0, decay_size=0):
    if i < 0:
        return lo
    total = float(first + (first if second is None else second))
    ratio = first / total
    if i < total:
        b = i + 1
        cycle = math.floor(1 + b / total)
        x = 1.0 + b / total - cycle
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return lo + (hi - lo) * scale
    if decay_rate == 0 or decay_size == 0:
        return lo
    return lo / (1 + decay_rate * ((i - total + 1) / decay_size))


def ds_lrrt_lr(i, lo, size, rate=1.0, staircase=False):
    if i < 0:
        return lo
    interval = (i + 1) / size
    return lo * (1 + rate * (math.floor(interval) if staircase else interval))


def per_update(get_lr, n: int) -> list[float]:
    return [get_lr(c - 1) for c in range(n)]


SCHEDULERS = {
    "WarmupLR-log": ({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 7}},
                     lambda i: ds_warmup_lr(i, 1e-4, 3e-3, 7)),
    "WarmupLR-linear-1": ({"type": "WarmupLR", "params": {"warmup_num_steps": 1, "warmup_type": "linear"}},
                          lambda i: ds_warmup_lr(i, 0.0, 1e-3, 1, "linear")),
    "WarmupDecayLR": ({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3,
                                                            "warmup_num_steps": 5, "total_num_steps": 30}},
                      lambda i: ds_warmup_lr(i, 0.0, 2e-3, 5, total=30)),
    "WarmupCosineLR": ({"type": "WarmupCosineLR", "params": {"total_num_steps": 25, "warmup_num_steps": 6,
                                                              "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}},
                       lambda i: ds_warmup_cosine_lr(i, 5e-3, 25, 0.1, 6, 0.01)),
    "WarmupCosineLR-linear": ({"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_num_steps": 4,
                                                                     "warmup_type": "linear"}},
                              lambda i: ds_warmup_cosine_lr(i, 5e-3, 12, 0.0, 4, 1e-4, "linear")),
    "OneCycle": ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                  "cycle_first_step_size": 6, "cycle_second_step_size": 9,
                                                  "decay_lr_rate": 0.5, "decay_step_size": 3,
                                                  "cycle_momentum": False}},
                 lambda i: ds_one_cycle_lr(i, 1e-4, 1e-3, 6, 9, 0.5, 3)),
    "OneCycle-no-decay": ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                           "cycle_first_step_size": 5, "cycle_momentum": False}},
                          lambda i: ds_one_cycle_lr(i, 1e-4, 1e-3, 5)),
    "LRRangeTest": ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 4,
                                                        "lr_range_test_step_rate": 5}},
                    lambda i: ds_lrrt_lr(i, 1e-4, 4, 5)),
    "LRRangeTest-stairs": ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-3,
                                                               "lr_range_test_step_size": 3,
                                                               "lr_range_test_staircase": True}},
                           lambda i: ds_lrrt_lr(i, 1e-3, 3, 1.0, True)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_gives_each_update_deepspeeds_rate(name):
    scheduler, get_lr = SCHEDULERS[name]
    config = {"train_batch_size": 2, "scheduler": scheduler,
              "optimizer": {"type": "AdamW", "params": {"lr": 5e-3}}}
    setup = from_config(config)
    n = 45
    assert_rates(rates(setup.schedule, n), per_update(get_lr, n))
    # the optimizer runs on it: its recorded rate after each update is the rate of that update
    tx, params = setup.optimizer, {"w": torch.zeros(3)}
    state = tx.init(params)
    for c in range(4):
        _, state = tx.update({"w": torch.ones(3)}, state, params)
        assert float(zf.optim.learning_rate(state)) == pytest.approx(get_lr(c - 1), rel=2e-7, abs=1e-12)
    assert_report_covers(config, setup.report)


def test_new_schedules_are_deepspeeds_formulas_standalone():
    # lr_range_test and linear_one_cycle count from the first update; warmup_cosine_ratio is get_lr(c).
    assert_rates(rates(zf.optim.lr_range_test(1e-4, 200, 5), 500), [ds_lrrt_lr(c - 1, 1e-4, 200, 5) for c in range(500)])
    assert_rates(rates(zf.optim.lr_range_test(2e-3, 7, 0.5, staircase=True), 50),
                 [ds_lrrt_lr(c - 1, 2e-3, 7, 0.5, True) for c in range(50)])
    assert_rates(rates(zf.optim.linear_one_cycle(1e-4, 1e-3, 10, 4, 0.001, 5), 60),
                 [ds_one_cycle_lr(c - 1, 1e-4, 1e-3, 10, 4, 0.001, 5) for c in range(60)])
    assert_rates(rates(zf.optim.warmup_cosine_ratio(1e-3, 10, 40, 0.05, 0.02), 60),
                 [ds_warmup_cosine_lr(c, 1e-3, 40, 0.05, 10, 0.02) for c in range(60)])


@pytest.mark.parametrize("make", [
    lambda: zf.optim.lr_range_test(1e-4, 5, 2.0, staircase=True),
    lambda: zf.optim.linear_one_cycle(1e-4, 1e-3, 5, 7, 0.1, 2),
    lambda: zf.optim.warmup_cosine_ratio(1e-3, 5, 20),
    lambda: zds.deepspeed_timing(zf.optim.warmup(1e-3, 5), 0.0),
])
def test_new_schedules_trace_to_one_graph(make):
    import torch._dynamo

    schedule = make()
    torch._dynamo.reset()
    compiled = torch.compile(schedule, fullgraph=True, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for c in (0, 1, 3, 5, 12, 20, 31):
            count = torch.tensor(c, dtype=torch.int64)
            assert float(compiled(count)) == float(schedule(count))
    torch._dynamo.reset()


@pytest.mark.parametrize("make, match", [
    (lambda: zf.optim.lr_range_test(1e-3, 0), "step_size must be >= 1"),
    (lambda: zf.optim.lr_range_test(-1e-3, 10), "min_lr must be"),
    (lambda: zf.optim.linear_one_cycle(1e-3, 1e-2, 0), "first_steps must be >= 1"),
    (lambda: zf.optim.warmup_cosine_ratio(1e-3, 10, 10), r"total_steps \(10\) must exceed"),
])
def test_new_schedules_check_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --------------------------------------------------------------------------
# The configs of DeepSpeed's docs and transformers' tests


FIXTURES = {
    # file: (kwargs, expected stack or an error regex)
    "hf_zero2.json": (dict(world_size=2, **HF_ARGS),
                      "shard(offload(mixed_precision(accumulate(train_step, micro_batches=2), policy='fp16', "
                      "initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1, "
                      "consecutive_hysteresis=False), optimizer='host'), stage=2)"),
    "hf_zero3.json": (dict(world_size=2, hidden_size=64, **HF_ARGS),
                      "shard(offload(mixed_precision(accumulate(train_step, micro_batches=2), policy='fp16', "
                      "initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1, "
                      "consecutive_hysteresis=False), optimizer='host', params='host'), stage=3)"),
    "cifar10_tutorial.json": ({}, "train_step"),
    "getting_started.json": ({}, "shard(mixed_precision(train_step, policy='fp16', initial_scale_power=32, "
                                 "loss_scale_window=1000, hysteresis=1, min_loss_scale=1.0), stage=1)"),
    "bert_pretraining.json": ({}, r"optimizer\.params\.max_grad_norm: .*use the top-level \"gradient_clipping\""),
    "zero1_tutorial.json": ({"world_size": 4}, "shard(train_step, stage=1)"),
    "zero2_tutorial.json": ({"world_size": 4}, "shard(train_step, stage=2)"),
    "zero3_offload_tutorial.json": ({}, "shard(offload(train_step, optimizer='host', params='host'), stage=3)"),
    "zero_offload_tutorial.hjson": ({}, "shard(offload(train_step, optimizer='host'), stage=2)"),
    "zero_infinity.json": ({}, "shard(offload(mixed_precision(train_step, policy='fp16', initial_scale_power=32, "
                               "loss_scale_window=1000, hysteresis=1, min_loss_scale=1.0), optimizer='nvme', "
                               "params='nvme', nvme_dir='/nvme_data'), stage=3)"),
    "config_json_page.json": ({"world_size": 2},
                              "shard(offload(checkpoint(mixed_precision(accumulate(train_step, micro_batches=4), "
                              "policy=Policy(param_dtype='fp32', compute_dtype='fp16', output_dtype='fp32', "
                              "reduce_dtype='fp32'), initial_scale_power=16, loss_scale_window=1000, hysteresis=2, "
                              "min_loss_scale=1, consecutive_hysteresis=False), policy='recompute'), "
                              "optimizer='host', device_fraction=0.7, params='host'), stage=3)"),
    "one_cycle_tutorial.json": ({}, "train_step"),
    "lrrt_tutorial.json": ({}, "train_step"),
}


def stack_text(setup) -> str:
    return str(setup).splitlines()[0].removeprefix("stack:").strip()


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_documented_configs_map_or_are_refused(name):
    if name.endswith(".hjson"):
        pytest.importorskip("hjson")
    kwargs, expected = FIXTURES[name]
    path = DATA / name
    if expected.startswith("train_step") or expected.startswith(("shard", "mixed", "offload")):
        setup = from_config(path, **kwargs)
        assert stack_text(setup) == expected
        assert_report_covers(zds.read_config(path), setup.report)
        text = str(setup.report)
        assert all(key in text for key in setup.report.keys())
    else:
        with pytest.raises(DeepSpeedConfigError, match=expected):
            from_config(path, **kwargs)
    assert sorted(FIXTURES) == sorted(p.name for p in DATA.iterdir())


def test_hf_zero3_fills_autos_from_training_args_and_model():
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(hidden_size=64)
    setup = from_config(DATA / "hf_zero3.json", model, world_size=2, training_args=types.SimpleNamespace(**HF_ARGS))
    report = setup.report
    assert (setup.micro_batch_size, setup.micro_batches, setup.train_batch_size) == (4, 2, 16)
    assert setup.gradient_clipping == 0.5
    assert report["zero_optimization.reduce_bucket_size"].auto.startswith("hidden_size² = 4096")
    assert report["zero_optimization.stage3_param_persistence_threshold"].auto.startswith("10 × hidden_size = 640")
    assert report["optimizer.params.betas"].auto == "[adam_beta1, adam_beta2] = [0.9, 0.98]"
    clip, adamw = setup.optimizer.hyperparams["transforms"]
    assert clip.hyperparams["max_norm"] == 0.5
    assert {k: adamw.hyperparams[k] for k in ("name", "b1", "b2", "eps", "weight_decay")} == \
        {"name": "adamw", "b1": 0.9, "b2": 0.98, "eps": 1e-6, "weight_decay": 0.01}
    assert_rates(rates(setup.schedule, 20), per_update(lambda i: ds_warmup_lr(i, 0.0, 3e-4, 10), 20))


def test_training_args_from_a_dict_kwargs_override_and_typos_are_refused():
    args = dict(HF_ARGS, unrelated_hf_field="x")
    setup = from_config(DATA / "hf_zero2.json", world_size=1, training_args=args, learning_rate=1e-3,
                        warmup_steps=0.25, max_steps=40)
    assert setup.report["scheduler.params.warmup_num_steps"].auto == "ceil(max_steps × warmup_steps) = ceil(40 × 0.25)"
    assert_rates(rates(setup.schedule, 15), per_update(lambda i: ds_warmup_lr(i, 0.0, 1e-3, 10), 15))
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_rat'"):
        from_config(DATA / "hf_zero2.json", learning_rat=1e-3)


@pytest.mark.parametrize("drop, match", [
    ("learning_rate", r"optimizer\.params\.betas|scheduler\.params\.warmup_max_lr|is 'auto'"),
    ("per_device_train_batch_size", r"train_batch_size: is 'auto' and nothing fills it: pass "
                                    r"per_device_train_batch_size and gradient_accumulation_steps"),
    ("warmup_steps", r"scheduler\.params\.warmup_num_steps: is 'auto' and nothing fills it: pass warmup_steps"),
    ("fp16", r"fp16\.enabled: is 'auto' and nothing fills it: pass fp16"),
])
def test_an_auto_nothing_fills_names_the_key_and_the_argument(drop, match):
    args = {k: v for k, v in HF_ARGS.items() if k != drop}
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_config(DATA / "hf_zero2.json", world_size=1, **args)


def test_bucket_autos_need_no_model_since_zfunc_ignores_them():
    setup = from_config(DATA / "hf_zero3.json", world_size=1, **HF_ARGS)
    entry = setup.report["zero_optimization.reduce_bucket_size"]
    assert entry.status == "ignored" and entry.value == "auto" and entry.auto is None


def test_values_that_disagree_with_training_args_are_listed_together():
    with pytest.raises(DeepSpeedConfigError) as info:
        from_config(DATA / "cifar10_tutorial.json", learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999)
    message = str(info.value)
    assert "optimizer.params.betas = [0.8, 0.999] but [adam_beta1, adam_beta2] = [0.9, 0.999]" in message
    assert "optimizer.params.lr" not in message   # 1e-3 agrees


# --------------------------------------------------------------------------
# Batch sizes


@pytest.mark.parametrize("given, world, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_batch_size": 12}, 3, (12, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 6}, 2, (12, 6, 1)),
])
def test_batch_sizes_follow_deepspeeds_rule(given, world, expected):
    setup = from_config(given, world_size=world)
    assert (setup.train_batch_size, setup.micro_batch_size, setup.micro_batches) == expected
    assert (setup.transform("accumulate") is not None) == (expected[2] > 1)


@pytest.mark.parametrize("given, world, match", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     r"32 != train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size = 4 × 2 × 2"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 1, "10 is not a multiple of"),
    ({"train_batch_size": 10}, 4, r"not a multiple of the world size \(4\)"),
    ({"gradient_accumulation_steps": 2}, 1, "give train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 0}, 1, "must be a positive whole number"),
    ({"train_micro_batch_size_per_gpu": 2.5}, 1, "must be a positive whole number"),
])
def test_inconsistent_batch_sizes_are_refused(given, world, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_config(given, world_size=world)


# --------------------------------------------------------------------------
# Optimizers


def optimizer_of(opt: dict, **config):
    setup = from_config({"train_batch_size": 1, "optimizer": opt, **config})
    return setup.optimizer.hyperparams


@pytest.mark.parametrize("opt, expected", [
    ({"type": "Adam", "params": {"lr": 1e-3}}, {"name": "adamw", "weight_decay": 0.0}),
    ({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, {"name": "adam", "weight_decay": 0.1}),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, {"name": "adamw", "weight_decay": 0.0}),
    ({"type": "AdamW", "params": {"torch_adam": True}}, {"name": "adamw", "weight_decay": 0.01}),
    ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, {"name": "adam", "weight_decay": 0.0}),
    ({"type": "Adam", "params": {"betas": [0.8, 0.9], "eps": 1e-6}}, {"name": "adamw", "b1": 0.8, "b2": 0.9,
                                                                       "eps": 1e-6}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}},
     {"name": "sgd", "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "learning_rate": 0.1}),
    ({"type": "Lamb", "params": {"max_coeff": 0.3, "min_coeff": 0.01}}, {"name": "deepspeed_lamb", "max_coeff": 0.3,
                                                                        "eps": 1e-8, "weight_decay": 0.0}),
])
def test_optimizer_types_and_defaults(opt, expected):
    hyper = optimizer_of(opt)
    assert {k: hyper[k] for k in expected} == expected


def test_adam_modes_compute_torchs_adam_and_adamw():
    torch.manual_seed(0)
    p0, grads = torch.randn(5), [torch.randn(5) for _ in range(3)]
    for mode, torch_cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        tx = from_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {
            "lr": 0.01, "weight_decay": 0.1, "adam_w_mode": mode}}}).optimizer
        param = torch.nn.Parameter(p0.clone())
        ref = torch_cls([param], lr=0.01, weight_decay=0.1)
        params, state = {"w": p0.clone()}, tx.init({"w": p0})
        for g in grads:
            updates, state = tx.update({"w": g}, state, params)
            params = zf.optim.apply_updates(params, updates)
            param.grad = g.clone()
            ref.step()
        torch.testing.assert_close(params["w"], param.detach(), rtol=1e-6, atol=1e-7)


def fused_lamb_reference(p, grads, lr, b1, b2, eps, wd, max_coeff, min_coeff, eps_inside_sqrt=False,
                         bias_correction=True):
    """DeepSpeed's FusedLamb CUDA kernel, written out in float64 numpy."""
    p, m, v = p.astype(np.float64), np.zeros_like(p, np.float64), np.zeros_like(p, np.float64)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        denom = np.sqrt(v + eps) if eps_inside_sqrt else np.sqrt(v) + eps
        update = m / denom + wd * p
        w_norm, u_norm = np.linalg.norm(p), np.linalg.norm(update)
        coeff = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, min_coeff), max_coeff)
        step = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else lr
        p = p - step * coeff * update
    return p


@pytest.mark.parametrize("extra", [{}, {"eps_inside_sqrt": True}, {"bias_correction": False},
                                   {"max_coeff": 0.3, "weight_decay": 0.01}])
def test_lamb_is_deepspeeds_fused_lamb(extra):
    params_cfg = {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.0, "max_coeff": 10.0,
                  "min_coeff": 0.01, **extra}
    tx = from_config({"train_batch_size": 1, "optimizer": {"type": "Lamb", "params": params_cfg}}).optimizer
    torch.manual_seed(1)
    p0 = torch.randn(4, 3, dtype=torch.float64)
    grads = [torch.randn(4, 3, dtype=torch.float64) for _ in range(4)]
    params, state = {"w": p0.clone()}, tx.init({"w": p0})
    for g in grads:
        updates, state = tx.update({"w": g}, state, params)
        params = zf.optim.apply_updates(params, updates)
    expected = fused_lamb_reference(p0.numpy(), [g.numpy() for g in grads], 0.02, 0.9, 0.99, params_cfg["eps"],
                                    params_cfg["weight_decay"], params_cfg["max_coeff"], 0.01,
                                    params_cfg.get("eps_inside_sqrt", False), params_cfg.get("bias_correction", True))
    # fp32 trust-ratio norms and learning rate, as zfunc's LAMB: fp32 rounding
    np.testing.assert_allclose(params["w"].numpy(), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("opt, config, match", [
    ({"type": "OneBitAdam"}, {}, "optimizer.type: 'onebitadam': 1-bit Adam compresses its communication"),
    ({"type": "Adagrad"}, {}, "zf.optim has no Adagrad"),
    ({"type": "RMSprop"}, {}, "'RMSprop' is not an optimizer zfunc maps"),
    ({"type": "Adam", "params": {"amsgrad": True}}, {}, r"optimizer\.params\.amsgrad: AMSGrad"),
    ({"type": "Adam", "params": {"bias_correction": False}}, {}, "always correct the moments' bias"),
    ({"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}, {}, "gradient_clipping"),
    ({"type": "Adam", "params": {"betas": [0.9]}}, {}, r"betas: must be a list of two numbers"),
    ({"type": "Adam", "params": {"momentum": 0.9}}, {}, r"params\.momentum: is not a parameter of"),
    ({"type": "Lamb"}, {"zero_optimization": {"stage": 2}}, "trust ratio is per partition"),
    ({"type": "SGD", "params": {"maximize": True}}, {}, "negate your loss"),
    ({"type": "Adam", "params": {"betas": [0.9, 1.5]}}, {}, r"optimizer\.params: b2 must be in \[0, 1\)"),
])
def test_optimizers_zfunc_cannot_honour_are_refused(opt, config, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_config({"train_batch_size": 1, "optimizer": opt, **config})


def test_learning_rate_is_reported_once_the_scheduler_is_known():
    setup = from_config(DATA / "cifar10_tutorial.json")
    assert setup.report["optimizer.params.lr"].status == "ignored"
    setup = from_config({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
                         "gradient_clipping": 1.0})
    assert setup.report["optimizer.params.lr"].to == "learning rate 0.02 (no scheduler)"
    assert [t.hyperparams["name"] for t in setup.optimizer.hyperparams["transforms"]] == \
        ["clip_by_global_norm", "adamw"]


@pytest.mark.parametrize("scheduler, optimizer, match", [
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}, {"type": "Adam"},
     r"cycle_momentum: true \(its default\): DeepSpeed's OneCycle would cycle beta1"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}, None, "cycle beta1 of your"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 10}}, {"type": "Adam"}, "resuming a schedule"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 1e-4]}}, {"type": "Adam"}, "one value per parameter group"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, {"type": "Adam"}, "must be 'log' or 'linear'"),
    ({"type": "StepLR", "params": {}}, {"type": "Adam"}, "not a DeepSpeed scheduler zfunc maps"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, {"type": "Adam"},
     r"scheduler\.params\.total_num_steps: is required"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}, None, "pass learning_rate="),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-2, "warmup_max_lr": 1e-3}}, {"type": "Adam"},
     r"scheduler\.params: min_lr .* must not exceed peak_lr"),
])
def test_schedulers_zfunc_cannot_honour_are_refused(scheduler, optimizer, match):
    config = {"train_batch_size": 1, "scheduler": scheduler}
    if optimizer:
        config["optimizer"] = optimizer
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_config(config)


def test_scheduler_without_optimizer_section_gives_the_schedule_alone():
    setup = from_config({"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 30, "warmup_num_steps": 5}}}, learning_rate=2e-3)
    assert setup.optimizer is None
    assert_rates(rates(setup.schedule, 35), per_update(lambda i: ds_warmup_cosine_lr(i, 2e-3, 30, num=5), 35))


# --------------------------------------------------------------------------
# Precision


@pytest.mark.parametrize("config, expected", [
    ({"bf16": {"enabled": True}}, {"policy": "bf16"}),
    ({"bfloat16": {"enabled": True}}, {"policy": "bf16"}),
    ({"bf16": {"enabled": True}, "communication_data_type": "fp32"},
     {"policy": Policy("fp32", "bf16", "fp32", "fp32")}),
    ({"communication_data_type": "bf16"}, {"policy": Policy("fp32", "fp32", "fp32", "bf16")}),
    # ZeRO's DynamicLossScaler: the given keys, or its own defaults (2**32, no hysteresis) when none is given
    ({"fp16": {"enabled": True, "loss_scale_window": 50}, "zero_optimization": {"stage": 1}},
     {"policy": "fp16", "initial_scale_power": 16, "loss_scale_window": 50, "hysteresis": 2, "min_loss_scale": 1,
      "consecutive_hysteresis": False}),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
     {"policy": "fp16", "initial_scale_power": 32, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}),
    # stage 0: FP16_Optimizer (DeepSpeed's FusedAdam) or FP16_UnfusedOptimizer, neither with hysteresis
    ({"fp16": {"enabled": True, "hysteresis": 4}, "optimizer": {"type": "Adam"}},
     {"policy": "fp16", "initial_scale_power": 16, "hysteresis": 1, "loss_scale_window": 1000, "min_loss_scale": 1}),
    ({"fp16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"torch_adam": True}}},
     {"policy": "fp16", "initial_scale_power": 16, "hysteresis": 1, "loss_scale_window": 1000,
      "min_loss_scale": 0.25}),
    ({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 3}}, {"policy": "fp16", "loss_scale": 128}),
])
def test_precision_maps_to_mixed_precision_as_deepspeeds_loss_scalers(config, expected):
    setup = from_config({"train_batch_size": 1, **config})
    call = setup.transform("mixed_precision")
    assert dict(call.kwargs) == expected
    assert_report_covers({"train_batch_size": 1, **config}, setup.report)


def test_fp16_keys_without_effect_are_reported_why():
    setup = from_config({"train_batch_size": 1, "fp16": {"enabled": True, "hysteresis": 4, "auto_cast": True}})
    assert "no hysteresis" in setup.report["fp16.hysteresis"].to
    setup = from_config({"train_batch_size": 1, "fp16": {"enabled": False, "loss_scale_window": 10}})
    assert setup.transform("mixed_precision") is None
    assert setup.report["fp16.loss_scale_window"].to == "fp16 is disabled"


@pytest.mark.parametrize("config, match", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "apex AMP"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16 master weights"),
    ({"communication_data_type": "int8"}, "must be 'fp32', 'fp16' or 'bf16'"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "old name of the bf16 section"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, "adds micro-batch gradients"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}, "zero_optimization": {"stage": 1}},
     r"fp16\.loss_scale_window: loss_scale_window must be an int >= 1"),
])
def test_precision_zfunc_cannot_honour_is_refused(config, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_config({"train_batch_size": 1, **config})


# --------------------------------------------------------------------------
# ZeRO and offload: the planned arguments, as data


@pytest.mark.parametrize("zero, world, expected", [
    ({"stage": 0}, 1, []),
    ({"stage": 0}, 2, [("shard", {"stage": 1})]),
    ({"stage": 3}, 1, [("shard", {"stage": 3})]),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}, 2,
     [("offload", {"optimizer": "host"}), ("shard", {"stage": 2})]),
    ({"stage": 1, "cpu_offload": True}, 2, [("offload", {"optimizer": "host"}), ("shard", {"stage": 1})]),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}, 2,
     [("offload", {"optimizer": "host", "device_fraction": 0.75}), ("shard", {"stage": 3})]),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, 2,
     [("offload", {"optimizer": "host", "device_fraction": 1.0, "params": "host"}), ("shard", {"stage": 3})]),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}, "offload_param": {"device": "cpu"}},
     2, [("offload", {"optimizer": "nvme", "params": "host", "nvme_dir": "/nvme"}), ("shard", {"stage": 3})]),
    ({"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True}}, 2, [("shard", {"stage": 2})]),
])
def test_zero_sections_plan_shard_and_offload(zero, world, expected):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    setup = from_config(config, world_size=world)
    assert [(c.name, dict(c.kwargs)) for c in setup.transforms] == expected
    assert_report_covers(config, setup.report)


def test_offload_sources_name_the_deepspeed_keys():
    setup = from_config(DATA / "zero_infinity.json")
    call = setup.transform("offload")
    assert dict(call.sources) == {
        "optimizer": "zero_optimization.offload_optimizer.device", "params": "zero_optimization.offload_param.device",
        "nvme_dir": "zero_optimization.offload_optimizer.nvme_path and zero_optimization.offload_param.nvme_path"}


@pytest.mark.parametrize("zero, match", [
    ({"stage": 3, "zero_hpz_partition_size": 8}, "zero_hpz_partition_size: 8: ZeRO\\+\\+ hierarchical"),
    ({"stage": 3, "zero_quantized_weights": True}, "quantized weight"),
    ({"stage": 2, "zero_quantized_gradients": True}, "quantized gradient"),
    ({"stage": 3, "mics_shard_size": 4}, "MiCS"),
    ({"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}, "LoCo"),
    ({"stage": 4}, "must be 0, 1, 2 or 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "parameter offload needs stage 3"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "NVMe optimizer offload needs stage 3"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "partial offload needs stage 3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload needs ZeRO stage 1, 2 or 3"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "needs the directory to write to: set nvme_path"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
      "offload_param": {"device": "nvme", "nvme_path": "/b"}}, "offload takes one nvme_dir"),
    ({"stage": 3, "offload_optimizer": {"device": "gpu"}}, "must be 'cpu', 'nvme' or 'none'"),
    ({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, "old spelling of offload_optimizer"),
    ({"stage": 2, "bucket_sizes": 3}, r"zero_optimization\.bucket_sizes: not a DeepSpeed config key"),
])
def test_zero_features_zfunc_lacks_are_refused(zero, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=2)


class FakeOffload:
    """An offload that takes only today's keywords and spellings (optimizer 'cpu' | 'cpu-pytree')."""

    def __init__(self, step, optimizer="cpu", threads=None, overlap=False):
        if optimizer not in ("cpu", "cpu-pytree"):
            raise ValueError(f"offload: optimizer must be 'cpu' or 'cpu-pytree', got {optimizer!r}")
        self.step, self.optimizer = step, optimizer


def test_wrap_names_the_deepspeed_key_a_transform_does_not_take_yet(monkeypatch):
    plain = from_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}})
    params = from_config(DATA / "zero3_offload_tutorial.json").transform("offload")
    monkeypatch.setattr("zfunc.deepspeed.stack.constructor", lambda name: FakeOffload)
    built = build_transform(plain.transform("offload"), "step")
    assert built.optimizer == "cpu"   # the planned 'host', in the spelling this offload knows
    with pytest.raises(NotImplementedError, match=r"zero_optimization\.offload_param\.device maps to "
                                                  r"offload\(params='host'\)"):
        build_transform(params, "step")
    nvme = TransformCall("offload", {"optimizer": "nvme"}, {"optimizer": "zero_optimization.offload_optimizer.device"})
    with pytest.raises(NotImplementedError, match=r"zero_optimization\.offload_optimizer\.device map to "
                                                  r"offload\(step, optimizer='nvme'\), which this version"):
        build_transform(nvme, "step")


# --------------------------------------------------------------------------
# Activation checkpointing, other keys, reading files


def test_activation_checkpointing_maps_to_checkpoint():
    setup = from_config({"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpointing": True,
                                                                             "partition_activations": True}},
                        checkpoint_modules=["blocks.0"])
    assert dict(setup.transform("checkpoint").kwargs) == {"policy": "offload_inputs", "modules": ["blocks.0"]}
    assert setup.report["activation_checkpointing.partition_activations"].status == "ignored"
    assert dict(from_config({"train_batch_size": 1, "activation_checkpointing": {}})
                .transform("checkpoint").kwargs) == {"policy": "recompute"}


@pytest.mark.parametrize("config, match", [
    ({"pipeline": {"stages": 2}}, "pipeline parallelism: zfunc does not have it"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elastic batch sizes"),
    ({"sparse_gradients": True}, "sparse embedding gradients"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor"),
    ({"my_key": 1}, r"my_key: not a DeepSpeed config key zfunc knows.*ignore=\['my_key'\]"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 2}}, r"fp16\.loss_scale_windw: not a DeepSpeed config key"),
])
def test_other_keys_zfunc_cannot_honour_are_refused(config, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_config({"train_batch_size": 1, **config})


def test_disabled_features_and_logging_are_ignored_with_reasons():
    config = {"train_batch_size": 1, "elasticity": {"enabled": False, "max_gpus": 8},
              "tensorboard": {"enabled": True, "output_path": "x"}, "checkpoint": {"use_node_local_storage": True},
              "zero_allow_untested_optimizer": True, "prescale_gradients": True}
    setup = from_config(config)
    assert_report_covers(config, setup.report)
    assert setup.report["elasticity.max_gpus"].to.endswith("disabled")
    assert all(e.status == "ignored" for e in setup.report if e.key != "train_batch_size")


def test_ignore_leaves_keys_to_the_caller():
    config = {"train_batch_size": 1, "my_key": {"a": 1, "b": 2}, "fp16": {"enabled": True}}
    setup = from_config(config, ignore=["my_key", "fp16.enabled"])
    assert setup.transform("mixed_precision") is None
    assert setup.report["my_key.a"].to == "yours: passed in ignore="
    assert_report_covers(config, setup.report)
    with pytest.raises(DeepSpeedConfigError, match="no such key"):
        from_config(config, ignore=["nope"])


def test_the_callers_dict_is_not_changed():
    config = json.loads((DATA / "hf_zero2.json").read_text())
    before = json.dumps(config)
    from_config(config, world_size=1, **HF_ARGS)
    assert json.dumps(config) == before


def test_hjson_only_syntax_without_hjson_is_refused_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "hjson", None)
    with pytest.raises(DeepSpeedConfigError, match=r"is not strict JSON .*install it \(pip install hjson\)"):
        from_config(DATA / "zero_offload_tutorial.hjson")


def test_duplicate_keys_and_missing_files_are_refused(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 1, "train_batch_size": 2}')
    with pytest.raises(DeepSpeedConfigError, match="train_batch_size: appears twice"):
        from_config(path)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        from_config(tmp_path / "missing.json")


def test_report_prints_as_a_table():
    setup = from_config(DATA / "zero2_tutorial.json", world_size=2)
    lines = str(setup.report).splitlines()
    assert lines[0] == "DeepSpeed config: 2 keys mapped, 5 ignored"
    assert lines[1].split()[:3] == ["train_micro_batch_size_per_gpu", "8", "mapped"]
    assert "zero_optimization.overlap_comm" in str(setup)


# --------------------------------------------------------------------------
# End to end: config -> stack -> steps on TinyLM, equal to the same stack built by hand


E2E = {
    "zero2-offload-fp16-accumulate": {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "initial_scale_power": 14, "loss_scale_window": 2, "hysteresis": 2,
                 "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
    },
    "zero3-checkpoint-sgd-onecycle": {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                     "cycle_first_step_size": 2}},
        "zero_optimization": {"stage": 3},
        "activation_checkpointing": {"cpu_checkpointing": True},
    },
    "stage0-lamb-bf16": {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01, "max_coeff": 0.3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6,
                                                          "warmup_max_lr": 1e-2}},
    },
}


def by_hand(name: str, world: int):
    """The stack and optimizer of E2E[name], written with zfunc directly."""
    if name.startswith("zero2"):
        schedule = zds.deepspeed_timing(zf.optim.warmup(1e-2, 3, min_lr=1e-3), 1e-3)
        tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0),
                            zf.optim.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
        wrap = lambda s: shard(offload(mixed_precision(accumulate(s, 2), "fp16", initial_scale_power=14,  # noqa: E731
                                                       loss_scale_window=2, hysteresis=2, min_loss_scale=1)),
                               stage=2)
    elif name.startswith("zero3"):
        tx = zf.optim.sgd(zf.optim.linear_one_cycle(0.01, 0.1, 2), momentum=0.9)
        wrap = lambda s: shard(checkpoint(accumulate(s, 2), policy="offload_inputs"), stage=3)  # noqa: E731
    else:
        schedule = zds.deepspeed_timing(zf.optim.warmup_decay(1e-2, 2, 6), 0.0)
        tx = zds.deepspeed_lamb(schedule, weight_decay=0.01, max_coeff=0.3)
        wrap = (lambda s: shard(mixed_precision(s, "bf16"), stage=1)) if world > 1 else \
            (lambda s: mixed_precision(s, "bf16"))
    return wrap, tx


def train(name: str, use_config: bool, steps: int = 5):
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
        if torch.distributed.is_initialized() else (0, 1)
    _, params, train_step = tiny_lm_step()
    params = {k: v.clone() for k, v in params.items()}
    if use_config:
        setup = from_config(E2E[name])
        assert setup.world_size == world
        wrap, tx = setup.wrap, setup.optimizer
        per_rank = setup.micro_batch_size * setup.micro_batches
    else:
        wrap, tx = by_hand(name, world)
        per_rank = 4
    step = wrap(train_step)
    state = step.init(zf.TrainState.create(params, tx))
    trace = []
    for i in range(steps):
        batch = {k: v.chunk(world)[rank] for k, v in make_batch(per_rank * world, seed=i).items()}
        state, metrics = step(state, batch)
        trace.append((float(metrics["loss"]), float(metrics.get("loss_scale", 1)), bool(metrics.get("skipped", 0))))
    return {k: v.detach().float().clone() for k, v in step.gather(state).items()}, trace


@pytest.fixture(scope="module")
def warm_kernels():
    """Run each config once here: the forked ranks then inherit what the first run loads lazily (offload's
    numba kernel, torch's own lazy initializations: seconds per process on a small machine)."""
    for name in E2E:
        train(name, True, steps=1)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", sorted(E2E))
def test_config_trains_exactly_like_the_stack_built_by_hand(name, world, warm_kernels):
    got = run_distributed(train, world, name, True)
    want = run_distributed(train, world, name, False)
    for (got_params, got_trace), (want_params, want_trace) in zip(got, want):
        assert got_trace == want_trace
        for key in want_params:
            torch.testing.assert_close(got_params[key], want_params[key], rtol=0, atol=0)
    if name.startswith("zero2"):
        skipped = [s for _, _, s in got[0][1]]
        assert any(skipped) and not all(skipped)   # the fp16 keys were exercised: overflow, then recovery
    for params, _ in got[1:]:
        for key in params:
            torch.testing.assert_close(params[key], got[0][0][key], rtol=0, atol=0)
