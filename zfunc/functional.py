"""`functional(model)`: a torch.nn.Module as a pure function of a params dict.

What is carried where (the decision this module makes for the whole library):

- **params** — the *trainable* parameters (``requires_grad=True``), as a dict
  keyed by qualified name. This is what is differentiated, optimized,
  sharded, offloaded and saved in a `TrainState`.
- **tied weights** — one tensor reachable under two names (a GPT's token
  embedding and lm head) appears once, under the name `named_parameters`
  lists first. ``apply_fn`` re-ties it, so it trains as one parameter with
  the sum of both uses' gradients, exactly as in eager PyTorch.
- **frozen parameters and buffers** — read from the module itself at call
  time (like constants closed over): they get no gradient, no optimizer
  state, and follow the module if it is moved with ``.to()``. A forward that
  updates a buffer in place (BatchNorm running statistics in training mode)
  updates the module's buffer as in eager mode; inside a `torch.func`
  transform, which forbids mutating captured tensors, it is refused with an
  error that says what to do.

Transforms change *how* the model runs through the ``apply`` primitive: they
receive a `ModelCall` and may swap its params (cast, gather) or wrap chosen
sub-modules ("blocks") — e.g. `shard` gathers a block's parameters just
before it runs and `checkpoint` recomputes it in backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import torch
from torch import nn

from zfunc.interpret import dispatch
from zfunc.reparametrize import swapped
from zfunc.tree import describe_mismatch, register_pytree_node

# A block body runs one sub-module on its (local-named) trainable params:
#     body(block_params: dict[str, Tensor], *args, **kwargs) -> output
BlockBody = Callable[..., Any]
# A block wrapper rewrites a body: wrapper(block_name, body) -> body
BlockWrapper = Callable[[str, BlockBody], BlockBody]


@dataclasses.dataclass
class ModelCall:
    """One call of a functional model, as transforms see and rewrite it.

    ``params`` are the trainable parameters handed to ``apply_fn`` (whatever
    the active transforms keep there: full tensors, a compute-dtype copy,
    or shards that a transform gathers per block).

    ``block_wrappers`` maps a block's qualified name to wrappers of its body.
    Wrappers of kind ``"materialize"`` (gather, cast) run innermost, right
    around the module's own forward; wrappers of kind ``"around"`` wrap
    those and must recompute their body in backward (as `zfunc.recompute`
    does) rather than keep what it materialized: a recomputed block then
    re-gathers its parameters in backward instead of saving them.
    """

    model: nn.Module
    params: dict[str, torch.Tensor]
    args: tuple
    kwargs: dict
    aliases: dict[str, str]
    block_wrappers: dict[str, list[tuple[str, BlockWrapper]]] = dataclasses.field(default_factory=dict)
    # Replacements, by qualified name, for the module's own non-trainable
    # tensors (frozen parameters, buffers): e.g. compute-dtype copies under
    # `mixed_precision`. Inside a wrapped block they are handed to the block's
    # own forward, so a block recomputed in backward sees them too.
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    recompute_required: set[str] = dataclasses.field(default_factory=set)
    # Lookups that depend only on the module's structure, kept by the functional model across
    # calls: each walks modules, which would otherwise happen per block per forward (a block's
    # param names and ties, `zfunc.reparametrize` slots, the names outside wrapped blocks).
    cache: dict = dataclasses.field(default_factory=dict)

    def wrap_block(self, name: str, wrapper: BlockWrapper,
                   kind: Literal["materialize", "around"] = "around") -> None:
        if kind not in ("materialize", "around"):
            raise ValueError(f"kind must be 'materialize' or 'around', got {kind!r}")
        self.block_wrappers.setdefault(name, []).append((kind, wrapper))

    def require_recompute(self, name: str) -> None:
        """Ask that block ``name`` keep nothing it materialized for backward.

        `shard(stage=3)` asks this so that a gathered block is not saved by
        autograd; if no "around" wrapper (all of which recompute, e.g. the
        `checkpoint` transform's) is given for the block, a plain recompute
        is added. Either way the block is recomputed once, not twice.
        """
        self.block_wrappers.setdefault(name, [])
        self.recompute_required.add(name)

    def block_param_names(self, name: str) -> dict[str, str]:
        """``{local name: params key}`` of the trainable parameters of block ``name``."""
        key = ("block_param_names", name)
        if key not in self.cache:
            self.cache[key] = block_param_names(self.model, name, self.aliases)
        return self.cache[key]

    def block_has_ties(self, name: str) -> bool:
        """Whether block ``name`` holds one tensor under two names (then swapping its params in
        must re-tie them, which walks the block's modules; most blocks need not)."""
        key = ("block_has_ties", name)
        if key not in self.cache:
            block = self.model.get_submodule(name)
            named = list(block.named_parameters(remove_duplicate=False)) + \
                list(block.named_buffers(remove_duplicate=False))
            self.cache[key] = len({id(t) for _, t in named}) < len(named)
        return self.cache[key]


def block_param_names(model: nn.Module, name: str, aliases: dict[str, str]) -> dict[str, str]:
    """``{local name in block: key in params}`` for a sub-module's trainable params."""
    block = model.get_submodule(name)
    prefix = f"{name}." if name else ""
    out = {}
    for local, p in block.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            out[local] = aliases[prefix + local]
    return out


class FunctionalModel:
    """``apply_fn(params, *args, **kwargs)``: the module run with ``params``.

    Also exposes ``model`` (the template module), ``aliases`` (every trainable
    qualified name, tied ones included, -> its key in params) and
    ``param_spec`` (key -> (shape, dtype)) used to validate params.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.aliases: dict[str, str] = {}
        self._cache: dict = {}  # ModelCall.cache
        canonical_of: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                continue
            self.aliases[name] = canonical_of.setdefault(id(p), name)
        self.param_spec = {name: (p.shape, p.dtype) for name, p in model.named_parameters()
                           if p.requires_grad}

    def __call__(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        call = ModelCall(self.model, params, args, kwargs, self.aliases, cache=self._cache)
        return dispatch("apply", run_model_call, call)

    def release_module_params(self) -> None:
        """Free the template module's own trainable tensors (keep frozen ones and buffers).

        Once a state holds the parameters (sharded, offloaded or cast by a
        transform's ``init``), the module is only the structure ``apply_fn``
        runs; its original fp32 tensors would be a full extra copy (4Ψ bytes)
        on every rank. After this the module cannot run on its own any more.
        """
        for module in self.model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.requires_grad:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def check_params(self, params: Any) -> None:
        """Raise a readable error if ``params`` does not match the model's."""
        if not isinstance(params, dict):
            raise TypeError(f"params must be a dict of tensors keyed by parameter name, got {type(params).__name__}")
        expected = {k: torch.empty(shape, device="meta") for k, (shape, _) in self.param_spec.items()}
        problems = describe_mismatch(expected, params)
        if problems:
            raise ValueError(f"params do not match {type(self.model).__name__}:\n{problems}\n"
                             "Use the params returned by zf.functional(model) (or a state built from them).")

    def __repr__(self) -> str:
        return f"functional({type(self.model).__name__}, {len(self.param_spec)} trainable tensors)"


class Params(dict):
    """The trainable parameters `functional` returns: a plain ``dict`` that also records the
    model's tied weights (``ties``: ``{alias: key}``), which `TrainState.create` keeps so that
    checkpoints export every name the model has. Copies made with ``dict(...)`` or a
    comprehension are plain dicts and record none."""

    def __init__(self, tensors: dict[str, torch.Tensor], ties: dict[str, str]) -> None:
        super().__init__(tensors)
        self.ties = dict(ties)


# A pytree node like a dict (keys sorted, as optree orders dicts), so tree utilities and
# torch.func see its tensors; the ties ride along as static data.
register_pytree_node(
    Params,
    lambda p: ([p[k] for k in sorted(p)], (tuple(sorted(p)), tuple(sorted(p.ties.items())))),
    lambda static, values: Params(dict(zip(static[0], values)), dict(static[1])),
)


def functional(model: nn.Module) -> tuple[FunctionalModel, dict[str, torch.Tensor]]:
    """Split ``model`` into a pure apply function and its trainable params.

    Returns ``(apply_fn, params)``: ``params`` is a dict (qualified name ->
    tensor) of the trainable parameters, detached copies-free views of the
    module's own tensors (``p.detach()``; no memory is copied), and
    ``apply_fn(params, *args, **kwargs)`` runs ``model`` with them swapped
    in for its own tensors, as `torch.func.functional_call` does (see
    `zfunc.reparametrize`). See the module docstring for tied weights, frozen
    parameters and buffers.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"functional() takes a torch.nn.Module, got {type(model).__name__}")
    apply_fn = FunctionalModel(model)
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    ties = {alias: key for alias, key in apply_fn.aliases.items() if alias != key}
    return apply_fn, Params(params, ties)


# --------------------------------------------------------------------------
# The plain implementation of the ``apply`` primitive.


def run_model_call(call: ModelCall) -> Any:
    """Run ``call``: the module with its params swapped in (what `torch.func.functional_call`
    does, see `zfunc.reparametrize`), honouring block wrappers."""
    model = call.model
    keys = call.cache.get("keys")
    if keys is None:
        keys = call.cache["keys"] = frozenset(call.aliases.values())
    if not call.block_wrappers and not call.params.keys() >= keys:
        missing = {k for k in call.aliases.values() if k not in call.params}
        raise ValueError(f"params lack {len(missing)} trainable tensors of {type(model).__name__}: "
                         f"{', '.join(sorted(missing)[:8])}")
    # Names inside a wrapped block take their params from the block's body;
    # every other name (a tied twin outside the block included) from the call.
    prefixes = tuple(f"{name}." for name in call.block_wrappers)
    outer = call.cache.get(("outer", prefixes))
    if outer is None:
        outer = call.cache[("outer", prefixes)] = [(name, key) for name, key in call.aliases.items()
                                                   if not name.startswith(prefixes)]
    outer_params = {name: call.params[key] for name, key in outer if key in call.params}
    outer_params.update({name: t for name, t in call.constants.items() if not name.startswith(prefixes)})
    overrides = [_BlockOverride(call, name) for name in call.block_wrappers]
    for override in overrides:
        override.install()
    try:
        with swapped(model, outer_params, call.cache):
            return model(*call.args, **call.kwargs)
    except RuntimeError as err:
        if "mutate a captured Tensor" in str(err):
            raise RuntimeError(
                f"{type(model).__name__} updates a buffer in place during its forward (e.g. BatchNorm running "
                "statistics). Inside zf.value_and_grad the step is a pure function and cannot mutate module "
                "state: put such modules in eval mode, use track_running_stats=False, or a norm without "
                "running statistics (LayerNorm, GroupNorm).") from err
        raise
    finally:
        for override in overrides:
            override.uninstall()


def _call_block(block: nn.Module, block_params: dict, args: tuple, kwargs: dict, cache: dict,
                tied: bool = True) -> Any:
    """The innermost body: the block's own ``forward`` with its params swapped in.

    ``forward`` itself, not ``block(...)``: the parent's call of the block
    already ran the block's hooks once (and a recompute in backward should
    not run them again). ``tied``: whether the block holds a tensor under two
    names; only then may swapping in need to re-tie (see `swapped`).
    """
    with swapped(block, block_params, cache, tie_weights=tied):
        return type(block).forward(block, *args, **kwargs)


def _plain_recompute(name: str, body: BlockBody) -> BlockBody:
    from zfunc.recompute import recompute  # noqa: PLC0415

    return lambda block_params, *args, **kwargs: recompute(body, block_params, *args, **kwargs)


class _BlockOverride:
    """Routes a block's forward through its wrappers while a call runs.

    The block's ``forward`` is replaced on the instance for the duration of
    the call only. Inside the wrapped body the original forward must run, so
    the override steps aside while its body runs (``_inside``); a recompute in
    backward runs after the call has ended and meets the original forward.
    """

    def __init__(self, call: ModelCall, name: str) -> None:
        self.call, self.name = call, name
        self.block = call.model.get_submodule(name)
        self.param_names = call.block_param_names(name)
        self.tied = call.block_has_ties(name)
        prefix = f"{name}."
        self.constants = {n[len(prefix):]: t for n, t in call.constants.items() if n.startswith(prefix)}
        wrappers = list(call.block_wrappers[name])
        if name in call.recompute_required and not any(kind == "around" for kind, _ in wrappers):
            wrappers.append(("around", _plain_recompute))
        body: BlockBody = lambda bp, *a, **kw: self._original(bp, a, kw)  # noqa: E731
        for kind in ("materialize", "around"):
            for k, wrap in wrappers:
                if k == kind:
                    body = wrap(name, body)
        self.body = body
        self._inside = False

    def _original(self, block_params, args, kwargs):
        was_inside, self._inside = self._inside, True
        try:
            if self.constants:
                block_params = {**block_params, **self.constants}
            return _call_block(self.block, block_params, args, kwargs, self.call.cache, self.tied)
        finally:
            self._inside = was_inside

    def forward(self, *args, **kwargs):
        if self._inside:  # the body is running the module itself
            return type(self.block).forward(self.block, *args, **kwargs)
        block_params = {local: self.call.params[key] for local, key in self.param_names.items()}
        return self.body(block_params, *args, **kwargs)

    def install(self) -> None:
        self.block.forward = self.forward

    def uninstall(self) -> None:
        self.block.__dict__.pop("forward", None)
        # self.body ends in self._original: a reference cycle that would keep this call (and the
        # params it was given) alive until the next gc. Recomputes still in flight hold their
        # own reference to the body.
        self.body = None


def repeated_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks.

    The children of the longest ``ModuleList``/``Sequential`` whose children
    all have one type (a transformer's layers). Empty if there is none.
    """
    best: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and len(module) > len(best):
                prefix = f"{name}." if name else ""
                best = [f"{prefix}{i}" for i in range(len(module))]
    return best


def select_blocks(model: nn.Module, modules: Any = None) -> list[str]:
    """Resolve a ``modules=`` argument of a transform into block names.

    ``None``: `repeated_blocks`. A class or tuple of classes: every sub-module
    of that type (outermost ones only). A callable: every sub-module whose
    qualified name it accepts. A list of names: those names.
    """
    if modules is None:
        return repeated_blocks(model)
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
