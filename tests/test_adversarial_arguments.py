"""Arguments that must be refused (or, where they mean something, honoured exactly).

Every optimizer, schedule and transform argument that cannot be used (NaN,
inf, negative, out of range, a bool or a string where a number goes, a unit
name that matches nothing) is refused when it is given, with a message that
names the argument and says what to pass; never accepted to produce NaN
parameters, an infinite loss scale or a unit that is silently empty.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, single_thread, train  # noqa: F401 (single_thread: a fixture)
from tests.models import make_batch, tiny_lm_step
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

pytestmark = pytest.mark.usefixtures("single_thread")

O = zf.optim
NAN, INF = float("nan"), float("inf")


def _step(state, batch):  # a placeholder step for constructors that only check their arguments
    return state, {}


# -- optimizers ------------------------------------------------------------------

OPTIMIZER_ARGUMENTS = {
    "clip-nan": (lambda: O.clip_by_global_norm(NAN), ["max_norm", "finite", "leave clip_by_global_norm out"]),
    "clip-inf": (lambda: O.clip_by_global_norm(INF), ["max_norm", "finite", "leave clip_by_global_norm out"]),
    "clip-negative": (lambda: O.clip_by_global_norm(-1.0), ["max_norm", "> 0", "leave clip_by_global_norm out"]),
    "clip-zero": (lambda: O.clip_by_global_norm(0.0), ["max_norm", "> 0"]),
    "clip-string": (lambda: O.clip_by_global_norm("1.0"), ["max_norm", "finite number", "'1.0'"]),
    "clip-bool": (lambda: O.clip_by_global_norm(True), ["max_norm", "finite number", "True"]),
    "clip-tensor": (lambda: O.clip_by_global_norm(torch.tensor(1.0)), ["max_norm", "finite number"]),
    "adam-lr-nan": (lambda: O.adam(NAN), ["lr", "finite"]),
    "adam-lr-negative": (lambda: O.adam(-1e-3), ["lr", ">= 0", "negate the loss"]),
    "adam-lr-overflows-float32": (lambda: O.adam(1e39), ["lr", "float32"]),
    "adam-b1-one": (lambda: O.adam(1e-3, b1=1.0), ["b1", r"\[0, 1\)", "typical"]),
    "adam-b2-negative": (lambda: O.adam(1e-3, b2=-0.1), ["b2", r"\[0, 1\)"]),
    "adam-eps-negative": (lambda: O.adam(1e-3, eps=-1e-8), ["eps", ">= 0"]),
    "adamw-weight-decay-negative": (lambda: O.adamw(1e-3, weight_decay=-0.1), ["weight_decay", ">= 0"]),
    "adamw-weight-decay-nan": (lambda: O.adamw(1e-3, weight_decay=NAN), ["weight_decay", "finite"]),
    "adamw-mask-int": (lambda: O.adamw(1e-3, mask=3), ["mask", "callable", "dict"]),
    "lamb-eps-inf": (lambda: O.lamb(1e-3, eps=INF), ["eps", "finite"]),
    "sgd-momentum-negative": (lambda: O.sgd(0.1, momentum=-0.9), ["momentum", ">= 0"]),
    "sgd-nesterov-without-momentum": (lambda: O.sgd(0.1, nesterov=True), ["nesterov", "momentum > 0"]),
    "sgd-nesterov-string": (lambda: O.sgd(0.1, momentum=0.9, nesterov="yes"), ["nesterov", "True or False"]),
    "sgd-dampening-above-one": (lambda: O.sgd(0.1, momentum=0.9, dampening=2.0), ["dampening", r"\[0, 1\]"]),
    "scale_by_adam-b1-above-one": (lambda: O.scale_by_adam(b1=2.0), ["b1", r"\[0, 1\)"]),
    "scale_by_adam-eps-nan": (lambda: O.scale_by_adam(eps=NAN), ["eps", "finite"]),
    "trace-momentum-nan": (lambda: O.trace(NAN), ["momentum", "finite"]),
    "add_decayed_weights-negative": (lambda: O.add_decayed_weights(-0.1), ["weight_decay", ">= 0"]),
    "scale_by_trust_ratio-nan": (lambda: O.scale_by_trust_ratio(NAN), ["trust_coefficient", "finite"]),
    "scale_by_learning_rate-negative": (lambda: O.scale_by_learning_rate(-0.1), ["lr", ">= 0"]),
    "decoupled-weight-decay-bool": (lambda: O.scale_by_learning_rate(0.1, decoupled_weight_decay=True),
                                    ["decoupled_weight_decay", "finite number"]),
    "chain-of-a-string": (lambda: O.chain(O.sgd(0.1), "adam"), ["chain", "GradientTransformation"]),
}


@outcome("clear")
@pytest.mark.parametrize("case", list(OPTIMIZER_ARGUMENTS))
def test_optimizer_arguments_are_refused(case):
    build, words = OPTIMIZER_ARGUMENTS[case]
    clear_error(build, *words, exc=(ValueError, TypeError))


# -- schedules -------------------------------------------------------------------

SCHEDULE_ARGUMENTS = {
    "constant-negative": (lambda: O.constant(-1.0), ["lr", ">= 0"]),
    "constant-overflows-float32": (lambda: O.constant(1e39), ["lr", "float32"]),
    "warmup-nan": (lambda: O.warmup(NAN, 10), ["peak_lr", "finite"]),
    "warmup-steps-float": (lambda: O.warmup(1.0, 10.0), ["warmup_steps", "int"]),
    "warmup-steps-negative": (lambda: O.warmup(1.0, -1), ["warmup_steps", ">= 0"]),
    "warmup_cosine-total-below-warmup": (lambda: O.warmup_cosine(1.0, 10, 5), ["total_steps", "warmup_steps"]),
    "warmup_cosine-min-above-peak": (lambda: O.warmup_cosine(1.0, 1, 5, min_lr=2.0), ["min_lr", "peak_lr", "swap"]),
    "warmup_decay-peak-inf": (lambda: O.warmup_decay(INF, 1, 10), ["peak_lr", "finite"]),
    "one_cycle-pct-zero": (lambda: O.one_cycle(1.0, 100, pct_start=0.0), ["pct_start", r"\(0, 1\)"]),
    "one_cycle-div-zero": (lambda: O.one_cycle(1.0, 100, div_factor=0), ["div_factor", "> 0"]),
    "lr_range_test-negative-rate": (lambda: O.lr_range_test(1.0, 10, step_rate=-1.0), ["step_rate", ">= 0"]),
    "warmup_cosine_ratio-negative-ratio": (lambda: O.warmup_cosine_ratio(1.0, 2, 10, cos_min_ratio=-0.5),
                                           ["cos_min_ratio", ">= 0"]),
}


@outcome("clear")
@pytest.mark.parametrize("case", list(SCHEDULE_ARGUMENTS))
def test_schedule_arguments_are_refused(case):
    build, words = SCHEDULE_ARGUMENTS[case]
    clear_error(build, *words, exc=(ValueError, TypeError))


PARAMS = {"w": torch.zeros(3)}


@outcome("clear")
@pytest.mark.parametrize("rate", [-1e-3, NAN, INF], ids=["negative", "nan", "inf"])
def test_a_user_schedule_whose_first_rate_is_unusable_is_refused_at_init(rate):
    tx = O.adamw(lambda count: torch.full((), rate) + 0 * count)
    clear_error(lambda: tx.init(PARAMS), "schedule returned", "count 0", "finite number >= 0")


@outcome("clear")
def test_a_user_schedule_returning_a_string_is_refused():
    clear_error(lambda: O.sgd(lambda count: "1e-3").init(PARAMS), "schedule", "returned str", "number or a 0-d")


@outcome("right")
@pytest.mark.parametrize("alias", ["sgd", "adam", "adamw"])
def test_a_user_schedule_may_return_python_numbers(alias):
    """``lambda count: 0.01`` means what it says: the same trajectory as the constant 0.01."""
    make = {"sgd": lambda lr: O.sgd(lr, momentum=0.9), "adam": O.adam, "adamw": O.adamw}[alias]
    batches = [make_batch(seed=i) for i in range(2)]
    results = []
    for lr in (0.01, lambda count: 0.01):
        _, params, step = tiny_lm_step()
        state, _ = train(step, zf.TrainState.create(copies(params), make(lr)), batches)
        results.append(state.params)
    assert_same(results[1], results[0])


@outcome("right")
def test_every_built_in_schedule_stays_finite_and_nonnegative():
    schedules = [O.warmup(1.0, 10), O.warmup_decay(1.0, 5, 20), O.warmup_cosine(1.0, 5, 20, min_lr=0.1),
                 O.one_cycle(1.0, 20), O.warmup_cosine_ratio(1.0, 5, 20), O.linear_one_cycle(0.1, 1.0, 5),
                 O.linear_one_cycle(1.0, 0.1, 5, decay_rate=0.5, decay_steps=3), O.lr_range_test(0.1, 3),
                 O.warmup_cosine_ratio(3e38, 2, 10, warmup_min_ratio=0.0, cos_min_ratio=0.0)]
    counts = torch.arange(0, 200)
    for schedule in schedules:
        values = torch.stack([schedule(c) for c in counts])
        assert values.dtype == torch.float32 and torch.isfinite(values).all() and (values >= 0).all()


# -- transforms ------------------------------------------------------------------

TRANSFORM_ARGUMENTS = {
    "shard-stage-True": (lambda: shard(_step, stage=True), ["stage", "1, 2 or 3"]),
    "shard-stage-string": (lambda: shard(_step, stage="3"), ["stage", "1, 2 or 3"]),
    "shard-stage-zero": (lambda: shard(_step, stage=0), ["stage", "1, 2 or 3"]),
    "shard-units-string": (lambda: shard(_step, units="blocks.0"), ["units", "list of module names"]),
    "shard-reshard-unknown": (lambda: shard(_step, reshard="drop"), ["reshard", "release", "recompute"]),
    "shard-timeout-zero": (lambda: shard(_step, timeout=0), ["timeout", "positive"]),
    "shard-timeout-nan": (lambda: shard(_step, timeout=NAN), ["timeout", "positive"]),
    "shard-verify-int": (lambda: shard(_step, verify=1), ["verify", "True or False"]),
    "accumulate-zero": (lambda: accumulate(_step, 0), ["micro_batches", "positive int"]),
    "accumulate-negative": (lambda: accumulate(_step, -2), ["micro_batches", "positive int"]),
    "accumulate-bool": (lambda: accumulate(_step, True), ["micro_batches", "positive int"]),
    "accumulate-float": (lambda: accumulate(_step, 2.0), ["micro_batches", "positive int"]),
    "accumulate-string": (lambda: accumulate(_step, "2"), ["micro_batches", "positive int"]),
    "offload-threads-zero": (lambda: offload(_step, threads=0), ["threads", "positive int"]),
    "offload-threads-bool": (lambda: offload(_step, threads=True), ["threads", "positive int"]),
    "offload-threads-float": (lambda: offload(_step, threads=1.5), ["threads", "positive int"]),
    "offload-optimizer-unknown": (lambda: offload(_step, optimizer="gpu"), ["optimizer", "host"]),
    "checkpoint-modules-empty": (lambda: checkpoint(_step, modules=[]), ["modules", "non-empty list"]),
    "checkpoint-modules-int": (lambda: checkpoint(_step, modules=3), ["modules", "module class"]),
    "checkpoint-modules-list-of-classes": (lambda: checkpoint(_step, modules=[nn.Linear]), ["tuple of classes"]),
    "checkpoint-modules-instance": (lambda: checkpoint(_step, modules=nn.Linear(2, 2)), ["modules", "module class"]),
    "checkpoint-modules-string": (lambda: checkpoint(_step, modules="blocks.0"), ["modules", "list of names"]),
    "checkpoint-policy-unknown": (lambda: checkpoint(_step, policy="fast"), ["policy", "recompute", "save_ops"]),
    "policy-int8": (lambda: mixed_precision(_step, torch.int8), ["policy", "bf16", "fp16"]),
    "policy-typo": (lambda: mixed_precision(_step, "bf32"), ["policy", "bf16"]),
    "policy-None": (lambda: mixed_precision(_step, None), ["policy", "string", "Policy"]),
    "policy-reduce-fp8": (lambda: mixed_precision(_step, "params=fp32,compute=bf16,output=fp32,reduce=fp8"),
                          ["reduce_dtype", "fp32"]),
    "loss_scale-nan": (lambda: mixed_precision(_step, "fp16", loss_scale=NAN), ["loss_scale", "positive"]),
    "loss_scale-overflows-float32": (lambda: mixed_precision(_step, "fp16", loss_scale=1e39),
                                     ["loss_scale", "float32"]),
    "loss_scale-negative": (lambda: mixed_precision(_step, "fp16", loss_scale=-1.0), ["loss_scale", "positive"]),
    "loss_scale-under-bf16": (lambda: mixed_precision(_step, "bf16", loss_scale=128.0), ["fp16", "no loss scaling"]),
    "initial_scale_power-overflows-float32": (lambda: mixed_precision(_step, "fp16", initial_scale_power=200),
                                              ["initial_scale_power", "at most 127", "inf"]),
    "initial_scale_power-negative": (lambda: mixed_precision(_step, "fp16", initial_scale_power=-1),
                                     ["initial_scale_power", "int >= 0"]),
    "loss_scale_window-zero": (lambda: mixed_precision(_step, "fp16", loss_scale_window=0),
                               ["loss_scale_window", "int >= 1"]),
    "hysteresis-bool": (lambda: mixed_precision(_step, "fp16", hysteresis=True), ["hysteresis", "int >= 1"]),
    "min_loss_scale-zero": (lambda: mixed_precision(_step, "fp16", min_loss_scale=0), ["min_loss_scale", "positive"]),
    "min_loss_scale-bool": (lambda: mixed_precision(_step, "fp16", min_loss_scale=True),
                            ["min_loss_scale", "positive"]),
    "consecutive_hysteresis-string": (lambda: mixed_precision(_step, "fp16", consecutive_hysteresis="yes"),
                                      ["consecutive_hysteresis", "True or False"]),
    "cast_buffers-string": (lambda: mixed_precision(_step, "bf16", cast_buffers="no"), ["cast_buffers", "True or False"]),
}


@outcome("clear")
@pytest.mark.parametrize("case", list(TRANSFORM_ARGUMENTS))
def test_transform_arguments_are_refused(case):
    build, words = TRANSFORM_ARGUMENTS[case]
    clear_error(build, *words, exc=(ValueError, TypeError))


UNITS = {
    "no-such-module": (["blocks.7"], ["blocks.7", "no trainable parameter", "name modules"]),
    "typo": (["blocks.0.nrom"], ["blocks.0.nrom", "no trainable parameter"]),
    "a-parameter-not-a-module": (["blocks.0.up.weight"], ["blocks.0.up.weight", "no trainable parameter"]),
    "nested": (["blocks.0", "blocks.0.up"], ["blocks.0.up", "inside unit 'blocks.0'", "name each module once"]),
    "named-twice": (["blocks.0", "blocks.0"], ["named twice"]),
    "a-container": (["blocks"], ["ModuleList", "container", "blocks.0"]),
    "empty-name": ([""], ["module names", "non-empty"]),
}


@outcome("clear")
@pytest.mark.parametrize("case", list(UNITS))
def test_shard_units_that_match_nothing_or_overlap_are_refused(case):
    units, words = UNITS[case]
    _, params, step = tiny_lm_step()
    stepped = shard(step, stage=3, units=units)
    clear_error(lambda: stepped(stepped.init(zf.TrainState.create(copies(params), O.sgd(0.1))), make_batch()),
                *words, exc=ValueError)


@outcome("right")
def test_shard_with_no_units_keeps_everything_in_the_root_and_says_so():
    batches = [make_batch(seed=i) for i in range(2)]
    _, params, step = tiny_lm_step()
    ref, _ = train(step, zf.TrainState.create(copies(params), O.sgd(0.1)), batches)
    stepped = shard(step, stage=3, units=[])
    with pytest.warns(UserWarning, match="root unit holds 100%"):
        state, _ = train(stepped, zf.TrainState.create(copies(params), O.sgd(0.1)), batches)
    assert_same(stepped.gather(state), ref.params)


@outcome("clear")
def test_shard_stage_as_a_float_is_refused():
    clear_error(lambda: shard(_step, stage=3.0), "stage", "1, 2 or 3", exc=ValueError)


@outcome("right")
def test_accumulate_takes_numpy_integers():
    batches = [make_batch(seed=i) for i in range(2)]
    results = []
    for k in (2, np.int64(2)):
        _, params, step = tiny_lm_step()
        state, _ = train(accumulate(step, k), zf.TrainState.create(copies(params), O.sgd(0.1)), batches)
        results.append(state.params)
    assert_same(results[1], results[0])


@outcome("clear")
def test_accumulate_refuses_a_batch_it_cannot_split():
    _, params, step = tiny_lm_step()
    stepped = accumulate(step, 3)
    clear_error(lambda: stepped(stepped.init(zf.TrainState.create(copies(params), O.sgd(0.1))), make_batch(8)),
                "micro_batches=3", "shape", "multiple of 3", exc=ValueError)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class Holder:
    def __init__(self, batch: dict) -> None:
        self.x, self.y = batch["x"], batch["y"]


def _as(kind: str, batch: dict):
    if kind == "BatchEncoding":
        return pytest.importorskip("transformers").BatchEncoding(dict(batch))
    return {"dict": dict, "dataclass": lambda b: Batch(**b), "object": Holder}[kind](batch)


def _accumulated(kind: str) -> tuple:
    model, params, _ = tiny_lm_step()
    apply_fn, _ = zf.functional(model)
    rows = []

    def loss_fn(p, batch):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) or hasattr(batch, "keys") else (batch.x, batch.y)
        rows.append(x.shape[0])
        return torch.nn.functional.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    def step(state, batch):
        _, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {}

    state, _ = train(accumulate(step, 2), zf.TrainState.create(copies(params), O.sgd(0.1)),
                     [_as(kind, make_batch(seed=i)) for i in range(2)])
    return state.params, rows


@outcome("right")
@pytest.mark.parametrize("kind", ["BatchEncoding", "dataclass"])
def test_accumulate_splits_batches_in_mappings_and_dataclasses(kind):
    """A Hugging Face BatchEncoding (a mapping zfunc's pytrees do not open) used to reach every micro-batch
    whole: the same numbers at k times the compute and the full batch's activation memory."""
    got, rows = _accumulated(kind)
    want, _ = _accumulated("dict")
    assert rows == [4, 4, 4, 4]  # two steps of two micro-batches of 4 rows
    assert_same(got, want)


@outcome("clear")
def test_accumulate_refuses_a_batch_object_it_cannot_split():
    clear_error(lambda: _accumulated("object"), "cannot split a Holder", "x, y", "dict, tuple, list or dataclass",
                exc=ValueError)


@outcome("right")
def test_the_policy_accepts_torch_dtypes():
    batches = [make_batch(seed=i) for i in range(2)]
    results = []
    for policy in ("bf16", torch.bfloat16):
        _, params, step = tiny_lm_step()
        stepped = mixed_precision(step, policy)
        state, _ = train(stepped, zf.TrainState.create(copies(params), O.adamw(1e-2)), batches)
        results.append(stepped.gather(state))
    assert repr(mixed_precision(_step, torch.bfloat16)) == repr(mixed_precision(_step, "bf16"))
    assert_same(results[1], results[0])


CHECKPOINT_MODULES = {
    "no-such-module": (["blocks.9"], ["checkpoint", "blocks.9"]),
    "a-container": (["blocks"], ["ModuleList", "container", "blocks.0"]),
    "predicate-matching-nothing": (lambda name: name.startswith("layers."), ["no blocks", "nothing matched"]),
    "class-absent-from-the-model": (nn.Conv2d, ["no blocks", "nothing matched"]),
}


@outcome("clear")
@pytest.mark.parametrize("case", list(CHECKPOINT_MODULES))
def test_checkpoint_modules_that_select_nothing_are_refused(case):
    modules, words = CHECKPOINT_MODULES[case]
    _, params, step = tiny_lm_step()
    stepped = checkpoint(step, modules=modules)
    state = zf.TrainState.create(copies(params), O.sgd(0.1))
    clear_error(lambda: stepped(state, make_batch()), *words, exc=ValueError)


# -- apply_fn and value_and_grad ---------------------------------------------------

@outcome("clear")
@pytest.mark.parametrize("stack", ["plain", "mixed_precision", "shard3", "checkpoint"])
def test_an_unknown_keyword_argument_to_apply_fn_reaches_the_model(stack):
    """A model whose forward has no ``**kwargs`` refuses ``bogus=1`` with torch's TypeError naming it; no
    transform swallows or drops it."""
    model, params, _ = tiny_lm_step()
    apply_fn, _ = zf.functional(model)

    def step(state, batch):
        loss, grads = zf.value_and_grad(lambda p, b: apply_fn(p, b["x"], bogus=1).sum())(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    wrap = {"plain": lambda s: s, "mixed_precision": lambda s: mixed_precision(s, "bf16"),
            "shard3": lambda s: shard(s, stage=3), "checkpoint": checkpoint}[stack]
    stepped = wrap(step)
    state = zf.init(stepped, zf.TrainState.create(copies(params), O.sgd(0.1)))
    clear_error(lambda: stepped(state, make_batch()), "unexpected keyword argument", "bogus", exc=TypeError)


@outcome("clear")
@pytest.mark.parametrize("extra", ["typo", "frozen-parameter", "buffer"])
def test_apply_fn_refuses_params_it_would_ignore(extra):
    model, params, _ = tiny_lm_step()
    apply_fn, _ = zf.functional(model)
    name = {"typo": "blocks.0.up.weigth", "frozen-parameter": "frozen_scale", "buffer": "offset"}[extra]
    bad = {**params, name: torch.zeros(10)}
    clear_error(lambda: apply_fn(bad, make_batch()["x"]), name, "not a trainable parameter", exc=ValueError)


@outcome("clear")
def test_value_and_grad_refuses_what_is_not_a_function_or_a_loss():
    clear_error(lambda: zf.value_and_grad(3), "takes a function", exc=TypeError)
    vg = zf.value_and_grad(lambda p: (p["w"].sum(), 1.0), has_aux=False)
    clear_error(lambda: vg({"w": torch.ones(2)}), "scalar tensor", "has_aux=True", exc=TypeError)
    vg = zf.value_and_grad(lambda p: p["w"].sum(), has_aux=True)
    clear_error(lambda: vg({"w": torch.ones(2)}), "has_aux=True", r"\(loss, aux\)", exc=TypeError)
