"""Hangs and unusable errors.

Across ranks: a rank that raises mid-step, skips a step, runs another step or
calls something else (``gather``, ``zfunc.io.save``) must leave the others with a
`CollectiveError` within ``$ZFUNC_TIMEOUT_S`` that names the collective they
waited in, never waiting forever. The harness names a killed rank as the first
failure. Within one process: a state of another model, dtype or key set, a
BatchNorm that a recompute would update twice, and apply_fn on a sharded
state's parameters end in errors that name the key (and the stack) or in the
right result, never in an error from deep inside torch.

The hang cases of one call run in one `run_distributed` call, each on a fresh
gloo subgroup (``shard(group=...)``): a case abandons its subgroup with a
collective still pending, which leaves the world group (and the next case) as
it was.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as tdist
from torch import nn

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, says, single_thread  # noqa: F401
from tests.models import TinyLM, lm_loss, make_batch, tiny_lm_step
from zfunc.dist import CollectiveError
from zfunc.testing import DistributedError, run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

pytestmark = pytest.mark.usefixtures("single_thread")

TIMEOUT_S = 1.0  # what ranks wait for each other in these cases
SLACK_S = 4.0  # how much later than that an error may come on a loaded 2-core machine


class Failure(Exception):
    pass


def _odd() -> bool:
    """Whether this is the rank that does something else (the last one)."""
    return tdist.get_rank() == tdist.get_world_size() - 1


class Skipper(TinyLM):
    """Block 1 runs on every rank but the last (data-dependent control flow: an expert that got no tokens)."""

    def forward(self, tokens):
        x = self.embed(tokens) * self.frozen_scale + self.offset
        for i, block in enumerate(self.blocks):
            if not (i == 1 and _odd()):
                x = block(x)
        return self.head(self.final_norm(x))


def _one_case(kind: str, stage: int, group):
    """What the ranks do in case ``kind`` (the last rank is the odd one out); returns (error type, seconds,
    message) or "ok"."""
    rank, world, odd = tdist.get_rank(), tdist.get_world_size(), _odd()
    torch.manual_seed(0)
    apply_fn, params = zf.functional(Skipper() if kind == "block-on-one-rank" else TinyLM())
    task = lm_loss(apply_fn)

    def loss_fn(p, batch):
        if kind == "raises-before-forward" and odd:
            raise Failure("the last rank fails in its loss")
        value = task(p, batch)
        if kind == "raises-after-forward" and odd:
            raise Failure("the last rank fails after its forward")
        return value

    def step(state, batch):
        _, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {}

    stepped = shard(step, stage=stage, group=group, timeout=TIMEOUT_S)
    state = stepped.init(zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    batch = {k: v.chunk(world)[rank] for k, v in make_batch().items()}
    start = time.monotonic()
    try:
        if kind == "skips-the-step":
            if not odd:
                stepped(state, batch)
        elif kind == "gathers-while-the-others-step":
            stepped.gather(state) if odd else stepped(state, batch)
        elif kind == "one-step-more":
            state, _ = stepped(state, batch)
            stepped(state, batch) if odd else stepped.gather(state)
        else:
            stepped(state, batch)
    except (Failure, CollectiveError) as err:
        return type(err).__name__, time.monotonic() - start, str(err)
    return "ok"


GATHER_OR_REDUCE = "gathering the parameters of unit|reducing gradients"
# Where a rank waits for one that left: the exchange that compares the units each rank ran (once per
# backward), or the call header every zfunc call starts with (`zfunc.dist.announce`).
SUM = "a sum over ranks"
STARTING = "starting a step of shard"
DIFFERENT = "the ranks are in different zfunc calls"
HANGS = {
    # (kind, stage, world): what a rank's message names: the collective it waited in (for the timeout), or,
    # where the ranks met in different calls or ran different units, the mismatch (at once)
    ("raises-before-forward", 3, 2): "gathering the parameters of unit ''",
    ("raises-before-forward", 3, 4): "gathering the parameters of unit ''",
    # (after its forward, a rank first meets the others in zf.value_and_grad's count of non-finite losses)
    ("raises-after-forward", 2, 2): SUM,
    ("raises-after-forward", 3, 2): SUM,
    ("skips-the-step", 1, 2): STARTING,
    ("skips-the-step", 1, 4): STARTING,
    ("skips-the-step", 3, 2): STARTING,
    ("gathers-while-the-others-step", 2, 2): DIFFERENT,
    ("gathers-while-the-others-step", 2, 4): DIFFERENT,
    ("one-step-more", 2, 2): DIFFERENT,
    ("block-on-one-rank", 3, 2): "unit\\(s\\) \\['blocks.* ran on some ranks only",
}
AT_ONCE = (DIFFERENT, HANGS[("block-on-one-rank", 3, 2)])  # errors that need no timeout


def _hangs(cases: list) -> dict:
    results = {}
    for kind, stage in cases:
        # Abandoned with a collective pending (see the module doc); gloo's own timeout ends that collective
        # in the background soon after, so that tearing the groups down at the end does not wait for it.
        group = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * TIMEOUT_S))
        results[f"{kind}-stage{stage}"] = _one_case(kind, stage, group)
    return results


@pytest.fixture(scope="module")
def hangs():
    return {world: run_distributed(_hangs, world, [(k, s) for k, s, w in HANGS if w == world], timeout=120)
            for world in (2, 4)}


@outcome("clear")
@pytest.mark.parametrize("kind,stage,world", list(HANGS), ids=[f"{k}-stage{s}-world{w}" for k, s, w in HANGS])
def test_ranks_that_part_ways_get_an_error_within_the_timeout(hangs, kind, stage, world):
    name = f"{kind}-stage{stage}"
    results = [per_rank[name] for per_rank in hangs[world]]
    waiting = [r for r in results if r != "ok" and r[0] in ("CollectiveError", "CallMismatch")]
    assert waiting, results
    expected = HANGS[(kind, stage, world)]
    for error, seconds, message in waiting:
        if expected in AT_ONCE:
            assert seconds < SLACK_S, seconds
            says(message, expected)
            continue
        assert TIMEOUT_S <= seconds < TIMEOUT_S + SLACK_S, seconds
        says(message, expected, "waited 1 s", "every rank must make the same zfunc calls", "ZFUNC_TIMEOUT_S")
    if kind.startswith("raises"):
        assert results[-1][0] == "Failure"  # the rank that failed says why, at once
        assert all(r != "ok" for r in results[:-1])  # and no other rank goes on as if nothing happened


def _saves_while_the_other_steps(directory: str):
    rank = tdist.get_rank()
    group = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * TIMEOUT_S))
    _, params, step = tiny_lm_step()
    stepped = shard(step, stage=3, group=group, timeout=TIMEOUT_S)
    state = stepped.init(zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    try:
        if rank == 0:
            zf.io.save(directory, state, group=group)
        else:
            stepped(state, {k: v.chunk(2)[rank] for k, v in make_batch().items()})
    except (CollectiveError, zf.io.CheckpointError) as err:
        return str(err)
    return None


@outcome("clear")
def test_a_rank_in_save_while_the_other_steps_gets_an_error(tmp_path):
    messages = run_distributed(_saves_while_the_other_steps, 2, str(tmp_path / "ck"), timeout=60)
    for message in messages:  # both ranks, at once (zfunc.dist.announce)
        says(message, "rank 1 is in a step of shard|the ranks are in different zfunc calls", "zf.io.save")


def _killed(world: int):
    if tdist.get_rank() == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    tdist.all_reduce(torch.ones(3))  # the others wait for it: gloo tells them the peer is gone


@outcome("right")
@pytest.mark.parametrize("world", [2, 4])
def test_the_harness_names_a_killed_rank_as_the_first_failure(world):
    with pytest.raises(DistributedError) as info:
        run_distributed(_killed, world, world, timeout=60)
    assert info.value.first_rank == world - 1
    says(str(info.value), f"first failure: rank {world - 1}", "killed by SIGKILL")


# -- within one process ------------------------------------------------------------

STACKS = {
    "plain": lambda s: s,
    "bf16": lambda s: mixed_precision(s, "bf16"),
    "shard1": lambda s: shard(s, stage=1),
    "shard2": lambda s: shard(s, stage=2),
    "shard3": lambda s: shard(s, stage=3),
    "offload": offload,
    "checkpoint": checkpoint,
    "accumulate": lambda s: accumulate(s, 2),
}
KEY = "blocks.1.up.weight"


def _state(stack: str, hidden: int = 23, dtype=None, drop: str | None = None):
    """A state made by ``stack``'s init from TinyLM(hidden) params (cast to ``dtype``, ``drop`` left out),
    and the step of ``stack`` over the usual TinyLM (hidden 23)."""
    torch.manual_seed(0)
    _, params = zf.functional(TinyLM(hidden=hidden))
    params = {k: (v.to(dtype) if dtype else v).clone() for k, v in params.items() if k != drop}
    stepped = STACKS[stack](tiny_lm_step()[2])
    return stepped, zf.init(stepped, zf.TrainState.create(params, zf.optim.adamw(1e-2)))


@outcome("clear")
def test_a_state_of_another_model_is_refused_by_the_plain_step():
    stepped, state = _state("plain", hidden=22)
    clear_error(lambda: stepped(state, make_batch()), "blocks.0.up.weight", r"\(22, 10\)", r"\(23, 10\)",
                exc=ValueError)


@outcome("clear")
@pytest.mark.parametrize("stack", [s for s in STACKS if s != "plain"])
def test_a_state_of_another_model_is_refused_under_every_stack(stack):
    stepped, state = _state(stack, hidden=22)
    clear_error(lambda: stepped(state, make_batch()), "blocks.0.up.weight", "22", "23", exc=ValueError)


@outcome("clear")
@pytest.mark.parametrize("stack", ["plain", "shard3", "checkpoint"])
def test_a_state_in_another_dtype_is_refused_naming_the_key(stack):
    stepped, state = _state(stack, dtype=torch.float16)
    clear_error(lambda: stepped(state, make_batch()), "float16", "float32", "embed.weight", exc=ValueError)


@outcome("right")
def test_a_state_in_another_dtype_under_mixed_precision_trains_from_its_values():
    """mixed_precision's init casts the params to its master dtype: fp16 params become an fp32 master
    holding the same values."""
    stepped, state = _state("bf16", dtype=torch.float16)
    reference_step, reference = _state("bf16")
    reference = reference_step.init(zf.TrainState.create(
        {k: v.half().float() for k, v in zf.functional(_seeded_tiny())[1].items()}, zf.optim.adamw(1e-2)))
    assert_same(stepped.gather(state), reference_step.gather(reference))
    new, _ = stepped(state, make_batch())
    again, _ = reference_step(reference, make_batch())
    assert_same(stepped.gather(new), reference_step.gather(again))


def _seeded_tiny():
    torch.manual_seed(0)
    return TinyLM()


MISSING_IS_CLEAR = ["plain", "bf16", "shard1", "offload", "accumulate"]


@outcome("clear")
@pytest.mark.parametrize("stack", MISSING_IS_CLEAR)
def test_a_state_lacking_a_key_is_refused_naming_it(stack):
    stepped, state = _state(stack, drop=KEY)
    clear_error(lambda: stepped(state, make_batch()), KEY, "lack", exc=ValueError)


@outcome("clear")
@pytest.mark.parametrize("stack", ["shard2", "shard3", "checkpoint"])
def test_a_state_lacking_a_key_is_refused_naming_it_under_block_transforms(stack):
    stepped, state = _state(stack, drop=KEY)
    clear_error(lambda: stepped(state, make_batch()), KEY, "lack", exc=ValueError)


# -- BatchNorm in training mode ------------------------------------------------------


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10)
        self.norm = nn.BatchNorm1d(10)

    def forward(self, x):
        return x + self.norm(self.lin(x).transpose(1, 2)).transpose(1, 2)


class NormLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 10)
        self.blocks = nn.ModuleList(NormBlock() for _ in range(2))
        self.head = nn.Linear(10, 13)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _norm_run(wrap, train_mode: bool = True):
    """Parameters and buffers after one step of ``wrap`` (and of eager PyTorch, for reference)."""
    batch = make_batch()
    torch.manual_seed(0)
    eager = NormLM().train(train_mode)
    torch.nn.functional.cross_entropy(eager(batch["x"]).flatten(0, 1), batch["y"].flatten()).backward()
    with torch.no_grad():
        for p in eager.parameters():
            p -= 0.1 * p.grad
    torch.manual_seed(0)
    model = NormLM().train(train_mode)
    apply_fn, params = zf.functional(model)

    def step(state, batch):
        _, grads = zf.value_and_grad(lm_loss(apply_fn))(state.params, batch)
        return state.apply_gradients(grads), {}

    stepped = wrap(step)
    state, _ = stepped(zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.sgd(0.1))), batch)
    want = {**{k: v.detach() for k, v in eager.named_parameters()}, **dict(eager.named_buffers())}
    return {**zf.gather(stepped, state), **dict(model.named_buffers())}, want


@outcome("clear")
def test_batchnorm_in_training_mode_under_checkpoint_is_refused():
    clear_error(lambda: _norm_run(checkpoint), "blocks.0.norm", "training mode", "running statistics",
                "a second time", "eval mode", exc=ValueError)


@outcome("right")
@pytest.mark.parametrize("stack", ["checkpoint", "shard3-recompute"])
def test_batchnorm_in_eval_mode_under_recompute_is_exact(stack):
    wrap = checkpoint if stack == "checkpoint" else (lambda s: shard(s, stage=3, reshard="recompute"))
    got, want = _norm_run(wrap, train_mode=False)
    assert_same(got, want, rtol=1e-6, atol=1e-7)


@outcome("right")
@pytest.mark.parametrize("stack", ["shard2", "shard3-release"])
def test_batchnorm_in_training_mode_without_recompute_is_exact(stack):
    wrap = (lambda s: shard(s, stage=2)) if stack == "shard2" else (lambda s: shard(s, stage=3))
    got, want = _norm_run(wrap)
    assert_same(got, want, rtol=1e-6, atol=1e-7)


@outcome("clear")
def test_batchnorm_in_training_mode_under_stage_3_recompute_is_refused():
    clear_error(lambda: _norm_run(lambda s: shard(s, stage=3, reshard="recompute")), "training mode",
                "running statistics", exc=ValueError)


@outcome("clear")
def test_batchnorm_under_mixed_precision_says_what_to_pass():
    clear_error(lambda: _norm_run(lambda s: mixed_precision(s, "bf16")), "cast_buffers=True", exc=RuntimeError)


# -- apply_fn on a sharded state's parameters ------------------------------------------


@outcome("clear")
def test_apply_fn_on_stage_3_shards_points_to_gather():
    model, params, step = tiny_lm_step()
    apply_fn, _ = zf.functional(model)
    stepped = shard(step, stage=3)
    state = stepped.init(zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    clear_error(lambda: apply_fn(state.params, make_batch()["x"]), "1-D shards", r"step\.gather\(state\)",
                exc=ValueError)


@outcome("right")
@pytest.mark.parametrize("stage", [1, 2])
def test_apply_fn_on_stage_1_and_2_params_sees_the_full_parameters(stage):
    model, params, step = tiny_lm_step()
    apply_fn, _ = zf.functional(model)
    stepped = shard(step, stage=stage)
    state, _ = stepped(stepped.init(zf.TrainState.create(copies(params), zf.optim.sgd(0.1))), make_batch())
    x = make_batch(seed=5)["x"]
    assert torch.equal(apply_fn(state.params, x), apply_fn(stepped.gather(state), x))
