"""State and policy mismatches: a state (or checkpoint) run by a step that did not make it.

A transform keeps its own state in ``state.extras`` (the fp32 master, the shard
layout, the loss scaler and the policy's codes). A state laid out by one stack
and run by another would train the wrong tensors (the bf16 compute copy instead
of the master, 1-D shards as parameters) or with the wrong loss scale; it must
be refused, naming the transform, unless the two layouts really are the same
(offload on a CPU-only machine keeps no extras: there the result must equal the
plain step's). Checkpoints: a restore may change a tensor's dtype only where
that loses nothing or where it is the point (a compute copy rebuilt from an
fp32 master).
"""

from __future__ import annotations

import copy

import pytest
import torch

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, says, single_thread  # noqa: F401 (a fixture)
from tests.models import make_batch, tiny_lm_step
from zfunc.transforms import checkpoint, mixed_precision, offload, shard

pytestmark = pytest.mark.usefixtures("single_thread")

STACKS = {
    "plain": lambda s: s,
    "bf16": lambda s: mixed_precision(s, "bf16"),
    "fp16": lambda s: mixed_precision(s, "fp16"),
    "shard1": lambda s: shard(s, stage=1),
    "shard3": lambda s: shard(s, stage=3),
    "checkpoint": checkpoint,
    "shard3-bf16": lambda s: shard(mixed_precision(s, "bf16"), stage=3),
    "offload-bf16": lambda s: offload(mixed_precision(s, "bf16")),
    "offload": offload,
}
BATCH = make_batch()


def _state_of(stack: str, half: bool = False):
    _, params, step = tiny_lm_step()
    params = copies(params)
    if half:
        params = {k: v.half() for k, v in params.items()}
    stepped = STACKS[stack](step)
    return stepped, zf.init(stepped, zf.TrainState.create(params, zf.optim.adamw(1e-2)))


# (state made by, run by) -> the words of the refusal
REFUSED = {
    ("bf16", "shard1"): ["laid out by mixed_precision", "does not have it", "step.gather", "restore"],
    ("bf16", "shard3"): ["laid out by mixed_precision", "wrong tensors"],
    ("bf16", "checkpoint"): ["laid out by mixed_precision", "wrong tensors"],
    ("bf16", "fp16"): ["another mixed-precision policy", "compute=bf16", "fp16", "loss scal"],
    ("fp16", "bf16"): ["another mixed-precision policy", "compute=fp16", "bf16"],
    ("offload-bf16", "fp16"): ["another mixed-precision policy"],
    ("shard1", "plain"): ["laid out by shard", "a plain step", "wrong tensors"],
    ("shard1", "bf16"): ["laid out by shard", "mixed_precision"],
    ("shard1", "shard3"): ["stage 1", "stage 3"],
    ("shard3", "plain"): ["embed.weight", "1-D shards", "step.gather"],
    ("shard3", "shard1"): ["stage 3", "stage 1"],
    ("shard3", "offload-bf16"): ["laid out by shard", "offload"],
    ("shard3-bf16", "shard3"): ["laid out by mixed_precision", "shard"],
    ("shard3-bf16", "checkpoint"): ["laid out by mixed_precision, shard", "does not have them"],
    ("shard3-bf16", "bf16"): ["laid out by shard", "mixed_precision"],
    ("plain", "bf16"): ["not in mixed_precision's layout", "step.init"],
    ("plain", "shard3"): ["not in shard's layout", "step.init"],
    ("checkpoint", "shard1"): ["not in shard's layout", "step.init"],
}


@outcome("clear")
@pytest.mark.parametrize("made,run", list(REFUSED), ids=[f"{m}-run-by-{r}" for m, r in REFUSED])
def test_a_state_run_by_a_stack_that_did_not_make_it_is_refused(made, run):
    _, state = _state_of(made)
    stepped = STACKS[run](tiny_lm_step()[2])
    clear_error(lambda: stepped(state, BATCH), *REFUSED[(made, run)], exc=ValueError)


@outcome("clear")
@pytest.mark.parametrize("made", ["bf16", "offload-bf16"])
def test_a_mixed_precision_state_run_by_a_plain_step_is_refused(made):
    _, state = _state_of(made)
    clear_error(lambda: tiny_lm_step()[2](state, BATCH), "mixed_precision", "bfloat16", exc=ValueError)


# (state made by, run by): the two layouts are the same on a CPU-only machine (offload keeps its own master
# in extras only when the parameters live on an accelerator; there check_laid_out_by refuses a plain step)
SAME_LAYOUT = [("offload-bf16", "bf16"), ("bf16", "offload-bf16"), ("offload", "plain"), ("plain", "offload"),
               ("checkpoint", "plain"), ("plain", "checkpoint")]


@outcome("right")
@pytest.mark.parametrize("made,run", SAME_LAYOUT, ids=[f"{m}-run-by-{r}" for m, r in SAME_LAYOUT])
def test_a_state_whose_layout_is_the_same_trains_exactly_alike(made, run):
    stepped_made, state = _state_of(made)
    other = STACKS[run](tiny_lm_step()[2])
    twin = zf.tree.tree_map(torch.clone, state)
    by_other, _ = other(state, BATCH)
    by_maker, _ = stepped_made(twin, BATCH)
    assert_same(zf.gather(other, by_other), zf.gather(stepped_made, by_maker), rtol=1e-6, atol=1e-7)


# -- checkpoints -------------------------------------------------------------------


def _saved(stack: str, root, half: bool = False) -> tuple:
    stepped, state = _state_of(stack, half)
    if not half:  # (TinyLM's frozen fp32 parameter cannot meet fp16 weights on the CPU)
        state, _ = stepped(state, BATCH)
    zf.io.save(root, state)
    return stepped, state


@outcome("clear")
def test_a_bf16_checkpoint_restored_into_an_fp16_stack_is_refused_before_it_trains(tmp_path):
    _saved("bf16", tmp_path / "ck")
    _, like = _state_of("fp16")
    clear_error(lambda: zf.io.restore(tmp_path / "ck", like=like), "another mixed-precision policy",
                "compute=bf16", "compute=fp16", "strict=False", exc=Exception)


@outcome("right")
def test_the_advised_restore_switches_a_checkpoint_to_another_policy(tmp_path):
    """strict=False restores the bf16 run's fp32 master into an fp16 stack: its own policy, a fresh loss
    scaler, a compute copy cast from the master; it then trains."""
    stepped_bf16, saved = _saved("bf16", tmp_path / "ck")
    stepped, like = _state_of("fp16")
    fresh = copy.deepcopy(like.extras["mixed_precision"])
    with pytest.warns(UserWarning, match="another mixed-precision policy"):
        state, _ = zf.io.restore(tmp_path / "ck", like=like, strict=False)
    mp = state.extras["mixed_precision"]
    assert_same(mp.master, saved.extras["mixed_precision"].master)
    assert_same(state.params, {k: v.to(torch.float16) for k, v in mp.master.items()})
    for field in ("policy", "loss_scale", "good_steps", "hysteresis_left", "skipped_steps"):
        assert torch.equal(getattr(mp, field), getattr(fresh, field)), field
    state, _ = stepped(state, BATCH)  # trains under fp16 from the bf16 run's master weights


@outcome("clear")
def test_an_fp32_checkpoint_restored_into_an_fp16_template_needs_an_explicit_cast(tmp_path):
    _saved("plain", tmp_path / "ck")
    _, like = _state_of("plain", half=True)
    clear_error(lambda: zf.io.restore(tmp_path / "ck", like=like), "float16", "float32", "cast", exc=Exception)


@outcome("right")
def test_an_fp16_checkpoint_restored_into_an_fp32_template_is_exact(tmp_path):
    _, saved = _saved("plain", tmp_path / "ck", half=True)
    _, like = _state_of("plain")
    state, _ = zf.io.restore(tmp_path / "ck", like=like)
    assert_same(state.params, {k: v.float() for k, v in saved.params.items()})


@outcome("right")
def test_a_plain_checkpoint_seeds_a_mixed_precision_master_exactly(tmp_path):
    _, saved = _saved("plain", tmp_path / "ck")
    stepped, like = _state_of("bf16")
    with pytest.warns(UserWarning, match="kept the template's values"):
        state, _ = zf.io.restore(tmp_path / "ck", like=like, strict=False)
    assert_same(stepped.gather(state), saved.params)
    assert_same(state.params, {k: v.to(torch.bfloat16) for k, v in saved.params.items()})


@outcome("right")
def test_a_mixed_precision_checkpoint_gives_a_plain_template_its_master(tmp_path):
    stepped, saved = _saved("bf16", tmp_path / "ck")
    _, like = _state_of("plain")
    with pytest.warns(UserWarning, match="ignored"):
        state, _ = zf.io.restore(tmp_path / "ck", like=like, strict=False)
    assert_same(state.params, stepped.gather(saved))


@outcome("clear")
def test_a_mixed_precision_checkpoint_into_a_plain_template_needs_strict_false(tmp_path):
    _saved("bf16", tmp_path / "ck")
    _, like = _state_of("plain")
    clear_error(lambda: zf.io.restore(tmp_path / "ck", like=like), "does not match the template",
                "strict=False", exc=zf.io.CheckpointError)


# -- edits to a state between steps -------------------------------------------------

EDITS = {
    "in place": lambda state, key: state.params[key].mul_(0.5),
    "dict assignment": lambda state, key: state.params.__setitem__(key, state.params[key] * 0.5),
    "replace": lambda state, key: state.replace(params={**state.params, key: state.params[key] * 0.5}),
    "master in place": lambda state, key: state.extras["mixed_precision"].master[key].mul_(0.5),
}


@outcome("clear")
@pytest.mark.parametrize("stack", ["bf16", "shard3-bf16"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_to_the_compute_copy_or_the_master_alone_is_refused(stack, edit):
    """Under mixed_precision state.params is the compute copy of the fp32 master: an edit to one of them
    alone would be ignored by the next step (or trained from weights that no longer match it)."""
    stepped, state = _state_of(stack)
    state, _ = stepped(state, BATCH)
    key = "embed.weight"
    with torch.no_grad():
        edited = EDITS[edit](state, key)
    state = edited if isinstance(edited, zf.TrainState) else state
    clear_error(lambda: stepped(state, BATCH), "embed.weight", "changed", "compute copy", "step.gather",
                "step.init", exc=ValueError)


@outcome("right")
@pytest.mark.parametrize("stack", ["plain", "shard1", "shard3", "offload"])
def test_an_edit_to_the_params_in_place_trains_from_the_edited_weights(stack):
    """Without a compute copy the params are the weights: an edit in place between steps is what the next
    step starts from, as with a plain step."""
    def run(wrap):
        torch.manual_seed(0)
        _, params, step = tiny_lm_step()
        stepped = wrap(step)
        state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))
        state, _ = stepped(state, BATCH)
        with torch.no_grad():
            for v in state.params.values():
                v.mul_(0.5)
        state, _ = stepped(state, BATCH)
        return zf.gather(stepped, state)

    assert_same(run(STACKS[stack]), run(STACKS["plain"]), rtol=1e-6, atol=1e-7)


@outcome("right")
@pytest.mark.parametrize("how", ["deepcopy", "restore"])
def test_a_copied_or_restored_mixed_precision_state_still_steps(how, tmp_path):
    """What the check records is not carried into a deep copy (other tensors) nor kept by a restore (which
    writes the template in place): neither is refused, and both step as the original does."""
    stepped, state = _state_of("bf16")
    state, _ = stepped(state, BATCH)
    if how == "deepcopy":
        other = copy.deepcopy(state)
    else:
        zf.io.save(tmp_path / "ck", state)
        other, _ = zf.io.restore(tmp_path / "ck", like=_state_of("bf16")[1])
    got, _ = stepped(other, BATCH)
    want, _ = stepped(state, BATCH)
    assert_same(zf.gather(stepped, got), zf.gather(stepped, want))


# -- not a state at all ------------------------------------------------------------
# What people hand a step in place of its state, each with its usual cause: the error says what it got and
# that cause, before anything else looks at it (issue 26: README's `state = zf.io.restore(...)` met
# "this state is not in mixed_precision's layout: call step.init", which sent the user the wrong way).


def _load_report():
    return zf.io.LoadReport(source="model_dir", loaded={}, tied={}, copies=(), missing=(), unexpected=(),
                            dropped=(), casts={}, mode="ranges", bytes_read=0)


# name -> (the value given, given the state and its params; the words of the refusal)
NOT_STATES = {
    "restore-pair": (lambda s, p: (s, {"batch": 3}), ["tuple of 2", r"\(TrainState, dict\)", "zf.io.restore returns",
                                                     r"state, client_state = zf.io.restore"]),
    "step-pair": (lambda s, p: (s, {"loss": torch.tensor(1.0)}), ["tuple of 2", r"returns \(state, metrics\)",
                                                                  r"state, metrics = step\(state, batch\)"]),
    "load-pretrained-pair": (lambda s, p: (s, _load_report()), ["tuple of 2", "load_pretrained returns",
                                                                r"state, report = "]),
    "params": (lambda s, p: p, ["dict of 21 tensors", "embed.weight", "parameters",
                                r"step.init\(zf.TrainState.create\(params, opt\)\)"]),
    "torch-load-checkpoint": (lambda s, p: {"model": p, "optimizer": {}}, ["dict with keys", "'model'", "torch.load",
                                                                           "zf.io.restore"]),
    "module": (lambda s, p: tiny_lm_step()[0], [r"nn.Module \(TinyLM\)", r"zf.functional\(model\)",
                                                 "TrainState.create"]),
    "none": (lambda s, p: None, ["got None", "returned nothing", r"\(new_state, metrics\)"]),
}
ENTRY_POINTS = {  # where a state goes: (the call, the name it is refused under)
    "step": (lambda stepped, x: stepped(x, BATCH), r"shard\(\.\.\.\) takes a zf.TrainState"),
    "init": (lambda stepped, x: stepped.init(x), r"shard\(\.\.\.\).init takes a zf.TrainState"),
    "gather": (lambda stepped, x: stepped.gather(x), r"shard\(\.\.\.\).gather takes a zf.TrainState"),
    "save": (lambda stepped, x: zf.io.save("never-written", x), r"zf.io.save\(dir, state\) takes"),
    "load_pretrained": (lambda stepped, x: zf.io.load_pretrained("never-read", like=x),
                        r"load_pretrained\(dir, like=\.\.\.\) takes"),
}


@outcome("clear")
@pytest.mark.parametrize("given", list(NOT_STATES))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_value_that_is_not_a_state_is_named_with_its_likely_cause(given, entry):
    _, params, step = tiny_lm_step()
    stepped = STACKS["shard3-bf16"](step)
    state = stepped.init(zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))
    make, words = NOT_STATES[given]
    call, refused_as = ENTRY_POINTS[entry]
    clear_error(lambda: call(stepped, make(state, params)), refused_as, *words, exc=TypeError)


@outcome("clear")
@pytest.mark.parametrize("stack", ["bf16", "shard3-bf16", "plain"])
def test_the_pair_restore_returns_given_to_a_step_says_to_unpack_it(stack, tmp_path):
    """The README's old resume line, run as written: the whole (state, client_state) pair assigned to one
    name, then stepped (a transformed step) or gathered (a plain one: zf.gather) or saved again."""
    stepped, state = _state_of(stack)
    state, _ = stepped(state, BATCH)
    zf.io.save(tmp_path / "ck", state, client_state={"batch": 1})
    state = zf.io.restore(tmp_path / "ck", like=_state_of(stack)[1])
    unpack = ["tuple of 2", "zf.io.restore returns", r"state, client_state = zf.io.restore\(dir, like=state\)"]
    if stack != "plain":
        clear_error(lambda: stepped(state, BATCH), *unpack, exc=TypeError)
    clear_error(lambda: zf.gather(stepped, state), *unpack, exc=TypeError)
    clear_error(lambda: zf.io.save(tmp_path / "ck", state), *unpack, exc=TypeError)
    clear_error(lambda: zf.io.restore(tmp_path / "ck", like=state), "restore", *unpack, exc=TypeError)
    state, client = state  # unpacked as the error says, it resumes
    assert client == {"batch": 1}
    stepped(state, BATCH)


@outcome("clear")
def test_a_compiled_step_given_the_pair_says_to_unpack_it():
    """Under torch.compile(fullgraph=True) the refusal is what dynamo reports the trace raised."""
    stepped, state = _state_of("bf16")
    compiled = torch.compile(stepped, fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled((state, {"batch": 1}), BATCH)
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    says("\n".join(chain), "tuple of 2", "zf.io.restore returns", r"state, client_state = zf.io.restore")
