"""zf.plan: the model state it predicts is the state `step.init` builds (per tier, per rank), its activation
measurement on fake tensors equals the same measurement on real tensors, the placement it chooses fits the
budgets and is the placement offload then builds; `zfunc plan` prints it for a meta-built model."""

from __future__ import annotations

import sys

import pytest
import torch

import zfunc as zf
from tests.models import lm_loss, make_batch, tiny_lm_step
from zfunc.plan_activations import _LiveBytes, measure_activations
from zfunc.testing import run_distributed
from zfunc.tiers.placement import Placement
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard
from zfunc.transforms.grad_accumulator import GradAccumulator

# The optimizer's scalars (step count, loss scale, policy codes) are in the state but not per parameter.
SCALARS = 128


def _stacks(step, nvme_dir):
    return {
        "s3-offload-bf16": shard(offload(mixed_precision(step, "bf16")), stage=3),
        "s3-nvme-half": shard(offload(step, nvme_fraction=0.5, nvme_dir=nvme_dir), stage=3),
        "s3-params-host": shard(offload(step, params="host", device_fraction=0.25), stage=3),
        "s2": shard(step, stage=2),
        "s2-device-share": shard(offload(mixed_precision(step, "fp16"), device_fraction=0.5), stage=2),
        "s1-offload-bf16": shard(offload(mixed_precision(step, "bf16")), stage=1),
    }


def _planned_and_built(nvme_dir):
    model, params, step = tiny_lm_step(width=24, hidden=37, depth=4)
    loss_fn = lm_loss(zf.functional(model)[0])
    out = {}
    for name, stack in _stacks(step, nvme_dir).items():
        planned = zf.plan(stack, loss_fn, make_batch(), params, measure=False, baseline=0)
        built = zf.describe(stack.init(zf.TrainState.create(params, zf.optim.adamw(1e-3))))
        out[name] = ({t: (b.params, b.optimizer) for t, b in planned.tiers.items()},
                     {t: (b.params, b.optimizer) for t, b in built.items()})
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_planned_model_state_is_the_state_init_builds(world, tmp_path):
    # On the CPU the "gpu" tier is host memory too: the plan's GPU and host add up to the host measured;
    # NVMe (memory-mapped files) is its own tier and must match alone.
    for per_rank in run_distributed(_planned_and_built, world, str(tmp_path)):
        for name, (planned, built) in per_rank.items():
            assert planned["gpu"][0] + planned["host"][0] == built["host"][0], name
            optimizer = planned["gpu"][1] + planned["host"][1]
            assert 0 <= built["host"][1] - optimizer <= SCALARS, (name, planned, built)
            assert planned["nvme"][1] == built["nvme"][1], name


def _accumulator_planned_and_built(nvme_dir):
    """Per tier: the accumulator bytes the plan counts, and those a step's accumulator holds (each unit's
    buffer counted on the tier of the unit's optimizer state; an NVMe unit's buffer is host memory)."""
    model, params, step = tiny_lm_step(width=24, hidden=37, depth=4)
    loss_fn = lm_loss(zf.functional(model)[0])
    stack = shard(offload(mixed_precision(accumulate(step, 2), "bf16"), device_fraction=0.4, nvme_fraction=0.3,
                          nvme_dir=nvme_dir), stage=3)
    planned = zf.plan(stack, loss_fn, make_batch(), params, measure=False, baseline=0)
    state = stack.init(zf.TrainState.create(params, zf.optim.adamw(1e-3)))
    layout = state.extras["shard"]
    tiers = Placement([(u.name, u.shard_size) for u in layout.units], stack.stack.facts.optimizer_split,
                      torch.device("cpu")).tiers
    held = {"gpu": 0, "host": 0}
    mean = GradAccumulator.mean

    def spy(self, k, like):
        for name, flat in self.flats.items():
            held["gpu" if tiers[name] == "device" else "host"] += flat.numel() * flat.element_size()
        return mean(self, k, like)

    GradAccumulator.mean = spy  # (in this forked worker only)
    rank, world = dist_rank_world()
    stack(state, {k: v.chunk(world)[rank] for k, v in make_batch().items()})
    return {t: planned.tiers[t].grads for t in ("gpu", "host", "nvme")}, held


def dist_rank_world():
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


@pytest.mark.parametrize("world", [1, 2])
def test_the_accumulator_is_planned_on_the_tier_of_each_units_optimizer_state(world, tmp_path):
    for planned, held in run_distributed(_accumulator_planned_and_built, world, str(tmp_path)):
        # fp32 accumulators of this rank's shards, on the GPU for the GPU share, in host memory for the rest;
        # no gradient shards kept beside them, and nothing on NVMe.
        assert planned == {"gpu": held["gpu"], "host": held["host"], "nvme": 0}, (planned, held)
        assert held["gpu"] > 0 and held["host"] > 0


def _landing_planned_and_built(nvme_dir):
    """One micro-batch under offload (gradients land in page-locked host buffers, `zfunc.tiers.landing`): the
    host bytes the plan counts for gradients and for buffers, and the page-locked bytes a step registers."""
    from tests.landing_fakes import landing_on_the_cpu

    model, params, step = tiny_lm_step(width=24, hidden=37, depth=4)
    loss_fn = lm_loss(zf.functional(model)[0])
    stack = shard(offload(mixed_precision(step, "bf16"), device_fraction=0.4, nvme_fraction=0.3, nvme_dir=nvme_dir),
                  stage=3)
    summed = shard(offload(mixed_precision(accumulate(step, 2), "bf16"), device_fraction=0.4, nvme_fraction=0.3,
                           nvme_dir=nvme_dir), stage=3)
    planned = zf.plan(stack, loss_fn, make_batch(), params, measure=False, baseline=0)
    planned_summed = zf.plan(summed, loss_fn, make_batch(), params, measure=False, baseline=0)
    state = stack.init(zf.TrainState.create(params, zf.optim.adamw(1e-3)))
    rank, world = dist_rank_world()
    with pytest.MonkeyPatch.context() as monkeypatch:
        registrations = landing_on_the_cpu(monkeypatch)
        for _ in range(2):  # (the second step lands in the first one's buffers: nothing more registered)
            state, _ = stack(state, {k: v.chunk(world)[rank] for k, v in make_batch().items()})
        registered = sum(registrations.live.values())
    return {"grads": planned.tiers["host"].grads, "device grads": planned.tiers["gpu"].grads,
            "units": len(state.extras["shard"].units), "buffers": planned.tiers["host"].buffers,
            "summed buffers": planned_summed.tiers["host"].buffers, "registered": registered,
            "registrations": registrations.registered}


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_landing_on_the_host_are_planned_as_the_step_registers_them(world, tmp_path):
    from zfunc.optim.streamed import CHUNK
    from zfunc.plan import _CHUNK_BUFFERS

    for got in run_distributed(_landing_planned_and_built, world, str(tmp_path)):
        # Each host and NVMe unit's bf16 gradient lands in a buffer of exactly its size, registered once (on the
        # CPU the device tier is host memory too, so the device units' gradients land there as well).
        assert got["registered"] == got["grads"] + got["device grads"] and got["grads"] > 0, got
        assert got["registrations"] == got["units"], got
        # No staging buffers at one micro-batch: the streamed update's chunk buffers only; summing on the
        # host (accumulate) still goes through staging buffers.
        chunk_buffers = got["buffers"]
        assert chunk_buffers == _CHUNK_BUFFERS * min(CHUNK, chunk_buffers // (_CHUNK_BUFFERS * 4)) * 4
        assert got["summed buffers"] > got["buffers"], got


def test_fake_measurement_equals_the_real_one():
    model, params, _ = tiny_lm_step(width=32, hidden=48, depth=3)
    loss_fn = lm_loss(zf.functional(model)[0])
    batch = make_batch(batch=16, seq=12)
    fake = measure_activations(loss_fn, batch, params, torch.float32, recompute=False, blocks=None)
    tracker = _LiveBytes()
    with tracker:
        _, grads = zf.value_and_grad(loss_fn)({k: v.detach().clone() for k, v in params.items()}, batch)
    real = tracker.peak_without(grads.values())
    # (within 10%: the fake run counts no view as an allocation, by the operators' schemas, while the real
    # run's tracker matches storages, which counts a parameter's first view here once: 40 KB of 500 KB)
    assert real > 0 and abs(fake - real) <= 0.1 * real, (fake, real)
    assert tracker.peak_without([]) == tracker.peak
    # The gradients are left out (the plan counts them where the stack keeps them): on one token the
    # parameters' gradients outweigh the activations.
    one_token = make_batch(batch=1, seq=1)
    tracker = _LiveBytes()
    with tracker:
        _, grads = zf.value_and_grad(loss_fn)({k: v.detach().clone() for k, v in params.items()}, one_token)
    grad_bytes = sum(g.numel() * g.element_size() for g in grads.values())
    assert tracker.peak_without(grads.values()) < tracker.peak - grad_bytes / 2


def test_recompute_and_smaller_batches_need_fewer_activations():
    model, params, step = tiny_lm_step(width=64, hidden=256, depth=6)
    loss_fn = lm_loss(zf.functional(model)[0])
    batch = make_batch(batch=32, seq=64)
    plain = zf.plan(shard(step, stage=3), loss_fn, batch, params, baseline=0).tiers["gpu"].activations
    recomputed = zf.plan(shard(checkpoint(step), stage=3), loss_fn, batch, params, baseline=0).tiers["gpu"]
    half = zf.plan(shard(step, stage=3), loss_fn, make_batch(batch=16, seq=64), params, baseline=0)
    assert recomputed.activations < 0.6 * plain
    assert 0.4 * plain < half.tiers["gpu"].activations < 0.6 * plain
    # bf16 halves what the blocks keep (the loss stays fp32 on its logits).
    bf16 = zf.plan(shard(mixed_precision(step, "bf16"), stage=3), loss_fn, batch, params, baseline=0)
    assert bf16.tiers["gpu"].activations < 0.75 * plain


def test_the_chosen_placement_fits_and_is_what_offload_builds(tmp_path):
    model, params, step = tiny_lm_step(width=24, hidden=37, depth=6)
    loss_fn = lm_loss(zf.functional(model)[0])
    stack = shard(offload(step), stage=3)
    everything = zf.plan(stack, loss_fn, make_batch(), params, baseline=0)
    state_bytes = everything.tiers["host"].optimizer
    need = everything.tiers["gpu"].peak  # params, grads, activations, in flight: no optimizer on the GPU
    # Room on the GPU for about a third of the optimizer state, on the host for another third.
    gpu_bytes = int((need + state_bytes / 3) / 0.92)  # the plan leaves 8% to the allocator
    # (the host also holds the gradients of the units off the GPU, as backward makes them: 2/3 of them)
    host_grads = everything.tiers["host"].grads * 2 / 3
    host_bytes = int((state_bytes / 3 + host_grads + everything.tiers["host"].buffers) / 0.9)  # 10% of the host
    planned = zf.plan(stack, loss_fn, make_batch(), params, baseline=0, gpu_bytes=gpu_bytes, host_bytes=host_bytes,
                      nvme_bytes=1 << 30)
    assert planned.fits
    assert planned.tiers["gpu"].peak <= gpu_bytes and planned.tiers["host"].peak <= host_bytes
    assert planned.tiers["host"].optimizer <= state_bytes / 3 + 1
    assert 0 < planned.offload_kwargs["device_fraction"] < 1 and 0 < planned.offload_kwargs["nvme_fraction"] < 1
    assert not any("plan needs" in n or "does not fit" in n for n in planned.notes), planned.notes
    assert any("nvme_dir" in n for n in planned.notes)
    built = zf.describe(shard(offload(step, nvme_dir=str(tmp_path), **planned.offload_kwargs), stage=3)
                        .init(zf.TrainState.create(params, zf.optim.adamw(1e-3))))
    assert built["nvme"].optimizer == planned.tiers["nvme"].optimizer > 0
    assert "memory plan per rank" in str(planned) and "nvme" in str(planned)


def test_a_plan_that_cannot_fit_says_so():
    model, params, step = tiny_lm_step()
    loss_fn = lm_loss(zf.functional(model)[0])
    tight = zf.plan(shard(offload(step), stage=3), loss_fn, make_batch(), params, baseline=0, gpu_bytes=1,
                    host_bytes=1, nvme_bytes=1)
    assert tight.placement["params"] == "host"
    assert any("does not fit" in n and "nvme is short of" in n for n in tight.notes), tight.notes
    assert any(n.startswith("gpu: the plan needs") and "missing" in n for n in tight.notes)
    # Under accumulate the units' accumulators need host memory too: the note names the tier and the bytes.
    tight = zf.plan(shard(offload(mixed_precision(accumulate(step, 4), "bf16")), stage=3), loss_fn, make_batch(),
                    params, baseline=0, gpu_bytes=1, host_bytes=1, nvme_bytes=1 << 30)
    assert any(n.startswith("host: the gradient accumulators") and "bytes) missing" in n for n in tight.notes), \
        tight.notes


def test_plan_cli_on_a_meta_built_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "planned_model.py").write_text(
        "from tests.models import TinyLM\n\ndef build():\n    return TinyLM(vocab=50, width=16, hidden=40, depth=2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from zfunc.cli import main

    assert main(["plan", "planned_model:build", "--batch", "4x8", "--checkpoint", "--offload", "--gpu-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "memory plan per rank" in out and "activations" in out
    assert main(["plan", "planned_model:build", "--batch", "4x8", "--choose-micro-batches", "--gpu-gib", "1"]) == 0
    assert "micro-batches: chose 1 of 4 rows each" in capsys.readouterr().out
    assert main(["plan", "planned_model:build", "--batch", "4by8"]) == 2
    assert "expected BATCHxSEQ" in capsys.readouterr().err
    sys.modules.pop("planned_model", None)


def test_describe_prints_the_same_table_and_step_plan_is_zf_plan():
    model, params, step = tiny_lm_step()
    loss_fn = lm_loss(zf.functional(model)[0])
    stack = shard(offload(step), stage=3)
    table = str(zf.describe(stack.init(zf.TrainState.create(params, zf.optim.adamw(1e-3)))))
    assert table.splitlines()[0].split() == ["tier", "params", "grads", "optimizer", "activations", "buffers", "peak"]
    assert stack.plan(loss_fn, make_batch(), params, baseline=0).tiers == \
        zf.plan(stack, loss_fn, make_batch(), params, baseline=0).tiers


def test_the_plan_chooses_the_fewest_micro_batches_that_fit():
    model, params, step = tiny_lm_step(width=32, hidden=64, depth=4)
    loss_fn = lm_loss(zf.functional(model)[0])
    batch = make_batch(batch=32, seq=64)  # one rank's batch for a whole update
    stack = shard(mixed_precision(step, "bf16"), stage=3)

    def peak_at(k):  # the plan of the step built with k micro-batches, on one micro-batch
        wrapped = shard(mixed_precision(accumulate(step, k), "bf16"), stage=3) if k > 1 else stack
        micro = {key: v[: 32 // k] for key, v in batch.items()}
        return zf.plan(wrapped, loss_fn, micro, params, baseline=0)

    whole, quarter = peak_at(1), peak_at(4)
    assert quarter.tiers["gpu"].peak < whole.tiers["gpu"].peak  # activations dominate this small model
    generous = zf.plan(stack, loss_fn, batch, params, baseline=0, gpu_bytes=1 << 40, choose_micro_batches=True)
    assert generous.micro_batches == 1 and generous.fits
    budget = quarter.tiers["gpu"].peak + 1  # four micro-batches fit; one does not
    chosen = zf.plan(stack, loss_fn, batch, params, baseline=0, gpu_bytes=budget, choose_micro_batches=True)
    fitting = [k for k in (1, 2, 4) if peak_at(k).tiers["gpu"].peak <= budget]
    assert chosen.micro_batches == fitting[0] > 1 and chosen.fits
    # ... and its arithmetic is that of the step built with accumulate(step, k): the accumulator included
    assert chosen.tiers == peak_at(chosen.micro_batches).tiers
    assert f"chose {chosen.micro_batches} of {32 // chosen.micro_batches} rows" in str(chosen)
    nothing = zf.plan(stack, loss_fn, batch, params, baseline=0, gpu_bytes=1, choose_micro_batches=True)
    assert not nothing.fits and "DOES NOT FIT" in str(nothing) and "closest to fitting" in str(nothing)
    assert nothing.micro_batches == 32  # (the smallest micro-batch is the least over a 1-byte GPU)
    with pytest.raises(ValueError, match="same leading size"):
        zf.plan(stack, loss_fn, {"x": batch["x"], "y": batch["y"][:3]}, params, choose_micro_batches=True)
