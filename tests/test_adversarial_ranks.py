"""Ranks that disagree.

Every rank must build the same model and the same step. When they do not, the
one thing zfunc may not do is go on: a rank seeded with ``seed + rank`` would
otherwise train a model spliced from several initializations, and ranks whose
parameter order, shapes, stage, policy, units or micro-batches differ issue
collectives that do not match (a hang, or a gloo abort). So ``shard.init``
starts every rank from rank 0's values (with a warning) and refuses, on every
rank at once and with the same message, a step or model that differs.

All disagreement cases of one world size run in one `run_distributed` call:
each case ends with every rank raising at the same check, so the group is still
in step for the next one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as tdist

import zfunc as zf
from tests.adversarial import copies, outcome, says
from tests.models import TinyLM, lm_loss, make_batch
from zfunc.dist import CollectiveError
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, shard


def _model_step(width: int = 10, order_reversed: bool = False):
    torch.manual_seed(0)
    model = TinyLM(width=width)
    apply_fn, params = zf.functional(model)
    loss_fn = lm_loss(apply_fn)

    def step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    params = copies(params)
    if order_reversed:
        params = dict(reversed(list(params.items())))
    return step, params


def _case(name: str, rank: int, odd: int):
    """``(stepped, plain state)`` of case ``name``; rank ``odd`` is the one that differs."""
    differs = rank == odd
    step, params = _model_step(width=12 if name == "shapes" and differs else 10,
                               order_reversed=name == "parameter-order" and differs)
    inner = step
    if name == "policy":
        inner = mixed_precision(step, "fp16" if differs else "bf16")
    if name == "cast_buffers":
        inner = mixed_precision(step, "bf16", cast_buffers=differs)
    if name == "micro_batches":
        inner = accumulate(step, 4 if differs else 2)
    if name == "checkpoint-on-one-rank":
        inner = checkpoint(step) if differs else step
    stage = 2 if name == "stage" and differs else 3
    units = ["blocks.0", "blocks.1"] if name == "units" and differs else None
    tx = zf.optim.adamw(1e-2)
    if name == "optimizer-state":
        tx = zf.optim.sgd(0.1, momentum=0.9) if differs else zf.optim.adamw(1e-2)
    return shard(inner, stage=stage, units=units), zf.TrainState.create(params, tx)


DISAGREEMENTS = {
    "parameter-order": ["parameter names, in order", "embed.weight"],
    "shapes": ["parameter shapes", "embed.weight", "10 vs 12"],
    "stage": ["the step", "stage=3", "stage=2"],
    "policy": ["the step", "bf16", "fp16"],
    "cast_buffers": ["the step", "cast_buffers"],
    "micro_batches": ["the step", "micro_batches=2", "micro_batches=4"],
    "units": ["the step", "units="],
    "checkpoint-on-one-rank": ["the step", "checkpoint"],
    "optimizer-state": ["optimizer state"],
}


def _disagree(names: list, odd: int) -> dict:
    os.environ["ZFUNC_TIMEOUT_S"] = "20"
    rank = tdist.get_rank()
    results = {}
    for name in names:
        stepped, state = _case(name, rank, odd)
        try:
            stepped.init(state)
            results[name] = None
        except CollectiveError as err:
            results[name] = str(err)
    return results


@pytest.fixture(scope="module")
def disagreements():
    names = list(DISAGREEMENTS)
    return {2: run_distributed(_disagree, 2, names, 1, timeout=120),
            4: run_distributed(_disagree, 4, names, 2, timeout=120)}


@outcome("clear")
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(DISAGREEMENTS))
def test_ranks_that_built_another_step_or_model_are_refused_on_every_rank(disagreements, name, world):
    messages = [per_rank[name] for per_rank in disagreements[world]]
    odd = 1 if world == 2 else 2
    assert messages[0] is not None and all(m == messages[0] for m in messages), messages  # the same, everywhere
    says(messages[0], "ranks disagree", f"rank\\(s\\) \\[{odd}\\]", "same model and the same step",
         *DISAGREEMENTS[name])


# -- different seeds ----------------------------------------------------------------


def _seeded_per_rank() -> tuple:
    rank = tdist.get_rank()
    torch.manual_seed(1234 + rank)  # the classic mistake
    _, params = zf.functional(TinyLM())
    stepped = shard(lambda state, batch: (state, {}), stage=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = stepped.init(zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))
    return stepped.gather(state), [str(w.message) for w in caught]


def _rank_zero_model() -> dict:
    torch.manual_seed(1234)
    return copies(zf.functional(TinyLM())[1])


@outcome("right")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_seeded_differently_start_from_rank_zeros_parameters(world):
    """(A meta-built model's ranks draw from rank 0's generator: tests/test_meta_init.py.)"""
    results = run_distributed(_seeded_per_rank, world, timeout=120)
    want = run_distributed(_rank_zero_model, 1, timeout=60)[0]
    for rank, (full, _) in enumerate(results):
        for key, value in want.items():
            assert torch.equal(full[key], value), (rank, key)
    says(" ".join(results[0][1]), "different initial parameters", "rank 0's", "Seed every rank alike")


# -- what init does not compare ---------------------------------------------------------


def _other_hyperparameters(kind: str):
    os.environ["ZFUNC_TIMEOUT_S"] = "20"
    rank = tdist.get_rank()
    tx = {"learning-rate": lambda: zf.optim.adamw(1e-2 if rank == 0 else 1e-3),
          "weight-decay": lambda: zf.optim.adamw(1e-2, weight_decay=0.1 if rank == 0 else 0.0),
          "adam-vs-adamw": lambda: zf.optim.adamw(1e-2) if rank == 0 else zf.optim.adam(1e-2)}[kind]()
    step, params = _model_step()
    stepped = shard(step, stage=3)
    try:
        stepped.init(zf.TrainState.create(params, tx))
    except CollectiveError as err:
        return str(err)
    return None


@outcome("clear")
@pytest.mark.parametrize("kind", ["learning-rate", "weight-decay", "adam-vs-adamw"])
def test_ranks_with_other_optimizer_hyperparameters_are_refused(kind):
    messages = run_distributed(_other_hyperparameters, 2, kind, timeout=60)
    assert all(m is not None and "optimizer" in m for m in messages), messages


def _same_code_other_addresses():
    os.environ["ZFUNC_TIMEOUT_S"] = "20"
    rank = tdist.get_rank()
    # Ranks are separate processes: the same function sits at another address on each one. Here (forked
    # ranks share a heap layout) the other address is made by allocating other functions first.
    earlier = []
    for _ in range(4 * rank):
        earlier.append(lambda name: False)
    blocks = lambda name: name.startswith("blocks.")
    step, params = _model_step()
    stepped = shard(checkpoint(step, modules=blocks), stage=3)
    del earlier
    try:
        stepped.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
    except CollectiveError as err:
        return repr(stepped), str(err)
    return repr(stepped), None


@outcome("right")
def test_identical_code_at_other_addresses_is_accepted():
    (first, refused), (second, _) = run_distributed(_same_code_other_addresses, 2, timeout=60)
    assert first != second  # the case itself: the same code, two addresses
    assert refused is None


# -- restore into templates of different stacks ----------------------------------------


def _restore_into_other_templates(directory: str):
    os.environ["ZFUNC_TIMEOUT_S"] = "20"
    rank = tdist.get_rank()
    step, params = _model_step()
    state, _ = step(zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)), make_batch())
    zf.io.save(directory, state)
    template = step if rank == 0 else mixed_precision(step, "bf16")  # rank 1 built another stack
    like = zf.init(template, zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))
    try:
        zf.io.restore(directory, like=like)
    except zf.io.CheckpointError as err:
        return str(err)
    return None


@outcome("clear")
def test_restore_into_a_template_of_another_stack_on_one_rank_fails_on_every_rank(tmp_path):
    messages = run_distributed(_restore_into_other_templates, 2, str(tmp_path / "ck"), timeout=60)
    assert all(m is not None for m in messages), messages
    says(messages[0], "failed on 1 of 2 ranks", "rank 1", "mixed_precision", "strict=False")
    says(messages[1], "mixed_precision", "strict=False")


# -- settings that are each rank's own ----------------------------------------------


def _own_nvme_dirs(root: str, fraction_differs: bool) -> dict:
    from zfunc.transforms import offload

    rank = tdist.get_rank()
    step, params = _model_step()
    own = os.path.join(root, f"rank{rank}")  # each rank's own local drive, as on separate nodes
    os.makedirs(own, exist_ok=True)
    fraction = 0.25 if fraction_differs and rank == 1 else 0.5
    stepped = shard(offload(step, nvme_fraction=fraction, nvme_dir=own, threads=1 + rank), stage=2)
    try:
        state = stepped.init(zf.TrainState.create(params, zf.optim.adamw(1e-2)))
    except CollectiveError as err:
        return {"error": str(err)}
    for i in range(2):
        state, _ = stepped(state, make_batch(seed=10 * i + rank))
    return {"params": stepped.gather(state)}


@outcome("right")
def test_ranks_with_their_own_nvme_directories_and_threads_train_as_one(tmp_path):
    """nvme_dir and threads are each rank's own (a local drive's path, its cores): they do not change the
    step, so ranks are not refused for them, and the replicas stay equal."""
    out = run_distributed(_own_nvme_dirs, 2, str(tmp_path), False, timeout=120)
    assert all("params" in o for o in out), out
    for key, value in out[0]["params"].items():
        assert torch.equal(value, out[1]["params"][key]), key


@outcome("clear")
def test_ranks_with_another_nvme_fraction_are_still_refused(tmp_path):
    out = run_distributed(_own_nvme_dirs, 2, str(tmp_path), True, timeout=120)
    for o in out:
        says(o["error"], "ranks disagree", "nvme_fraction")
