"""zfunc.io in one process: round trips, the files, consolidation, crashes, and every kind of bad input."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import zfunc as zf
from tests.io_tools import rewrite_manifest, write_manifest_bytes
from tests.models import TinyLM, make_batch, tiny_lm_step
from zfunc.cli import main as cli_main
from zfunc.io import CheckpointError, consolidate, list_checkpoints, restore, save
from zfunc.transforms import shard


def make(stage=None, opt=None, dropout=0.1, **model_kw):
    """A step and a fresh state (same values on every call)."""
    model, params, train_step = tiny_lm_step(dropout, **model_kw)
    step = train_step if stage is None else shard(train_step, stage=stage)
    params = {k: v.clone() for k, v in params.items()}
    state = zf.TrainState.create(params, opt or zf.optim.adamw(zf.optim.warmup_cosine(1e-2, 2, 20)))
    return step, zf.init(step, state), model


def trained(stage=None, steps=2, **kw):
    step, state, model = make(stage, **kw)
    for i in range(steps):
        state, _ = step(state, make_batch(seed=i))
    return step, state, model


def leaves(state):
    return [x for x in zf.tree.tree_leaves(state) if isinstance(x, torch.Tensor)]


def assert_same_state(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


# --------------------------------------------------------------------------
# Round trips


def test_round_trip_plain_in_place_with_client_state_and_rng(tmp_path):
    _, state, _ = trained()
    client = {"data_pos": 17, "epoch": 1, "name": "run", "hist": [1.5, None, True],
              "nested": {"t": torch.arange(5), "w": torch.ones(2, 3, dtype=torch.bfloat16)}}
    torch.manual_seed(7)
    random.seed(8)
    np.random.seed(9)
    expected_rng = (torch.get_rng_state(), random.random(), np.random.rand())
    torch.manual_seed(7)
    random.seed(8)
    np.random.seed(9)
    path = save(tmp_path, state, client)
    assert path == tmp_path / "step_000002"
    digest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    assert (tmp_path / "latest").read_text() == f"step_000002 {digest}\n"
    assert (path / "manifest.sha256").read_text() == f"{digest}  manifest.json\n"  # what sha256sum prints

    _, like, _ = make()
    before = {id(t) for t in leaves(like)}
    torch.manual_seed(123)
    random.seed(0)
    np.random.seed(0)
    got, got_client = restore(tmp_path, like=like)
    assert got is like and {id(t) for t in leaves(got)} == before  # written in place
    assert_same_state(got, state)
    assert torch.equal(torch.get_rng_state(), expected_rng[0])
    assert random.random() == expected_rng[1] and np.random.rand() == expected_rng[2]
    assert got_client["data_pos"] == 17 and got_client["hist"] == [1.5, None, True]
    assert torch.equal(got_client["nested"]["t"], torch.arange(5))
    assert got_client["nested"]["w"].dtype == torch.bfloat16
    assert restore(tmp_path, like=make()[1], rng=False)[1]["epoch"] == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_restore_keeps_flat_buffer_views(tmp_path, stage):
    step, state, _ = trained(stage)
    save(tmp_path, state)
    _, like, _ = make(stage)
    layout = like.extras["shard"]
    got, _ = restore(tmp_path, like=like)
    assert_same_state(got, state)
    mu = got.opt_state[0].mu
    for unit in layout.units:
        assert unit.flat_of({k: mu[k] for k in unit.keys}, unit.shard_size) is not None
        if stage < 3:
            assert unit.flat_of({k: got.params[k] for k in unit.keys}, unit.padded) is not None
    # and it trains on bitwise like the original
    torch.manual_seed(5)
    for i in (5, 6):
        state, _ = step(state, make_batch(seed=i))
    torch.manual_seed(5)
    for i in (5, 6):
        got, _ = step(got, make_batch(seed=i))
    assert_same_state(got, state)


def test_exact_resume_plain_with_dropout(tmp_path):
    step, state, _ = make()
    torch.manual_seed(42)
    for i in range(3):
        state, _ = step(state, make_batch(seed=i))
    save(tmp_path, state, {"pos": 3})
    for i in range(3, 6):
        state, _ = step(state, make_batch(seed=i))

    step2, like, _ = make()
    torch.manual_seed(999)  # restore must bring back the dropout stream
    like, client = restore(tmp_path, like=like)
    for i in range(client["pos"], 6):
        like, _ = step2(like, make_batch(seed=i))
    assert_same_state(like, state)


def test_files_are_plain_safetensors_and_json(tmp_path):
    _, state, _ = trained(stage=3)
    save(tmp_path, state)
    d = tmp_path / "step_000002"
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "manifest.sha256", "rank_00000.safetensors"]
    m = json.loads((d / "manifest.json").read_text())
    assert (m["format_version"], m["world_size"], m["stage"], m["step"]) == (2, 1, 3, 2)
    assert m["params"]["embed.weight"] == [13, 10] and m["weights"] == "params"
    part = m["files"][0]["parts"][0]
    assert part["file"] == "rank_00000.safetensors" and len(part["sha256"]) == 64
    assert part["bytes"] == (d / "rank_00000.safetensors").stat().st_size
    loaded = safetensors.torch.load_file(d / "rank_00000.safetensors")
    assert torch.equal(loaded["params/blocks.0.up.weight"], state.params["blocks.0.up.weight"])
    assert torch.equal(loaded["opt_state/0/nu/embed.weight"], state.opt_state[0].nu["embed.weight"])
    assert torch.equal(loaded["step"], state.step)
    with safe_open(d / "rank_00000.safetensors", "pt") as f:
        assert {"rng/torch_cpu", "opt_state/1/learning_rate"} <= set(f.keys())


def test_keep_latest_resave_and_named_steps(tmp_path):
    step, state, _ = make(dropout=0.0)
    saved = {}
    for i in range(5):
        state, _ = step(state, make_batch(seed=i))
        save(tmp_path, state, {"i": i}, keep=2)
        saved[i + 1] = {k: v.clone() for k, v in state.params.items()}
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert restore(tmp_path, like=make()[1])[1] == {"i": 4}
    assert restore(tmp_path, like=make()[1], step=4)[1] == {"i": 3}
    assert restore(tmp_path / "step_000004", like=make()[1])[1] == {"i": 3}
    with pytest.raises(CheckpointError, match=r"no complete checkpoint of step 1 .*steps present: 4, 5"):
        restore(tmp_path, like=make()[1], step=1)
    # the same step saved again replaces it; an older step saved later stays (it is the latest) with keep
    save(tmp_path, state, {"i": "again"}, keep=2)
    assert restore(tmp_path, like=make()[1])[1] == {"i": "again"}
    _, early, _ = make()
    save(tmp_path, early, {"i": "rewound"}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0, 5]
    assert restore(tmp_path, like=make()[1])[1] == {"i": "rewound"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".zfunc.lock", "latest", "step_000000", "step_000005"]


def test_large_ranks_are_split_into_parts_read_in_parallel(tmp_path):
    _, state, _ = trained(stage=3)
    save(tmp_path, state, part_bytes=2000)
    d = tmp_path / "step_000002"
    parts = json.loads((d / "manifest.json").read_text())["files"][0]["parts"]
    assert len(parts) > 3 and [p["file"] for p in parts[:2]] == ["rank_00000.safetensors",
                                                                "rank_00000.p001.safetensors"]
    got, _ = restore(tmp_path, like=make(stage=3)[1])
    assert_same_state(got, state)
    (d / parts[2]["file"]).unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000\.p002\.safetensors: rank 0's file is missing"):
        restore(tmp_path, like=make(stage=3)[1])


# --------------------------------------------------------------------------
# Mismatches


def test_different_parameter_names_or_shapes_are_listed(tmp_path):
    _, state, _ = trained(steps=1)
    save(tmp_path, state)
    _, other, _ = make(hidden=24, depth=4)
    with pytest.raises(CheckpointError) as err:
        restore(tmp_path, like=other)
    msg = str(err.value)
    assert "parameters differ" in msg and "missing from checkpoint: blocks.3.down.bias" in msg
    assert "blocks.0.up.weight: expected shape (24, 10), got (23, 10)" in msg


def test_different_optimizer_is_explained_and_strict_false_restores_the_rest(tmp_path):
    _, state, _ = trained(steps=1)
    save(tmp_path, state)
    _, sgd_state, _ = make(opt=zf.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"(?s)does not match the template.*missing from checkpoint: "
                                                r"opt_state/1/trace.*not in template: opt_state/0/mu"):
        restore(tmp_path, like=sgd_state)
    with pytest.warns(UserWarning, match="kept the template's values"):
        got, _ = restore(tmp_path, like=sgd_state, strict=False)
    for k in state.params:
        assert torch.equal(got.params[k], state.params[k])


# --------------------------------------------------------------------------
# Export


def test_consolidate_matches_gather_and_loads_into_the_model(tmp_path):
    step, state, _ = trained(stage=2)
    save(tmp_path / "ck", state)
    full = step.gather(state)
    out = consolidate(tmp_path / "ck", tmp_path / "w.safetensors", progress=False)
    weights = safetensors.torch.load_file(out)
    assert set(weights) == set(full) and "head.weight" not in weights
    for k in full:
        assert weights[k].dtype == torch.float32 and torch.equal(weights[k], full[k])
    model = TinyLM()
    result = model.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) == {"head.weight", "frozen_scale", "offset"}
    assert torch.equal(model.head.weight, full["embed.weight"])  # tied: loading the canonical name sets both

    half = consolidate(tmp_path / "ck", tmp_path / "h.safetensors", torch.bfloat16, aliases=TinyLM(), progress=False)
    weights = safetensors.torch.load_file(half)
    assert weights["head.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["head.weight"], full["embed.weight"].bfloat16())
    assert TinyLM().load_state_dict(weights, strict=False).missing_keys == ["frozen_scale", "offset"]


def test_cli_consolidate_info_verify(tmp_path, capsys):
    _, state, _ = trained(stage=1)
    save(tmp_path / "ck", state)
    assert cli_main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "a.safetensors"), "-q"]) == 0
    assert cli_main(["info", str(tmp_path / "ck")]) == 0
    assert cli_main(["verify", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "step 2, world size 1, stage 1" in out and "1 ranks, 1 files OK" in out
    assert cli_main(["info", str(tmp_path)]) == 2
    assert "not a zfunc checkpoint directory" in capsys.readouterr().err
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-m", "zfunc.io", "consolidate", str(tmp_path / "ck"),
                          str(tmp_path / "b.safetensors")], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert "100%" in run.stderr  # the progress bar
    a = safetensors.torch.load_file(tmp_path / "a.safetensors")
    b = safetensors.torch.load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------
# Bad input: each a CheckpointError that names the file and the problem


@pytest.fixture
def saved(tmp_path):
    _, state, _ = trained(steps=1, stage=3)
    save(tmp_path, state)
    return tmp_path, tmp_path / "step_000001"


def _restore(path):
    return restore(path, like=make(stage=3)[1])


def test_truncated_file(saved):
    root, d = saved
    f = d / "rank_00000.safetensors"
    data = f.read_bytes()
    for size in (len(data) - 1, len(data) // 2, 40, 3):
        f.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors: truncated"):
            _restore(root)
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors: truncated"):
        consolidate(root, root / "x.safetensors", progress=False)


def test_corrupted_bytes_fail_the_checksum(saved):
    root, d = saved
    f = d / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors: checksum mismatch"):
        _restore(root)
    assert cli_main(["verify", str(root)]) == 2


def test_corrupted_header(saved):
    root, d = saved
    f = d / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe\x00]"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors: corrupt safetensors header"):
        restore(root, like=make(stage=3)[1], verify=False)


def test_missing_rank_file(saved):
    root, d = saved
    (d / "rank_00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors: rank 0's file is missing"):
        _restore(root)


def test_newer_format_version(saved):
    root, d = saved
    rewrite_manifest(d, lambda m: m.update(format_version=99))  # as a newer zfunc would write it
    with pytest.raises(CheckpointError, match=r"manifest\.json: written in checkpoint format version 99 .*upgrade"):
        _restore(root)


def test_corrupt_manifest(saved):
    root, d = saved
    (d / "manifest.json").write_text('{"format": "zfunc-checkpoint", "format_')
    with pytest.raises(CheckpointError, match=r"manifest\.json: checksum mismatch"):
        _restore(root)
    write_manifest_bytes(d, b'{"format": "zfunc-checkpoint", "format_')  # even with its checksum sealed anew
    with pytest.raises(CheckpointError, match=r"manifest\.json: corrupt \(not JSON"):
        _restore(root)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "weights.bin").write_bytes(b"\0" * 100)
    for d in (tmp_path / "empty", tmp_path / "other"):
        with pytest.raises(CheckpointError, match=rf"{d.name}: not a zfunc checkpoint directory"):
            _restore(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        _restore(tmp_path / "nope")
    (tmp_path / "step_000003").mkdir()
    with pytest.raises(CheckpointError, match=r"step_000003: incomplete checkpoint"):
        _restore(tmp_path / "step_000003")
    (tmp_path / "other" / "manifest.json").write_text('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match=r"manifest\.json: not a zfunc checkpoint manifest"):
        _restore(tmp_path / "other")


def test_bad_save_arguments(tmp_path):
    _, state, _ = make()
    with pytest.raises(CheckpointError, match=r"client_state\['a'\]\[1\]: object is not JSON-able"):
        save(tmp_path, state, {"a": [1, object()]})
    with pytest.raises(CheckpointError, match="dict keys must be str"):
        save(tmp_path, state, {1: 2})
    with pytest.raises(ValueError, match="keep must be"):
        save(tmp_path, state, keep=0)
    with pytest.raises(TypeError, match="TrainState"):
        save(tmp_path, state.params)
    assert not list(tmp_path.iterdir())  # nothing written


# --------------------------------------------------------------------------
# Crashes: every moment of a save leaves a complete checkpoint behind


def _kill_state(value: float):
    params = {f"w{i}": torch.full((1 << 12,), value) for i in range(8)}
    state = zf.TrainState.create(params, zf.optim.adam(1e-3)).replace(step=torch.tensor(int(value)))
    for m in state.opt_state[1].mu.values():
        m.fill_(-value)
    return state


def _check_complete(root):
    like = _kill_state(0.0)
    got, client = restore(root, like=like, rng=False)
    s = int(got.step)
    assert client == {"step": s}
    for k, p in got.params.items():
        assert torch.equal(p, torch.full_like(p, float(s))), k
        assert torch.equal(got.opt_state[1].mu[k], torch.full_like(p, -float(s)))
    return s


def test_sigkill_at_random_moments_never_breaks_the_checkpoint(tmp_path):
    state = _kill_state(1.0)
    save(tmp_path, state, {"step": 1}, keep=2)
    rnd = random.Random(0)
    last, kills, longest = 1, 0, 0.06
    while kills < 20:
        start = last + 1
        pid = os.fork()
        if pid == 0:  # child: save step after step until killed (numpy writes only: no torch threads)
            code = 1
            try:
                torch.set_num_threads(1)  # forked after parallel work: keep OpenMP out (see zfunc.testing)
                for s in range(start, start + 10_000):
                    for k, p in state.params.items():
                        p.numpy()[:] = s
                        state.opt_state[1].mu[k].numpy()[:] = -s
                    state.step.numpy()[...] = s
                    save(tmp_path, state, {"step": s}, keep=2)
                code = 0
            finally:
                os._exit(code)
        time.sleep(rnd.uniform(0.002, longest))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        kills += 1
        s = _check_complete(tmp_path)
        assert s >= last
        longest = 0.06 if s > last else min(2 * longest, 1.0)  # a slow machine: give the child more time
        last = s
    assert last > 3  # the saves did make progress between kills


@pytest.mark.parametrize("fail_at", range(32))  # every rename, fsync and delete of the three saves
@pytest.mark.filterwarnings("ignore:.*names a missing or incomplete checkpoint")  # the fallback, when hit
def test_a_failure_at_any_filesystem_step_leaves_a_complete_checkpoint(tmp_path, monkeypatch, fail_at):
    """Crash simulation: the n-th rename/delete/fsync of a save raises."""
    import zfunc.io.writer as io_save

    state = _kill_state(1.0)
    save(tmp_path, state, {"step": 1}, keep=1)
    save(tmp_path, state, {"step": 1}, keep=1)  # a resave of the same step: the swap path
    calls = {"n": 0}

    def failing(fn):
        def wrapper(*a, **kw):
            calls["n"] += 1
            if calls["n"] == fail_at + 1:
                raise OSError("simulated crash")
            return fn(*a, **kw)
        return wrapper

    for name in ("os", "shutil"):
        module = getattr(io_save, name)
        for attr in {"os": ("replace", "fsync"), "shutil": ("rmtree",)}[name]:
            monkeypatch.setattr(module, attr, failing(getattr(module, attr)))
    for s in (2, 2, 3):
        for k, p in state.params.items():
            p.fill_(s)
            state.opt_state[1].mu[k].fill_(-s)
        state.step.fill_(s)
        try:
            save(tmp_path, state, {"step": s}, keep=1)
        except (CheckpointError, OSError):
            pass
        assert _check_complete(tmp_path) in (1, 2, 3)
    assert calls["n"] > fail_at  # the simulated crash did happen
    monkeypatch.undo()
    save(tmp_path, state, {"step": 3}, keep=1)  # and the next save cleans up after the crash
    assert _check_complete(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".zfunc.lock", "latest", "step_000003"]
