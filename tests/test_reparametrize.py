"""zfunc.reparametrize.swapped, and UnitLayout.shard_data's no-copy route."""

from __future__ import annotations

import torch
from torch import nn

from zfunc.reparametrize import SlotTable, swapped
from zfunc.transforms.shard_layout import make_layout


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.norm = nn.LayerNorm(3)
        self.register_buffer("offset", torch.ones(3))
        self.scale = torch.tensor(2.0)  # a plain tensor attribute, not a slot

    def forward(self, x):
        return self.head(self.norm(self.emb(x) + self.offset) * self.scale)


def test_fast_route_swaps_and_restores_every_name():
    m = Tied()
    originals = {n: t for n, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]}
    new = {n: torch.full_like(t, 0.5) for n, t in originals.items()}
    new["head.weight"] = new["emb.weight"]  # both names of the tied weight, one tensor
    cache: dict = {}
    x = torch.tensor([[0, 1, 4]])
    with swapped(m, new, cache):
        assert m.emb.weight is new["emb.weight"] and m.head.weight is new["emb.weight"]
        assert m.offset is new["offset"]
        got = m(x)
    assert cache[(m, tuple(new))], "every name is a slot and every tie is given: the fast route"
    for n, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers()]:
        assert t is originals[n], f"{n} not restored"
    with torch.nn.utils.stateless._reparametrize_module(m, new, tie_weights=True):
        want = m(x)
    assert torch.equal(got, want)


def test_slow_route_when_a_tied_twin_is_missing_or_a_name_is_no_slot():
    m = Tied()
    cache: dict = {}
    only_one = {"emb.weight": torch.zeros(5, 3)}
    with swapped(m, only_one, cache):
        assert m.head.weight is only_one["emb.weight"], "torch's route re-ties the twin"
    assert cache[(m, ("emb.weight",))] is False
    assert m.head.weight is m.emb.weight and isinstance(m.head.weight, nn.Parameter)
    plain = {"scale": torch.tensor(3.0)}
    with swapped(m, plain, cache):
        assert m.scale is plain["scale"]
    assert cache[(m, ("scale",))] is False and float(m.scale) == 2.0


def test_a_table_built_ahead_finds_the_same_routes():
    """`SlotTable`, built once (as `functional` does, before the module's parameters are released): the same
    fast and slow routes as a walk at the call; a sub-module's table knows only its own ties."""
    m = Tied()
    table, head_table = SlotTable(m), SlotTable(m.head)
    for p in m.parameters():
        p.data = torch.empty(0)  # (what release_module_params does: the identities stay)
    both = {"emb.weight": torch.zeros(5, 3), "head.weight": None}
    both["head.weight"] = both["emb.weight"]
    cache: dict = {}
    with swapped(m, both, cache, table=table):
        assert m.head.weight is both["emb.weight"]
    assert cache[(m, ("emb.weight", "head.weight"))]
    with swapped(m, {"emb.weight": torch.zeros(5, 3)}, cache, table=table):
        pass
    assert cache[(m, ("emb.weight",))] is False, "a tied twin not given: torch's route"
    with swapped(m.head, {"weight": torch.zeros(5, 3)}, cache, table=head_table):
        pass
    assert cache[(m.head, ("weight",))], "inside the head alone, its weight has no twin"
    assert table.twins["emb.weight"] == ["emb.weight", "head.weight"] and "norm.weight" not in table.twins


def test_restores_even_when_the_forward_raises():
    m = Tied()
    weight = m.norm.weight
    try:
        with swapped(m, {"norm.weight": torch.zeros(3)}, {}):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert m.norm.weight is weight


def test_shard_data_is_the_flat_shard_itself_for_its_views_else_a_copy():
    params = {"a": torch.randn(3, 4), "b": torch.randn(7), "c": torch.randn(2)}
    layout = make_layout(params, 3, world_size=2, rank=1, unit_names=[])
    (unit,) = layout.units
    flat = torch.arange(unit.shard_size, dtype=torch.float32)
    flat[unit.numel - unit.shard_size:] = 0  # rank 1's end of the padding (a copy pads with zeros)
    views = unit.shard_views(flat, 1)
    leaves = {k: v.detach().requires_grad_() for k, v in views.items()}  # what value_and_grad differentiates
    data = unit.shard_data(leaves, 1)
    assert data.data_ptr() == flat.data_ptr() and torch.equal(data, flat) and not data.requires_grad
    copies = {k: v.clone() for k, v in views.items()}
    data = unit.shard_data(copies, 1)
    assert data.data_ptr() != flat.data_ptr() and torch.equal(data, flat)
    shuffled = dict(views)
    shuffled["b"], shuffled["c"] = flat[:views["c"].numel()], flat[-views["b"].numel():]
    if views["b"].numel() and views["c"].numel():  # same storage, wrong places: never taken as the shard
        assert unit.shard_data(shuffled, 1).data_ptr() != flat.data_ptr()
