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

- **which parameters train** is decided when ``functional`` is called:
  setting ``requires_grad`` on a module's parameter afterwards is refused at
  the next call (build a new ``functional(model)`` and state instead).

Transforms change *how* the model runs through the ``apply`` primitive: they
receive a `ModelCall` and may swap its params (cast, gather) or wrap chosen
sub-modules ("blocks") — e.g. `shard` gathers a block's parameters just
before it runs and `checkpoint` recomputes it in backward. Which sub-modules
are the model's blocks has one definition, `find_blocks`, used by both.

Everything that depends only on the module's structure (a block's parameter
names, the slots `zfunc.reparametrize` swaps, the frozen tensors) is found
once and kept in a `ModelStructure` beside the apply function. One call of
the model and how it runs: `zfunc.model_call`; the blocks: `zfunc.blocks`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zfunc.blocks import find_blocks, select_blocks  # noqa: F401 (re-exported: the blocks' one definition)
from zfunc.materialize import Init, Materializer
from zfunc.model_call import (  # noqa: F401 (re-exported)
    BlockBody,
    BlockWrapper,
    ModelCall,
    run_model_call,
)
from zfunc.model_structure import ModelStructure, OutsideItsBlock  # noqa: F401 (re-exported)
from zfunc.compiled import same_keys
from zfunc.params_check import check_shapes_and_dtypes, refuse_other_keys
from zfunc.primitives import dispatch
from zfunc.step_context import current
from zfunc.tree import describe_mismatch, register_pytree_node


class FunctionalModel:
    """``apply_fn(params, *args, **kwargs)``: the module run with ``params``.

    Also exposes ``model`` (the template module), ``aliases`` (every trainable
    qualified name, tied ones included, -> its key in params) and
    ``param_spec`` (key -> (shape, dtype)) used to validate params.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.structure = ModelStructure(model)
        self.aliases = self.structure.aliases
        self.param_spec = self.structure.spec

    def __call__(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if not isinstance(params, dict):
            raise TypeError(f"apply_fn takes the params dict first (from zf.functional), got {type(params).__name__}")
        self.structure.check_trainable()
        ctx = current()

        def where() -> str:  # (for an error only: a transform's repr formats every setting, at every traced call)
            return f" under {ctx.stack.transforms[0]!r}" if ctx is not None and ctx.stack.transforms else ""

        if ctx is not None and ctx.facts.pp > 1 and not params.keys() >= self.structure.keys:
            raise RuntimeError(
                f"apply_fn{where()}: the model ran on a stage's parameters outside zf.value_and_grad. Under pipeline "
                "each rank holds only its stages' parameters (state.params), so the model runs only inside the "
                "pipelined zf.value_and_grad; evaluate on full parameters instead: full = step.gather(state), then "
                "apply_fn(full, ...) outside the step.")
        if not same_keys(params, self.structure.keys):
            refuse_other_keys(self.model, self.structure.keys, self.aliases, params, where())
        if ctx is None:  # (inside a step, the plain apply checks what the transforms hand it: `run_model_call`)
            check_shapes_and_dtypes(self.model, self.param_spec, params, passed=self.structure.shapes_passed)
        _check_devices(params, args, kwargs)
        call = ModelCall(self.model, params, args, kwargs, self.structure)
        return dispatch("apply", run_model_call, call)

    def route_blocks(self, names: list[str]) -> None:
        """Prepare sub-modules other than the model's blocks (``find_blocks``) that a transform will
        wrap (``checkpoint(modules=[...])``, ``shard(units=[...])``) for a first call under
        torch.compile: their forward is routed once, outside the trace (`zfunc.model_structure.BlockDispatch`;
        an eager call does this by itself)."""
        self.structure.route_blocks(names)

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

    def __init__(self, tensors: dict[str, torch.Tensor], ties: dict[str, str],
                 blocks: list[str] | None = None, materializer: Materializer | None = None) -> None:
        super().__init__(tensors)
        self.ties = dict(ties)
        self.blocks = None if blocks is None else list(blocks)
        self.materializer = materializer  # a meta-built model: how `step.init` gives the values


# A pytree node like a dict (keys sorted, as optree orders dicts), so tree utilities and
# torch.func see its tensors; the ties ride along as static data.
register_pytree_node(
    Params,
    lambda p: ([p[k] for k in sorted(p)], (tuple(sorted(p)), tuple(sorted(p.ties.items())),
                                           None if p.blocks is None else tuple(p.blocks), p.materializer)),
    lambda static, values: Params(dict(zip(static[0], values)), dict(static[1]), static[2], static[3]),
)


def _check_devices(params: dict, args: tuple, kwargs: dict) -> None:
    """One clear error when the parameters and the inputs are on different kinds of device (a model
    built on the CPU, a batch on the GPU), instead of a device mismatch deep inside the model."""
    param = next((t for t in params.values() if isinstance(t, torch.Tensor)), None)
    tensor = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    if param is None or tensor is None or param.device.type == tensor.device.type or param.is_meta:
        return
    raise ValueError(
        f"apply_fn: the parameters are on {param.device} but the inputs on {tensor.device}. The state lives where "
        "it was built: build the model on the device it trains on (or move it there) before zf.functional and "
        "TrainState.create, let shard place it (an NCCL group puts the state on its GPU), or move the batch to "
        f"{param.device}.")


def functional(model: nn.Module, init: Init = None) -> tuple[FunctionalModel, dict[str, torch.Tensor]]:
    """Split ``model`` into a pure apply function and its trainable params.

    Args:
      model: any ``nn.Module``; it may be built on the meta device (``with
        torch.device("meta"): model = GPT(cfg)``), and then `step.init` gives
        the parameters their values where they will live, one unit at a time
        (`zfunc.materialize`), without ever holding the whole model.
      init: for a meta-built model, its initializer: "reset_parameters"
        (default), "hf" (a Hugging Face model's own ``_init_weights``) or a
        function of a module (see `zfunc.materialize`).
    Returns:
      ``(apply_fn, params)``: ``params`` is a dict (qualified name -> tensor)
      of the trainable parameters, detached copy-free views of the module's
      own tensors (``p.detach()``; meta tensors for a meta-built model), and
      ``apply_fn(params, *args, **kwargs)`` runs ``model`` with them swapped in
      for its own tensors, as `torch.func.functional_call` does (see
      `zfunc.reparametrize`). See the module docstring for tied weights,
      frozen parameters and buffers.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"functional() takes a torch.nn.Module, got {type(model).__name__}")
    apply_fn = FunctionalModel(model)
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    ties = {alias: key for alias, key in apply_fn.aliases.items() if alias != key}
    materializer = None
    if any(p.is_meta for p in params.values()):
        materializer = Materializer(model, apply_fn.aliases, init)
    elif init is not None:
        raise ValueError("functional(model, init=...) applies to a model built on the meta device; this one has "
                         "values already")
    return apply_fn, Params(params, ties, apply_fn.structure.blocks(), materializer)
