"""No process group under torchrun.

A launcher started this process as one of ``WORLD_SIZE`` ranks, but the script
never called ``init_process_group``: every rank would shard over a world of
one, train its own model and save over the others' checkpoints. Everything in
zfunc that talks to other ranks refuses, before it changes anything, saying how
to start the group. (In these tests the environment is set, not a launcher.)
"""

from __future__ import annotations

import pytest
import torch

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, single_thread  # noqa: F401 (a fixture)
from tests.models import TinyLM, make_batch, tiny_lm_step
from zfunc.dist import CollectiveError
from zfunc.transforms import mixed_precision, offload, shard

pytestmark = pytest.mark.usefixtures("single_thread")

NO_GROUP = ("WORLD_SIZE=2", "init_process_group", "each rank would train its own model")


@pytest.fixture
def launched(monkeypatch):
    """This process looks like rank 0 of 2 started by torchrun."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def _plain_state():
    _, params, step = tiny_lm_step()
    return step, zf.TrainState.create(copies(params), zf.optim.sgd(0.1))


@outcome("clear")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shard_init_refuses(launched, stage):
    step, state = _plain_state()
    clear_error(lambda: shard(step, stage=stage).init(state), *NO_GROUP, exc=CollectiveError)


@outcome("clear")
def test_shard_init_of_a_meta_built_model_refuses(launched):
    with torch.device("meta"):
        model = TinyLM()
    _, params = zf.functional(model)
    stepped = shard(offload(lambda state, batch: (state, {})), stage=3)
    clear_error(lambda: stepped.init(zf.TrainState.create(params, zf.optim.sgd(0.1))), *NO_GROUP,
                exc=CollectiveError)


@outcome("clear")
@pytest.mark.parametrize("use", ["step", "gather"])
def test_a_sharded_state_refuses_to_step_or_gather(monkeypatch, use):
    step, state = _plain_state()
    stepped = shard(mixed_precision(step, "bf16"), stage=3)
    state = stepped.init(state)  # made before the environment says otherwise
    monkeypatch.setenv("WORLD_SIZE", "2")
    clear_error((lambda: stepped(state, make_batch())) if use == "step" else (lambda: stepped.gather(state)),
                *NO_GROUP, exc=CollectiveError)


@outcome("clear")
def test_save_refuses_and_writes_nothing(launched, tmp_path):
    _, state = _plain_state()
    clear_error(lambda: zf.io.save(tmp_path / "ck", state), *NO_GROUP, exc=CollectiveError)
    assert not (tmp_path / "ck").exists()


@outcome("clear")
def test_restore_refuses_and_leaves_the_template_alone(monkeypatch, tmp_path):
    step, state = _plain_state()
    state, _ = step(state, make_batch())
    zf.io.save(tmp_path / "ck", state)
    _, like = _plain_state()
    before = copies(like.params)
    monkeypatch.setenv("WORLD_SIZE", "2")
    clear_error(lambda: zf.io.restore(tmp_path / "ck", like=like), *NO_GROUP, exc=CollectiveError)
    assert_same(like.params, before)


@outcome("right")
def test_a_world_of_one_is_a_world_of_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    step, state = _plain_state()
    reference, _ = step(zf.tree.tree_map(torch.clone, state), make_batch())
    stepped = shard(step, stage=3)
    new, _ = stepped(stepped.init(state), make_batch())
    assert_same(stepped.gather(new), reference.params, rtol=1e-6, atol=1e-7)
