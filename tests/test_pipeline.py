"""pipeline: each schedule, composition with shard on a (dp, pp) mesh, tied weights, clipping, bad input,
counters, gather and checkpoints, against the plain step element-wise (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import zfunc as zf
from tests.models import make_batch, tiny_lm_step
from zfunc.mesh import make_mesh
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, pipeline, shard

transformers.logging.set_verbosity_error()
STEPS = 2
BATCH = 8


# -- models -----------------------------------------------------------------------------------------------
class UnevenBlock(nn.Module):
    def __init__(self, width: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=bias)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class UnevenMLP(nn.Module):
    """A plain torch model: blocks of very different sizes (one without a bias, one with a frozen weight),
    an input projection before them and a head after."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.Sequential(*(UnevenBlock(width, h, bias=i != 1) for i, h in enumerate((3, 29, 5, 17, 2))))
        self.blocks[2].up.weight.requires_grad_(False)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def hf_config(name: str, layers: int = 4):
    if name == "gpt2":
        return transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_embd=16, n_layer=layers, n_head=2, n_positions=16, vocab_size=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32, tie_word_embeddings=name == "llama-tied")


def build(model: str, opt: str = "adamw"):
    """``(train_step, plain state, batch_of(i))`` for a model, identical on every rank."""
    torch.manual_seed(0)
    if model == "tiny":
        net = tiny_lm_step(depth=5)[0]
    elif model == "uneven":
        net = UnevenMLP()
    else:
        cls, cfg = hf_config(model)
        net = cls(cfg)
    apply_fn, params = zf.functional(net)
    if model == "uneven":
        def loss_fn(p, batch):
            return F.mse_loss(apply_fn(p, batch["x"]), batch["y"])

        def batch_of(i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(BATCH, 4, generator=g), "y": torch.randn(BATCH, 3, generator=g)}
    elif model == "tiny":
        def loss_fn(p, batch):
            logits = apply_fn(p, batch["x"])
            return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

        def batch_of(i):
            return make_batch(BATCH, seed=i)
    else:
        def loss_fn(p, batch):
            return apply_fn(p, input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

        def batch_of(i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(0, 32, (BATCH, 6), generator=g)}

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    # (Hugging Face models train with SGD here: GPT-2's attention key bias has a gradient that is zero but for
    # rounding, and Adam's first steps turn any rounding difference there into a full-size update.)
    hf = model not in ("tiny", "uneven")
    tx = zf.optim.sgd(0.1, momentum=0.9) if hf else zf.optim.adamw(1e-2, weight_decay=0.1)
    if opt == "clip":
        tx = zf.optim.chain(zf.optim.clip_by_global_norm(0.05), tx)
    state = zf.TrainState.create({k: v.clone() for k, v in params.items()}, tx, ties=params.ties, blocks=params.blocks)
    return train_step, state, batch_of


def plain(model: str, opt: str = "adamw", micro_batches: int = 2) -> dict:
    """The reference: the plain step, accumulated over the pipeline's micro-batches (`accumulate` equals the
    plain step, tests/test_transforms.py; with the same micro-batches the float sums are the pipeline's, so
    Adam's first steps, which amplify rounding where a gradient is near zero, compare tightly)."""
    step, state, batch_of = build(model, opt)
    step = accumulate(step, micro_batches) if micro_batches > 1 else step
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, batch_of(i))
        losses.append(float(metrics["loss"]))
    return {"params": {k: v.numpy().copy() for k, v in state.params.items()}, "losses": losses}


def pipelined(model: str, schedule: str = "1F1B", micro_batches: int = 2, opt: str = "adamw", dp: int = 1,
              pp: int = 2, wrap=None, offloaded: bool = False, stage: int = 1) -> dict:
    step, state, batch_of = build(model, opt)
    mesh = make_mesh(dp=dp, pp=pp)
    inner = wrap(step) if wrap is not None else step
    pipelined_step = pipeline(inner, schedule=schedule, micro_batches=micro_batches, mesh=mesh)
    if offloaded:  # the optimizer state and its update on the host (the CPU here: the pytree update's path)
        pipelined_step = offload(pipelined_step)
    if dp > 1 or offloaded:
        pipelined_step = shard(pipelined_step, stage=stage, mesh=mesh)
    state = pipelined_step.init(state)
    dp_rank = mesh["dp"].get_local_rank()
    keys = sorted(state.params)
    losses = []
    for i in range(STEPS):
        batch = {k: v.chunk(dp)[dp_rank] for k, v in batch_of(i).items()}
        state, metrics = pipelined_step(state, batch)
        losses.append(float(metrics["loss"]))
    full = pipelined_step.gather(state)
    return {"params": {k: v.numpy().copy() for k, v in full.items()}, "losses": losses, "keys": keys,
            "counters": {k: v for k, v in metrics.items() if k.startswith("pp_")}, "repr": repr(pipelined_step)}


def assert_equivalent(outs: list, ref: dict, dp: int = 1) -> None:
    for rank, out in enumerate(outs):
        assert out["params"].keys() == ref["params"].keys()
        for key, value in ref["params"].items():
            np.testing.assert_allclose(out["params"][key], value, rtol=2e-5, atol=2e-6, err_msg=f"rank {rank} {key}")
        if dp == 1:
            np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-5)


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(model: str, opt: str = "adamw", micro_batches: int = 2) -> dict:
        if (model, opt, micro_batches) not in cache:
            cache[model, opt, micro_batches] = run_distributed(plain, 1, model, opt, micro_batches)[0]
        return cache[model, opt, micro_batches]
    return get


# -- equivalence ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "uneven", "gpt2"])
def test_pp2_1f1b_equals_the_plain_step(model, references):
    outs = run_distributed(pipelined, 2, model)
    assert_equivalent(outs, references(model))
    # Each rank holds its stage's parameters only; together every parameter once.
    assert not set(outs[0]["keys"]) & set(outs[1]["keys"])
    assert set(outs[0]["keys"]) | set(outs[1]["keys"]) == set(references(model)["params"])
    if model == "gpt2":
        # The tied wte is the embedding (stage 0) and the head (stage 1): stage 0 owns it, and its update uses
        # both uses' gradients (the equality above); stage 1 holds no copy that could drift.
        assert "transformer.wte.weight" in outs[0]["keys"] and "transformer.wte.weight" not in outs[1]["keys"]
        assert "transformer.ln_f.weight" in outs[1]["keys"] and "transformer.wpe.weight" in outs[0]["keys"]
        assert outs[0]["counters"]["pp_tied_sent"] == 1 and outs[1]["counters"]["pp_tied_received"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "llama-tied"])
def test_pp2_llama_equals_the_plain_step(model, references):
    assert_equivalent(run_distributed(pipelined, 2, model), references(model))


@pytest.mark.parametrize("schedule", ["interleaved", "zero_bubble"])
def test_interleaved_schedules_equal_the_plain_step(schedule, references):
    # Two stages per rank (blocks 0-1 and 3 on rank 0, 2 and 4 with the head on rank 1).
    outs = run_distributed(pipelined, 2, "tiny", schedule, 4)
    assert_equivalent(outs, references("tiny", "adamw", 4))
    assert {"blocks.0.up.weight", "blocks.1.up.weight", "blocks.3.up.weight"} <= set(outs[0]["keys"])
    assert {"blocks.2.up.weight", "blocks.4.up.weight", "final_norm.weight"} <= set(outs[1]["keys"])


def test_clipping_by_the_global_norm_over_stages(references):
    # The clip's norm must be the whole model's (psum over pp; the tied weight counted once): a per-stage
    # norm would clip each stage differently from the plain step.
    ref = references("tiny", "clip")
    assert_equivalent(run_distributed(pipelined, 2, "tiny", "1F1B", 2, "clip"), ref)


def test_pp2_x_dp2_with_shard_on_a_mesh(references):
    outs = run_distributed(pipelined, 4, "gpt2", "1F1B", 2, "clip", 2, 2)
    assert_equivalent(outs, references("gpt2", "clip", 4), dp=2)
    assert "shard(pipeline(train_step, stages=2, schedule='1F1B', micro_batches=2, mesh='dp2xpp2xtp1'), stage=1" \
        in outs[0]["repr"]
    # The two dp replicas of a stage hold the same parameters; stage ranks differ.
    mesh_pp = [0, 1, 0, 1]
    for rank, out in enumerate(outs):
        assert out["keys"] == outs[mesh_pp[rank]]["keys"]


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_around_a_pipeline_on_a_mesh(stage, references):
    # shard(offload(pipeline(...))): each stage's optimizer state on its ranks' hosts, pp2 x dp2, clipping
    outs = run_distributed(pipelined, 4, "gpt2", "1F1B", 2, "clip", 2, 2, None, True, stage)
    assert_equivalent(outs, references("gpt2", "clip", 4), dp=2)
    assert outs[0]["repr"].startswith(f"shard(offload(pipeline(train_step")


@pytest.mark.slow
def test_pp4_equals_the_plain_step(references):
    outs = run_distributed(pipelined, 4, "uneven", "1F1B", 4, "clip", 1, 4)
    assert_equivalent(outs, references("uneven", "clip", 4))


def test_pipeline_over_checkpoint_and_mixed_precision_fp32(references):
    wrap = lambda step: checkpoint(mixed_precision(step, "fp32"))  # noqa: E731
    assert_equivalent(run_distributed(pipelined, 2, "tiny", "1F1B", 2, "adamw", 1, 2, wrap), references("tiny"))


# -- counters -------------------------------------------------------------------------------------------------
def test_counters_one_activation_and_one_gradient_per_micro_batch_and_boundary():
    outs = run_distributed(pipelined, 2, "uneven", "1F1B", 4)
    first, last = outs[0]["counters"], outs[1]["counters"]
    m, width = 4, 6
    assert first == {"pp_activations_sent": m, "pp_activations_received": 0, "pp_gradients_sent": 0,
                     "pp_gradients_received": m, "pp_tied_sent": 0, "pp_tied_received": 0,
                     "pp_elements": 2 * BATCH * width}
    assert last == {"pp_activations_sent": 0, "pp_activations_received": m, "pp_gradients_sent": m,
                    "pp_gradients_received": 0, "pp_tied_sent": 0, "pp_tied_received": 0,
                    "pp_elements": 2 * BATCH * width}


# -- ordering and bad input -------------------------------------------------------------------------------------
def test_ordering_rules_name_the_right_order():
    step = tiny_lm_step()[2]
    with pytest.raises(ValueError, match=r"offload\(pipeline\(step\)\) instead of pipeline\(offload\(step\)\)"):
        pipeline(offload(step))
    with pytest.raises(ValueError, match=r"pipeline\(checkpoint\(step\)\) instead of checkpoint\(pipeline\(step\)\)"):
        checkpoint(pipeline(step))
    with pytest.raises(ValueError, match=r"pipeline\(mixed_precision\(step\)\) instead"):
        mixed_precision(pipeline(step), "bf16")
    shard(offload(pipeline(checkpoint(mixed_precision(step, "bf16")))), stage=1)  # the right order builds


def bad_inputs() -> dict:
    out = {}
    step, state, batch_of = build("tiny")
    pipelined_step = pipeline(step, micro_batches=3)
    s = pipelined_step.init(state)
    try:
        pipelined_step(s, batch_of(0))  # batch 8, 3 micro-batches
    except ValueError as err:
        out["micro_batches"] = str(err)
    step, state, _ = build("uneven")
    try:
        pipeline(step, schedule="interleaved", micro_batches=2).init(state)  # 4 stages, 5 blocks: fine
        out["interleaved_ok"] = True
        step, state, _ = build("tiny")
        state = zf.TrainState.create(state.params, state.tx, ties=dict(state.ties), blocks=list(state.blocks)[:3])
        pipeline(step, schedule="interleaved").init(state)  # 4 stages, 3 blocks
    except ValueError as err:
        out["stages"] = str(err)
    try:
        pipeline(step, micro_batches=1)  # 1F1B on 2 stages
    except ValueError as err:
        out["one_micro_batch"] = str(err)
    try:
        pipeline(step, stages=3)
    except ValueError as err:
        out["stages_arg"] = str(err)
    try:
        pipeline(step, mesh=make_mesh(dp=2, pp=1) if False else make_mesh(dp=1, pp=2), group=object())
    except ValueError as err:
        out["mesh_and_group"] = str(err)
    return out


def test_bad_input_is_refused_before_the_first_step():
    for out in run_distributed(bad_inputs, 2):
        assert "splits every batch tensor along dim 0 into 3 equal micro-batches" in out["micro_batches"]
        assert "make the batch size a multiple of 3" in out["micro_batches"]
        assert out["interleaved_ok"]
        assert "4 stages but the model has 3 blocks" in out["stages"]
        assert "runs 2 stages (1 per rank), got stages=3" in out["stages_arg"]
        assert "give mesh= or group=, not both" in out["mesh_and_group"]
        assert "needs at least as many micro-batches as stages" in out["one_micro_batch"]
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline(tiny_lm_step()[2], schedule="1f1b")
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        pipeline(tiny_lm_step()[2], micro_batches=0)


def test_the_model_outside_value_and_grad_is_refused_clearly():
    def run() -> str:
        _, state, batch_of = build("tiny")
        net = tiny_lm_step(depth=5)[0]
        apply_fn, _ = zf.functional(net)

        def step(state, batch):
            apply_fn(state.params, batch["x"])  # an evaluation forward inside the step
            return state, {}

        pipelined_step = pipeline(step)
        try:
            pipelined_step(pipelined_step.init(state), batch_of(0))
        except RuntimeError as err:
            return str(err)
        return "not refused"

    for out in run_distributed(run, 2):
        assert "outside zf.value_and_grad" in out and "step.gather(state)" in out


# -- plan -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_plan_counts_one_pipeline_rank_s_stage_parameters():
    def run() -> list:
        step, state, batch_of = build("gpt2")
        _, params = zf.functional(transformers.GPT2LMHeadModel(hf_config("gpt2")[1]))
        mesh = make_mesh(dp=2, pp=2)
        stacked = shard(pipeline(step, micro_batches=2, mesh=mesh), stage=1, mesh=mesh)
        out = []
        for pp_rank in (0, 1):
            p = zf.plan(stacked, lambda p, b: None, batch_of(0), params, measure=False, pp_rank=pp_rank,
                        baseline=0)
            out.append((p.parameters, p.tiers["gpu"].params, p.tiers["gpu"].optimizer, p.tiers["gpu"].buffers))
        return out

    (first, second) = run_distributed(run, 4)[0]
    _, params = zf.functional(transformers.GPT2LMHeadModel(hf_config("gpt2")[1]))
    stage0 = sum(v.numel() for k, v in params.items() if k.startswith(("transformer.wte", "transformer.wpe",
                                                                       "transformer.h.0.", "transformer.h.1.")))
    stage1 = sum(v.numel() for v in params.values()) - stage0
    assert first[0] == stage0 and second[0] == stage1
    assert first[1] >= stage0 * 4 and second[1] >= stage1 * 4  # fp32 parameters of the stage (padded over dp)
    assert first[2] == pytest.approx(stage0 * 8 / 2, rel=0.05)  # Adam's m and v, partitioned over dp2
    wte = params["transformer.wte.weight"].numel()
    assert second[3] == 2 * wte * 4 and first[3] == 0  # the last stage borrows wte (and its gradient)


# -- tp2 x pp2 ------------------------------------------------------------------------------------------------
def tp_pp(kind: str) -> dict:
    from tests.tp_cases import batch, make_step
    from zfunc.transforms import tensor_parallel, tp_plan

    mesh = make_mesh(pp=2, tp=2)
    apply_fn, step, state = make_step(kind, "clip")
    stacked = pipeline(tensor_parallel(step, tp_plan(apply_fn), mesh), micro_batches=2, mesh=mesh)
    state = stacked.init(state)
    for i in range(STEPS):
        state, metrics = stacked(state, batch(i, 0, 1))
    return {"params": stacked.gather(state), "keys": sorted(state.params), "repr": repr(stacked)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tp2_x_pp2_equals_the_plain_step(kind):
    from tests.tp_cases import reference

    ref = reference(kind, STEPS)
    outs = run_distributed(tp_pp, 4, kind)
    for rank, out in enumerate(outs):
        assert set(out["params"]) == set(ref)
        for key, want in ref.items():  # (tp's tolerance: Adam on gradients summed in another order)
            torch.testing.assert_close(out["params"][key], want, rtol=1e-5, atol=2e-5,
                                       msg=lambda m, rank=rank, key=key: f"rank {rank} {key}: {m}")
    # ranks 0, 1 (tp pair) hold stage 0, ranks 2, 3 stage 1
    assert outs[0]["keys"] == outs[1]["keys"] and outs[2]["keys"] == outs[3]["keys"]
    assert not set(outs[0]["keys"]) & set(outs[2]["keys"])


def nan_and_aux() -> dict:
    out = {}
    step, state, batch_of = build("uneven")
    pipelined_step = pipeline(step, micro_batches=2)
    state = pipelined_step.init(state)
    before = pipelined_step.gather(state)
    bad = batch_of(0)
    bad["x"][5, 0] = float("nan")  # in the second micro-batch only
    state, metrics = pipelined_step(state, bad)  # no host read: the update is skipped on the device
    out["nan_metric"] = bool(torch.isnan(metrics["loss"]).all())
    try:  # the error comes at the next use of the state the step returned
        pipelined_step(state, batch_of(1))
    except FloatingPointError as err:
        out["nan"] = str(err)
    out["unchanged"] = all(torch.equal(pipelined_step.gather(state)[k], v) for k, v in before.items())
    out["alive"] = float(pipelined_step(state, batch_of(1))[1]["loss"])  # the kept state steps again

    torch.manual_seed(0)
    net = UnevenMLP()
    apply_fn, params = zf.functional(net)

    def loss_fn(p, batch):
        y = apply_fn(p, batch["x"])
        return F.mse_loss(y, batch["y"]), {"mean": y.mean(), "n": 3}

    def aux_step(state, batch):
        (loss, aux), grads = zf.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss, **aux}

    s = zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.sgd(0.1))
    aux_pipelined = pipeline(aux_step, micro_batches=2)
    _, metrics = aux_pipelined(aux_pipelined.init(s), batch_of(0))
    with torch.no_grad():
        y = net(batch_of(0)["x"])
    out["aux"] = (float(metrics["mean"]), metrics["n"], float(y.mean()))
    return out


def test_a_nan_loss_stops_every_rank_and_aux_comes_back_averaged():
    for out in run_distributed(nan_and_aux, 2):
        assert out["nan_metric"] and "the loss is nan" in out["nan"] and "skipped its update" in out["nan"]
        assert "step=0" in out["nan"]
        assert out["unchanged"] and np.isfinite(out["alive"])
        mean, n, want = out["aux"]
        assert n == 3 and mean == pytest.approx(want, rel=1e-5)


# -- checkpoints across layouts ------------------------------------------------------------------------------
def save_pp2(directory: str) -> dict:
    step, state, batch_of = build("gpt2")
    pipelined_step = pipeline(step, micro_batches=2)
    state = pipelined_step.init(state)
    for i in range(STEPS):
        state, _ = pipelined_step(state, batch_of(i))
    zf.io.save(directory, state)
    saved = pipelined_step.gather(state)
    state, _ = pipelined_step(state, batch_of(STEPS))  # one more step, to compare with the restored runs'
    return {"saved": saved, "params": pipelined_step.gather(state)}


def restore_pp1(directory: str, save_to: str) -> dict:
    step, state, batch_of = build("gpt2")
    state, _ = zf.io.restore(directory, like=state)
    restored = {k: v.clone() for k, v in state.params.items()}
    zf.io.save(save_to, state)
    state, _ = accumulate(step, 2)(state, batch_of(STEPS))
    return {"restored": restored, "params": dict(state.params)}


def restore_pp2(directory: str) -> dict:
    step, state, batch_of = build("gpt2")
    pipelined_step = pipeline(step, micro_batches=2)
    state, _ = zf.io.restore(directory, like=pipelined_step.init(state))
    restored = pipelined_step.gather(state)
    state, _ = pipelined_step(state, batch_of(STEPS))
    return {"restored": restored, "params": pipelined_step.gather(state)}


def test_a_pp2_checkpoint_restores_into_pp1_and_back_exactly(tmp_path):
    pp2 = run_distributed(save_pp2, 2, str(tmp_path / "pp2"))[0]
    manifest = __import__("json").loads((next((tmp_path / "pp2").glob("step_*")) / "manifest.json").read_text())
    assert manifest["format_version"] == 4 and manifest["pipeline"]["holders"]["transformer.wte.weight"] == 0
    assert manifest["pipeline"]["holders"]["transformer.ln_f.weight"] == 1
    pp1 = run_distributed(restore_pp1, 1, str(tmp_path / "pp2"), str(tmp_path / "pp1"))[0]
    back = run_distributed(restore_pp2, 2, str(tmp_path / "pp1"))
    for key, want in pp2["saved"].items():  # the weights, bit for bit, both ways
        torch.testing.assert_close(pp1["restored"][key], want, rtol=0, atol=0, msg=lambda m, key=key: f"pp1 {key}: {m}")
        for rank, out in enumerate(back):
            torch.testing.assert_close(out["restored"][key], want, rtol=0, atol=0, msg=lambda m, rank=rank, key=key: f"{rank} {key}: {m}")
    # The optimizer state came along (SGD's momentum): the restored runs continue as the pp2 run did (up to
    # the order of the tied weight's two gradient sums; a lost momentum would move weights by ~1e-2).
    for key, want in pp2["params"].items():
        torch.testing.assert_close(pp1["params"][key], want, rtol=1e-6, atol=1e-8, msg=lambda m, key=key: f"pp1 {key}: {m}")
        for rank, out in enumerate(back):
            torch.testing.assert_close(out["params"][key], want, rtol=0, atol=0, msg=lambda m, rank=rank, key=key: f"{rank} {key}: {m}")
