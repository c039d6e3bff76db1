"""Where a step's gradients go between backward and the update (`zfunc.transforms.grad_accumulator`).

- One micro-batch under ``shard(offload(...), stage=2|3)``: each unit's gradient is handed to a sink as its
  reduction lands (on a GPU it leaves for the host there), every unit exactly once per backward pass, and the
  update gets exactly the plain step's gradients.
- On a GPU each such gradient lands straight in a page-locked host buffer (registered once per kept buffer), and
  nothing reads it on the host before its copy has landed: not the update, not the step's own code (checked
  here with copies that land only when waited for, `tests/landing_fakes.py`).
- The host buffers an accumulator fills are kept for the next call of the same step (fresh host memory
  costs a page fault per page at first touch), but never while anything outside zfunc still holds them.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.landing_fakes import DeferredLanding, landing_on_the_cpu
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, mixed_precision, offload, shard
from zfunc.transforms.grad_accumulator import GradAccumulator, HostBuffers


class Uneven(nn.Module):
    """Blocks of uneven sizes, a frozen block and a tied head (the embedding's weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 24)
        self.blocks = nn.ModuleList([nn.Linear(24, 24), nn.Sequential(nn.Linear(24, 40), nn.GELU(),
                                                                      nn.Linear(40, 24)), nn.Linear(24, 24)])
        self.blocks[2].requires_grad_(False)
        self.head = nn.Linear(24, 13, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(wrap, returns_grads: bool = False, optimizer=None, reads_norm: bool = False):
    """``(step, state)`` of the Uneven model; ``returns_grads``: the metrics hold the gradients; ``reads_norm``:
    the step also reads its gradients before the update (their squared norm, in the metrics)."""
    torch.manual_seed(0)
    model = Uneven()
    apply_fn, params = zf.functional(model)

    def loss_fn(p, ids):
        return F.cross_entropy(apply_fn(p, ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    def train_step(state, ids):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, ids)
        metrics = {"loss": loss, "grads": grads} if returns_grads else {"loss": loss}
        if reads_norm:
            metrics["norm"] = sum(g.float().pow(2).sum() for g in grads.values() if g.is_floating_point())
        return state.apply_gradients(grads), metrics

    step = wrap(train_step)
    state = step.init(zf.TrainState.create(params, optimizer or zf.optim.adamw(1e-2, weight_decay=0.1)))
    return step, state


def batch(i: int, rank: int = 0) -> torch.Tensor:
    return torch.randint(0, 13, (8, 9), generator=torch.Generator().manual_seed(100 * i + rank))


def train(wrap, steps: int = 3, rank: int = 0, optimizer=None) -> dict:
    step, state = build(wrap, optimizer=optimizer)
    for i in range(steps):
        state, _ = step(state, batch(i, rank))
    return {k: v.detach().float().clone() for k, v in step.gather(state).items()}


def one_micro_batch_sink(stage: int) -> dict:
    rank = torch.distributed.get_rank()
    fed: list[str] = []
    add_unit = GradAccumulator.add_unit

    def spy(self, unit, r, shard_):
        fed.append(unit.name)
        return add_unit(self, unit, r, shard_)

    GradAccumulator.add_unit = spy  # (in a forked worker: patched there only)
    wrapped = train(lambda s: shard(offload(mixed_precision(s, "bf16")), stage=stage), rank=rank)
    GradAccumulator.add_unit = add_unit
    plain = train(lambda s: shard(mixed_precision(s, "bf16"), stage=stage), rank=rank)
    return {"fed": fed, "wrapped": wrapped, "plain": plain}


def assert_wrapped_is_plain(got: dict) -> None:
    """One rank's results: the offloaded step's weights equal the plain step's, element-wise (the same arithmetic)."""
    for k, v in got["plain"].items():
        torch.testing.assert_close(got["wrapped"][k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_one_micro_batch_hands_every_unit_to_the_sink_once_per_step(world, stage):
    for got in run_distributed(one_micro_batch_sink, world, stage):
        units = set(got["fed"])
        assert len(got["fed"]) == 3 * len(units), got["fed"]  # three steps, each unit once per step
        assert len(units) >= 3  # the blocks with gradients and the root (the frozen block has none)
        assert_wrapped_is_plain(got)  # the same arithmetic as without offload: equal element-wise


def nvme_fp16_sink(nvme_dir: str) -> dict:
    rank = torch.distributed.get_rank()
    directory = f"{nvme_dir}/rank{rank}"
    os.makedirs(directory, exist_ok=True)
    wrapped = train(lambda s: shard(offload(mixed_precision(s, "fp16"), nvme_fraction=0.5, nvme_dir=directory),
                                    stage=3), rank=rank)
    plain = train(lambda s: shard(mixed_precision(s, "fp16"), stage=3), rank=rank)
    return {"wrapped": wrapped, "plain": plain}


def test_one_micro_batch_sink_with_the_nvme_tier_and_fp16_loss_scaling(tmp_path):
    for got in run_distributed(nvme_fp16_sink, 2, str(tmp_path)):
        assert_wrapped_is_plain(got)


def accumulate_step():
    return lambda s: shard(mixed_precision(accumulate(s, 2), "bf16"), stage=3)


def test_host_buffers_are_kept_and_reused_across_calls():
    step, state = build(accumulate_step())
    kept = step.stack.kept
    state, _ = step(state, batch(0))
    pool: HostBuffers = kept["host gradient buffers"]
    assert pool.kept_bytes() > 0  # the fp32 sums of the bf16 gradients, on the host (the CPU here)
    before = {b.data_ptr() for free in pool._free.values() for b in free}
    taken = []
    take = pool.take

    def spy(n, dtype, page_locked=False):
        buffer = take(n, dtype, page_locked)
        taken.append(buffer.data_ptr())
        return buffer

    pool.take = spy
    state, _ = step(state, batch(1))
    assert taken and set(taken) <= before  # the second call summed into the first call's memory
    # ... and trained exactly as fresh buffers would have: the same as a step that never keeps any.
    reference_step, reference = build(accumulate_step())
    for i in range(2):
        reference_step.stack.kept["host gradient buffers"] = HostBuffers()  # a new, empty one each call
        reference, _ = reference_step(reference, batch(i))
    got, want = step.gather(state), reference_step.gather(reference)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_gradients_a_step_returns_are_never_reused():
    step, state = build(accumulate_step(), returns_grads=True)
    state, metrics = step(state, batch(0))
    held = {k: g.clone() for k, g in metrics["grads"].items()}
    assert step.stack.kept["host gradient buffers"].kept_bytes() == 0  # the step's metrics hold them
    state, _ = step(state, batch(1))
    for k, g in metrics["grads"].items():  # the first step's gradients, as the first step returned them
        torch.testing.assert_close(g, held[k], rtol=0, atol=0, msg=k)


# -- one micro-batch: gradients land in page-locked host buffers (`zfunc.tiers.landing`) ---------------------
# (On the CPU through the seams of `tests/landing_fakes.py`: a copy lands only when waited for.)


def landed_sink(stage: int, steps: int = 3) -> dict:
    rank = torch.distributed.get_rank()
    with pytest.MonkeyPatch.context() as monkeypatch:
        registrations = landing_on_the_cpu(monkeypatch)
        wrapped = train(lambda s: shard(offload(mixed_precision(s, "bf16")), stage=stage), steps=steps, rank=rank)
        landings = DeferredLanding.made
    plain = train(lambda s: shard(mixed_precision(s, "bf16"), stage=stage), steps=steps, rank=rank)
    return {"wrapped": wrapped, "plain": plain, "issued": [ld.issued for ld in landings],
            "left": sum(len(ld.pending) for ld in landings), "registered": registrations.registered,
            "live": len(registrations.live)}


@pytest.mark.parametrize(("world", "stage"), [(1, 2), (2, 2), (1, 3), (2, 3), (4, 3)])
def test_gradients_landing_in_page_locked_buffers_train_as_the_plain_step(world, stage):
    for got in run_distributed(landed_sink, world, stage):
        assert got["issued"] and sum(got["issued"]) == 3 * got["registered"], got  # each unit's gradient, each step
        assert got["left"] == 0  # every copy was waited for by the end of its step
        assert got["registered"] == got["live"] >= 3  # registered once per kept buffer (not once per step)
        assert_wrapped_is_plain(got)  # exactly the plain step's update: no read before its copy landed


def landed_split(nvme_dir: str) -> dict:
    rank = torch.distributed.get_rank()
    directory = f"{nvme_dir}/rank{rank}"
    os.makedirs(directory, exist_ok=True)
    with pytest.MonkeyPatch.context() as monkeypatch:
        landing_on_the_cpu(monkeypatch)
        wrapped = train(lambda s: shard(offload(mixed_precision(s, "bf16"), device_fraction=0.3, nvme_fraction=0.3,
                                                nvme_dir=directory, params="host"), stage=3), rank=rank)
    plain = train(lambda s: shard(mixed_precision(s, "bf16"), stage=3), rank=rank)
    return {"wrapped": wrapped, "plain": plain}


def test_landing_gradients_with_every_tier_and_parameters_on_the_host(tmp_path):
    for got in run_distributed(landed_split, 2, str(tmp_path)):
        assert_wrapped_is_plain(got)


@pytest.mark.parametrize("optimizer", ["clipped", "sgd"])
def test_landing_gradients_read_whole_by_clipping_and_a_pytree_optimizer(optimizer, monkeypatch):
    """Clipping's norm (fused) and a non-fused optimizer read every gradient before any update: all land first."""
    make = {"clipped": lambda: zf.optim.chain(zf.optim.clip_by_global_norm(0.05), zf.optim.adamw(1e-2)),
            "sgd": lambda: zf.optim.sgd(0.1, momentum=0.9)}[optimizer]
    plain = train(lambda s: shard(mixed_precision(s, "bf16"), stage=3), optimizer=make())
    landing_on_the_cpu(monkeypatch)
    wrapped = train(lambda s: shard(offload(mixed_precision(s, "bf16")), stage=3), optimizer=make())
    assert DeferredLanding.made and DeferredLanding.made[-1].issued
    for k, v in plain.items():
        torch.testing.assert_close(wrapped[k], v, rtol=0, atol=0, msg=k)


def test_landing_gradients_with_the_nvme_tier_and_fp16_loss_scaling(tmp_path):
    def both(directory):
        with pytest.MonkeyPatch.context() as monkeypatch:
            landing_on_the_cpu(monkeypatch)
            return nvme_fp16_sink(directory)

    for got in run_distributed(both, 2, str(tmp_path)):
        assert_wrapped_is_plain(got)


def norm_step(wrap):
    """A step that reads its gradients before the update (their norm) and returns them."""
    return build(wrap, returns_grads=True, reads_norm=True)


def test_a_step_reading_landing_gradients_waits_for_them_and_keeps_what_it_returns(monkeypatch):
    registrations = landing_on_the_cpu(monkeypatch)
    step, state = norm_step(lambda s: shard(offload(mixed_precision(s, "bf16")), stage=3))
    ref_step, ref = norm_step(lambda s: shard(mixed_precision(s, "bf16"), stage=3))
    modes = torch._C._len_torch_function_stack()
    returned = []
    for i in range(2):
        state, metrics = step(state, batch(i))
        ref, ref_metrics = ref_step(ref, batch(i))
        assert torch._C._len_torch_function_stack() == modes  # the guard is gone after the step
        assert DeferredLanding.made[-1].issued > 0 and not DeferredLanding.made[-1].pending
        torch.testing.assert_close(metrics["norm"], ref_metrics["norm"], rtol=0, atol=0)
        for k, g in ref_metrics["grads"].items():
            torch.testing.assert_close(metrics["grads"][k].float(), g.float(), rtol=0, atol=0, msg=k)
        returned.append(({k: g for k, g in metrics["grads"].items()}, {k: g.clone() for k, g in ref_metrics["grads"].items()}))
    # The first step's gradients, held by the caller: never reused by the second step, still the first step's.
    assert step.stack.kept["host gradient buffers"].kept_bytes() == 0
    for held, want in returned:
        for k, g in want.items():
            torch.testing.assert_close(held[k].float(), g.float(), rtol=0, atol=0, msg=k)
    # Each step's buffers were held by the caller, so each step registered fresh ones; none of the held ones
    # was unregistered while held.
    units = DeferredLanding.made[-1].issued
    assert registrations.registered == 2 * units and len(registrations.live) == 2 * units
    del returned, metrics, held
    import gc
    gc.collect()
    assert len(registrations.live) == 0  # dropped with their last holder


def test_page_locked_host_buffers_are_registered_once_and_unregistered_when_dropped(monkeypatch):
    import gc

    registrations = landing_on_the_cpu(monkeypatch)
    pool = HostBuffers()
    a = pool.take(100, torch.bfloat16, page_locked=True)
    b = pool.take(50, torch.float32)  # pageable: not registered
    assert registrations.registered == 1
    pool.give_back([(a, True), (b, False)])
    a_ptr = a.data_ptr()
    del a, b
    again = pool.take(100, torch.bfloat16, page_locked=True)  # the kept one, still registered
    assert again.data_ptr() == a_ptr and registrations.registered == 1 and registrations.unregistered == 0
    assert pool.take(100, torch.bfloat16).data_ptr() != a_ptr  # (pageable and page-locked are kept apart)
    view = again[10:20]
    pool.give_back([])  # not taken back this call: dropped; a view held elsewhere keeps it (registered)
    del again
    gc.collect()
    assert registrations.unregistered == 0
    view.fill_(1.0)
    assert view.sum().item() == 10.0
    del view  # the last holder lets go: unregistered (before the memory is freed)
    gc.collect()
    assert registrations.unregistered == 1 and not registrations.live


def test_the_streamed_update_waits_for_each_landing_gradient_before_it_reads_it():
    """The chunked host update reads each run's gradient only after ``ready`` said it had landed (here a
    gradient is NaN until then): the result is the whole update's, bit for bit."""
    from zfunc.kernels.cpu_adam import adamw_
    from zfunc.optim.streamed import streamed_update

    g = torch.Generator().manual_seed(1)
    sizes = [1000, 64, 3000]
    base = [(torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g) * 0.1,
             torch.rand(n, generator=g) * 0.01) for n in sizes]

    def kernel(p, gr, m, v, out, wd):
        assert not gr.float().isnan().any()
        adamw_(p, gr, m, v, lr=1e-2, step=3, weight_decay=wd, out_lowp=out)

    whole = [tuple(t.clone() for t in run) for run in base]
    outs_whole = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    for (p, gr, m, v), out in zip(whole, outs_whole):
        kernel(p, gr, m, v, out, 0.1)
    landing = DeferredLanding(torch.device("cpu"))
    runs = []
    for p, gr, m, v in base:
        buffer = torch.empty_like(gr)
        landing.copy(buffer, gr)
        runs.append((p.clone(), buffer, m.clone(), v.clone()))
    outs = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in sizes]
    streamed_update([(p, gr, m, v, out, 0.1) for (p, gr, m, v), out in zip(runs, outs)], kernel, torch.bfloat16,
                    chunk=128, ready=landing.wait)
    assert not landing.pending
    for (p, _, m, v), (pw, _, mw, vw), out, ow in zip(runs, whole, outs, outs_whole):
        for x, y in ((p, pw), (m, mw), (v, vw), (out, ow)):
            assert torch.equal(x, y)
