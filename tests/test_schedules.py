"""Learning-rate schedules against torch.optim.lr_scheduler and DeepSpeed's formulas."""

from __future__ import annotations

import math

import pytest
import torch

from zfunc import optim

# float32 rounding of a float64 rate: ~6e-8 relative.
LR_TOL = {"rtol": 2e-7, "atol": 1e-12}


def ours(schedule, steps: int) -> list[float]:
    values = []
    for c in range(steps):
        lr = schedule(torch.tensor(c, dtype=torch.int64))
        assert lr.dtype == torch.float32 and lr.shape == ()
        values.append(float(lr))
    return values


def torch_lrs(make_scheduler, base_lr: float, steps: int) -> list[float]:
    """The rate torch's optimizer uses at each of ``steps`` steps (scheduler.step() after each)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = make_scheduler(opt)
    values = []
    for _ in range(steps):
        values.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return values


def assert_lrs_close(got: list[float], expected: list[float]) -> None:
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.float64)
    torch.testing.assert_close(as_tensor(got), as_tensor(expected), **LR_TOL)


# DeepSpeed's WarmupLR / WarmupDecayLR written out (deepspeed/runtime/lr_schedules.py): with
# W = max(2, warmup_num_steps) and i = last_batch_iteration, lr = min + (max - min) * gamma(i).
def deepspeed_gamma(i: int, warmup_steps: int, warmup_type: str, total_steps: int | None = None) -> float:
    w = max(2, warmup_steps)
    if i < w:
        return math.log(i + 1) / math.log(w) if warmup_type == "log" else i / w
    if total_steps is None:
        return 1.0
    return max(0.0, (total_steps - i) / max(1.0, total_steps - w))


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_steps", [0, 1, 2, 10])
def test_warmup_matches_deepspeed(warmup_steps, warmup_type):
    peak, floor = 3e-3, 1e-4
    got = ours(optim.warmup(peak, warmup_steps, min_lr=floor, warmup_type=warmup_type), 40)
    expected = [floor + (peak - floor) * deepspeed_gamma(i, warmup_steps, warmup_type) for i in range(40)]
    assert_lrs_close(got, expected)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_steps, total_steps", [(0, 20), (5, 30), (10, 10), (8, 35)])
def test_warmup_decay_matches_deepspeed(warmup_steps, total_steps, warmup_type):
    peak, floor = 1e-3, 2e-5
    schedule = optim.warmup_decay(peak, warmup_steps, total_steps, min_lr=floor, warmup_type=warmup_type)
    got = ours(schedule, 45)   # past total_steps: stays at min_lr
    expected = [floor + (peak - floor) * deepspeed_gamma(i, warmup_steps, warmup_type, total_steps)
                for i in range(45)]
    assert_lrs_close(got, expected)
    assert got[-1] == pytest.approx(floor, rel=1e-6)


@pytest.mark.parametrize("warmup_steps, total_steps, floor", [(5, 30, 0.0), (0, 30, 1e-5), (10, 25, 3e-5)])
def test_warmup_cosine_matches_lambda_lr(warmup_steps, total_steps, floor):
    peak = 1e-3

    def factor(c: int) -> float:   # the Hugging Face cosine-with-warmup shape, with a floor
        if c < warmup_steps:
            return c / warmup_steps
        progress = min(1.0, (c - warmup_steps) / max(1, total_steps - warmup_steps))
        return (floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))) / peak

    steps = total_steps + 10
    expected = torch_lrs(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor), peak, steps)
    got = ours(optim.warmup_cosine(peak, warmup_steps, total_steps, min_lr=floor), steps)
    assert_lrs_close(got, expected)


def test_warmup_cosine_decay_matches_cosine_annealing_lr():
    peak, floor, warmup_steps, total_steps = 1e-3, 1e-5, 6, 36
    decay = total_steps - warmup_steps
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR
    expected = torch_lrs(lambda opt: cosine(opt, T_max=decay, eta_min=floor), peak, decay + 1)
    got = ours(optim.warmup_cosine(peak, warmup_steps, total_steps, min_lr=floor), total_steps + 1)
    assert_lrs_close(got[warmup_steps:], expected)
    assert_lrs_close(got[:warmup_steps], [peak * c / warmup_steps for c in range(warmup_steps)])


@pytest.mark.parametrize("total_steps, pct_start, div_factor, final_div_factor", [
    (40, 0.3, 25.0, 1e4),
    (35, 0.25, 10.0, 100.0),    # the end of the warmup phase is not an integer step
    (50, 0.5, 25.0, 1e4),
])
def test_one_cycle_matches_torch(total_steps, pct_start, div_factor, final_div_factor):
    max_lr = 0.1
    expected = torch_lrs(lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=max_lr, total_steps=total_steps, pct_start=pct_start, div_factor=div_factor,
        final_div_factor=final_div_factor, cycle_momentum=False), max_lr, total_steps)
    schedule = optim.one_cycle(max_lr, total_steps, pct_start=pct_start, div_factor=div_factor,
                               final_div_factor=final_div_factor)
    got = ours(schedule, total_steps + 5)
    assert_lrs_close(got[:total_steps], expected)
    assert got[total_steps:] == [got[total_steps - 1]] * 5   # stays at the final rate


def test_constant():
    assert ours(optim.constant(0.25), 3) == [0.25] * 3


ALL_SCHEDULES = {
    "constant": lambda: optim.constant(1e-3),
    "warmup": lambda: optim.warmup(1e-3, 5),
    "warmup_decay": lambda: optim.warmup_decay(1e-3, 5, 20, warmup_type="linear"),
    "warmup_cosine": lambda: optim.warmup_cosine(1e-3, 5, 20, min_lr=1e-5),
    "one_cycle": lambda: optim.one_cycle(1e-2, 20),
}


@pytest.mark.parametrize("name", sorted(ALL_SCHEDULES))
def test_schedules_trace_to_one_graph(name):
    """No Python branch on the count: one dynamo graph serves every phase, no recompiles."""
    import torch._dynamo

    schedule = ALL_SCHEDULES[name]()
    torch._dynamo.reset()
    compiled = torch.compile(schedule, fullgraph=True, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for c in (0, 3, 5, 12, 20, 31):
            count = torch.tensor(c, dtype=torch.int64)
            assert float(compiled(count)) == float(schedule(count))
    torch._dynamo.reset()


@pytest.mark.parametrize("make, match", [
    (lambda: optim.constant(-1.0), "lr must be a finite number >= 0"),
    (lambda: optim.warmup(-1e-3, 10), "peak_lr must be"),
    (lambda: optim.warmup(1e-3, -1), "warmup_steps must be >= 0"),
    (lambda: optim.warmup(1e-3, 10, min_lr=1e-2), "must not exceed peak_lr"),
    (lambda: optim.warmup(1e-3, 10, warmup_type="cosine"), "warmup_type must be 'log' or 'linear'"),
    (lambda: optim.warmup_decay(1e-3, 10, 5), r"total_steps \(5\) must be >= warmup_steps \(10\)"),
    (lambda: optim.warmup_cosine(1e-3, 10, 5), r"total_steps \(5\) must be >= warmup_steps"),
    (lambda: optim.warmup_cosine(1e-3, 0, 0), "total_steps must be >= 1"),
    (lambda: optim.warmup_cosine(float("inf"), 1, 10), "finite"),
    (lambda: optim.one_cycle(0.1, 1), "total_steps must be >= 2"),
    (lambda: optim.one_cycle(0.1, 100, pct_start=1.0), r"pct_start must be a number in \(0, 1\)"),
    (lambda: optim.one_cycle(0.1, 3, pct_start=0.3), "leaves an empty phase"),
    (lambda: optim.one_cycle(0.1, 100, div_factor=0.0), "div_factor must be > 0"),
])
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_steps_must_be_ints():
    with pytest.raises(TypeError, match="warmup_steps must be an int"):
        optim.warmup(1e-3, 10.0)
