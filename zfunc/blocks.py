"""The model's blocks: one definition for every transform.

`find_blocks` names a model's repeated blocks from its parameter names alone (so
`shard`'s units, `checkpoint`'s recomputed blocks and the planner agree on them);
`select_blocks` resolves what a user passes as ``modules=`` (names, classes, or
None for `find_blocks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from zfunc.model_structure import ModelStructure


def find_blocks(sizes: dict[str, int]) -> list[str]:
    """The model's repeated blocks, from its parameter names.

    A *container* is a module path whose children are numbered (``layers.0``,
    ``layers.1``, ...: a ``ModuleList`` or ``Sequential``). The blocks are the
    numbered children holding parameters of every *outermost* container with
    at least two such children: containers nested inside a block of another
    (an MoE layer's experts inside a transformer layer) are not blocks, since
    the outer block already groups them; a numbered child whose parameters
    all sit in numbered children of its own (nested ``ModuleList``s:
    ``layers.0.0``, ``layers.0.1``) is replaced by those, because a container
    is never called. A container named like an MoE layer's experts
    (``experts``, ``local_experts``, ``deepspeed_experts``) is never a block
    container: experts run only for the tokens routed to them, on some ranks
    and not others, so their parent (the MoE layer) is the block. The blocks
    need not be identical (one may lack a bias).
    Returns them in the order of their first parameter; empty if the model has
    no container.

    Args:
      sizes: ``{qualified parameter name: numel}`` in the model's order (tied names included).
    """
    names = list(sizes)
    children: dict[str, dict[str, None]] = {}  # container -> its numbered children, in order
    for name in names:
        parts = name.split(".")
        for i in range(len(parts) - 1):
            if parts[i].isdigit():
                children.setdefault(".".join(parts[:i]), {})[".".join(parts[:i + 1])] = None
    containers = [c for c, kids in children.items() if len(kids) >= 2]
    outermost = [c for c in containers if not any(o != c and (o == "" or c.startswith(o + ".")) for o in containers)]
    blocks: list[str] = []
    for c in outermost:
        if c.rpartition(".")[2] in EXPERT_CONTAINERS:
            # An MoE layer's experts run only for the tokens routed to them (on some ranks, not
            # others): the layer that holds them is the block, never each expert.
            if c.rpartition(".")[0]:
                blocks.append(c.rpartition(".")[0])
            continue
        blocks.extend(b for child in children[c] for b in _called(child, names, children))
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        for b in blocks:
            if name.startswith(b + "."):
                first.setdefault(b, i)
    return sorted(blocks, key=lambda b: first.get(b, len(names)))


EXPERT_CONTAINERS = frozenset({"experts", "local_experts", "deepspeed_experts"})


def _called(child: str, names: list[str], children: dict[str, dict[str, None]]) -> list[str]:
    """``child``, or, if every parameter under it sits in a numbered child of it (so it is a
    container, never called), those children, recursively."""
    inner = children.get(child)
    prefix = child + "."
    if inner and all(n[len(prefix):].split(".", 1)[0].isdigit() for n in names if n.startswith(prefix)):
        return [b for c in inner for b in _called(c, names, children)]
    return [child]


def select_blocks(model: nn.Module, modules: Any = None, structure: ModelStructure | None = None) -> list[str]:
    """Resolve a ``modules=`` argument of a transform into block names.

    ``None``: the model's blocks (`find_blocks`). A class or tuple of classes:
    every sub-module of that type (outermost ones only). A callable: every
    sub-module whose qualified name it accepts. A list of names: those names.
    """
    if modules is None:
        if structure is not None:
            return structure.blocks()
        return find_blocks({n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)})
    if isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules):
        for name in modules:
            model.get_submodule(name)  # raises a clear AttributeError for a typo
        return list(modules)
    if isinstance(modules, type) or (isinstance(modules, tuple) and all(isinstance(m, type) for m in modules)):
        accept = lambda name, m: isinstance(m, modules)  # noqa: E731
    elif callable(modules):
        accept = lambda name, m: bool(modules(name))  # noqa: E731
    else:
        raise TypeError("modules must be None, a module class (or tuple of classes), "
                        f"a predicate on qualified names, or a list of names; got {modules!r}")
    chosen: list[str] = []
    for name, module in model.named_modules():
        if name and accept(name, module) and not any(name.startswith(c + ".") for c in chosen):
            chosen.append(name)
    return chosen
