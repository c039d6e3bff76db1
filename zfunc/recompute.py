"""Recompute a function in backward instead of saving its activations.

`recompute(body, params, *args, **kwargs)` returns ``body(params, *args,
**kwargs)`` but keeps from the forward pass none of the activations inside
it; backward re-runs ``body`` (with the forward's RNG state, so dropout masks
repeat) to get them back. Both the `checkpoint` transform and
`shard(stage=3, reshard="recompute")` use it: when ``body`` starts by
gathering its parameters from shards, the gather is simply re-run in
backward, so a block's full parameters are alive only while that block runs.

Two routes, picked per call:

- eagerly (zfunc's `value_and_grad` runs plain autograd), `zfunc.recompute_eager`
  (the semantics of torch's non-reentrant ``torch.utils.checkpoint``, with a
  Python call per saved tensor instead of a dozen): the forward builds the
  ordinary autograd graph and only the tensors its ops save are dropped, kept
  as their positions, and recomputed when backward first needs one. So
  everything that leaves the block — its return value, but also tensors a
  forward hook or a side list carries out (Hugging Face's ``output_attentions``,
  an MoE router's logits for its load-balancing loss) — gets exact gradients,
  as without recompute. A selective policy (``context_fn``, checkpoint's
  ``SaveOps``) goes through torch's checkpoint, which implements it;
- inside a `torch.func` transform (vmap for per-example gradients), where
  saved-tensor hooks and ``torch.utils.checkpoint`` are refused, an `autograd.Function` with
  ``setup_context`` that runs ``body`` without grad, keeps its inputs, and in
  backward re-runs it under `torch.func.vjp` (``create_graph=False``). That
  route sees only the block's return value: a tensor that leaves the block
  otherwise would carry no gradient there, so the forward runs under
  `EscapeWatch`, which refuses such side outputs. Checkpoint's ``offload_inputs``
  policy takes the eager route with the block's inputs held in host memory
  (``inputs_to_host``), and this route, through its ``save=`` hook, under
  torch.func.

While `torch.compile` traces a whole step the block runs as it is: neither
route traces there (`zfunc.compiled`); `zfunc.transforms.compile_blocks`
compiles the blocks and keeps the eager route.

``params`` is the dict of tensors that gradients flow to (a block's own
parameters, or their shards); ``args``/``kwargs`` may hold tensors (which get
gradients when they require them) and any other values.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.weak import WeakIdKeyDictionary

from zfunc.autodiff import under_torch_func_or_compile
from zfunc.compiled import tracing
from zfunc.recompute_eager import RngStates, run_recomputed
from zfunc.tree import read_in_c, tree_flatten, tree_unflatten, version_of


def refuse_running_statistics(norms: list[tuple[str, torch.nn.Module]], who: str, remedy: str) -> None:
    """Refuse a norm with running statistics in training mode inside a block ``who`` recomputes: the
    recompute in backward would update its statistics a second time, without a word.

    ``norms``: ``(qualified name, module)`` of the block's norm modules; ``remedy``: what else the caller
    may do, appended to the usual choices.
    """
    for where, module in norms:
        if module.training and module.track_running_stats:
            raise ValueError(
                f"{who}: {where} is a {type(module).__name__} in training mode inside a recomputed block; "
                "the recompute in backward would update its running statistics a second time. Put it in eval "
                "mode, use track_running_stats=False or a norm without running statistics (LayerNorm, "
                f"GroupNorm), or {remedy}.")


def recompute(body: Callable, params: dict[str, torch.Tensor], *args: Any,
              save: Callable[[dict, tuple], tuple] | None = None, context_fn: Callable | None = None,
              inputs_to_host: bool | None = None, **kwargs: Any) -> Any:
    """``body(params, *args, **kwargs)`` without saving its activations.

    Args:
      body: the function to recompute; ``params`` are the tensors gradients flow to.
      save: optional; how the inputs are kept for backward on the Function route (under torch.func):
        ``save(kept_tensors) -> (stored, load)`` where ``load(stored)`` returns
        them (e.g. moved to host memory and back).
      inputs_to_host: optional; on the eager route, keep the block's tensor inputs in host memory
        between forward and backward (True: pinned when they are on a GPU; False: pageable). The
        copies to the host and back are part of the autograd graph, so gradients stay exact and
        tensors that leave the block on the side still get theirs.
      context_fn: optional; torch's selective-checkpoint contexts (which op
        outputs to keep rather than recompute), for the eager route.
    Returns:
      What ``body`` returns.
    """
    if tracing():
        # torch.compile of the whole step: the block runs as it is and its activations stay (see
        # `zfunc.compiled`: neither route traces under the step's torch.func.vjp), so dropout needs no replay.
        # A key/value cache is refused as eagerly, looked for among the block's own arguments (where a model
        # hands it over) rather than in their flattened tree, which dynamo would walk leaf by leaf per block.
        _refuse_kv_cache([x for x in (*args, *kwargs.values()) if x is not None and not isinstance(x, torch.Tensor)])
        return body(params, *args, **kwargs)
    flat, spec = tree_flatten((args, kwargs))  # (once: what the checks and both routes walk)
    _refuse_kv_cache(flat)
    if not under_torch_func_or_compile() and (save is None or inputs_to_host is not None):
        if inputs_to_host is not None:
            args, kwargs = _kept_on_host((args, kwargs), pin_memory=inputs_to_host)
            flat, spec = tree_flatten((args, kwargs))
        return _checkpoint_eagerly(body, params, args, kwargs, flat, spec, context_fn)
    keys = list(params)
    is_tensor = [isinstance(x, torch.Tensor) for x in flat]
    tensors = [x for x, t in zip(flat, is_tensor) if t]
    others = [x for x, t in zip(flat, is_tensor) if not t]

    def run(param_values, tensor_values):
        it_t, it_o = iter(tensor_values), iter(others)
        merged = [next(it_t) if t else next(it_o) for t in is_tensor]
        a, kw = tree_unflatten(spec, merged)
        return body(dict(zip(keys, param_values)), *a, **kw)

    ctx_info = _Plan(run, len(keys), save)
    ctx_info.functional = under_torch_func_or_compile()  # seen here: inside forward, functorch hides it
    outputs = _RecomputeFunction.apply(ctx_info, *[params[k] for k in keys], *tensors)
    return tree_unflatten(ctx_info.out_spec, list(outputs))


def _refuse_kv_cache(leaves: list) -> None:
    for other in leaves:
        if hasattr(other, "update") and hasattr(other, "get_seq_length"):
            # A Hugging Face key/value cache is mutated by the block: re-running
            # the block in backward would append its keys again and attend to them.
            raise ValueError(
                f"a key/value cache ({type(other).__name__}) reaches a recomputed block; recomputing would "
                "replay its update and change the result. Train with use_cache=False "
                "(e.g. apply_fn(params, input_ids=x, use_cache=False)).")


def host_copy(t: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    """A copy of ``t`` in host memory: page-locked and copied asynchronously when ``pin_memory`` and ``t`` is
    on a CUDA device. Autograd records the copy when ``t`` requires grad (gradients reach ``t``)."""
    pinned = pin_memory and t.device.type == "cuda"
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned).copy_(t, non_blocking=pinned)


class _OnHost:
    """A block input kept in host memory: `load` brings it back (differentiably) where it was."""

    def __init__(self, t: torch.Tensor, pin_memory: bool) -> None:
        self.device = t.device
        self.host = host_copy(t, pin_memory)

    def load(self) -> torch.Tensor:
        return self.host.to(self.device, non_blocking=True)


def _kept_on_host(tree: Any, pin_memory: bool) -> Any:
    """``tree`` with its floating-point tensors on an accelerator replaced by `_OnHost` holders, which
    `_checkpoint_eagerly`'s run loads back: the forward's inputs then live in host memory until the
    recompute (what checkpoint's ``offload_inputs`` policy is for)."""
    flat, spec = tree_flatten(tree)
    out = [_OnHost(x, pin_memory) if isinstance(x, torch.Tensor) and x.is_floating_point()
           and x.device.type != "cpu" else x for x in flat]
    return tree_unflatten(spec, out)


def _checkpoint_eagerly(body: Callable, params: dict, args: tuple, kwargs: dict, flat: list, spec: Any,
                        context_fn) -> Any:
    """The eager route (see the module docstring): `zfunc.recompute_eager` around ``body``; torch's
    non-reentrant checkpoint where a selective policy (``context_fn``) chooses what to keep. ``flat, spec``:
    ``(args, kwargs)`` flattened."""
    inputs = [x.host if isinstance(x, _OnHost) else x for x in flat
              if isinstance(x, (torch.Tensor, _OnHost))]
    versions = [t._version for t in inputs]
    weights = list(params.values())  # (selected and read in C in the common case: this runs per block per forward)
    if not all(map(isinstance, weights, itertools.repeat(torch.Tensor))):
        weights = [t for t in weights if isinstance(t, torch.Tensor)]
    weight_versions = list(map(version_of, weights)) if read_in_c(weights) else [t._version for t in weights]
    runs = [0]
    on_host = any(isinstance(x, _OnHost) for x in flat)

    def run(*_):
        if runs[0] and any(t._version != v for t, v in zip(inputs, versions)):
            # A recompute from the changed values would silently give other gradients.
            raise RuntimeError("an input of a recomputed block was modified by an inplace operation between the "
                               "forward and the backward pass, so the recompute would see other values; clone "
                               "it before changing it in place")
        if runs[0] and [t._version for t in weights] != weight_versions:
            # What autograd says of a saved tensor that changed (the parameters reach the body by closure):
            # `zfunc.autodiff` names the parameter written.
            raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                               "inplace operation: a parameter of a recomputed block changed between its forward "
                               "and the recompute in backward")
        runs[0] += 1
        if on_host:
            a, kw = tree_unflatten(spec, [x.load() if isinstance(x, _OnHost) else x for x in flat])
            return body(dict(params), *a, **kw)
        return body(dict(params), *args, **kwargs)

    # The devices whose RNG states the recompute replays (the CPU's always is): those of the parameters.
    devices = {t.device for t in weights}
    if context_fn is None:
        return run_recomputed(run, devices)
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

    # The body reaches ``params`` by closure (the non-reentrant checkpoint differentiates whatever its forward
    # used), and torch's checkpoint is handed one of them per device: what it infers the device type and the
    # devices whose RNG states it replays from.
    per_device = {t.device: t for t in weights}
    return checkpoint(run, *per_device.values(), use_reentrant=False, preserve_rng_state=True,
                      context_fn=context_fn)


class _Plan:
    """What the Function needs besides tensors (functions, counts, output structure)."""

    def __init__(self, run: Callable, num_params: int, save) -> None:
        self.run, self.num_params, self.save = run, num_params, save
        self.out_spec = None
        self.rng: RngStates | None = None
        self.functional = False  # whether the call ran under a torch.func transform (then rerun under vjp)


class _RecomputeFunction(torch.autograd.Function):
    # vmap (per-example gradients) runs forward/backward under vmap itself (torch.func cannot differentiate through a nested autograd.Function there).
    generate_vmap_rule = True

    @staticmethod
    def forward(plan: _Plan, *inputs: torch.Tensor):
        plan.rng = RngStates(torch.device("cuda", i) for i in _rng_devices())  # (the current CUDA device's)
        params, tensors = inputs[:plan.num_params], inputs[plan.num_params:]
        watch = EscapeWatch([t for t in inputs if t.is_floating_point()])
        with torch.no_grad(), watch:
            out = plan.run(list(params), list(tensors))
        leaves, plan.out_spec = tree_flatten(out)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError("a recomputed block must return tensors (or a tuple/dict of tensors)")
        # What the Function returns are new tensor objects: a clone where the block returned an input (autograd
        # would see a view of a saved input), else an alias of the same memory (`detach`: no copy). So the
        # objects the block made are gone once ours are the only references, and one still alive was carried
        # out on the side (a hook on the block's last layer keeps the very tensor the block returns, which
        # would reach the loss as a constant here).
        returned = tuple(x.clone() if any(x is i for i in inputs) else x.detach() for x in leaves)
        del out, leaves
        watch.refuse_escapes(returned=list(returned), inputs=inputs)
        return returned

    @staticmethod
    def setup_context(ctx, inputs, output):
        plan, *tensors = inputs
        ctx.plan = plan
        if plan.save is not None:
            stored, ctx.load = plan.save(tuple(tensors))
            ctx.stored = stored
            ctx.save_for_backward()
        else:
            ctx.load = None
            ctx.save_for_backward(*tensors)
        ctx.needs = [t.requires_grad if isinstance(t, torch.Tensor) else False for t in tensors]

    @staticmethod
    def backward(ctx, *grad_outputs):
        plan: _Plan = ctx.plan
        inputs = list(ctx.load(ctx.stored)) if ctx.load is not None else list(ctx.saved_tensors)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        # Replay the forward's RNG so dropout masks are the same; restore ours after.
        with torch.random.fork_rng(devices=_rng_devices()):
            plan.rng.restore()

            def rerun(*diff):
                values = list(inputs)
                for i, d in zip(wanted, diff):
                    values[i] = d
                out = plan.run(values[:plan.num_params], values[plan.num_params:])
                return tuple(tree_flatten(out)[0])

            if plan.functional:
                with torch.enable_grad():
                    _, vjp_fn = torch.func.vjp(rerun, *[inputs[i].detach() for i in wanted])
                grads = vjp_fn(tuple(grad_outputs), retain_graph=False, create_graph=False)
            else:  # plain autograd (offload_inputs eagerly): the rerun is ordinary autograd too
                grads = _autograd_rerun(rerun, [inputs[i] for i in wanted], grad_outputs)
        result: list[torch.Tensor | None] = [None] * len(inputs)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (None, *result)


class EscapeWatch(TorchDispatchMode):
    """Find tensors that leave a block other than through its return value.

    On the Function route the block runs without grad and only its return value is wired into autograd, so
    a tensor it hands out otherwise (a forward hook or a list collecting a sub-module's output) reaches the
    loss as a constant: its gradient would be dropped without a word. Under this dispatch mode every op
    output computed from the watched tensors (the block's parameters and floating inputs), directly or
    through other such outputs, is recorded by weak reference; `refuse_escapes` raises if one is still
    alive after the block returned and is neither returned nor the base of a returned view. ``detach``
    ends the chain: a detached tensor (a module's cache) carries no gradient in eager PyTorch either.
    """

    def __init__(self, sources: list[torch.Tensor]) -> None:
        super().__init__()
        self.derived = WeakIdKeyDictionary({t: True for t in sources})
        self.made: list[tuple[weakref.ref, str]] = []
        self.kept_by_zfunc: set[int] = set()  # outputs a checkpoint policy saves for the backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ENDS_DERIVATION:
            return out
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(a in self.derived for a in inputs):
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.is_floating_point() and not any(o is a for a in inputs):
                    self.derived[o] = True
                    self.made.append((weakref.ref(o), str(func)))
        return out

    def alive(self, returned: list[torch.Tensor], inputs: tuple) -> list[tuple[torch.Tensor, str]]:
        """The derived tensors still alive that are not returned, bases of returned views, or inputs."""
        kept = {id(t) for t in inputs} | self.kept_by_zfunc
        for t in returned:
            for layer in _functorch_layers(t):
                while layer is not None:
                    kept.add(id(layer))
                    layer = layer._base
        return [(t, op) for ref, op in self.made if (t := ref()) is not None and id(t) not in kept]

    def refuse_escapes(self, returned: list[torch.Tensor], inputs: tuple) -> None:
        if not self.alive(returned, inputs):
            return
        gc.collect()  # (a reference cycle may be what keeps a temporary alive)
        escaped = self.alive(returned, inputs)
        if escaped:
            t, op = escaped[0]
            raise RuntimeError(
                f"a tensor computed inside a recomputed block ({op} -> {tuple(t.shape)} {t.dtype}; "
                f"{len(escaped)} such) is still alive after the block returned but is not part of its return "
                "value: a forward hook or a list carried it out on the side (Hugging Face's output_attentions, "
                "an MoE router's logits). Under a torch.func transform the recompute is an autograd.Function "
                "that sees only the block's return value, so that tensor's gradient would be silently lost. "
                "Return it from the block, differentiate with zf.value_and_grad (whose recompute gives side "
                "outputs exact gradients), or leave this block out of the recompute.")


def kept_for_backward(t: torch.Tensor) -> None:
    """Tell the enclosing `EscapeWatch`, if any, that zfunc itself keeps ``t`` for the backward (what
    checkpoint's ``save_ops`` policy does with the outputs of the ops it saves): not a side output."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, EscapeWatch):
            mode.kept_by_zfunc.add(id(t))


def _functorch_layers(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` and the tensors it wraps (under vmap the block returns batched wrappers of what its ops made)."""
    layers = [t]
    while torch._C._functorch.is_functorch_wrapped_tensor(layers[-1]):
        layers.append(torch._C._functorch.get_unwrapped(layers[-1]))
    return layers


# Ops whose outputs carry no gradient in eager PyTorch (a module keeps such a tensor as a cache).
_ENDS_DERIVATION = (torch.ops.aten.detach.default,)


def _autograd_rerun(rerun: Callable, inputs: list[torch.Tensor], grad_outputs: tuple) -> list:
    """The gradients of ``rerun(*inputs)`` given the outputs' gradients, through plain autograd."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    with torch.enable_grad():
        outs = rerun(*leaves)
    pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
    if not pairs:
        return [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


def _rng_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []
