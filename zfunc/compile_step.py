"""`compile_step`: ``torch.compile`` of a whole step, with stage 3's gathered weights re-gathered for backward.

    step = zf.compile_step(shard(train_step, stage=3))   # = torch.compile(step, fullgraph=True, options=...)

Why: ``torch.compile(step, fullgraph=True)`` puts forward, backward (traced
through ``torch.func.vjp``), `shard`'s functional collectives and the update
in one Inductor graph. At stage 3 on two ranks or more, a block's all-gathered
weights are read in its forward and again in its backward (the matmuls'
saved inputs), so in that one graph they live from the block's forward to its
backward: the compiled step held every block's gathered weights at once,
where the eager step holds about one block (released after its forward,
gathered again for its backward). The eager step's recompute cannot be traced
there (`zfunc.compiled`); this does the same thing to the graph instead.

**The pass** (`RegatherPass`, Inductor's ``post_grad_custom_post_pass``)
finds each ``_c10d_functional.all_gather_into_tensor`` and its
``wait_tensor``, and the nodes that read the gathered buffer: through a chain
of nodes that read only it (views, slices, splits, reshapes, dtype casts),
down to the nodes that compute with it (its *uses*). In graph order it cuts
the uses into groups, and gives every group after the first a fresh gather of
the same shard (``all_gather_into_tensor`` + ``wait_tensor``, and copies of
the chain) just before the group's first use. The first buffer then dies
after its first group's uses.

**The rule, "far apart"**: a buffer's uses are cut between two consecutive
uses where, between them, the graph starts on another gathered buffer (the
first use of another gather lies between the two). That is the eager step's
policy said in the graph's terms: a unit's full weights are kept while their
block runs and never across another unit's block. What it gives on a model
of blocks, forward and backward in one graph:

- a block: forward uses, then later blocks start, then its backward uses ->
  gathered again for backward, as eager refills it. The last block's backward
  follows its forward with no other block between: kept (one block);
- the root unit (embeddings, final norm, head: what no block holds): the
  embedding's lookup, then the blocks, then the head's forward and backward
  -> gathered again for the head. Eager keeps the root gathered for the whole
  step; here the root is not held while the blocks run, at the price of one
  more all-gather of the root per step (the embedding's backward needs no
  weights);
- a gather read once, or only within one stretch (stages 1/2's gather of the
  updated parameters, anything at world size 1, where the step runs on the
  shards and gathers nothing): unchanged.

Why that rule and not "the uses after the forward/backward boundary": the
graph has no marked boundary (one inference graph, the backward traced by
``torch.func.vjp``), and a fixed distance in nodes or in gathers issued would
depend on how Inductor and dynamo happened to order the gathers (all issued
at the graph's top, in the graphs measured). The first use of another
gathered buffer is where the computation moved on to other weights, whatever
the order the collectives were issued in.

Why it is exact: functional collectives are pure (the same shard gives the
same buffer), and nothing after this pass merges two gathers (Inductor does
no common-subexpression elimination after the post-grad passes; the tests
count the gathers in the code Inductor generates). Every rank runs the same
pass on a graph of the same structure, so every rank inserts the same
gathers at the same places, and Inductor, scheduling graphs of the same
structure, issues the collectives in the same order on every rank (checked
in the code generated for two ranks of a 6-block step). The regather is issued one regathered group
ahead (while the group before it computes: eager's prefetch) and waited for
just before its group; Inductor's scheduler (``reorder_for_peak_memory``)
then orders the graph for its own estimate of the peak, which keeps the
buffers' short lives. Measured (``benchmarks/compile_memory.py``: rank 0 of 2,
blocks of 256x256 fp32, Adam): a step's peak of live memory 13.4 blocks' worth
of weights at 12 blocks without the pass, 4.2 with it (7.2 and 4.1 at 6
blocks): with the pass it no longer grows with the depth.

What it costs: one more all-gather per regathered group (every block but the
last, and the root), as the eager step's refills; the shard a regather reads
stays alive until then (a view of the state's shard, or at most 1/N of the
unit).

Limits: it acts on every ``all_gather_into_tensor`` of the graph, zfunc's or
not (an activation gathered for sequence parallelism is re-gathered likewise,
which is what Megatron's sequence parallelism does by hand). A gather whose
buffer is read through an op it does not know as a pure read of one tensor is
a use like any other: correct, possibly kept longer. Only Inductor runs the
pass (other backends: ``torch.compile(step, fullgraph=True)``, which keeps
the gathered weights).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_PASS_OPTION = "post_grad_custom_post_pass"


def _ops(*names: str) -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# Ops that read one tensor and compute nothing from other tensors (views, copies, casts): a chain from
# the gathered buffer through them is what the regather copies. Compared by overload packet.
_PURE_READS = _ops(
    "view", "reshape", "_unsafe_view", "permute", "t", "transpose", "as_strided", "slice", "select", "expand",
    "unsqueeze", "squeeze", "alias", "split", "split_with_sizes", "narrow", "unbind", "clone", "contiguous",
    "_to_copy", "view_as", "detach",
) | frozenset({torch.ops.prims.convert_element_type})


def _gather_op():
    return torch.ops._c10d_functional.all_gather_into_tensor.default


def _wait_op():
    return torch.ops._c10d_functional.wait_tensor.default


def _inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.map_arg((node.args, node.kwargs), found.append)
    return found


def _reads_only(node: torch.fx.Node, parent: torch.fx.Node) -> bool:
    """Whether ``node`` is a pure read of ``parent`` alone (a link of a gathered buffer's chain)."""
    if node.op != "call_function" or any(n is not parent for n in _inputs(node)):
        return False
    if node.target is operator.getitem:  # (one output of a split)
        return True
    return getattr(node.target, "overloadpacket", None) in _PURE_READS


class Gathered:
    """One gathered buffer: its gather, its wait, the chain that reads only it, and its uses."""

    def __init__(self, gather: torch.fx.Node, wait: torch.fx.Node) -> None:
        self.gather, self.wait = gather, wait
        self.chain: set[torch.fx.Node] = {wait}
        self.uses: list[torch.fx.Node] = []
        todo = [wait]
        while todo:
            node = todo.pop()
            for user in node.users:
                if _reads_only(user, node):
                    if user not in self.chain:
                        self.chain.add(user)
                        todo.append(user)
                elif user not in self.uses:
                    self.uses.append(user)


def find_gathers(graph: torch.fx.Graph) -> list[Gathered]:
    """Every ``all_gather_into_tensor`` of ``graph`` waited for by one ``wait_tensor`` and nothing else."""
    found = []
    for node in graph.find_nodes(op="call_function", target=_gather_op()):
        users = list(node.users)
        if len(users) == 1 and users[0].target is _wait_op():
            found.append(Gathered(node, users[0]))
    return found


def use_groups(gathers: list[Gathered], order: dict[torch.fx.Node, int]) -> list[list[list[torch.fx.Node]]]:
    """Per gathered buffer, its uses in graph order cut into groups (the module doc's rule): a new group
    starts at a use when another buffer's first use lies between it and the use before it."""
    for g in gathers:
        g.uses.sort(key=order.__getitem__)
    firsts = sorted(order[g.uses[0]] for g in gathers if g.uses)
    groups = []
    for g in gathers:
        mine: list[list[torch.fx.Node]] = []
        for use in g.uses:
            if mine:
                before, here = order[mine[-1][-1]], order[use]
                if bisect.bisect_left(firsts, here) - bisect.bisect_right(firsts, before) == 0:
                    mine[-1].append(use)
                    continue
            mine.append([use])
        groups.append(mine)
    return groups


def regather(graph: torch.fx.Graph) -> int:
    """Gather again, for each later group of uses of a gathered buffer, just before the group (see the
    module doc). Returns the number of gathers added (0: ``graph`` is unchanged)."""
    gathers = find_gathers(graph)
    if not gathers:
        return 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    late = [(g, group) for g, groups in zip(gathers, use_groups(gathers, order)) for group in groups[1:]]
    late.sort(key=lambda item: order[item[1][0]])
    issue_at = None  # where the previous regather is waited for: this one is issued there (one ahead)
    for g, group in late:
        first = group[0]
        shard = g.gather.args[0]
        ahead = issue_at if issue_at is not None and order[issue_at] > order.get(shard, -1) else first
        with graph.inserting_before(ahead):
            gather = graph.node_copy(g.gather)
        copies = {g.gather: gather}
        with graph.inserting_before(first):
            for use in group:
                for node in _inputs(use):
                    if node in g.chain:
                        use.replace_input_with(node, _copy_chain(graph, node, copies))
        issue_at = first
        for node in sorted(g.chain, key=order.__getitem__, reverse=True):  # (links only the late group read)
            if not node.users:
                graph.erase_node(node)
    graph.lint()
    counters["inductor"]["regather"] += len(late)  # (torch's compile counters: what a compile did)
    return len(late)


def _copy_chain(graph: torch.fx.Graph, node: torch.fx.Node, copies: dict) -> torch.fx.Node:
    """``node`` of a gathered buffer's chain, made again from the regathered buffer (memoized in ``copies``)."""
    if node not in copies:
        parent = _inputs(node)[0]
        _copy_chain(graph, parent, copies)
        copies[node] = graph.node_copy(node, lambda n: copies[n])
    return copies[node]


class RegatherPass(CustomGraphPass):
    """`regather` as an Inductor post-grad pass (``post_grad_custom_post_pass``); its ``uuid`` (this file's
    hash) lets Inductor's FX graph cache key a graph it compiled."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        regather(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


class _Chained(CustomGraphPass):
    """The user's own post-grad passes, then `RegatherPass` (cached only where each of the user's can be)."""

    def __init__(self, first: Callable | list | tuple, then: CustomGraphPass) -> None:
        self.first = tuple(first) if isinstance(first, (list, tuple)) else (first,)
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        for user_pass in self.first:
            user_pass(graph)
        self.then(graph)

    def uuid(self) -> Any:
        theirs = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.first)
        return None if None in theirs else (*theirs, self.then.uuid())


def inductor_options(mode: str | None, options: dict | None, dynamic: bool | None) -> dict:
    """The Inductor options `compile_step` hands ``torch.compile``: ``mode``'s (torch takes a mode or options,
    not both), then ``options``, with `RegatherPass` after a ``post_grad_custom_post_pass`` of the user's."""
    merged = dict(torch._inductor.list_mode_options(mode, dynamic)) if mode else {}
    merged.update(options or {})
    theirs = merged.get(_PASS_OPTION)
    merged[_PASS_OPTION] = RegatherPass() if theirs is None else _Chained(theirs, RegatherPass())
    return merged


def compile_step(step: Callable, *, fullgraph: bool = True, mode: str | None = None,
                 options: dict | None = None, **compile_kwargs: Any) -> Callable:
    """``torch.compile(step, fullgraph=True, ...)`` with `RegatherPass` run by Inductor on the step's graph.

    The compiled step computes exactly what ``torch.compile(step, fullgraph=True)`` computes; at stage 3
    (two ranks or more) a block's gathered weights are released after its forward and gathered again
    for its backward (the module doc). Anything else goes to ``torch.compile`` as given: ``mode``
    becomes its options (``torch._inductor.list_mode_options``: torch takes a mode or options, not both),
    and a ``post_grad_custom_post_pass`` of the user's own runs first, then the regather (the FX graph
    cache keys the pair only where the user's pass is a ``CustomGraphPass`` with a ``uuid``). The pass
    is Inductor's: another ``backend`` is refused.
    """
    backend = compile_kwargs.pop("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"compile_step: backend={backend!r}: the regather pass runs in Inductor only; use "
                         "torch.compile(step, fullgraph=True, backend=...) for another backend (a stage-3 step "
                         "then keeps every block's gathered weights from forward to backward)")
    merged = inductor_options(mode, options, compile_kwargs.get("dynamic"))
    return torch.compile(step, fullgraph=fullgraph, options=merged, **compile_kwargs)
