"""zfunc.io across processes: exact resume for every stage and world size, resharding, rank agreement.

Every training run happens in `run_distributed` workers (one intra-op thread
each), so an interrupted run and its uninterrupted twin do the same float
operations in the same order and must agree bitwise.
"""

import warnings

import numpy as np
import pytest
import safetensors.torch
import torch

import zfunc as zf
from tests.shard_cases import build, local_batch, rank_and_world, to_numpy
from zfunc.io import CheckpointError, consolidate, locate, read_manifest, restore, save
from zfunc.testing import run_distributed, seed_everything
from zfunc.transforms import offload, shard

try:
    from zfunc.transforms.mixed_precision import mixed_precision
except ImportError as e:  # being written alongside
    mixed_precision, MP_MISSING = None, f"zfunc.transforms.mixed_precision is not importable: {e}"
else:
    MP_MISSING = None

K, M = 2, 1  # steps before the save, steps after it

WRAPS = {
    "plain": lambda step: step,
    "offload": lambda step: offload(step),
    "bf16": lambda step: mixed_precision(step, "bf16"),
    "offload+fp16": lambda step: offload(mixed_precision(step, "fp16")),
}
needs_mp = {"bf16", "offload+fp16"}


def configs(world):
    """(stage, wrap) pairs run at this world size; stage 0 = no shard."""
    out = [(stage, "plain") for stage in (1, 2, 3)]
    if world == 1:
        out += [(0, "plain"), (0, "offload"), (0, "bf16")]
    if world == 2:
        out += [(1, "offload"), (2, "bf16"), (3, "offload+fp16")]
    return [c for c in out if c[1] not in needs_mp or mixed_precision is not None]


def make(stage, wrap):
    train_step, state = build("adamw", dropout=0.1)
    step = WRAPS[wrap](train_step)
    if stage:
        step = shard(step, stage=stage)
    return step, zf.init(step, state)


def name(stage, wrap):
    return f"s{stage}-{wrap}"


def full_numpy(step, state):
    return to_numpy(zf.gather(step, state))


def train_and_save(root, world_configs):
    """K steps, save, M more: the uninterrupted reference (and the params at the save)."""
    rank, world = rank_and_world()
    out = {}
    for stage, wrap in world_configs:
        step, state = make(stage, wrap)
        seed_everything(100 + rank)  # each rank its own dropout stream
        for pos in range(K):
            state, _ = step(state, local_batch(pos, rank, world))
        save(root / name(stage, wrap), state, {"pos": K, "rank": rank, "mark": torch.tensor([rank, K])})
        at_save = full_numpy(step, state)
        for pos in range(K, K + M):
            state, _ = step(state, local_batch(pos, rank, world))
        out[(stage, wrap)] = {"at_save": at_save, "final": full_numpy(step, state)}
    return out


def resume(root, world_configs):
    """Fresh template, restore, train on from the saved data position."""
    rank, world = rank_and_world()
    out = {}
    for stage, wrap in world_configs:
        step, state = make(stage, wrap)
        seed_everything(12345)  # not the stream that was saved: restore must bring that back
        state, client = restore(root / name(stage, wrap), like=state)
        assert client["rank"] == rank and torch.equal(client["mark"], torch.tensor([rank, K]))
        for pos in range(client["pos"], K + M):
            state, _ = step(state, local_batch(pos, rank, world))
        out[(stage, wrap)] = full_numpy(step, state)
    return out


_RUNS = {}


def warm_up():
    """One step of the configurations with costly first calls (stage 3's, numba's) in this process,
    so that every forked worker inherits them warm: ~10x less time per run_distributed call."""
    for stage, wrap in [(3, "plain"), (0, "offload")] + [(0, "offload+fp16")] * (mixed_precision is not None):
        step, state = make(stage, wrap)
        step(state, local_batch(0, 0, 1))


def saved_run(world, tmp_path_factory):
    """The reference run of this world size (computed once, shared by the tests below)."""
    if not _RUNS:
        warm_up()
    if world not in _RUNS:
        root = tmp_path_factory.mktemp(f"world{world}")
        _RUNS[world] = root, run_distributed(train_and_save, world, root, configs(world))
    return _RUNS[world]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_exact_resume_every_stage(world, tmp_path_factory):
    root, ref = saved_run(world, tmp_path_factory)
    got = run_distributed(resume, world, root, configs(world))
    for rank in range(world):
        for config in configs(world):
            for key, value in ref[rank][config]["final"].items():
                np.testing.assert_array_equal(got[rank][config][key], value,
                                              err_msg=f"world {world} rank {rank} {config} {key}")
    for config in configs(world):  # the ranks agree, and dropout made the steps differ from a no-dropout run
        assert all(np.array_equal(ref[r][config]["final"]["embed.weight"], ref[0][config]["final"]["embed.weight"])
                   for r in range(world))


def test_mixed_precision_and_offload_are_covered():
    if MP_MISSING:
        pytest.skip(MP_MISSING)
    assert {w for _, w in configs(1) + configs(2)} == set(WRAPS)


def test_mixed_precision_checkpoint_exports_the_master(tmp_path_factory, tmp_path):
    if MP_MISSING:
        pytest.skip(MP_MISSING)
    root, ref = saved_run(1, tmp_path_factory)
    src = root / name(0, "bf16")
    manifest = read_manifest(locate(src))
    assert manifest["weights"] == "extras/mixed_precision/master"
    assert set(manifest["groups"]["params"].values()) == {"bfloat16"}
    weights = safetensors.torch.load_file(consolidate(src, tmp_path / "w.safetensors", progress=False))
    at_save = ref[0][(0, "bf16")]["at_save"]
    for k, v in at_save.items():
        assert weights[k].dtype == torch.float32
        np.testing.assert_array_equal(weights[k].numpy(), v)
    with pytest.raises(CheckpointError, match="not in template: extras/mixed_precision/master"):
        plain_restore(src, strict=True)
    full = plain_restore(src, strict=False)  # into a plain fp32 state: params come from the master
    for k, v in at_save.items():
        np.testing.assert_array_equal(full["params"][k], v)


# --------------------------------------------------------------------------
# Resharding


def plain_restore(path, strict=True):
    """A checkpoint restored into one plain process: full params and Adam moments."""
    _, state = build("adamw", dropout=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RNG is not restored across world sizes
        state, _ = restore(path, like=state, strict=strict, rng=False)
    adam = state.opt_state[0]
    return {"params": to_numpy(state.params), "mu": to_numpy(adam.mu), "nu": to_numpy(adam.nu),
            "step": int(state.step)}


def restore_sharded(src, stage, save_to=None):
    """Restore into this world's `stage` layout; return the local pieces (and optionally save again)."""
    _, state = make(stage, "plain")
    layout = state.extras["shard"]
    with pytest.warns(UserWarning, match="RNG states not restored"):
        state, client = restore(src, like=state)
    adam = state.opt_state[0]
    views_intact = all(
        unit.flat_of({k: adam.mu[k] for k in unit.keys}, unit.shard_size) is not None
        and (stage == 3 or unit.flat_of({k: state.params[k] for k in unit.keys}, unit.padded) is not None)
        for unit in layout.units)
    if save_to is not None:
        save(save_to, state, client)
    return {"layout": layout, "views_intact": views_intact, "params": to_numpy(state.params),
            "mu": to_numpy(adam.mu), "nu": to_numpy(adam.nu), "client": client, "step": int(state.step)}


def assemble(pieces, field):
    """Full flat tensors from every rank's local 1-D slices (rank r's slice follows rank r-1's)."""
    return {k: np.concatenate([p[field][k].reshape(-1) for p in pieces]) for k in pieces[0][field]}


def assert_matches(full, pieces, fields, sharded_params):
    for field in fields:
        got = assemble(pieces, field) if field != "params" or sharded_params else pieces[0][field]
        for k, v in full[field].items():
            np.testing.assert_array_equal(got[k].reshape(v.shape), v, err_msg=f"{field} {k}")


def test_reshard_4_ranks_stage3_to_2_ranks_stage2_to_1_plain(tmp_path_factory, tmp_path):
    root, ref = saved_run(4, tmp_path_factory)
    src = root / name(3, "plain")
    full = plain_restore(src)
    for k, v in ref[0][(3, "plain")]["at_save"].items():  # the plain restore is what was trained
        np.testing.assert_array_equal(full["params"][k], v)
    pieces = run_distributed(restore_sharded, 2, src, 2, tmp_path / "two")
    assert all(p["views_intact"] and p["step"] == K for p in pieces)
    assert [p["client"]["rank"] for p in pieces] == [0, 0]  # another world size: rank 0's client_state
    assert_matches(full, pieces, ("params", "mu", "nu"), sharded_params=False)
    for p in pieces:  # stage 2 keeps the full params on every rank
        for k, v in full["params"].items():
            np.testing.assert_array_equal(p["params"][k], v)
    again = plain_restore(tmp_path / "two")  # the 2-rank stage-2 save, restored plain
    for field in ("params", "mu", "nu"):
        for k, v in full[field].items():
            np.testing.assert_array_equal(again[field][k], v, err_msg=f"{field} {k}")


def test_reshard_2_ranks_to_4_ranks_stage3(tmp_path_factory):
    root, _ = saved_run(2, tmp_path_factory)
    src = root / name(1, "plain")
    full = plain_restore(src)
    pieces = run_distributed(restore_sharded, 4, src, 3)
    assert all(p["views_intact"] for p in pieces)
    assert_matches(full, pieces, ("params", "mu", "nu"), sharded_params=True)


# --------------------------------------------------------------------------
# Ranks must agree


def disagreeing_steps(root):
    rank, _ = rank_and_world()
    _, state = make(3, "plain")
    state = state.replace(step=torch.tensor(5 + rank))
    try:
        save(root, state)
    except CheckpointError as e:
        return str(e)
    return None


def missing_peer_file(root):
    rank, _ = rank_and_world()
    _, state = make(2, "plain")
    save(root, state)
    torch.distributed.barrier()
    if rank == 0:
        (root / "step_000000" / "rank_00001.safetensors").unlink()
    torch.distributed.barrier()
    try:
        restore(root, like=make(2, "plain")[1])
    except CheckpointError as e:
        return str(e)
    return None


def test_ranks_disagreeing_on_the_step_all_raise(tmp_path):
    errors = run_distributed(disagreeing_steps, 2, tmp_path)
    for e in errors:
        assert e is not None and "ranks disagree on state.step (rank 0: 5, rank 1: 6)" in e
    assert not list(tmp_path.iterdir())


def test_a_missing_rank_file_fails_every_rank(tmp_path):
    errors = run_distributed(missing_peer_file, 2, tmp_path)
    for e in errors:
        assert e is not None and "rank_00001.safetensors: rank 1's file is missing" in e


def plain_state_on_two_ranks(root):
    """No shard: every rank holds the same whole state; rank 0 writes it, every rank its RNG and client_state."""
    rank, _ = rank_and_world()
    step, state = make(0, "plain")
    seed_everything(7 + rank)
    state, _ = step(state, local_batch(0, 0, 1))
    save(root, state, {"rank": rank})
    expected = torch.get_rng_state()
    state, client = restore(root, like=make(0, "plain")[1])
    return client["rank"] == rank and torch.equal(torch.get_rng_state(), expected), to_numpy(state.params)


def test_unsharded_state_saved_from_several_ranks(tmp_path):
    results = run_distributed(plain_state_on_two_ranks, 2, tmp_path)
    assert [ok for ok, _ in results] == [True, True]
    manifest = read_manifest(locate(tmp_path))
    assert manifest["world_size"] == 2 and manifest["layout"] is None
    full = plain_restore(tmp_path)
    for k, v in results[0][1].items():
        np.testing.assert_array_equal(full["params"][k], v)
