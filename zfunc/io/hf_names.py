"""Which checkpoint tensor fills which tensor of the model: names, ties, shapes and dtypes, checked up front.

A model's tensors (`Target`) are its trainable parameters (the keys of the
training state), the other names of tied ones (``lm_head.weight`` for
``transformer.wte.weight``), and, with the module at hand, its frozen
parameters and persistent buffers (``state_dict`` minus the trainable).

Each checkpoint name is mapped to a model name by, in order: ``rename`` (a
dict or a callable; a callable returning None drops the tensor), then the
name itself, then, if that is not a model name, the name with the model's
base prefix added or removed (Hugging Face's ``base_model_prefix``:
``transformer``, ``model``, ``bert``; a checkpoint of ``GPT2Model`` loads
into ``GPT2LMHeadModel`` and back). A tied group is filled from whichever
of its names the checkpoint holds (the parameter's own first); the other
copies are not read (`Plan.copies`).

Missing model tensors and unexpected checkpoint tensors are errors unless
allowed (``True``, or glob patterns / compiled regular expressions matched
against the model name, resp. the checkpoint name). Shapes must agree.
Dtypes: a cast that represents every value exactly (bf16 -> fp32, int32 ->
int64) is done and reported; a lossy one (fp32 -> bf16) is refused unless
``allow_lossy_cast``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import torch
from torch import nn

from zfunc.io.format import CheckpointError, dtype_name

Allow = bool | Iterable[str | re.Pattern]
Rename = Mapping[str, str] | Callable[[str], str | None] | None


@dataclasses.dataclass(frozen=True)
class Target:
    """One tensor of the model: its kind, full shape, the dtype its values are kept in, and its other names."""

    kind: Literal["param", "frozen", "buffer"]
    shape: tuple[int, ...]
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where each model tensor comes from (see the module docstring).

    Attributes:
      sources: ``{model name: checkpoint name}`` for every target the checkpoint fills (canonical names).
      copies: checkpoint tensors of tied names whose group is filled from another name (not read).
      missing: model names (canonical) the checkpoint lacks; allowed, or `resolve` would have raised.
      unexpected: checkpoint names that match no model tensor; allowed likewise.
      dropped: checkpoint names ``rename`` mapped to None.
      casts: ``{model name: (checkpoint dtype, model dtype)}`` where they differ.
    """

    sources: dict[str, str]
    copies: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    dropped: tuple[str, ...]
    casts: dict[str, tuple[str, str]]


def resolve(checkpoint: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], targets: Mapping[str, Target], *,
            rename: Rename = None, prefix: str | None | Iterable[str] = None, allow_missing: Allow = False,
            allow_unexpected: Allow = False, allow_lossy_cast: bool = False, where: str = "checkpoint",
            hint: str = "") -> Plan:
    """Map ``checkpoint`` (``{name: (dtype, shape)}``) onto ``targets``; raise `CheckpointError` listing every
    problem (unmatched names not allowed, ambiguous names, shapes, lossy casts) at once.

    ``prefix``: the base prefix, or several candidates (the one that matches the most names is used);
    ``hint``: added to the message about unexpected names.
    """
    owner = {name: name for name in targets}
    for name, target in targets.items():
        for alias in target.aliases:
            owner[alias] = name
    renamed = {ck: _renamed(ck, rename) for ck in checkpoint}
    dropped = [ck for ck, name in renamed.items() if name is None]
    candidates = [prefix] if prefix is None or isinstance(prefix, str) else list(prefix) or [None]
    prefix = max(candidates, key=lambda p: sum(_with_prefix(n, owner, p) is not None
                                               for n in renamed.values() if n is not None))
    matched: dict[str, list[str]] = {}  # model name (canonical or alias) -> checkpoint names
    unexpected = []
    for ck, name in renamed.items():
        if name is None:
            continue
        model_name = _with_prefix(name, owner, prefix)
        if model_name is None:
            unexpected.append(ck)
        else:
            matched.setdefault(model_name, []).append(ck)
    problems = [f"  {m}: filled by several checkpoint tensors {cks}" for m, cks in matched.items() if len(cks) > 1]
    sources, copies, missing, casts = {}, [], [], {}
    for name, target in targets.items():
        present = [n for n in (name, *target.aliases) if n in matched]
        if not present:
            missing.append(name)
            continue
        ck = matched[present[0]][0]
        copies += [matched[n][0] for n in present[1:]]
        sources[name] = ck
        dtype, shape = checkpoint[ck]
        if tuple(shape) != target.shape:
            problems.append(f"  {name}: the model's shape is {list(target.shape)}, {ck!r} in the checkpoint has "
                            f"{list(shape)}")
        elif dtype != target.dtype:
            casts[name] = (dtype_name(dtype), dtype_name(target.dtype))
            if not allow_lossy_cast and not exact_cast(dtype, target.dtype):
                problems.append(f"  {name}: {dtype_name(dtype)} in the checkpoint, {dtype_name(target.dtype)} in the "
                                "model: a lossy cast (pass allow_lossy_cast=True to round it, or build the model "
                                f"in {dtype_name(dtype)})")
    bad_missing = [n for n in missing if not _allowed(allow_missing, (n, *targets[n].aliases))]
    bad_unexpected = [n for n in unexpected if not _allowed(allow_unexpected, (n,))]
    if bad_missing:
        problems.append(f"  missing from the checkpoint ({len(bad_missing)}): {_some(bad_missing)}\n    (pass "
                        "allow_missing=True or patterns such as ['classifier.*'] to keep their values: the "
                        "initialized ones, or the model's initializer's for a meta-built model)")
    if bad_unexpected:
        base = f"; the model's base prefix is {prefix!r}" if prefix else ""
        problems.append(f"  not in the model ({len(bad_unexpected)}): {_some(bad_unexpected)}\n    ({hint}pass rename= "
                        f"to map names{base}, or allow_unexpected=True or patterns to skip them)")
    if problems:
        raise CheckpointError(f"load_pretrained from {where}: the checkpoint does not fit the model:\n"
                              + "\n".join(problems))
    return Plan(sources, tuple(copies), tuple(missing), tuple(unexpected), tuple(dropped), casts)


def module_names(model: nn.Module) -> tuple[dict[str, str], dict[str, tuple[torch.Tensor, tuple[str, ...]]]]:
    """``({trainable name: key}, {constant name: (tensor, its other names)})``: trainable names as
    `zf.functional` keys them; constants are the frozen parameters and persistent buffers of
    ``state_dict``, one entry per tensor (shared ones list their other names)."""
    trainable: dict[str, str] = {}
    first: dict[int, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and p.requires_grad:
                name = f"{prefix}.{attr}" if prefix else attr
                trainable[name] = first.setdefault(id(p), name)
    constants: dict[str, tuple[torch.Tensor, tuple[str, ...]]] = {}
    owner: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name in trainable:
            continue
        canonical = owner.setdefault(id(t), name)
        if canonical == name:
            constants[name] = (t, ())
        else:
            tensor, others = constants[canonical]
            constants[canonical] = (tensor, (*others, name))
    return trainable, constants


def _renamed(name: str, rename: Rename) -> str | None:
    if rename is None:
        return name
    if isinstance(rename, Mapping):
        return rename.get(name, name)
    if callable(rename):
        out = rename(name)
        if out is not None and not isinstance(out, str):
            raise TypeError(f"rename({name!r}) returned {out!r}; it must return a str (or None to drop the tensor)")
        return out
    raise TypeError(f"rename must be a dict, a callable name -> name or None, got {type(rename).__name__}")


def _with_prefix(name: str, owner: Mapping[str, str], prefix: str | None) -> str | None:
    """``name`` as a model name: itself, or with the base prefix added or removed; None if none of them is."""
    if name in owner:
        return name
    if prefix:
        if f"{prefix}.{name}" in owner:
            return f"{prefix}.{name}"
        if name.startswith(prefix + ".") and name[len(prefix) + 1:] in owner:
            return name[len(prefix) + 1:]
    return None


def _allowed(allow: Allow, names: tuple[str, ...]) -> bool:
    if isinstance(allow, bool):
        return allow
    if isinstance(allow, (str, re.Pattern)):
        allow = [allow]
    for pattern in allow:
        for name in names:
            if isinstance(pattern, re.Pattern) and pattern.fullmatch(name):
                return True
            if isinstance(pattern, str) and fnmatch.fnmatchcase(name, pattern):
                return True
    return False


def _some(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is exactly a value of ``dst`` (a widening cast)."""
    if src == dst or src == torch.bool:
        return True
    if src.is_floating_point:
        if not dst.is_floating_point:
            return False
        a, b = torch.finfo(src), torch.finfo(dst)
        return b.eps <= a.eps and b.max >= a.max and b.smallest_normal <= a.smallest_normal
    if src.is_complex or dst.is_complex or dst == torch.bool:
        return False
    lo, hi = torch.iinfo(src).min, torch.iinfo(src).max
    if dst.is_floating_point:  # an integer is exact in a float whose mantissa covers its bits
        return max(abs(lo), hi) <= 2 / torch.finfo(dst).eps  # 2 ** (mantissa bits + 1)
    return torch.iinfo(dst).min <= lo and hi <= torch.iinfo(dst).max
