"""mixed_precision: the fp32 master trajectory, dtypes of the state, fp16 loss scaling and skipping."""

import pytest
import torch
from torch import nn

import zfunc as zf
from tests.models import TinyLM, lm_loss, make_batch
from zfunc.interpret import Transform
from zfunc.transforms.accumulate import accumulate
from zfunc.transforms.mixed_precision import mixed_precision
from zfunc.transforms.mixed_precision_policy import MixedPrecisionState, Policy

K = 5


def make_step(apply_fn, metrics_fn=None):
    loss_fn = lm_loss(apply_fn)

    def poisoned_loss(params, batch):
        # batch["mult"] holds 1.0 per example (an exact no-op) or inf (every gradient non-finite)
        return loss_fn(params, batch) * batch["mult"].mean()

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(poisoned_loss)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return train_step


def batch(i, poison=False):
    b = make_batch(seed=i)
    b["mult"] = torch.full((b["x"].shape[0],), float("inf") if poison else 1.0)
    return b


def run(wrap, opt, batches, seed=0):
    torch.manual_seed(seed)
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    p0 = {k: v.clone() for k, v in params.items()}
    step = wrap(make_step(apply_fn))
    state = zf.init(step, zf.TrainState.create(dict(params), opt))
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(m)
    return p0, state, step, metrics


def test_fp32_policy_is_bitwise_the_plain_step():
    batches = [batch(i) for i in range(K)]
    _, ref, _, ref_m = run(lambda s: s, zf.optim.adamw(1e-2), batches)
    _, out, step, m = run(lambda s: mixed_precision(s, "fp32"), zf.optim.adamw(1e-2), batches)
    assert out.extras["mixed_precision"].master == {}  # params are the master
    for k in ref.params:
        assert torch.equal(out.params[k], ref.params[k]), k
    assert [x["loss"] for x in m] == [x["loss"] for x in ref_m]
    assert int(out.step) == K and all(not bool(x["skipped"]) for x in m)
    assert all(float(x["loss_scale"]) == 1.0 for x in m)


@pytest.mark.parametrize("policy, kw, tol", [
    ("bf16", {}, 0.08),                             # bf16: 8 mantissa bits
    ("fp16", {"initial_scale_power": 8}, 0.006),    # fp16: 11 mantissa bits
])
def test_low_precision_tracks_the_fp32_trajectory(policy, kw, tol):
    """SGD deltas (p_K - p_0) agree element-wise within the dtype's tolerance."""
    batches = [batch(i) for i in range(K)]
    p0, ref, _, ref_m = run(lambda s: s, zf.optim.sgd(0.5), batches)
    _, out, step, m = run(lambda s: mixed_precision(s, policy, **kw), zf.optim.sgd(0.5), batches)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[policy]
    mp = out.extras["mixed_precision"]
    assert isinstance(mp, MixedPrecisionState)
    assert not any(bool(x["skipped"]) for x in m) and int(out.step) == K
    for k, p in out.params.items():
        assert p.dtype == low, k
        assert mp.master[k].dtype == torch.float32, k
        assert torch.equal(p, mp.master[k].to(low)), k  # the compute copy is the master rounded
    full = step.gather(out)
    assert set(full) == set(ref.params)
    for k, r in ref.params.items():
        assert full[k].dtype == torch.float32 and torch.equal(full[k], mp.master[k])
        delta, delta_ref = full[k] - p0[k], r - p0[k]
        scale = delta_ref.abs().max().item()
        torch.testing.assert_close(delta, delta_ref, rtol=tol, atol=tol * scale, msg=k)
    losses = torch.stack([x["loss"] for x in m])
    torch.testing.assert_close(losses, torch.stack([x["loss"] for x in ref_m]), rtol=tol / 4, atol=0)


def test_opt_state_is_fp32_for_the_master():
    _, out, _, _ = run(lambda s: mixed_precision(s, "bf16"), zf.optim.adamw(1e-2), [batch(0)])
    leaves = [x for x in zf.tree.tree_leaves(out.opt_state) if isinstance(x, torch.Tensor) and x.dim() > 0]
    assert leaves and all(x.dtype == torch.float32 for x in leaves)


def test_overflow_step_is_skipped_and_changes_nothing_but_the_scaler():
    kw = dict(initial_scale_power=10, loss_scale_window=1000, hysteresis=1)
    wrap = lambda s: mixed_precision(s, "fp16", **kw)
    _, before, step, _ = run(wrap, zf.optim.adamw(1e-2), [batch(0)])
    snapshot = zf.tree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                                (before.step, before.params, before.opt_state, before.extras["mixed_precision"].master))
    after, m = step(before, batch(1, poison=True))
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 2.0 ** 9
    assert not torch.isfinite(m["loss"])  # the (unscaled) loss is reported as computed
    mp = after.extras["mixed_precision"]
    assert int(mp.skipped_steps) == 1 and int(mp.good_steps) == 0
    now = (after.step, after.params, after.opt_state, mp.master)
    same = zf.tree.tree_map(lambda a, b: torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b,
                            snapshot, now)
    assert all(zf.tree.tree_leaves(same))
    assert int(after.step) == 1  # state.step counts applied updates: a skipped step does not advance it


def test_skipped_step_is_a_no_op_for_the_trajectory():
    """Training on [b0, poisoned, b1, b2] equals training on [b0, b1, b2] (scales are powers of two)."""
    kw = dict(initial_scale_power=10, hysteresis=1)
    good = [batch(0), batch(1), batch(2)]
    _, ref, _, _ = run(lambda s: mixed_precision(s, "fp16", **kw), zf.optim.adamw(1e-2), good)
    _, out, _, m = run(lambda s: mixed_precision(s, "fp16", **kw), zf.optim.adamw(1e-2),
                       [good[0], batch(9, poison=True), good[1], good[2]])
    assert [bool(x["skipped"]) for x in m] == [False, True, False, False]
    assert int(out.step) == 3
    master, ref_master = out.extras["mixed_precision"].master, ref.extras["mixed_precision"].master
    for k in ref_master:
        torch.testing.assert_close(master[k], ref_master[k], rtol=1e-6, atol=1e-7)


# -- the loss-scale schedule ---------------------------------------------------


def reference_scaler(flags, power, window, hysteresis, min_scale, consecutive=False):
    """The documented rules, one step at a time in plain Python: [(scale after, skipped)] or 'error' at the end."""
    scale, good, hyst, out = 2.0 ** power, 0, hysteresis, []
    for overflow in flags:
        if overflow:
            if hyst <= 1:
                if scale <= min_scale:
                    out.append("error")
                    return out
                scale = max(scale / 2, min_scale)
            else:
                hyst -= 1
            good = 0
        else:
            grow = good > 0 and good % window == 0
            if consecutive or grow:
                hyst = hysteresis
            if grow:
                scale *= 2
            good += 1
        out.append((scale, overflow))
    return out


def drive(flags, **kw):
    """Run the fp16 step on a tiny model, poisoning the steps whose flag is set."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    apply_fn, params = zf.functional(model)

    def loss_fn(p, b):
        return (apply_fn(p, b["x"]) ** 2).mean() * b["mult"]

    def train_step(state, b):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, b)
        return state.apply_gradients(grads), {"loss": loss}

    step = mixed_precision(train_step, "fp16", **kw)
    state = step.init(zf.TrainState.create(params, zf.optim.sgd(1e-3)))
    out = []
    x = torch.randn(4, 3)
    for flag in flags:
        b = {"x": x, "mult": torch.tensor(float("inf") if flag else 1.0)}
        try:
            state, m = step(state, b)
        except FloatingPointError as err:
            assert "bf16" in str(err) and "minimum loss scale" in str(err)
            out.append("error")
            return out, state
        out.append((float(m["loss_scale"]), bool(m["skipped"])))
    return out, state


def test_scale_grows_after_window_without_overflow():
    got, state = drive([False] * 10, initial_scale_power=3, loss_scale_window=3)
    # DeepSpeed's rule: doubles on a good step that follows 3, 6, 9... good steps
    assert [s for s, _ in got] == [8, 8, 8, 16, 16, 16, 32, 32, 32, 64]
    assert got == reference_scaler([False] * 10, 3, 3, 2, 1.0)
    assert int(state.step) == 10


def test_all_overflow_uses_hysteresis_then_halves_then_errors_at_min_scale():
    flags = [True] * 10
    got, state = drive(flags, initial_scale_power=3, loss_scale_window=3, hysteresis=2, min_loss_scale=1)
    # hysteresis 2: the first overflow only spends it; then 8 -> 4 -> 2 -> 1; an overflow at 1 raises, at the
    # next call (the step itself skips on the device, without a host read, and returns)
    assert got == [(8, True), (4, True), (2, True), (1, True), (1, True), "error"]
    assert got[:4] + got[5:] == reference_scaler(flags, 3, 3, 2, 1.0)
    assert int(state.step) == 0


@pytest.mark.parametrize("consecutive", [False, True])
def test_some_overflows_follow_the_reference_rules(consecutive):
    g = torch.Generator().manual_seed(3)
    flags = (torch.rand(60, generator=g) < 0.2).tolist()
    kw = dict(initial_scale_power=12, loss_scale_window=4, hysteresis=3, min_loss_scale=2.0,
              consecutive_hysteresis=consecutive)
    got, state = drive(flags, **kw)
    assert got == reference_scaler(flags, 12, 4, 3, 2.0, consecutive)
    assert "error" not in got
    assert int(state.step) == flags.count(False)
    assert int(state.extras["mixed_precision"].skipped_steps) == flags.count(True)


def test_hysteresis_is_refilled_by_growth_only_unless_consecutive():
    flags = [True, False, False, True]  # spend one, two good steps (no growth), overflow again
    plain, _ = drive(flags, initial_scale_power=4, loss_scale_window=10, hysteresis=2)
    consecutive, _ = drive(flags, initial_scale_power=4, loss_scale_window=10, hysteresis=2,
                           consecutive_hysteresis=True)
    assert [s for s, _ in plain] == [16, 16, 16, 8]
    assert [s for s, _ in consecutive] == [16, 16, 16, 16]


def test_static_loss_scale():
    flags = [False, True, True, True, False, True]
    got, state = drive(flags, loss_scale=128.0)
    assert got == [(128.0, f) for f in flags]  # never moves, never errors; overflows still skipped
    assert int(state.step) == flags.count(False)
    # a static scale trains exactly like a dynamic one that happens to sit at the same value
    batches = [batch(i) for i in range(3)]
    _, a, _, _ = run(lambda s: mixed_precision(s, "fp16", loss_scale=1024.0), zf.optim.sgd(0.5), batches)
    _, b, _, _ = run(lambda s: mixed_precision(s, "fp16", initial_scale_power=10), zf.optim.sgd(0.5), batches)
    for k in a.params:
        assert torch.equal(a.extras["mixed_precision"].master[k], b.extras["mixed_precision"].master[k])


class _OtherRankOverflows(Transform):
    """Stands in for `shard`: its psum adds one non-finite element 'from another rank'."""

    name = "fake_shard"
    level = 2

    def __init__(self, step):
        super().__init__(step)
        self.psums = 0

    def psum(self, next, x):
        self.psums += 1
        return next(x + 1)


def test_overflow_check_goes_through_psum():
    torch.manual_seed(0)
    apply_fn, params = zf.functional(TinyLM())
    step = _OtherRankOverflows(mixed_precision(make_step(apply_fn), "fp16", hysteresis=1))
    state = step.init(zf.TrainState.create(dict(params), zf.optim.sgd(0.1)))
    state, m = step(state, batch(0))  # finite here, but "another rank" overflowed: skip together
    assert step.psums == 1 and bool(m["skipped"]) and int(state.step) == 0
    # bf16 checks no gradients; its one psum is value_and_grad's check that no rank's loss is NaN, which
    # "another rank" answers here with a NaN count: the step stops before its update
    step = _OtherRankOverflows(mixed_precision(make_step(apply_fn), "bf16"))
    state = step.init(zf.TrainState.create(dict(params), zf.optim.sgd(0.1)))
    state, _ = step(state, batch(0))  # the update is skipped on the device; the next call raises
    assert step.psums == 1 and int(state.step) == 0
    with pytest.raises(FloatingPointError, match="loss is"):
        step(state, batch(0))


# -- apply: casts ----------------------------------------------------------------


def test_apply_casts_inputs_constants_and_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    model[1].weight.requires_grad_(False)  # a frozen parameter
    model.register_buffer("shift", torch.ones(3))
    apply_fn, params = zf.functional(model)
    seen = {}

    def train_step(state, b):
        def loss_fn(p, b):
            out = apply_fn(p, b["x"])  # x is fp32: cast on the way in
            seen["out"] = out.dtype
            return out.float().pow(2).mean()
        loss, grads = zf.value_and_grad(loss_fn)(state.params, b)
        seen["grads"] = {g.dtype for g in grads.values()}
        return state.apply_gradients(grads), {"loss": loss}

    b = {"x": torch.randn(5, 4)}
    for policy, out_dtype in [("bf16", torch.float32), ("params=fp32,compute=bf16,output=bf16", torch.bfloat16)]:
        step = mixed_precision(train_step, policy)
        state = step.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
        state, _ = step(state, b)
        assert seen["out"] == out_dtype and seen["grads"] == {torch.bfloat16}
    assert model[1].weight.dtype == torch.float32 and model.shift.dtype == torch.float32  # module untouched


@pytest.mark.parametrize("inside_grad", [False, True])
def test_running_statistics_are_written_back(inside_grad):
    x = torch.randn(8, 4)
    means = []
    # BatchNorm needs its running statistics in its weight's dtype on the CPU: cast_buffers=True.
    for wrap in (lambda s: s, lambda s: mixed_precision(s, "bf16", cast_buffers=True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
        apply_fn, params = zf.functional(model)

        def step_fn(state, b):
            if inside_grad:
                _, grads = zf.value_and_grad(lambda p, b: apply_fn(p, b).float().pow(2).mean())(state.params, b)
                return state.apply_gradients(grads), {}
            with torch.no_grad():
                apply_fn(state.params, b)  # train mode: updates the running statistics
            return state, {}

        step = wrap(step_fn)
        step(zf.init(step, zf.TrainState.create(params, zf.optim.sgd(0.1))), x)
        assert model[1].running_mean.dtype == torch.float32 and int(model[1].num_batches_tracked) == 1
        means.append(model[1].running_mean.clone())
    assert means[0].abs().min() > 0
    torch.testing.assert_close(means[1], means[0], rtol=2e-2, atol=2e-3)


def test_has_aux_returns_unscaled_values():
    torch.manual_seed(0)
    apply_fn, params = zf.functional(TinyLM())
    loss_fn = lm_loss(apply_fn)
    seen = {}

    def train_step(state, b):
        def with_aux(p, b):
            loss = loss_fn(p, b)
            return loss, {"double": 2 * loss.detach()}
        (loss, aux), grads = zf.value_and_grad(with_aux, has_aux=True)(state.params, b)
        seen["ref"] = loss_fn({k: v.float() for k, v in step.gather(state).items()}, b)
        return state.apply_gradients(grads), {"loss": loss, "double": aux["double"]}

    step = mixed_precision(train_step, "fp16", initial_scale_power=8)
    state = step.init(zf.TrainState.create(dict(params), zf.optim.sgd(0.1)))
    _, m = step(state, make_batch())
    torch.testing.assert_close(m["loss"], seen["ref"], rtol=5e-3, atol=0)  # not × 256
    torch.testing.assert_close(m["double"], 2 * m["loss"])


def test_composes_with_accumulate():
    wraps = {
        "plain": lambda s: mixed_precision(s, "fp16", initial_scale_power=8),
        "outer": lambda s: accumulate(mixed_precision(s, "fp16", initial_scale_power=8), micro_batches=2),
        "inner": lambda s: mixed_precision(accumulate(s, micro_batches=2), "fp16", initial_scale_power=8),
    }
    masters = {}
    for name, wrap in wraps.items():
        _, st, _, m = run(wrap, zf.optim.sgd(0.5), [batch(0), batch(1)])
        masters[name] = st.extras["mixed_precision"].master
        assert not any(bool(x["skipped"]) for x in m) and int(st.step) == 2
    for name in ("outer", "inner"):
        for k in masters["plain"]:
            torch.testing.assert_close(masters[name][k], masters["plain"][k], rtol=1e-2, atol=1e-3)


# -- policy, settings, errors ------------------------------------------------------


def test_policy_forms():
    assert Policy.parse("bf16") == Policy("fp32", "bf16", "fp32", "bf16")
    assert Policy.parse("FP16") == Policy(torch.float32, torch.float16, "float32")
    assert Policy.parse("fp32") == Policy()
    assert Policy.parse("params=fp32,compute=bf16,output=bf16,reduce=fp32") == Policy("fp32", "bf16", "bf16", "fp32")
    pol = Policy("fp32", "bf16", "fp32")
    assert pol.reduce_dtype == "bf16" and pol.compute is torch.bfloat16 and pol.reduce is torch.bfloat16
    for bad in ("fp8", "params=fp32,compute=int8", "compute:bf16", ""):
        with pytest.raises(ValueError):
            Policy.parse(bad)
    with pytest.raises(TypeError):
        Policy.parse(16)
    with pytest.raises(ValueError):
        Policy("fp32", "tf32")


def test_the_stack_declares_the_policy_once():
    step = accumulate(mixed_precision(lambda s, b: (s, {}), "fp16"), micro_batches=2)
    facts = step.stack.facts
    assert (facts.compute_dtype, facts.master_dtype, facts.reduce_dtype) == (torch.float16, torch.float32,
                                                                             torch.float16)
    assert facts.loss_scaling == "dynamic"
    assert Policy.parse(torch.bfloat16) == Policy.parse("bf16")  # the torch dtype, as the message says


def train_step(state, batch):
    return state, {}


def test_repr():
    assert repr(mixed_precision(train_step, "bf16")) == "mixed_precision(train_step, policy='bf16')"
    assert repr(mixed_precision(train_step, "fp16")) == (
        "mixed_precision(train_step, policy='fp16', initial_scale_power=16, loss_scale_window=1000, "
        "hysteresis=2, min_loss_scale=1.0)")
    assert repr(mixed_precision(train_step, "fp16", loss_scale=512)) == (
        "mixed_precision(train_step, policy='fp16', loss_scale=512.0)")
    custom = Policy("fp32", "bf16", "bf16")
    assert repr(accumulate(mixed_precision(train_step, custom), micro_batches=2)) == (
        f"accumulate(mixed_precision(train_step, policy={custom!r}), micro_batches=2)")


@pytest.mark.parametrize("kw", [
    {"loss_scale": -1.0}, {"loss_scale": float("inf")}, {"initial_scale_power": -1},
    {"loss_scale_window": 0}, {"hysteresis": 0}, {"min_loss_scale": 0.0}, {"hysteresis": 1.5},
])
def test_bad_knobs(kw):
    with pytest.raises(ValueError):
        mixed_precision(lambda s, b: (s, {}), "fp16", **kw)


def test_errors():
    with pytest.raises(ValueError, match="fp16 compute only"):
        mixed_precision(lambda s, b: (s, {}), "bf16", loss_scale=128.0)
    with pytest.raises(TypeError):
        mixed_precision("not a step", "bf16")
    with pytest.raises(ValueError, match="applied twice"):
        mixed_precision(mixed_precision(lambda s, b: (s, {}), "bf16"), "bf16")
    torch.manual_seed(0)
    apply_fn, params = zf.functional(TinyLM())
    step = mixed_precision(make_step(apply_fn), "bf16")
    plain = zf.TrainState.create(dict(params), zf.optim.sgd(0.1))
    with pytest.raises(ValueError, match="step.init"):
        step(plain, batch(0))
    state = step.init(plain)
    with pytest.raises(ValueError, match="already"):
        step.init(state)


def test_bf16_does_not_skip_and_a_nan_loss_stops_as_in_the_plain_step():
    """bf16 has fp32's exponent range: no loss scale and no skipping; a NaN loss stops the step before its
    update, as zf.value_and_grad does in the plain step (tests/test_adversarial_nonfinite.py)."""
    _, out, _, m = run(lambda s: mixed_precision(s, "bf16"), zf.optim.sgd(0.1), [batch(0), batch(1)])
    assert [bool(x["skipped"]) for x in m] == [False, False] and int(out.step) == 2
    with pytest.raises(FloatingPointError, match="loss is inf"):  # (raised at the call after the NaN one)
        run(lambda s: mixed_precision(s, "bf16"), zf.optim.sgd(0.1), [batch(0), batch(1, poison=True), batch(2)])


def _one_rank_overflows():
    from tests.shard_cases import rank_and_world, to_numpy
    from zfunc.transforms.shard import shard

    rank, world = rank_and_world()
    torch.manual_seed(0)
    apply_fn, params = zf.functional(TinyLM())
    params = {k: v.clone() for k, v in params.items()}
    step = shard(mixed_precision(make_step(apply_fn), "fp16", initial_scale_power=8, hysteresis=1), stage=2)
    state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-2)))
    skipped = []
    for i in range(3):
        b = {k: v.chunk(world)[rank] for k, v in batch(i, poison=(i == 1 and rank == 0)).items()}
        state, m = step(state, b)
        skipped.append(bool(m["skipped"]))
    return skipped, int(state.step), float(m["loss_scale"]), to_numpy(step.gather(state))


def test_under_shard_all_ranks_skip_together():
    from zfunc.testing import run_distributed

    results = run_distributed(_one_rank_overflows, 2)
    for skipped, steps, scale, _ in results:
        assert skipped == [False, True, False] and steps == 2 and scale == 128.0
    for k, v in results[0][3].items():
        assert (v == results[1][3][k]).all() and v.dtype == "float32", k


def test_unscale_and_check_matches_division_and_isfinite():
    import importlib

    unscale_and_check_ = importlib.import_module("zfunc.transforms.loss_scale").unscale_and_check_
    torch.manual_seed(0)
    grads = [torch.randn(7, 3), torch.randn(5), torch.zeros(0), torch.randn(4).half().float()]
    scale = torch.tensor(1024.0)
    expected = [g / scale for g in grads]
    found = unscale_and_check_(grads, scale)
    assert float(found) == 0.0
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)  # power-of-two scale: multiplying by 1/scale is exact
    bad = [torch.tensor([1.0, float("nan")]), torch.tensor([2.0])]
    assert float(unscale_and_check_(bad, scale)) == 1.0
    assert float(unscale_and_check_([torch.tensor([float("inf")])], scale)) == 1.0
