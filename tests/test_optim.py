"""zfunc.optim against torch.optim, element by element, step by step."""

from __future__ import annotations

import math

import pytest
import torch

import zfunc.interpret
from zfunc import optim
from zfunc.tree import tree_leaves, tree_map

STEPS = 25
SHAPES = {"w": (7, 3), "b": (5,), "k": (2, 3, 4)}
TIGHT = {"rtol": 1e-6, "atol": 1e-7}


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def make_grads(steps: int = STEPS, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()} for _ in range(steps)]


def warmup_cosine_reference(peak: float, warmup: int, total: int, floor: float):
    """The warmup_cosine formula in Python floats (independent of zfunc)."""
    def lr(c: int) -> float:
        if c < warmup:
            return peak * c / warmup
        progress = min(1.0, (c - warmup) / max(1, total - warmup))
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return lr


PEAK, WARMUP, TOTAL, FLOOR = 0.05, 5, 20, 0.005   # TOTAL < STEPS: the floor is reached too


def run_torch(make_opt, lr_fn=None, groups=None, clip=None) -> list[dict[str, torch.Tensor]]:
    """Parameters after every step of a torch optimizer (``lr_fn(c)`` drives LambdaLR,
    ``clip`` is a max norm for clip_grad_norm_ before each step)."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in make_params().items()}
    opt = make_opt(groups(params) if groups else list(params.values()))
    sched = None
    if lr_fn is not None:
        base = opt.param_groups[0]["lr"]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda c: lr_fn(c) / base)
    history = []
    for grads in make_grads():
        for k, p in params.items():
            p.grad = grads[k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
        if sched is not None:
            sched.step()
        history.append({k: p.detach().clone() for k, p in params.items()})
    return history


def run_zfunc(tx) -> tuple[list[dict[str, torch.Tensor]], object]:
    params = make_params()
    state = tx.init(params)
    history = []
    for grads in make_grads():
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        history.append(params)
    return history, state


def assert_same_history(got, expected, **tol):
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        for name in SHAPES:
            where = f"step {step + 1}, param {name!r}"
            torch.testing.assert_close(g[name], e[name], **(tol or TIGHT), msg=lambda m, w=where: f"{w}: {m}")


# name -> (zfunc optimizer(lr, wd), torch optimizer factory(lr, wd)) for the same hyperparameters.
ADAM_CASES = {
    "adam": (lambda lr, wd: optim.adam(lr, weight_decay=wd),
             lambda lr, wd: lambda ps: torch.optim.Adam(ps, lr=lr, weight_decay=wd, foreach=False)),
    "adamw": (lambda lr, wd: optim.adamw(lr, weight_decay=wd),
              lambda lr, wd: lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, foreach=False)),
}
SGD_CASES = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "dampening": {"momentum": 0.8, "dampening": 0.3},
}


@pytest.mark.parametrize("scheduled", [False, True], ids=["const_lr", "schedule"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("name", sorted(ADAM_CASES))
def test_adam_family_matches_torch(name, wd, scheduled):
    ours, theirs = ADAM_CASES[name]
    if scheduled:
        ref = warmup_cosine_reference(PEAK, WARMUP, TOTAL, FLOOR)
        tx = ours(optim.warmup_cosine(PEAK, WARMUP, TOTAL, FLOOR), wd)
        expected = run_torch(theirs(PEAK, wd), lr_fn=ref)
    else:
        tx = ours(0.01, wd)
        expected = run_torch(theirs(0.01, wd))
    got, _ = run_zfunc(tx)
    assert_same_history(got, expected)


def test_adam_moments_match_torch():
    """Not only the parameters: m and v equal torch's exp_avg / exp_avg_sq element-wise."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in make_params().items()}
    opt = torch.optim.Adam(list(params.values()), lr=0.01, weight_decay=0.1, foreach=False)
    tx = optim.adam(0.01, weight_decay=0.1)
    ours = make_params()
    state = tx.init(ours)
    for grads in make_grads():
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
        updates, state = tx.update(grads, state, ours)
        ours = optim.apply_updates(ours, updates)
    adam_state = state[1]
    assert isinstance(adam_state, optim.ScaleByAdamState)
    assert int(adam_state.count) == STEPS
    for k, p in params.items():
        torch.testing.assert_close(adam_state.mu[k], opt.state[p]["exp_avg"], **TIGHT)
        torch.testing.assert_close(adam_state.nu[k], opt.state[p]["exp_avg_sq"], **TIGHT)


@pytest.mark.parametrize("scheduled", [False, True], ids=["const_lr", "schedule"])
@pytest.mark.parametrize("wd", [0.0, 0.05])
@pytest.mark.parametrize("case", sorted(SGD_CASES))
def test_sgd_matches_torch(case, wd, scheduled):
    kwargs = SGD_CASES[case]
    if scheduled:
        tx = optim.sgd(optim.warmup_cosine(PEAK, WARMUP, TOTAL, FLOOR), weight_decay=wd, **kwargs)
        expected = run_torch(lambda ps: torch.optim.SGD(ps, PEAK, weight_decay=wd, foreach=False, **kwargs),
                             lr_fn=warmup_cosine_reference(PEAK, WARMUP, TOTAL, FLOOR))
    else:
        tx = optim.sgd(0.05, weight_decay=wd, **kwargs)
        expected = run_torch(lambda ps: torch.optim.SGD(ps, 0.05, weight_decay=wd, foreach=False, **kwargs))
    got, _ = run_zfunc(tx)
    assert_same_history(got, expected)


@pytest.mark.parametrize("as_dict", [False, True], ids=["callable", "dict"])
def test_adamw_mask_matches_torch_param_groups(as_dict):
    decayed = {"w", "k"}
    mask = {name: name in decayed for name in SHAPES} if as_dict else (lambda name: name != "b")
    tx = optim.adamw(0.01, weight_decay=0.2, mask=mask)

    def groups(params):
        return [{"params": [params[n] for n in sorted(decayed)], "weight_decay": 0.2},
                {"params": [params["b"]], "weight_decay": 0.0}]

    expected = run_torch(lambda gs: torch.optim.AdamW(gs, lr=0.01, foreach=False), groups=groups)
    got, _ = run_zfunc(tx)
    assert_same_history(got, expected)


def test_mask_dict_must_name_every_parameter():
    tx = optim.adamw(0.01, weight_decay=0.1, mask={"w": True})
    params = make_params()
    with pytest.raises(ValueError, match="no entry for parameter 'b'"):
        tx.update(make_grads(1)[0], tx.init(params), params)


def test_nested_params_are_named_with_dots():
    seen = []
    tx = optim.add_decayed_weights(0.1, mask=lambda name: seen.append(name) or name.startswith("enc"))
    params = {"enc": {"w": torch.ones(2)}, "head": torch.ones(3)}
    updates, _ = tx.update(tree_map(torch.zeros_like, params), tx.init(params), params)
    assert sorted(seen) == ["enc.w", "head"]
    assert torch.equal(updates["enc"]["w"], torch.full((2,), 0.1))
    assert torch.equal(updates["head"], torch.zeros(3))


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clips", "no_clip"])
def test_clip_by_global_norm_matches_torch(max_norm):
    grads = make_grads(1)[0]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    tx = optim.clip_by_global_norm(max_norm)
    clipped, state = tx.update(grads, tx.init(grads))
    assert state == optim.EmptyState()
    for p, name in zip(params, SHAPES):
        torch.testing.assert_close(clipped[name], p.grad, **TIGHT)


def test_clipped_adamw_chain_matches_torch():
    """chain(clip, adamw) = clip_grad_norm_ then AdamW.step(), every step (the norm of grads is ~6)."""
    tx = optim.chain(optim.clip_by_global_norm(2.0), optim.adamw(0.01, weight_decay=0.1))
    expected = run_torch(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False), clip=2.0)
    got, _ = run_zfunc(tx)
    assert_same_history(got, expected)


def test_clip_by_global_norm_uses_psum(monkeypatch):
    """Under sharding psum adds the other ranks' squares: 4 equal shards double the norm."""
    grads = make_grads(1)[0]
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    monkeypatch.setattr(zfunc.optim.transforms, "psum", lambda x: 4 * x)
    clipped, _ = optim.clip_by_global_norm(norm).update(grads, optim.EmptyState())
    for name in SHAPES:
        torch.testing.assert_close(clipped[name], grads[name] * norm / (2 * norm + 1e-6), **TIGHT)


def lamb_reference(lr, b1, b2, eps, wd, steps_grads, params):
    """LAMB from the paper (You et al. 2020, Alg. 2), per tensor, in float64, φ = identity."""
    p = {k: v.double() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    history = []
    for t, grads in enumerate(steps_grads, start=1):
        for k, x in list(p.items()):
            g = grads[k].double()
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            r = (m[k] / (1 - b1 ** t)) / ((v[k] / (1 - b2 ** t)).sqrt() + eps) + wd * x
            pn, rn = x.norm(), r.norm()
            ratio = pn / rn if pn > 0 and rn > 0 else 1.0
            p[k] = x - lr * ratio * r
        history.append({k: x.float() for k, x in p.items()})
    return history


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lamb_matches_paper_formula(wd):
    tx = optim.lamb(0.01, weight_decay=wd)
    got, _ = run_zfunc(tx)
    expected = lamb_reference(0.01, 0.9, 0.999, 1e-6, wd, make_grads(), make_params())
    # float32 vs a float64 reference: rounding (not order) differences, so a little looser than TIGHT.
    assert_same_history(got, expected, rtol=2e-6, atol=1e-6)


def test_trust_ratio_calls_psum_once_on_stacked_norms(monkeypatch):
    calls = []

    def fake_psum(x):
        calls.append(tuple(x.shape))
        return x

    monkeypatch.setattr(zfunc.optim.transforms, "psum", fake_psum)
    tx = optim.lamb(0.01)
    params = make_params()
    tx.update(make_grads(1)[0], tx.init(params), params)
    assert calls == [(2 * len(SHAPES),)]


def test_trust_ratio_is_one_for_zero_params():
    tx = optim.scale_by_trust_ratio()
    params = {"z": torch.zeros(3), "w": torch.ones(4)}
    updates = {"z": torch.full((3,), 2.0), "w": torch.zeros(4)}
    out, _ = tx.update(updates, tx.init(params), params)
    assert torch.equal(out["z"], updates["z"]) and torch.equal(out["w"], updates["w"])


ALIASES = {
    "sgd": lambda lr: optim.sgd(lr, momentum=0.9, weight_decay=0.01),
    "adam": lambda lr: optim.adam(lr, weight_decay=0.01),
    "adamw": lambda lr: optim.adamw(lr),
    "lamb": lambda lr: optim.lamb(lr, weight_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_learning_rate_readable_and_counters_are_tensors(name):
    schedule = optim.warmup_cosine(PEAK, WARMUP, TOTAL, FLOOR)
    ref = warmup_cosine_reference(PEAK, WARMUP, TOTAL, FLOOR)
    tx = ALIASES[name](schedule)
    params = make_params()
    state = tx.init(params)
    assert float(optim.learning_rate(state)) == pytest.approx(ref(0), abs=1e-9)   # the first update's rate
    for step, grads in enumerate(make_grads(8)):
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        lr = optim.learning_rate(state)
        assert lr.dtype == torch.float32 and lr.shape == ()
        assert float(lr) == pytest.approx(ref(step), rel=1e-6)                      # the rate just used
    counts = [s.count for s in tree_states(state) if "count" in s._fields]
    assert counts and all(c.dtype == torch.int64 and c.shape == () and int(c) == 8 for c in counts)


def tree_states(state):
    """Every NamedTuple in a (chain) state."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return [state]
    return [s for part in state for s in tree_states(part)]


def test_learning_rate_needs_exactly_one_rate():
    tx = optim.chain(optim.scale_by_learning_rate(0.1), optim.scale_by_learning_rate(0.2))
    with pytest.raises(ValueError, match="exactly one"):
        optim.learning_rate(tx.init(make_params()))
    with pytest.raises(ValueError, match="exactly one"):
        optim.learning_rate(optim.clip_by_global_norm(1.0).init(make_params()))


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_update_is_pure(name):
    tx = ALIASES[name](0.1)
    params = make_params()
    grads = make_grads(1)[0]
    state = tx.init(params)
    _, state = tx.update(grads, state, params)   # a state with non-zero moments
    before = [x.clone() for x in tree_leaves((params, grads, state))]
    tx.update(grads, state, params)
    after = tree_leaves((params, grads, state))
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


def test_hyperparams_describe_adam_and_adamw():
    schedule = optim.warmup_cosine(1e-3, 10, 100)
    mask = lambda name: not name.endswith("bias")
    hp = optim.adamw(schedule, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1, mask=mask).hyperparams
    assert (hp["name"], hp["mode"], hp["b1"], hp["b2"], hp["eps"], hp["weight_decay"]) == \
        ("adamw", "adamw", 0.8, 0.95, 1e-6, 0.1)
    assert hp["mask"] is mask and hp["learning_rate"] is schedule and hp["schedule"] is schedule
    assert hp["elementwise"] is True
    hp = optim.adam(3e-4, weight_decay=0.01).hyperparams
    assert (hp["mode"], hp["weight_decay"], hp["mask"], hp["learning_rate"]) == ("adam", 0.01, None, 3e-4)
    assert float(hp["schedule"](torch.tensor(7))) == pytest.approx(3e-4)
    assert optim.lamb(0.1).hyperparams["elementwise"] is False
    chained = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)).hyperparams
    assert chained["elementwise"] is True and chained["transforms"][1].hyperparams["name"] == "adamw"
    hash(optim.adamw(1e-3, mask={"w": True}))  # static pytree metadata of TrainState must hash


def test_apply_updates_keeps_param_dtype():
    params = {"h": torch.ones(3, dtype=torch.bfloat16)}
    out = optim.apply_updates(params, {"h": torch.full((3,), 0.5)})
    assert out["h"].dtype == torch.bfloat16 and torch.equal(out["h"].float(), torch.full((3,), 1.5))


@pytest.mark.parametrize("make, match", [
    (lambda: optim.sgd(-0.1), "lr must be >= 0"),
    (lambda: optim.sgd(0.1, momentum=-0.9), "momentum must be >= 0"),
    (lambda: optim.sgd(0.1, nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, dampening=0.1), "dampening = 0"),
    (lambda: optim.sgd(0.1, dampening=0.5), "no effect without momentum"),
    (lambda: optim.sgd(0.1, weight_decay=-1.0), "weight_decay must be >= 0"),
    (lambda: optim.adam(-1e-3), "lr must be >= 0"),
    (lambda: optim.adam(1e-3, b1=1.0), r"b1 must be in \[0, 1\)"),
    (lambda: optim.adam(1e-3, b2=-0.1), r"b2 must be in \[0, 1\)"),
    (lambda: optim.adam(1e-3, eps=-1e-8), "eps must be >= 0"),
    (lambda: optim.adamw(1e-3, weight_decay=-0.01), "weight_decay must be >= 0"),
    (lambda: optim.adamw(float("nan")), "finite"),
    (lambda: optim.lamb(1e-3, b1=1.5), "b1 must be in"),
    (lambda: optim.clip_by_global_norm(0.0), "max_norm must be > 0"),
])
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_unknown_keyword_and_bad_mask_are_type_errors():
    with pytest.raises(TypeError):
        optim.adamw(1e-3, beta1=0.9)
    with pytest.raises(TypeError):
        optim.adamw(1e-3, mask=["w"])


def compiled_adamw_steps(backend: str) -> dict[str, torch.Tensor]:
    """Three steps of a compiled adamw update with a warmup schedule; a recompile raises."""
    import torch._dynamo

    tx = optim.adamw(optim.warmup_cosine(0.01, 2, 10), weight_decay=0.1)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    params = make_params()
    state = tx.init(params)
    eager_params, eager_state = params, state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for grads in make_grads(3):
            params, state = compiled(params, state, grads)
            eager_params, eager_state = step(eager_params, eager_state, grads)
    torch._dynamo.reset()
    assert int(state[0].count) == 3
    for name in SHAPES:
        torch.testing.assert_close(params[name], eager_params[name], rtol=1e-6, atol=1e-7)
    return params


def test_compiled_adamw_does_not_recompile_eager_backend():
    """Dynamo guards (what decides recompiles) without inductor's codegen: fast."""
    compiled_adamw_steps("eager")


@pytest.mark.slow
def test_compiled_adamw_does_not_recompile_inductor():
    compiled_adamw_steps("inductor")
