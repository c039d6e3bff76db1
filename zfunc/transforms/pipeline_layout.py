"""`pipeline`'s split of a model into stages: which blocks each stage runs and which stage owns each
parameter (pure arithmetic on names and shapes, as `shard_layout` is for `shard`)."""

from __future__ import annotations

import dataclasses

# The attribute (not a field) under which `pipeline_stage.schedules_of` keeps a state's built torch schedules on
# its layout: structure built once per state, left out of copies and pickles of the layout (`__getstate__`).
SCHEDULES_ATTRIBUTE = "_built_schedules"


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Which stage owns what (the same on every rank but ``rank``); kept in ``state.extras["pipeline"]``.

    Attributes:
      pp: pipeline ranks. rank: this rank among them. schedule: the schedule's name.
      stage_blocks: the blocks of each stage, in order (stage k runs on rank ``k % pp``).
      owner: ``(key, stage)`` for every trainable parameter: the one stage that holds and updates it.
      borrowers: ``(key, stages)``: the other stages that use it (a tied weight), lent it each step.
      first_root: root parameters named before the first block (computed as zeros on later stages).
      shapes: ``(key, shape)`` of every parameter, for `step.gather` and checkpoints.
    """

    pp: int
    rank: int
    schedule: str
    stage_blocks: tuple[tuple[str, ...], ...]
    owner: tuple[tuple[str, int], ...]
    borrowers: tuple[tuple[str, tuple[int, ...]], ...]
    first_root: frozenset
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    def __getstate__(self) -> dict:
        # A copy of a state (copy.deepcopy) gets its own schedules, built at its first step: torch's
        # schedules hold process groups and per-run buffers, which are not copied.
        return {k: v for k, v in self.__dict__.items() if k != SCHEDULES_ATTRIBUTE}

    @property
    def stages(self) -> int:
        return len(self.stage_blocks)

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    @property
    def local_stages(self) -> tuple[int, ...]:
        return tuple(s for s in range(self.stages) if self.rank_of(s) == self.rank)

    def owned_by(self, stage: int) -> list[str]:
        return [k for k, s in self.owner if s == stage]

    def used_by(self, stage: int) -> list[str]:
        """The keys stage ``stage`` computes with: its own and those it borrows."""
        return self.owned_by(stage) + [k for k, users in self.borrowers if stage in users]

    def loans(self) -> list[tuple[str, int, int, int]]:
        """Every loan of a tied weight: ``(key, borrowing stage, owner's rank, borrower's rank)``."""
        owner = dict(self.owner)
        return [(key, user, self.rank_of(owner[key]), self.rank_of(user))
                for key, users in self.borrowers for user in users]

    @property
    def keys(self) -> list[str]:
        """The keys this rank holds (its stages' own), in the model's order."""
        mine = set(self.local_stages)
        return [k for k, s in self.owner if s in mine]

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(b for s in self.local_stages for b in self.stage_blocks[s])

    def stage_of_block(self) -> dict[str, int]:
        return {b: s for s, blocks in enumerate(self.stage_blocks) for b in blocks}

    def describe(self) -> dict:
        """A JSON description (checkpoint manifests, ranks' agreement)."""
        return {"pp": self.pp, "schedule": self.schedule, "stage_blocks": [list(b) for b in self.stage_blocks],
                "owner": dict(self.owner), "borrowers": {k: list(v) for k, v in self.borrowers}}


def make_pipeline_layout(keys: list[str], aliases: list[tuple[str, str]], blocks: list[str],
                         shapes: dict[str, tuple], stages: int, pp: int, rank: int, schedule: str) -> PipelineLayout:
    """Split ``blocks`` (in order) into ``stages`` contiguous runs and assign every parameter to a stage.

    Args:
      keys: the trainable parameters' keys in the model's order (`zf.functional`'s params).
      aliases: ``(alias, key)`` of tied weights (`TrainState.ties`).
      blocks: the model's blocks in order (`find_blocks`).
      shapes: key -> shape.
    Runs are as even as the counts allow (the first stages get one more block when they do not divide). A
    name inside a block belongs to the block's stage; a root name to the first stage if it comes before
    the blocks, else the last (an alias sits where its module's other parameters are, or after the blocks
    when its module holds nothing else: a tied head). A key's owner is the first stage using it by any name.
    """
    if len(blocks) < stages:
        raise ValueError(
            f"pipeline: {stages} stages but the model has {len(blocks)} blocks ({', '.join(blocks[:6])}): every "
            "stage needs at least one block. Use fewer stages (a smaller pp dimension, or the 1F1B schedule "
            "instead of an interleaved one, which puts two stages on each rank).")
    base, extra = divmod(len(blocks), stages)
    runs, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        runs.append(tuple(blocks[start:start + n]))
        start += n
    stage_of = {b: s for s, run in enumerate(runs) for b in run}
    block_of = lambda name: next((b for b in blocks if name.startswith(b + ".")), None)  # noqa: E731
    in_blocks = [i for i, k in enumerate(keys) if block_of(k) is not None]
    first_at, last_at = (min(in_blocks), max(in_blocks)) if in_blocks else (len(keys), -1)

    def stage_of_name(name: str, position: int | None) -> int:
        block = block_of(name)
        if block is not None:
            return stage_of[block]
        if position is None:  # an alias: where its module's own keys are, else after the blocks (a tied head)
            module = name.rpartition(".")[0]
            siblings = [i for i, k in enumerate(keys) if k.rpartition(".")[0] == module]
            position = siblings[0] if siblings else last_at + 1
        return 0 if position < first_at else stages - 1

    users: dict[str, list[int]] = {k: [stage_of_name(k, i)] for i, k in enumerate(keys)}
    for alias, key in aliases:
        s = stage_of_name(alias, None)
        if s not in users[key]:
            users[key].append(s)
    first_root = frozenset(k for i, k in enumerate(keys) if block_of(k) is None and i < first_at)
    owner = tuple((k, min(users[k])) for k in keys)
    borrowers = tuple((k, tuple(sorted(set(users[k]) - {min(users[k])}))) for k in keys if len(set(users[k])) > 1)
    return PipelineLayout(pp, rank, schedule, tuple(runs), owner, borrowers, first_root,
                          tuple((k, tuple(shapes[k])) for k in keys))
