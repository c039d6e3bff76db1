"""`shard` against eager PyTorch on the ZeRO edge cases of tests/zero_scenarios.py.

One test per (world size, scenario, configuration): K steps of
``shard(<variant>(step), stage)`` on N gloo ranks, each rank on its slice of the
batch, the gathered parameters compared element-wise with eager PyTorch +
``torch.optim.AdamW`` after every step (see zero_scenarios' module docstring), or,
where a scenario must be refused, a clear error on every rank and never a hang.
The configurations of one world size run together in as few harness calls as
possible (`zero_scenarios.collect`, cached for the module), so a test mostly reads
its result; the first test of a batch pays for it (~50 s for 2 ranks, ~20 s for 4,
~15 s for the transformers models, most of it transformers' import).

What fails today is marked ``xfail(strict=True, raises=...)``, grouped by defect
(`DEFECTS`, `KNOWN`): a fix makes its tests pass, strict makes that an error until
the mark is removed, and ``raises`` makes a different failure (say, a hang that
turned into wrong numbers) an error too. ``python -m tests.zero_scenarios 2 4``
prints the whole outcome matrix.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from tests import zero_scenarios as zs
from zfunc.testing import DistributedError

SCENARIOS = zs.scenarios()

# World sizes. Every scenario runs on 2 ranks; on 4 (marked slow) those where the
# rank count changes what happens: empty or padding-only slices, routing, divergence.
WORLD_4 = ("stack", "many_small_params", "one_long_param", "empty_parameter", "moe_balanced", "moe_starved",
           "moe_starved_expert_units", "hf_mixtral_starved")


class Defect(NamedTuple):
    reason: str
    raises: type | tuple[type, ...]


DIVERGED = (AssertionError, TimeoutError, DistributedError)  # mismatched collectives: wrong, hang or abort

DEFECTS = {
    "used_twice": Defect(
        "defect: a unit used twice in one forward (a block called twice, a block object at two positions, or "
        "apply_fn called twice in one loss) gets garbage gradients at stages 2 and 3: _UnitViews.backward returns "
        "the reduce-scatter's output buffer while the asynchronous collective is still in flight, and autograd "
        "sums the two uses' buffers before counter.wait_pending() (shard_layout._UnitViews, dist.reduce_scatter_flat)",
        AssertionError),
    "tied_position": Defect(
        "defect: the default units make blocks.0 a unit although blocks.2 is the same module object, then "
        "_check_ties refuses the alias blocks.2.* (shard._check_ties, shard_layout.repeated_prefixes)",
        zs.EveryRankRaised),
    "outside_block": Defect(
        "defect: a block's parameter used outside the block (F.linear(h, blocks[0].weight)) reads the template "
        "module's stale tensor and its gradient is dropped: run_model_call swaps block params in only inside the "
        "block's own forward (functional.run_model_call 'outer', shard.apply)",
        AssertionError),
    "dangling": Defect(
        "defect: a block that returns its own parameter crashes stage 3 with reshard='release': the output is a "
        "view of the gathered buffer, whose storage around_block frees (resize_(0)) before the caller reads it "
        "(reshard.around_block, ReleasedBuffer.release); a use after free: a segfault, or garbage",
        (DistributedError, AssertionError)),
    "diverged": Defect(
        "defect: a unit that runs on only some ranks (a branch chosen by rank, a block skipped on one rank, MoE "
        "experts that get no token on a rank) issues its all-gather / reduce-scatter on those ranks only; "
        "collectives then pair with the wrong partner (wrong numbers), abort gloo on a size mismatch, or wait "
        "forever; the default units make MoE experts and branches units (shard_layout.repeated_prefixes, "
        "shard.apply)",
        DIVERGED),
    "container": Defect(
        "defect: a unit that is a container never called itself (a ModuleList of ModuleLists, tiled linear "
        "layers) is never gathered nor reduced: its wrapper replaces the container's forward, which nobody calls, "
        "and its params are not swapped in anywhere else, so the model reads the template's tensors and the "
        "gradients are zero (shard.apply wrap_block, functional._BlockOverride); checkpoint's default picks the "
        "same containers and refuses them",
        (AssertionError, zs.EveryRankRaised)),
    "toggled": Defect(
        "defect: requires_grad set to False after zf.functional is ignored at stage 1 (the parameter still "
        "trains) and fails with a bare KeyError at stages 2 and 3: functional snapshots aliases/param_spec at "
        "construction, block_param_names re-reads requires_grad lazily (functional.block_param_names, "
        "UnitLayout.shard_data)",
        AssertionError),
    "padding_rank": Defect(
        "defect: under recompute (checkpoint at stage 3, reshard='recompute') a rank that owns only padding of a "
        "unit (numel 3 on 4 ranks) never runs the unit's reduce-scatter, so the other ranks wait: "
        "UnitLayout.cat_shard drops the empty slices and returns fresh zeros with no autograd edge to them, so "
        "dist.AllGather's backward never runs there (shard.apply composable_views); a hang, or gloo's abort on "
        "the next collective's size",
        (TimeoutError, DistributedError)),
    "empty_unit": Defect(
        "defect: a unit whose parameters all have zero elements (blocks holding only empty parameters) makes "
        "UnitLayout.cat_shard index an empty list (IndexError) in shard.gather_params (and in the recompute "
        "path): it drops empty slices, and a unit of numel 0 has nothing else",
        zs.EveryRankRaised),
    "recompute_outputs": Defect(
        "limitation (checkpoint): a recomputed block must return tensors; blocks returning an int, None or an "
        "opaque object are refused (recompute.recompute)",
        zs.EveryRankRaised),
    "recompute_hooks": Defect(
        "defect (checkpoint): the router logits that transformers captures with forward hooks inside a "
        "recomputed decoder layer come from its no-grad forward, so the load-balancing loss sends no gradient "
        "through them (recompute.recompute runs the forward under no_grad)",
        AssertionError),
}

S23 = {"s2-plain", "s3-plain", "s3-offload", "s2-accumulate"}  # stages 2 and 3, without checkpoint
S3 = {"s3-plain", "s3-offload"}


class Known(NamedTuple):
    """Configs of one scenario that fail today through ``defect`` (on the given world sizes)."""

    defect: str
    configs: frozenset[str]
    worlds: tuple[int, ...] = (2, 4)


def known(defect: str, configs, worlds=(2, 4)) -> Known:
    return Known(defect, frozenset(configs), worlds)


KNOWN: dict[str, list[Known]] = {
    "reused_layers": [known("used_twice", S23)],  # checkpoint's nested backward waits: passes
    "looped_blocks": [known("used_twice", S23)],
    "apply_twice_linear": [known("used_twice", S23)],
    "two_forwards_blocks": [known("used_twice", S23 | {"s3-checkpoint"})],
    "shared_position": [known("tied_position", S23 | {"s3-checkpoint"})],
    "weight_outside_block": [known("outside_block", S23 | {"s3-checkpoint"})],
    "dangling_bias": [known("dangling", S3)],
    "dangling_bias_object": [known("dangling", S3), known("recompute_outputs", {"s3-checkpoint"})],
    "structured_block_outputs": [known("dangling", S3), known("recompute_outputs", {"s3-checkpoint"})],
    "keyword_block_args": [known("recompute_outputs", {"s3-checkpoint"})],
    "choose_by_rank": [known("diverged", S23)],
    "choose_by_rank_units": [known("diverged", S23)],
    "skip_block_on_rank0": [known("diverged", S23)],
    "moe_starved": [known("diverged", S23)],
    "moe_starved_expert_units": [known("diverged", S23)],
    "nested_module_lists": [known("container", S23 | {"s3-checkpoint"})],
    "tiled_linear": [known("container", S23 | {"s3-checkpoint"})],
    "tiled_linear_units": [known("container", S23)],
    "requires_grad_toggled": [known("toggled", S23 | {"s1-plain", "s3-checkpoint"})],
    "many_small_params": [known("padding_rank", {"s3-checkpoint", "s3-recompute"}, worlds=(4,))],
    "only_empty_blocks": [known("empty_unit", S23 | {"s1-plain", "s3-checkpoint"})],
    "hf_mixtral": [known("recompute_hooks", {"s3-checkpoint"})],
    "hf_mixtral_starved": [known("recompute_hooks", {"s3-checkpoint"})],
    "hf_qwen2_moe_starved": [known("recompute_hooks", {"s3-checkpoint"})],
}


def failure(name: str, config: zs.Config, world: int) -> Defect | None:
    """The defect ``name`` under ``config`` on ``world`` ranks fails through today, if any."""
    for k in KNOWN.get(name, []):
        if str(config) in k.configs and world in k.worlds:
            return DEFECTS[k.defect]
    return None


def cases():
    for world in (2, 4):
        for name, scenario in SCENARIOS.items():
            if world == 4 and name not in WORLD_4:
                continue
            for config in zs.configs(scenario):
                marks = []
                if world == 4 or name.startswith("hf_"):
                    marks.append(pytest.mark.slow)
                defect = failure(name, config, world)
                if defect is not None:
                    marks.append(pytest.mark.xfail(strict=True, reason=defect.reason, raises=defect.raises))
                yield pytest.param(world, name, config, id=f"{world}ranks-{name}-{config}", marks=marks)


class Outcomes:
    """Outcomes, computed on first use for a whole batch: every (scenario, config) of one
    world size, the transformers scenarios apart (they need the package and a warm-up)."""

    def __init__(self) -> None:
        self.cache: dict = {}
        self.warm: set = set()

    def get(self, world: int, name: str, config: zs.Config) -> zs.Outcome:
        hf = name.startswith("hf_")
        if (world, hf) not in self.cache:
            if hf not in self.warm:
                zs.warm_up(transformers=hf)
                self.warm.add(hf)
            names = [n for n in SCENARIOS if n.startswith("hf_") == hf and (world == 2 or n in WORLD_4)]
            pairs = [zs.Pair(n, c, _timeout(n, c, world)) for n in names for c in zs.configs(SCENARIOS[n])]
            self.cache[(world, hf)] = zs.collect(pairs, world)
        return self.cache[(world, hf)][(name, config)]


def _timeout(name: str, config: zs.Config, world: int) -> float:
    """A short gloo timeout where a hang is expected today (each costs that long)."""
    defect = failure(name, config, world)
    raises = () if defect is None else defect.raises if isinstance(defect.raises, tuple) else (defect.raises,)
    return zs.HANG_TIMEOUT_S if TimeoutError in raises else zs.TIMEOUT_S


@pytest.fixture(scope="module")
def outcomes():
    return Outcomes()


@pytest.mark.parametrize(("world", "name", "config"), list(cases()))
def test_scenario(outcomes, world, name, config):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    zs.check(SCENARIOS[name], config, outcomes.get(world, name, config))


# ----------------------------------------------------------------------------
# The scenarios are what they claim to be


@pytest.mark.parametrize("world", [2, 4])
def test_moe_batches_route_as_planned(world):
    """Balanced: every expert of both MoE layers gets tokens on every rank at every step;
    starved: the last expert of the first layer gets none on rank 0 (and some elsewhere)."""
    balanced = zs.expert_load(SCENARIOS["moe_balanced"], world)
    assert (balanced > 0).all(), balanced
    starved = zs.expert_load(SCENARIOS["moe_starved"], world)
    assert (starved[:, 0, 0, -1] == 0).all() and (starved[:, 1:, 0, -1] > 0).all(), starved


@pytest.mark.parametrize("name", ["hf_mixtral_starved", "hf_qwen2_moe_starved"])
def test_hf_moe_starves_experts_on_rank_0(name):
    """Rank 0's slice is one repeated token: in every layer two experts get no token there,
    while every expert gets tokens on rank 1 (so the loss still reaches all of them)."""
    pytest.importorskip("transformers")
    load = zs.hf_expert_load(SCENARIOS[name], 2)
    assert ((load[:, 0] == 0).sum(-1) == 2).all(), load
    assert (load[:, 1] > 0).all(), load


def test_reference_is_the_mean_of_per_rank_losses():
    """The reference's DDP semantics: for a mean loss, N slices give the full-batch step."""
    scenario = SCENARIOS["stack"]
    whole = zs.reference(scenario, 1, steps=1)[0]
    sliced = zs.reference(scenario, 4, steps=1)[0]
    for key in whole:
        torch.testing.assert_close(sliced[key], whole[key], rtol=1e-5, atol=1e-6)
