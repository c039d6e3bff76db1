"""Build a model without materializing it: initialize a meta-built module one group of parameters at a time.

A model constructed on the meta device (``with torch.device("meta"): model =
GPT(cfg)``) has shapes but no values. `Materializer` gives its trainable
parameters their values module by module, in the order its initializer
would visit them over the whole model, and hands each *group* of parameters
(a `shard` unit) to the caller as soon as the group is complete, so the
caller keeps only its share (this rank's shard, on its tier) and no process
ever holds the whole model.

The initializer (``init`` of `zf.functional`):

- ``"reset_parameters"`` (default): each module's own ``reset_parameters()``,
  in module order (``model.modules()``), which is what the constructors of
  torch's layers call. For a model built from such layers and tied after
  construction, the values equal eager construction with the same seed;
- ``"hf"``: a Hugging Face model's own ``_init_weights``, in the order
  transformers applies it (children before parents, each sub-model with its
  own), as ``post_init`` does;
- a callable ``fn(module)``, applied like ``model.apply(fn)`` (children
  before parents).

The initializer runs with the generator on ``init_device`` (the CPU by
default, like eager construction); a tied alias gets a scratch tensor while
its module initializes (eager models draw the alias's own values at
construction and discard them when tying), so the random stream matches.
Contract, checked: an initializer writes only the parameters of the module it
is called on and of modules inside it, and every trainable parameter, frozen
parameter and buffer is written (they start as NaN; one still NaN afterwards
is an error naming it, e.g. a buffer a constructor computed, which meta
construction cannot replay). Frozen parameters and buffers are materialized
into the module itself, on ``device``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal

import torch
from torch import nn

Init = Literal["reset_parameters", "hf"] | Callable[[nn.Module], Any] | None


def is_meta(tree_leaves: list) -> bool:
    """Whether any tensor among ``tree_leaves`` is on the meta device."""
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves)


def materialized(state, init_device="cpu", device=None):
    """A meta-built model's fresh state with values: every parameter at once, on ``device`` (default
    ``init_device``), the optimizer state made for them (steps without `shard` hold the whole model
    anyway). ``state`` is a `zfunc.TrainState` from ``TrainState.create``."""
    values: dict[str, torch.Tensor] = {}
    state.materializer.run({"all": frozenset(state.params)}, lambda _, ready: values.update(ready), init_device,
                           device if device is not None else init_device)
    if device is not None:
        values = {k: v.to(device) for k, v in values.items()}
    return type(state).create({k: values[k] for k in state.params}, state.tx, ties=dict(state.ties),
                              blocks=state.blocks)


class Materializer:
    """Initializes a meta-built model's parameters group by group (see the module docstring).

    Args:
      model: the module, built on the meta device.
      aliases: ``{qualified trainable name: key}`` (`zfunc.model_structure.ModelStructure.aliases`).
      init: the initializer.
    """

    def __init__(self, model: nn.Module, aliases: dict[str, str], init: Init = None) -> None:
        if init is None:
            init = "reset_parameters"
        if not (init in ("reset_parameters", "hf") or callable(init)):
            raise ValueError(f"init must be 'reset_parameters', 'hf' or a callable fn(module), got {init!r}")
        if init == "hf" and not callable(getattr(model, "_init_weights", None)):
            raise ValueError(f"init='hf' needs a Hugging Face model (one with _init_weights); {type(model).__name__} "
                             "has none: pass init='reset_parameters' or a function of a module")
        self.model, self.aliases, self.init = model, aliases, init

    def __repr__(self) -> str:
        init = self.init if isinstance(self.init, str) else getattr(self.init, "__name__", "fn")
        return f"Materializer({type(self.model).__name__}, init={init})"

    # -- the order --------------------------------------------------------------
    def _visits(self) -> list[tuple[str, nn.Module, Callable[[nn.Module], Any] | None]]:
        """``(qualified name, module, what initializes it)`` in the initializer's order."""
        if self.init == "reset_parameters":
            return [(n, m, _reset if callable(getattr(m, "reset_parameters", None)) else None)
                    for n, m in self.model.named_modules(remove_duplicate=False)]
        visits: list = []

        def post_order(name: str, module: nn.Module, fn):
            if self.init == "hf" and callable(getattr(module, "_init_weights", None)):
                fn = module._init_weights  # a sub-model initializes its own modules (transformers' smart_apply)
            for child_name, child in module.named_children():
                post_order(f"{name}.{child_name}" if name else child_name, child, fn)
            visits.append((name, module, fn))

        post_order("", self.model, self.model._init_weights if self.init == "hf" else self.init)
        return visits

    # -- the run ----------------------------------------------------------------
    def run(self, groups: dict[str, frozenset[str]], on_group: Callable[[str, dict[str, torch.Tensor]], None],
            init_device: torch.device | str = "cpu", device: torch.device | str = "cpu") -> int:
        """Initialize every trainable parameter; call ``on_group(name, {key: value})`` once per group as soon
        as all its keys are final (values on ``init_device``; the caller may keep them, nothing else does).
        Returns the most bytes of parameter values it held at once.

        Args:
          groups: ``{group name: its keys}``, covering every trainable key once.
          on_group: receives each complete group.
          init_device: where values are generated (its generator draws them).
          device: where the module's own frozen parameters and buffers are materialized.
        """
        init_device, device = torch.device(init_device), torch.device(device)
        group_of = {k: g for g, keys in groups.items() for k in keys}
        canonical = set(self.aliases.values())
        missing = canonical - group_of.keys()
        if missing:
            raise ValueError(f"materialize: keys in no group: {sorted(missing)[:6]}")
        visits = self._visits()
        # A group is complete after the last visit of a module holding one of its parameters and,
        # since an initializer may write a child's parameters, after the visits of every module
        # above those (within the group's block; outside it such a write is refused).
        last_visit = {g: -1 for g in groups}
        owner_visits: dict[str, list[int]] = {}
        for i, (name, module, _) in enumerate(visits):
            for attr, p in module._parameters.items():
                if p is None or not p.requires_grad:
                    continue
                key = self.aliases[_join(name, attr)]
                owner_visits.setdefault(key, []).append(i)
        for key, idx in owner_visits.items():
            last_visit[group_of[key]] = max(last_visit[group_of[key]], max(idx))
        prefixes = {g: _common_prefix([k for k in keys]) for g, keys in groups.items()}
        for i, (name, _, _) in enumerate(visits):
            for g, prefix in prefixes.items():
                if prefix is not None and (name == prefix or name.startswith(prefix + ".")):
                    last_visit[g] = max(last_visit[g], i)
        done_after: dict[int, list[str]] = {}
        for g, i in last_visit.items():
            done_after.setdefault(i, []).append(g)

        values: dict[str, torch.Tensor] = {}  # key -> its value, until its group is handed over
        peak = 0
        originals: list[tuple[dict, str, Any]] = []  # every trainable slot we filled: put back at the end
        slots_of: dict[str, list[tuple[dict, str, str]]] = {}  # key -> (owner's _parameters, attr, name)
        try:
            for i, (name, module, fn) in enumerate(visits):
                self._fill(name, module, values, originals, slots_of, init_device, device)
                peak = max(peak, sum(t.numel() * t.element_size() for t in values.values()))
                if fn is not None:
                    with torch.no_grad():
                        fn(module)
                for g in done_after.get(i, []):
                    ready = {k: values.pop(k) for k in sorted(groups[g]) if k in values}
                    unset = [k for k, t in ready.items() if t.is_floating_point() and torch.isnan(t).any()]
                    if unset:
                        raise ValueError(
                            f"materialize: parameter(s) {', '.join(map(repr, unset[:6]))} were not initialized by "
                            f"{self!r} (still NaN): give their modules a reset_parameters() or pass "
                            "functional(model, init=fn) covering them")
                    for k, t in ready.items():
                        for where, attr, full in slots_of.get(k, []):  # later writes are refused, not lost
                            where[attr] = _Released(full, t.shape, t.dtype, init_device)
                    on_group(g, ready)
        finally:
            for where, attr, original in reversed(originals):
                where[attr] = original  # the trainable slots stay meta: the state holds the values
        self._check_constants()
        return peak

    def _fill(self, name: str, module: nn.Module, values: dict, originals: list, slots_of: dict,
              init_device, device) -> None:
        """Give ``module``'s own meta slots tensors with values (NaN until the initializer writes them)."""
        for attr, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            full = _join(name, attr)
            if p.requires_grad:
                key = self.aliases[full]
                if full == key:
                    value = values.setdefault(key, torch.full(p.shape, math.nan, dtype=p.dtype, device=init_device))
                else:  # a tied alias: eager models draw its own values and drop them when tying
                    value = torch.full(p.shape, math.nan, dtype=p.dtype, device=init_device)
                originals.append((module._parameters, attr, p))
                slots_of.setdefault(key, []).append((module._parameters, attr, full))
                module._parameters[attr] = nn.Parameter(value, requires_grad=True)
            else:  # a frozen parameter: materialized in the module itself
                module._parameters[attr] = nn.Parameter(torch.full(p.shape, math.nan, dtype=p.dtype, device=device),
                                                        requires_grad=False)
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[attr] = torch.full(b.shape, math.nan if b.is_floating_point() else 0, dtype=b.dtype,
                                                   device=device)

    def _check_constants(self) -> None:
        for name, t in [*((n, p) for n, p in self.model.named_parameters() if not p.requires_grad),
                        *self.model.named_buffers()]:
            if t.is_floating_point() and not t.is_meta and torch.isnan(t).any():
                raise ValueError(
                    f"materialize: {name} was computed by its module's constructor, which a meta-built model never "
                    "ran, and the initializer did not set it (it is still NaN). Set it after zf.functional (e.g. "
                    f"model.get_buffer({name!r}).copy_(...)) or initialize it in reset_parameters / init=fn.")


def _reset(module: nn.Module) -> None:
    module.reset_parameters()


def _join(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _common_prefix(keys: list[str]) -> str | None:
    """The module path all ``keys`` live under (None for the root's mix)."""
    if not keys:
        return None
    parts = [k.split(".")[:-1] for k in keys]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) if common else None


class _Released(torch.Tensor):
    """A parameter whose group was already handed over: an initializer writing it again is refused."""

    @staticmethod
    def __new__(cls, name, shape, dtype, device):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        t.param_name = name
        return t

    def __init__(self, *args, **kwargs) -> None:
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        found = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, _Released)), None)
        name = found.param_name if found is not None else "a parameter"
        raise RuntimeError(
            f"materialize: the initializer touched {name} ({func.__name__}) after its unit was complete; a meta "
            "init streams the model one unit at a time, so an initializer may write only the module it is called "
            "on and the modules inside it (not, from a parent, the parameters of a whole block)")
