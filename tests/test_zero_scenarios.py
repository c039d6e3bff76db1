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

What fails is marked ``xfail(strict=True, raises=...)``, grouped by defect
(`DEFECTS`, `KNOWN`; empty today): a fix makes its tests pass, strict makes that an
error until the mark is removed, and ``raises`` makes a different failure (say, a
hang that turned into wrong numbers) an error too. ``python -m tests.zero_scenarios 2 4``
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


# What fails today, by defect: nothing. The defects this suite found when it was ported (a unit used
# twice, a parameter used outside its block, a block returning its own parameter, a unit run on some
# ranks only, containers as units, requires_grad toggled after functional, padding-only ranks, units
# of empty parameters, forward hooks inside recomputed blocks) are fixed; see ARCHITECTURE.md. A new
# known failure goes here as Defect(reason, raises) with its configs in KNOWN.
DEFECTS: dict[str, Defect] = {}


class Known(NamedTuple):
    """Configs of one scenario that fail today through ``defect`` (on the given world sizes)."""

    defect: str
    configs: frozenset[str]
    worlds: tuple[int, ...] = (2, 4)


KNOWN: dict[str, list[Known]] = {}


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
