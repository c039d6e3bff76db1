"""The GPU path of the fused update, structured once (`zfunc.optim.fused_plan`), on this CPU.

The GPU path runs here on CPU tensors (`zfunc.optim.fused.on_host` and `device_backend` patched) with
the Triton kernels in Triton's interpreter. Each case compares, bit for bit, the one launch of a
`DevicePlan` with the per-run kernel the GPU path used before (`adam_flat_` once per run), and checks
when the plan is built: once per state layout, again when the layout changes, never used for buffers
it was not built from.
"""

from __future__ import annotations

import gc

import pytest
import torch

import zfunc as zf
from zfunc.kernels import adam_segments
from zfunc.kernels import gpu_adam as ga
from zfunc.optim import fused, fused_plan
from zfunc.optim.transforms import ScaleByAdamState

quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# Two units of uneven sizes (none a multiple of the 16-element grid but one), and an empty key (a rank's empty
# slice of a parameter); biases ("...b") do not decay under the mask.
UNITS = {"u0": [("u0.w", (7, 9)), ("u0.b", (9,)), ("u0.e", (0,)), ("u0.w2", (16, 3))],
         "u1": [("u1.w", (5, 13)), ("u1.b", (13,))]}


@pytest.fixture
def device_path(monkeypatch):
    """The GPU path on CPU tensors: Triton interpreted, small blocks and chunks (several per run)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(ga.TRITON_CONFIG, "adam_block", 32)
    monkeypatch.setattr(adam_segments, "CHUNK", 64)
    monkeypatch.setattr(fused, "on_host", lambda t: False)
    monkeypatch.setattr(fused, "device_backend", lambda device: "triton")
    counts = {"runs": 0, "flat": 0, "builds": 0}
    runs, flat, build = fused_plan.adam_runs_, ga.adam_flat_, fused_plan.DevicePlan.build.__func__

    def count(name, fn):
        def counted(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return counted

    monkeypatch.setattr(fused_plan, "adam_runs_", count("runs", runs))
    monkeypatch.setattr(ga, "adam_flat_", count("flat", flat))
    monkeypatch.setattr(fused_plan.DevicePlan, "build", classmethod(count("builds", build)))
    return counts


# The GPU path driven on CPU tensors (the fixture above): where CUDA is, `shard` puts the state on the GPU, whose
# own tests below (bit for bit on CUDA) take over.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="drives the GPU path on CPU tensors; on a GPU "
                              "shard places the state there, and the CUDA tests cover it")


def per_run(monkeypatch):
    """The per-run kernel (the general path) instead of a plan."""
    monkeypatch.setattr(fused, "_device_plan", lambda *a: None)


def views(flats: dict, dtype=torch.float32, fill=None, seed=0, device="cpu") -> dict:
    """Per-key views of one flat buffer per unit (shard's layout), the flats kept in ``flats``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for unit, entries in UNITS.items():
        n = sum(torch.Size(s).numel() for _, s in entries)
        flat = (torch.randn(n, generator=g) if fill is None else torch.full((n,), fill)).to(device, dtype)
        flats[unit] = flat
        o = 0
        for k, s in entries:
            m = torch.Size(s).numel()
            out[k] = flat[o:o + m].view(s)
            o += m
    return out


def make_state(tx, device="cpu"):
    keep = {}
    params = views(keep, seed=1, device=device)
    opt_state = tx.init(params)
    spec = tx.fused
    adam = spec.adam_state(opt_state)
    mu, nu = views(keep, fill=0.0, device=device), views(keep, fill=0.0, device=device)
    opt_state = fused._replace_at(opt_state, spec.adam_path, ScaleByAdamState(adam.count, mu, nu))
    return params, opt_state, keep


def optimizer(mode: str, clip: bool):
    mask = lambda name: not name.endswith("b")  # noqa: E731
    tx = (zf.optim.adamw(zf.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1, mask=mask) if mode == "adamw"
          else zf.optim.adam(1e-2, weight_decay=0.05))
    return zf.optim.chain(zf.optim.clip_by_global_norm(0.5), tx) if clip else tx


def run(tx, grad_dtype, out_dtype, steps=3, skip_at=None, grads_of=None, device="cpu"):
    """``steps`` fused updates with fresh gradients (a new flat per unit each step); the state after."""
    params, opt_state, keep = make_state(tx, device)
    copy_keep = {}
    into = views(copy_keep, dtype=out_dtype, fill=0.0, device=device) if out_dtype is not None else None
    for t in range(steps):
        grads = views({}, dtype=grad_dtype, seed=10 + t, device=device) if grads_of is None else grads_of(t)
        skip = None if skip_at is None else torch.tensor(t == skip_at, device=device)
        params, opt_state, copy = fused.fused_update(tx.fused, params, grads, opt_state, out_dtype, into, skip=skip)
    return params, opt_state, copy


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.numel() else t


def assert_same(a, b, spec):
    """Bit for bit: params, moments, the compute copy."""
    (pa, sa, ca), (pb, sb, cb) = a, b
    ma, mb = spec.adam_state(sa), spec.adam_state(sb)
    assert (ca is None) == (cb is None)
    for x, y in ((pa, pb), (ma.mu, mb.mu), (ma.nu, mb.nu)) + (((ca, cb),) if ca is not None else ()):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(bits(x[k]), bits(y[k])), k


@pytest.mark.skipif(not (torch.cuda.is_available() and ga.triton_available()), reason="needs CUDA + triton")
@pytest.mark.parametrize("mode, clip, grad_dtype, out_dtype, skip_at", [
    ("adamw", False, torch.bfloat16, torch.bfloat16, None), ("adam", True, torch.float32, torch.float16, 1)])
def test_cuda_one_launch_is_the_per_run_kernel(monkeypatch, mode, clip, grad_dtype, out_dtype, skip_at):
    """On a GPU, unpatched: the fused update is one launch, bit for bit the per-run kernel's result."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launches = []
    monkeypatch.setattr(fused_plan, "adam_runs_", lambda *a, **k: (launches.append(1), ga.adam_runs_(*a, **k)))
    tx = optimizer(mode, clip)
    planned = run(tx, grad_dtype, out_dtype, skip_at=skip_at, device="cuda")
    assert len(launches) == 3
    per_run(monkeypatch)
    assert_same(planned, run(optimizer(mode, clip), grad_dtype, out_dtype, skip_at=skip_at, device="cuda"), tx.fused)


@quiet
@pytest.mark.parametrize("mode, clip, grad_dtype, out_dtype, skip_at", [
    ("adamw", False, torch.bfloat16, torch.bfloat16, None),
    ("adamw", True, torch.float32, None, 1),
    ("adam", False, torch.float16, torch.float16, 1),
])
def test_one_launch_is_the_per_run_kernel(device_path, monkeypatch, mode, clip, grad_dtype, out_dtype, skip_at):
    tx = optimizer(mode, clip)
    planned = run(tx, grad_dtype, out_dtype, skip_at=skip_at)
    assert device_path["runs"] == 3 and device_path["flat"] == 0 and device_path["builds"] == 1
    per_run(monkeypatch)
    reference = run(optimizer(mode, clip), grad_dtype, out_dtype, skip_at=skip_at)
    assert device_path["flat"] >= 3 * len(UNITS)  # (each unit, split where the decay changes)
    assert_same(planned, reference, tx.fused)
    if skip_at is not None:  # a skipped step moves nothing: the counts say one update less
        assert int(tx.fused.adam_state(planned[1]).count) == 2


@quiet
def test_plan_kept_while_the_layout_holds_and_rebuilt_when_it_changes(device_path, monkeypatch):
    tx = optimizer("adamw", False)
    spec = tx.fused
    params, opt_state, keep = make_state(tx)
    copies = {}
    into = views(copies, dtype=torch.bfloat16, fill=0.0)
    grads = [views({}, dtype=torch.bfloat16, seed=10 + t) for t in range(6)]

    def step(params, opt_state, into, t, grads_t=None):
        return fused.fused_update(spec, params, grads[t] if grads_t is None else grads_t, opt_state,
                                  torch.bfloat16, into)

    params, opt_state, _ = step(params, opt_state, into, 0)
    plan = spec.tables[fused._PLAN]
    # the same state, new gradients at other addresses, the params a new dict of the same tensors: kept
    params, opt_state, _ = step(dict(params), opt_state, dict(into), 1)
    assert spec.tables[fused._PLAN] is plan and device_path["builds"] == 1
    assert sorted(plan.table.grads.tolist()) == sorted(grads[1][k].data_ptr() for k in ("u0.w", "u1.w"))
    # new views of the same buffers (what shard's stage 1/2 hand over): kept
    fresh = {k: t.view(t.shape) for k, t in params.items()}
    params, opt_state, _ = step(fresh, opt_state, into, 2)
    assert device_path["builds"] == 1
    # gradients laid out otherwise (a tensor of their own for each key): a new plan
    separate = {k: g.clone() for k, g in grads[3].items()}
    params, opt_state, _ = step(params, opt_state, into, 3, separate)
    assert device_path["builds"] == 2 and spec.tables[fused._PLAN] is not plan
    # a parameter's storage swapped under the same tensor object: a new plan, never the old addresses
    params["u1.b"].data = params["u1.b"].data.clone()
    params, opt_state, _ = step(params, opt_state, into, 4)
    assert device_path["builds"] == 3
    assert device_path["runs"] == 5 and device_path["flat"] == 0


@quiet
def test_the_plan_refuses_gradients_laid_out_otherwise(device_path, monkeypatch):
    """`DevicePlan.grad_addresses`, the check every step makes (from C for plain tensors, key by key
    otherwise): each way a gradient can leave the plan's layout is refused, and the same gradients pass."""
    tx = optimizer("adamw", False)
    params, opt_state, keep = make_state(tx)
    adam = tx.fused.adam_state(opt_state)
    fused.fused_update(tx.fused, params, views({}, dtype=torch.bfloat16, seed=10), opt_state)
    plan = tx.fused.tables[fused._PLAN]
    flats = {}
    grads = views(flats, dtype=torch.bfloat16, seed=11)

    def addresses(g):
        return plan.grad_addresses(params, g, adam.mu, adam.nu, None)

    assert sorted(addresses(grads)) == sorted([flats["u0"].data_ptr(), flats["u1"].data_ptr()])
    wide = flats["u1"].new_zeros(2 * flats["u1"].numel())
    shifted = {**grads, "u1.b": wide[:13]}  # one gradient away from its run's first address
    strided = {**grads, "u1.b": wide[::2][:13]}  # non-contiguous
    grads_u0 = dict(grads)
    moved = flats["u0"].clone()  # the run's members each in its own place
    grads_u0["u0.w"] = moved[:63].view(7, 9)
    as_float = {**grads, "u1.b": grads["u1.b"].float()}  # another dtype
    short = {**grads, "u1.b": flats["u1"][65:70]}  # at its address, but of another size
    for name, bad in {"shifted": shifted, "strided": strided, "moved": grads_u0, "float": as_float,
                      "short": short}.items():
        assert addresses(bad) is None, name
    # A run laid out right but inside a buffer the kernel writes: bf16 views of the second moment's own bytes
    in_nu = adam.nu["u1.w"].view(-1)[:39].view(torch.bfloat16)  # (78 bf16 elements: u1.w and u1.b)
    overlapping = {**grads, "u1.w": in_nu[:65].view(5, 13), "u1.b": in_nu[65:78]}
    assert addresses(overlapping) is None
    assert addresses({**grads, "u1.w": in_nu.clone()[:65].view(5, 13)}) is None  # (u1.b not after it)
    assert addresses(grads) is not None  # (and the same gradients still pass)


@quiet
def test_another_state_is_never_updated_through_a_stale_table(device_path, monkeypatch):
    tx = optimizer("adamw", False)
    a = make_state(tx)
    out_a = fused.fused_update(tx.fused, a[0], views({}, dtype=torch.bfloat16, seed=10), a[1])
    before = {k: v.clone() for k, v in out_a[0].items()}
    # a second state of the same shapes (kept alive beside the first) and one made after the first was freed
    # (whose buffers may reuse its addresses): each updated where it lives, the first left alone
    b = make_state(tx)
    grads = views({}, dtype=torch.bfloat16, seed=11)
    got_b = fused.fused_update(tx.fused, b[0], grads, b[1])
    assert all(torch.equal(before[k], out_a[0][k]) for k in before)
    del a, out_a, before
    gc.collect()
    c = make_state(tx)
    got_c = fused.fused_update(tx.fused, c[0], grads, c[1])
    per_run(monkeypatch)
    ref = make_state(tx)
    want = fused.fused_update(tx.fused, ref[0], grads, ref[1])
    assert_same(got_b, want, tx.fused)
    assert_same(got_c, want, tx.fused)


@quiet
def test_no_plan_where_one_launch_cannot_take_the_update(device_path, monkeypatch):
    tx = optimizer("adamw", False)
    params, opt_state, keep = make_state(tx)
    grads = views({}, dtype=torch.bfloat16, seed=10)
    grads["u1.b"] = grads["u1.b"].float()  # gradients of two dtypes
    fused.fused_update(tx.fused, params, grads, opt_state)
    assert device_path["runs"] == 0 and device_path["flat"] > 0
    assert isinstance(tx.fused.tables[fused._PLAN], list)  # remembered for these parameters: not asked again
    fused.fused_update(tx.fused, params, grads, opt_state)
    assert device_path["builds"] == 1


def _shard_run(stage: int, policy: str, planned: bool):
    from tests.shard_cases import STEPS, build, local_batch, rank_and_world
    from zfunc.transforms import mixed_precision, shard

    if not planned:
        fused._device_plan = lambda *a: None  # (a forked rank's own module: the parent's stays)
    inner, state = build("clip+schedule")
    # (fp16: the scale chosen so that the second of the three steps overflows and is skipped)
    knobs = {"initial_scale_power": 15, "hysteresis": 1} if policy == "fp16" else {}
    step = shard(mixed_precision(inner, policy, **knobs), stage=stage)
    state = step.init(state)
    rank, world = rank_and_world()
    for i in range(STEPS):
        state, _ = step(state, local_batch(i, rank, world))
    mp = state.extras["mixed_precision"]
    return {"params": {k: v.clone() for k, v in state.params.items()},
            "master": {k: v.clone() for k, v in mp.master.items()}, "scale": float(mp.loss_scale),
            "planned": isinstance(state.tx.fused.tables.get(fused._PLAN), fused_plan.DevicePlan)}


@cpu_only
@quiet
@pytest.mark.parametrize("stage, policy", [(1, "bf16"), (2, "fp16"), (3, "bf16")])
def test_shard_through_one_launch_is_the_per_run_kernel(device_path, monkeypatch, stage, policy):
    planned = _shard_run(stage, policy, True)
    assert device_path["runs"] == 3 and device_path["builds"] == 1 and device_path["flat"] == 0
    monkeypatch.setattr(fused, "_device_plan", lambda *a: None)
    reference = _shard_run(stage, policy, False)
    assert device_path["flat"] > 0
    assert planned["scale"] == reference["scale"] == (2.0 ** 14 if policy == "fp16" else 1.0)
    for part in ("params", "master"):
        for k, v in reference[part].items():
            assert torch.equal(bits(planned[part][k]), bits(v)), (part, k)


@cpu_only
@quiet
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_shard_at_world_2_through_one_launch_is_the_per_run_kernel(device_path, stage):
    from zfunc.testing import run_distributed

    planned = run_distributed(_shard_run, 2, stage, "bf16", True)
    reference = run_distributed(_shard_run, 2, stage, "bf16", False)
    for got, want in zip(planned, reference):
        assert got["planned"] and not want["planned"]
        for part in ("params", "master"):
            assert got[part].keys() == want[part].keys()
            for k, v in want[part].items():
                assert torch.equal(bits(got[part][k]), bits(v)), (part, k)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_norm_of_low_precision_gradients_reads_them_as_they_are(monkeypatch, device):
    """Clipping's Σ g² over bf16/fp16 gradients: their fp32 copies' number, bit for bit, without making them
    (no cast per leaf: a copy of every gradient, and a launch each, per clipped step)."""
    from zfunc.tree import tree_sum_of_squares

    g = torch.Generator().manual_seed(0)
    tree = {f"p{i}": (torch.randn(n, generator=g) * 3).to(device, dtype) for i, (n, dtype) in
            enumerate([(7, torch.bfloat16), (1000, torch.float16), (123457, torch.bfloat16), (33, torch.float32),
                       (0, torch.bfloat16), (70001, torch.float16)])}
    want = tree_sum_of_squares({k: v.float() for k, v in tree.items()})
    casts = []
    original = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: (casts.append(self.dtype), original(self, *a, **k))[1])
    got = tree_sum_of_squares(tree)
    assert not {torch.bfloat16, torch.float16} & set(casts) and torch.equal(got, want)


@cpu_only
def test_stage_1_shard_views_found_once_per_state_and_let_go_with_it():
    """shard stages 1/2 find a state's unit flats and shard views once (ShardLayout.state_views), reuse them
    while the state's params are the same tensors, never for another state, and drop them with the state."""
    import copy

    from tests.shard_cases import build, local_batch
    from zfunc.transforms import mixed_precision, shard

    inner, plain = build("adamw")
    step = shard(mixed_precision(inner, "bf16"), stage=1)
    state = step.init(plain)
    layout = state.extras["shard"]
    state, _ = step(state, local_batch(0, 0, 1))
    first = layout.state_views.get(state.params)
    assert first is not None
    state, _ = step(state, local_batch(1, 0, 1))
    again = layout.state_views.get(state.params)
    assert all(a is b for a, b in zip(again[1].values(), first[1].values()))  # the same views: not found again
    twin = copy.deepcopy(state)  # (a copy: its own buffers, and no views of the original's)
    assert twin.extras["shard"].state_views.get(twin.params) is None
    assert layout.state_views.get(twin.params) is None
    twin, _ = step(twin, local_batch(2, 0, 1))
    assert all(a is not b for a, b in zip(twin.extras["shard"].state_views.get(twin.params)[1].values(),
                                          first[1].values()))
    views = layout.state_views
    del state, first, again
    import gc
    gc.collect()
    assert views._entry is None  # the dropped state's buffers are not held by its views


def test_state_identities_are_trusted_only_while_every_held_tensor_lives():
    """`fused_plan._Held` finds the usual step's state by ids (from C) where its dicts are new; an id names one
    object only while it lives, so once a held tensor died, equal ids prove nothing: the tensors are compared
    one by one, and a new tensor that took a dead one's id, at its address but of another dtype, is refused."""
    flat = torch.zeros(12)
    a, b = flat[:6], flat[6:]
    keys = ("a", "b")
    held = fused_plan._Held(({"a": a, "b": b},), keys)
    assert held.same(({"a": a, "b": b},), keys) and held.same_values.objects.alive[0]
    assert not held.same(({"a": a, "b": flat[6:]},), keys)  # (a new view at b's address: not the same object)
    as_int = flat.view(torch.int32)
    dead_id, dead_ptr = id(b), b.data_ptr()
    del b  # (freed here: no other reference)
    assert not held.same_values.objects.alive[0]
    # A tensor at b's address with another dtype, made until one takes b's id (CPython reuses the freed slot).
    made = []
    for _ in range(1000):
        c = as_int[6:]
        if id(c) == dead_id:
            break
        made.append(c)
    else:
        pytest.skip("no new tensor took the dead one's id here")
    assert c.data_ptr() == dead_ptr and c.numel() == 6
    assert not held.same(({"a": a, "b": c},), keys)  # equal ids and addresses, but one of them died: not trusted
    assert not held.still_at([a, c], -1)  # and compared one by one: another dtype, refused


def test_held_state_rearms_on_equivalent_tensors():
    """New views of the very buffers (same addresses, dtypes and sizes) pass the one-by-one comparison and are
    held from then on, so the step after finds them from C again; the dtypes and sizes stay the plan's."""
    flat = torch.zeros(12)
    keys = ("a", "b")
    held = fused_plan._Held(({"a": flat[:6], "b": flat[6:]},), keys)
    fresh = ({"a": flat[:6], "b": flat[6:]},)
    tensors = fused_plan._in_order(fresh, keys)
    assert not held.same(fresh, keys) and held.still_at(tensors, -1)
    held.rearm(fresh, keys, tensors)
    assert held.same(fresh, keys) and held.numels == [6, 6] and held.dtypes == [torch.float32] * 2
    assert not held.still_at([flat[:6], flat[6:9]], -1)  # (another size at the same address)


def _after_one_planned_update():
    """AdamW's fused form, its state (``keep``: what must outlive the test), bf16 gradients, the state after one
    update through the device plan, and that plan."""
    tx = optimizer("adamw", False)
    spec = tx.fused
    params, opt_state, keep = make_state(tx)
    grads = views({}, dtype=torch.bfloat16, seed=10)
    params, opt_state, _ = fused.fused_update(spec, params, grads, opt_state)
    return spec, params, opt_state, keep, grads, spec.tables[fused._PLAN]


@quiet
def test_plan_takes_new_views_of_its_buffers_and_refuses_other_tensors_at_their_addresses(device_path):
    """Through `fused_update`: the same state's tensors as new views are kept (one plan, re-armed, found from
    C at the next step); a tensor of another dtype at a held address gets a new plan."""
    spec, params, opt_state, keep, grads, plan = _after_one_planned_update()
    fresh = {k: t.view(t.shape) for k, t in params.items()}
    params, opt_state, _ = fused.fused_update(spec, fresh, grads, opt_state)
    assert spec.tables[fused._PLAN] is plan and device_path["builds"] == 1
    assert plan._held.same((fresh, spec.adam_state(opt_state).mu, spec.adam_state(opt_state).nu), plan.keys)
    as_int = {**fresh, "u1.b": fresh["u1.b"].view(torch.int32)}  # (the same bytes, another dtype)
    assert plan.grad_addresses(as_int, grads, spec.adam_state(opt_state).mu, spec.adam_state(opt_state).nu,
                               None) is None


def test_gradient_alignment_found_once_per_new_addresses():
    """`AdamRuns.grads_aligned` (the kernel's GRADS_ALIGNED) follows the addresses set last."""
    table = adam_segments.AdamRuns.build([(0, 0, 0, 0), (16, 16, 16, 0)], [[(0, 4, 0.0)], [(0, 4, 0.0)]], [4, 4],
                                         "cpu")
    table.set_grads([32, 64])
    assert table.grads_aligned
    table.set_grads([32, 66])
    assert not table.grads_aligned and table.grads.tolist() == [32, 66]
    table.set_grads([48, 80])
    assert table.grads_aligned


@quiet
def test_new_views_at_every_step_are_held_again_only_now_and_then(device_path, monkeypatch):
    """A stack that hands new views of the same buffers at every step is compared one by one at each (as it
    must be) and still updated through the one plan; the plan holds them again only at the 1st, 2nd, 4th, ...
    such step in a row (no weak reference made per tensor per step); the very tensors again: found from C."""
    spec, params, opt_state, keep, grads, plan = _after_one_planned_update()
    rearms = []
    rearm = fused_plan._Held.rearm
    monkeypatch.setattr(fused_plan._Held, "rearm", lambda self, *a: (rearms.append(1), rearm(self, *a)))
    for _ in range(8):
        params, opt_state, _ = fused.fused_update(spec, {k: t.view(t.shape) for k, t in params.items()}, grads,
                                                  opt_state)
    assert len(rearms) == 4 and plan._held.misses == 8  # (at the 1st, 2nd, 4th and 8th)
    assert spec.tables[fused._PLAN] is plan and device_path["builds"] == 1 and device_path["runs"] == 9
    fused.fused_update(spec, params, grads, opt_state)  # (the tensors held at the 8th)
    assert plan._held.misses == 0 and len(rearms) == 4


def test_gradients_outside_the_state_found_for_all_runs_at_once_as_run_by_run():
    """`DevicePlan._all_outside_state` (three numpy searches, at every step on a GPU) says what `_outside_state`
    says run by run: random buffers and runs, and runs that touch a buffer's either end or begin inside one."""
    import random

    rng = random.Random(0)
    for trial in range(200):
        spans, at = [], rng.randrange(1, 1000)
        for _ in range(rng.randrange(0, 12)):
            at += rng.randrange(0, 64)  # (0: abutting the buffer before)
            spans.append((at, at + rng.randrange(1, 64)))
            at = spans[-1][1]
        lengths = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 9))]  # bf16 elements per run
        grad_runs = [(f"k{i}", ((f"k{i}", 0, n),)) for i, n in enumerate(lengths)]
        plan = fused_plan.DevicePlan((), (), torch.device("cpu"), None, torch.bfloat16, None, None, grad_runs, spans)
        edges = [a for span in spans for a in span] or [0]
        for _ in range(20):
            starts = tuple(rng.choice([rng.randrange(0, at + 100), rng.choice(edges), rng.choice(edges) - 2 * n])
                           for n in lengths)
            starts = tuple(max(s, 0) for s in starts)
            want = all(plan._outside_state(s, s + 2 * n) for s, n in zip(starts, lengths))
            assert plan._all_outside_state(starts)[0] == want, (spans, starts, lengths)
