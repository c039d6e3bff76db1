"""The traced update once per flat buffer (`zfunc.optim.flat`) equals the per-parameter pure update bit for bit.

The update is plain torch operations, so it is compared eagerly (fast) on states laid out like `shard`'s:
per-key views of one flat buffer per run, each recording its buffer (``_zfunc_owner``) and its key (``_zfunc_key``),
with uneven sizes,
an empty key (a rank's empty slice), a mask that decays some keys of a run and not others, clipping, a bf16
compute copy, a skipped update; and once under torch.compile, where the owners are what dynamo reads.
"""

from __future__ import annotations

import pytest
import torch

import zfunc as zf
from zfunc.optim.flat import OWNER, PLACE, flat_adam_update
from zfunc.state import pure_update

SHAPES = {"a.w": (5, 3), "a.b": (5,), "a.empty": (0,), "b.w": (7, 2), "b.norm": (2,), "b.b": (2,)}
RUNS = (("a.w", "a.b"), ("b.w", "b.norm", "b.b"))
PAD = 3  # (a shard's padding after the keys: not part of any key)


def _flat_dict(values: dict, owned: bool = True) -> dict:
    """Per run: the keys' values in one flat buffer (plus padding), as views recording it and their keys."""
    out = {k: values[k].clone() for k in values}
    if not owned:
        return out
    for run in RUNS:
        flat = torch.cat([values[k].reshape(-1) for k in run] + [torch.zeros(PAD, dtype=values[run[0]].dtype)])
        pos = 0
        for k in run:
            n = values[k].numel()
            out[k] = flat[pos:pos + n].view(values[k].shape)
            setattr(out[k], OWNER, flat)
            setattr(out[k], PLACE, k)
            pos += n
    return out


def _values(seed: int, dtype=torch.float32, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=g) * scale).to(dtype) for k, s in SHAPES.items()}


OPTIMIZERS = {
    "adamw_mask": lambda: zf.optim.adamw(zf.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1,
                                         mask=lambda name: name.endswith(".w")),
    "adamw": lambda: zf.optim.adamw(3e-3, weight_decay=0.1),
    "adamw_no_decay": lambda: zf.optim.adamw(3e-3, weight_decay=0.0),
    "adam_l2": lambda: zf.optim.adam(1e-2, weight_decay=0.05),
    "clip_adamw": lambda: zf.optim.chain(zf.optim.clip_by_global_norm(0.05), zf.optim.adamw(1e-2, weight_decay=0.1)),
}


def _states(tx, owned: bool):
    params = _flat_dict(_values(0), owned)
    opt_state = tx.init(params)
    # Moments with values (a few steps in), laid out like the params.
    adam = tx.fused.adam_state(opt_state)
    mu = _flat_dict({k: v * 1e-2 for k, v in _values(1).items()}, owned)
    nu = _flat_dict({k: v.square() * 1e-3 for k, v in _values(2).items()}, owned)
    opt_state = tx.fused.advanced(opt_state, mu, nu, tx.fused.lr_state(opt_state).learning_rate)
    assert int(tx.fused.adam_state(opt_state).count) == int(adam.count) + 1
    return params, opt_state


def _both(tx, grads, owned=True, copy_owned=True, skip=None, run_grads=None):
    """(flat result, pure result), each ``(params, mu, nu, counts, compute copy)`` as plain tensors."""
    spec = tx.fused
    params, opt_state = _states(tx, owned)
    ref_params, ref_state = _states(tx, owned)
    into = _flat_dict({k: v.to(torch.bfloat16) for k, v in _values(0).items()}, copy_owned)
    new_params, new_state, copy = flat_adam_update(spec, params, grads, opt_state, RUNS, torch.bfloat16, into,
                                                   skip=skip, run_grads=run_grads)
    ref_new, ref_new_state = pure_update(tx, ref_params, grads, ref_state)
    if skip is not None:
        ref_new = {k: torch.where(skip, ref_params[k], v) for k, v in ref_new.items()}
        ref_new_state = zf.tree.tree_map(lambda n, o: torch.where(skip, o, n), ref_new_state, ref_state)
    ref_copy = {k: v.to(torch.bfloat16) for k, v in ref_new.items()}

    def plain(p, state, c):
        adam = spec.adam_state(state)
        return ({k: v.clone() for k, v in p.items()}, {k: v.clone() for k, v in adam.mu.items()},
                {k: v.clone() for k, v in adam.nu.items()}, (int(adam.count), int(spec.lr_state(state).count),
                                                              float(spec.lr_state(state).learning_rate)),
                {k: v.clone() for k, v in c.items()})

    return plain(new_params, new_state, copy), plain(ref_new, ref_new_state, ref_copy), (params, into)


def _assert_equal(got, want):
    for got_part, want_part in zip(got, want):
        if isinstance(want_part, dict):
            assert got_part.keys() == want_part.keys()
            for k in want_part:
                assert got_part[k].shape == want_part[k].shape, k
                torch.testing.assert_close(got_part[k], want_part[k], rtol=0, atol=0, msg=k)
        else:
            assert got_part == want_part


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_flat_equals_per_parameter(name, grad_dtype):
    tx = OPTIMIZERS[name]()
    got, want, (params, into) = _both(tx, _values(3, grad_dtype))
    _assert_equal(got, want)
    # In place: the state's own tensors hold the new values, the padding after the keys is untouched.
    for k, v in got[0].items():
        torch.testing.assert_close(params[k], v, rtol=0, atol=0)
    for run in RUNS:
        assert not getattr(params[run[0]], OWNER)[-PAD:].any()
        torch.testing.assert_close(getattr(into[run[0]], OWNER)[:-PAD].float(),
                                   torch.cat([got[4][k].float().reshape(-1) for k in run]), rtol=0, atol=0)


def test_flat_moves_parameters():
    """(Not a tautology: the update changes every parameter, and a different optimizer gives other values.)"""
    got, _, _ = _both(OPTIMIZERS["adamw_mask"](), _values(3))
    other, _, _ = _both(OPTIMIZERS["adamw"](), _values(3))
    start = _values(0)
    for k, v in got[0].items():
        if v.numel():
            assert not torch.equal(v, start[k]), k
    assert not torch.equal(got[0]["b.norm"], other[0]["b.norm"])  # masked out of the decay in one only


def _made_whole(grads: dict, scale: float = 1.0) -> tuple[dict, tuple]:
    """``grads`` remade as views of one flat gradient per run (what `shard` differentiates at one rank), and
    ``run_grads`` naming them; the flats scaled by ``scale`` afterwards (a flat whose values are not its
    parts' shows which one the update read)."""
    out, made = dict(grads), []
    for run in RUNS:
        flat = torch.cat([grads[k].reshape(-1) for k in run])
        parts = tuple(part.view(grads[k].shape) for k, part in zip(run, flat.split([grads[k].numel() for k in run])))
        out.update(zip(run, parts))
        made.append((flat * scale if scale != 1.0 else flat, parts))
    return out, tuple(made)


def test_a_run_reads_its_gradient_whole_only_where_its_keys_are_its_parts():
    """``run_grads`` (`zfunc.primitives.UpdateRequest.flat_grads`): read whole where the gradients are its parts
    (equal to the per-parameter update), and not where they are other tensors (a transform replaced them)."""
    tx = OPTIMIZERS["adamw_mask"]()
    grads, made = _made_whole(_values(3, torch.bfloat16))
    got, want, _ = _both(tx, grads, run_grads=made)
    _assert_equal(got, want)
    _, doubled = _made_whole(grads, scale=2.0)  # (parts of ``grads``' flats, but their flats' values doubled)
    doubled = tuple((flat, tuple(map(grads.__getitem__, run))) for (flat, _), run in zip(doubled, RUNS))
    read_whole, _, _ = _both(tx, grads, run_grads=doubled)
    assert not torch.equal(read_whole[0]["a.w"], want[0]["a.w"])  # (the flat was read: not a tautology)
    replaced = {k: g.clone() for k, g in grads.items()}
    got, want, _ = _both(tx, replaced, run_grads=doubled)
    _assert_equal(got, want)


@pytest.mark.parametrize("owned", [False, True])
def test_without_owners_and_mixed(owned):
    """A state whose tensors record no buffer (replaced, or never laid out flat) takes the concatenation:
    equal all the same; a compute copy with no owner comes back as new tensors."""
    tx = OPTIMIZERS["adamw_mask"]()
    got, want, _ = _both(tx, _values(3, torch.bfloat16), owned=owned, copy_owned=False)
    _assert_equal(got, want)


def test_views_moved_between_keys_are_taken_key_by_key():
    """Two views of one run swapped under their keys (the same owner, each at the other's place) are taken key by
    key, not as their buffer (`owner_of` compares the key each view records with the key it is found under):
    equal to the per-parameter update of the swapped dict. (Taken whole, each was updated with the other's
    gradient.)"""
    tx = OPTIMIZERS["adamw_mask"]()
    swapped = lambda d: {**d, "b.norm": d["b.b"], "b.b": d["b.norm"]}  # noqa: E731 (two of one shape)
    params, opt_state = _states(tx, owned=True)
    ref_params, ref_state = _states(tx, owned=False)
    grads = _values(3)
    new_params, new_state, _ = flat_adam_update(tx.fused, swapped(params), grads, opt_state, RUNS)
    ref_new, _ = pure_update(tx, swapped(ref_params), grads, ref_state)
    for k in ref_new:
        torch.testing.assert_close(new_params[k], ref_new[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("flag", [True, False])
def test_skip_keeps_everything(flag):
    tx = OPTIMIZERS["adamw_mask"]()
    got, want, _ = _both(tx, _values(3), skip=torch.tensor(flag))
    _assert_equal(got, want)
    if flag:
        start = _values(0)
        for k, v in got[0].items():
            torch.testing.assert_close(v, start[k], rtol=0, atol=0)


def test_refuses_what_it_cannot_run():
    """Keys outside every run that hold elements, or runs mixing dtypes: None (the caller's pure update)."""
    tx = OPTIMIZERS["adamw"]()
    params, opt_state = _states(tx, True)
    grads = _values(3)
    assert flat_adam_update(tx.fused, params, grads, opt_state, RUNS[:1]) is None
    params = {**params, "b.b": params["b.b"].double()}
    assert flat_adam_update(tx.fused, params, grads, opt_state, RUNS) is None


def _compiled_update(tx, params, grads, opt_state, into):
    def update(params, grads, opt_state, into):
        return flat_adam_update(tx.fused, params, grads, opt_state, RUNS, torch.bfloat16, into)

    return torch.compile(update, fullgraph=True, backend="aot_eager")(params, grads, opt_state, into)


def test_compiled_equals_eager():
    """Under torch.compile the owners are read by dynamo (graph inputs aliasing the views), written in
    place, and the views read back the new values: the same as eagerly, bit for bit."""
    import torch._dynamo

    torch._dynamo.reset()
    tx = OPTIMIZERS["adamw_mask"]()
    grads = _values(3, torch.bfloat16)
    params, opt_state = _states(tx, True)
    into = _flat_dict({k: v.to(torch.bfloat16) for k, v in _values(0).items()})
    new_params, new_state, copy = _compiled_update(tx, params, grads, opt_state, into)
    ref_params, ref_state = _states(tx, True)
    ref_into = _flat_dict({k: v.to(torch.bfloat16) for k, v in _values(0).items()})
    want_params, want_state, want_copy = flat_adam_update(tx.fused, ref_params, grads, ref_state, RUNS,
                                                          torch.bfloat16, ref_into)
    for k in want_params:
        torch.testing.assert_close(params[k], want_params[k], rtol=0, atol=0, msg=k)  # written in place
        torch.testing.assert_close(new_params[k], want_params[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(copy[k], want_copy[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(tx.fused.adam_state(new_state).nu[k], tx.fused.adam_state(want_state).nu[k],
                                   rtol=0, atol=0, msg=k)


def test_decay_mask_under_compile_names_the_keys():
    """Under torch.compile a mask sees the parameters' names (dynamo's polyfill of optree's paths gave other
    names: a compiled AdamW with a mask decayed nothing)."""
    seen = {}

    def masked(params):
        seen.update(zf.optim.decay_mask(lambda name: name.endswith(".w"), params))
        seen.update({"mapping": all(zf.optim.decay_mask({k: True for k in params}, params).values())})
        return params["a.w"] * 2

    torch.compile(masked, fullgraph=True, backend="eager")(_values(0))
    assert seen == {"a.w": True, "a.b": False, "a.empty": False, "b.w": True, "b.norm": False, "b.b": False,
                    "mapping": True}


def _compiled_stage_3_step(stage: int) -> str:
    """One compiled step of shard(mixed_precision(bf16)) with the per-parameter update made to fail: the traced
    update must take the flat route (and the state's views then hold the new values)."""
    import torch._dynamo

    import zfunc.state
    from tests.models import make_batch
    from tests.shard_cases import build
    from zfunc.transforms import mixed_precision, shard

    def per_parameter(*args, **kwargs):
        raise AssertionError("the traced update took the per-parameter route")

    torch._dynamo.reset()
    plain, state = build()
    step = shard(mixed_precision(plain, "bf16"), stage=stage)
    state = step.init(state)
    before = {k: v.clone() for k, v in state.params.items()}
    zfunc.state.pure_update = per_parameter
    run = torch.compile(step, fullgraph=True, backend="eager")
    for i in range(2):  # (the schedule's first rate is 0: warmup)
        state, _ = run(state, make_batch(8, seed=i))
    moved = [k for k, v in state.params.items() if v.numel() and not torch.equal(v, before[k])]
    return "flat" if len(moved) == sum(1 for v in before.values() if v.numel()) else f"moved only {moved}"


@pytest.mark.slow  # (traces two whole steps: ~15 s each on 2 idle cores)
@pytest.mark.parametrize("stage", [1, 3])
def test_compiled_shard_step_takes_the_flat_route(dist, stage):
    assert dist(_compiled_stage_3_step, 1, stage, timeout=600)[0] == "flat"
