"""checkpoint: the same training as the plain step, with blocks recomputed in backward."""

import pytest
import torch
from torch import nn

import zfunc as zf
from tests.models import Block, TinyLM, lm_loss, make_batch, tiny_lm_step
from zfunc.transforms.accumulate import accumulate
from zfunc.transforms.checkpoint import OffloadInputs, Recompute, SaveOps, _Counts, _Replay, checkpoint
from zfunc.transforms.mixed_precision import mixed_precision

K = 5
POLICIES = ["recompute", "save_ops", "offload_inputs"]


def train(wrap, steps=K, dropout=0.1, lr=1e-2, batch=8, count_calls=False):
    """``steps`` AdamW steps of ``wrap(train_step)`` on TinyLM; returns (gathered params, step, calls of blocks.0.up)."""
    model, params, train_step = tiny_lm_step(dropout)
    calls = []
    if count_calls:
        model.blocks[0].up.register_forward_hook(lambda *a: calls.append(1))
    step = wrap(train_step)
    state = zf.init(step, zf.TrainState.create(dict(params), zf.optim.adamw(lr)))
    torch.manual_seed(1)  # the dropout masks
    replayed = recomputed = 0
    for i in range(steps):
        state, metrics = step(state, make_batch(batch=batch, seed=i))
        replayed += metrics.get("save_ops_replayed", 0)
        recomputed += metrics.get("save_ops_recomputed", 0)
    step.counts = {"replayed": replayed, "recomputed": recomputed}
    return zf.gather(step, state), step, len(calls)


def assert_same(out, ref, rtol=1e-6):
    assert set(out) == set(ref)
    for k in ref:
        err = ((out[k] - ref[k]).abs().max() / ref[k].abs().max()).item()
        assert err < rtol, (k, err)


@pytest.fixture(scope="module")
def reference():
    params, _, calls = train(lambda s: s, count_calls=True)
    assert calls == K  # one forward per step
    return params


@pytest.mark.parametrize("policy", POLICIES)
def test_matches_the_plain_step_with_dropout(reference, policy):
    out, step, calls = train(lambda s: checkpoint(s, policy=policy), count_calls=True)
    assert_same(out, reference)
    assert calls == 2 * K  # forward + recompute in backward
    if policy == "save_ops":
        assert step.counts == {"replayed": 2 * 3 * K, "recomputed": 0}  # up and down, 3 blocks


def test_dropout_is_really_on(reference):
    other, _, _ = train(lambda s: s, dropout=0.0)
    assert any(not torch.allclose(other[k], reference[k]) for k in reference)


@pytest.mark.parametrize("modules, expected", [
    (None, ["blocks.0", "blocks.1", "blocks.2"]),
    (Block, ["blocks.0", "blocks.1", "blocks.2"]),
    ((nn.LayerNorm,), ["blocks.0.norm", "blocks.1.norm", "blocks.2.norm", "final_norm"]),
    (lambda name: name in ("blocks.0", "blocks.2"), ["blocks.0", "blocks.2"]),
    (["blocks.1"], ["blocks.1"]),
    (["blocks.1", "blocks.1.up"], ["blocks.1"]),  # nested names: the outer block covers the inner
])
def test_modules_selection(modules, expected):
    step = checkpoint(lambda s, b: (s, {}), modules=modules)
    assert step.blocks(TinyLM()) == expected


@pytest.mark.parametrize("modules, calls_per_step", [
    (["blocks.1"], 1), ((nn.LayerNorm,), 1),
    # blocks.0.up itself wrapped: its hooks fire once, from its parent's call; the wrapper runs
    # the module's forward directly (not its __call__), and so does the recompute in backward
    (lambda name: name.endswith(".up"), 1),
])
def test_selections_train_like_the_plain_step(reference, modules, calls_per_step):
    out, _, calls = train(lambda s: checkpoint(s, modules=modules), count_calls=True)
    assert_same(out, reference)
    assert calls == calls_per_step * K


def test_composes_with_accumulate():
    ref, _, _ = train(lambda s: accumulate(s, micro_batches=2))
    for wrap in (lambda s: accumulate(checkpoint(s), micro_batches=2),
                 lambda s: checkpoint(accumulate(s, micro_batches=2), policy="save_ops")):
        out, _, _ = train(wrap)
        assert_same(out, ref)


def test_composes_with_mixed_precision_bf16():
    ref, _, _ = train(lambda s: mixed_precision(s, "bf16"), steps=3)
    for wrap in (lambda s: checkpoint(mixed_precision(s, "bf16")),
                 lambda s: mixed_precision(checkpoint(s, policy="save_ops"), "bf16"),
                 lambda s: checkpoint(mixed_precision(s, "bf16"), policy="offload_inputs")):
        out, step, calls = train(wrap, steps=3, count_calls=True)
        assert all(v.dtype == torch.float32 for v in out.values())
        assert_same(out, ref)
        assert calls == 6


def test_under_torch_func_grad_and_vmap():
    """A step may differentiate with torch.func itself, per-example gradients (vmap) included."""
    torch.manual_seed(0)
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    loss_fn = lm_loss(apply_fn)
    seen = {}

    def step_fn(state, b):
        def one(p, x, y):
            return loss_fn(p, {"x": x[None], "y": y[None]})
        seen["grad"] = torch.func.grad(loss_fn)(state.params, b)
        seen["per_example"] = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(
            state.params, b["x"], b["y"])
        return state, {}

    b = make_batch(batch=4)
    state = zf.TrainState.create(params, zf.optim.sgd(0.1))
    step_fn(state, b)
    ref = dict(seen)
    for policy in POLICIES:
        checkpoint(step_fn, policy=policy)(state, b)
        for key in ("grad", "per_example"):
            for k in params:
                torch.testing.assert_close(seen[key][k], ref[key][k], rtol=1e-6, atol=1e-7)


# -- policies in detail ------------------------------------------------------------


def test_save_ops_replays_exact_gradients_and_custom_ops():
    torch.manual_seed(0)
    w1, w2 = torch.randn(6, 4), torch.randn(3, 6)
    x = torch.randn(5, 7, 4)

    def body(p, x):
        h = torch.matmul(x, p["w1"].t())  # 3-D @ 2-D: folded into one mm
        h = h.relu()
        return torch.bmm(h, p["w2"].t().expand(5, 6, 3))

    def loss(p, x, make):
        return make(body)(p, x).square().sum()

    p = {"w1": w1, "w2": w2}
    ref = torch.func.grad(loss, argnums=(0, 1))(p, x, lambda f: f)
    for ops, replayed in ((("mm", "bmm"), 2), (("aten.bmm",), 1), ((torch.ops.aten.mm.default,), 1)):
        stats = _Counts()
        policy = SaveOps(ops=ops)

        def make(f):
            from zfunc.recompute import recompute
            return lambda p, x: recompute(_Replay(f, policy.packets(), stats), p, x)

        got = torch.func.grad(loss, argnums=(0, 1))(p, x, make)
        assert (stats.replayed, stats.recomputed) == (replayed, 0), ops
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_save_ops_does_not_replay_an_output_changed_in_place():
    torch.manual_seed(0)
    w, x = torch.randn(4, 4), torch.randn(3, 4)
    stats = _Counts()
    from zfunc.recompute import recompute

    def body(p, x):
        y = x @ p["w"]
        y.mul_(2)  # the recorded mm output changes after it was recorded
        return (x @ p["w"]).relu() + y

    def loss(p, make):
        return make(p, x).square().sum()

    ref = torch.func.grad(loss)({"w": w}, body)
    got = torch.func.grad(loss)({"w": w}, lambda p, x: recompute(_Replay(body, SaveOps().packets(), stats), p, x))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert (stats.replayed, stats.recomputed) == (1, 1)


def test_save_ops_falls_back_when_the_recompute_diverges():
    stats = _Counts()
    replay = _Replay(lambda p, x: x @ p["w"], SaveOps().packets(), stats)
    w = torch.randn(4, 4)
    first = replay({"w": w}, torch.randn(3, 4))
    again = replay({"w": w}, torch.randn(2, 4))  # another input shape: nothing to replay
    assert first.shape == (3, 4) and again.shape == (2, 4)
    assert (stats.replayed, stats.recomputed) == (0, 1)


class _MutatesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        h = x * 1.0
        y = self.blocks[0](h)
        h.add_(1.0)  # the block's saved input changes before backward
        return self.blocks[1](y).sum() + h.sum()


@pytest.mark.parametrize("policy, error", [("recompute", "modified by an inplace operation"),
                                           ("offload_inputs", "modified by an inplace operation|modified in place")])
def test_input_modified_in_place_is_caught(policy, error):
    model = _MutatesInput()
    apply_fn, params = zf.functional(model)

    def step_fn(state, x):
        _, grads = zf.value_and_grad(lambda p, x: apply_fn(p, x))(state.params, x)
        return state.apply_gradients(grads), {}

    step = checkpoint(step_fn, modules=["blocks.0"], policy=policy)
    with pytest.raises(RuntimeError, match=error):
        step(zf.TrainState.create(params, zf.optim.sgd(0.1)), torch.randn(2, 4))


def test_offload_inputs_keeps_block_inputs_on_the_host_and_stays_exact(monkeypatch):
    """Eagerly, each block's tensor inputs are held in host memory between forward and backward
    (`zfunc.recompute._OnHost`), through copies autograd differentiates. On this CPU-only machine the
    inputs are already in host memory and stay as they are, so the holders are forced here: every block
    input is held once per step, and the result equals the plain step's."""
    import zfunc.recompute as rc

    held = []
    real = rc._OnHost

    def forced(tree, pin_memory):
        flat, spec = rc.tree_flatten(tree)
        out = [real(x, pin_memory) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in flat]
        held.extend(tuple(x.host.shape) for x in out if isinstance(x, real))
        return rc.tree_unflatten(spec, out)

    monkeypatch.setattr(rc, "_kept_on_host", forced)
    out, _, _ = train(lambda s: checkpoint(s, policy=OffloadInputs(pin_memory=False)), steps=2, dropout=0.0)
    assert held == [(8, 5, 10)] * 3 * 2  # one activation input per block per step
    ref, _, _ = train(lambda s: s, steps=2, dropout=0.0)
    assert_same(out, ref)


def test_offload_inputs_under_torch_func_saves_through_the_hook(monkeypatch):
    """Under torch.func the Function route keeps the inputs through `save` (`_host_saver`)."""
    import importlib
    ck = importlib.import_module("zfunc.transforms.checkpoint")  # the module, not the transform of that name
    moved = []
    real = ck._to_host
    monkeypatch.setattr(ck, "_to_host", lambda t, pin: moved.append(tuple(t.shape)) or real(t, pin))
    model, params, _ = tiny_lm_step(0.0)
    apply_fn = zf.functional(model)[0]
    batch = make_batch(batch=8, seed=0)

    def train_step(state, batch):
        grads = torch.func.grad(lambda p: lm_loss(apply_fn)(p, batch))(state.params)
        return state.apply_gradients(grads), {}

    step = checkpoint(train_step, policy=OffloadInputs(pin_memory=False))
    step(zf.TrainState.create(dict(params), zf.optim.sgd(0.1)), batch)
    # one activation input per block, copied once although setup_context runs per functorch level
    assert moved == [(8, 5, 10)] * 3


def test_policy_forms_and_repr():
    def train_step(state, batch):
        return state, {}
    assert repr(checkpoint(train_step)).endswith("train_step, policy='recompute')")
    assert repr(checkpoint(train_step, modules=["blocks.0"], policy=SaveOps())).endswith(
        "train_step, modules=['blocks.0'], policy='save_ops')")
    assert repr(checkpoint(train_step, policy=SaveOps(ops=("mm",)))).endswith("policy=\"save_ops('mm',)\")")
    assert checkpoint(train_step, policy="offload_inputs").policy == OffloadInputs()
    assert checkpoint(train_step, policy=Recompute()).policy == Recompute()
    assert repr(mixed_precision(checkpoint(train_step), "bf16")).startswith("mixed_precision(checkpoint(")


def test_errors():
    def train_step(state, batch):
        return state, {}
    with pytest.raises(ValueError, match="unknown policy"):
        checkpoint(train_step, policy="everything")
    with pytest.raises(ValueError, match="not an aten op"):
        SaveOps(ops=("matmul_please",))
    with pytest.raises(ValueError):
        SaveOps(ops=())
    for bad in (3, "blocks.0", [], [Block], [1, 2]):
        with pytest.raises(TypeError):
            checkpoint(train_step, modules=bad)
    with pytest.raises(ValueError, match="applied twice"):
        checkpoint(checkpoint(train_step))
    with pytest.raises(ValueError, match="no sub-module|has no attribute"):
        checkpoint(train_step, modules=["blocks.7"]).blocks(TinyLM())
    with pytest.raises(ValueError, match="found no blocks"):
        checkpoint(train_step).blocks(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="never called"):
        checkpoint(train_step, modules=["blocks"]).blocks(TinyLM())
    with pytest.raises(ValueError, match="found no blocks"):
        checkpoint(train_step, modules=nn.Conv2d).blocks(TinyLM())
