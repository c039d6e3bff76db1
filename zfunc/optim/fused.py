"""The fused form of an optimizer, declared by the optimizer itself, and the one dispatcher to its kernels.

`adam` and `adamw` are chains of pure transformations; a fused kernel (the
numba one on the host, the Triton one on a GPU) does the same arithmetic in
one pass, in place. Each alias that a kernel can run carries an `AdamSpec`
(``tx.fused``): its betas, eps, weight decay and mask, its schedule, an
optional clip (``chain(clip_by_global_norm(c), adamw(...))`` declares one),
and *where its state lives*, by name: the paths to its `ScaleByAdamState` and
`ScaleByLearningRateState` inside the optimizer state. Nothing reverse
engineers a chain: a chain of anything else declares no fused form and takes
the pure pytree update.

`fused_update` runs a spec over dicts of tensors: it groups the keys into
runs that are one gap-free span in every operand (`zfunc.optim.spans`; under `shard` a unit's
parameters, gradients and moments are views of one flat buffer each, so a
unit is one run per weight decay) and hands each run to the CPU kernel
(`zfunc.kernels.cpu_adam.adamw_`) or the GPU kernel
(`zfunc.kernels.gpu_adam.adam_flat_`) by the run's device. It is exact:
both kernels compute what `adamw`'s pure update computes, to the ulp (the
kernels' docstrings state the arithmetic).

When all of the state is on one GPU, the update is one launch over every run
(`zfunc.kernels.gpu_adam.adam_runs_`, the same bits as a launch per run),
and what it derives from the layout (runs, buffers, decay tables, where the
compute copy goes) is built once per state layout and checked, not rebuilt,
at later steps (`zfunc.optim.fused_plan.DevicePlan`). With ``spec.graph``
(`zfunc.optim.cuda_graphed`), that launch and the small operations around it
(rate, step, clip divisor, counts) are captured in a CUDA graph once per
layout and replayed (`zfunc.optim.update_graph`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal

import torch

from zfunc.kernels.gpu_adam import resolve_backend
from zfunc.optim.fused_plan import DevicePlan
from zfunc.optim.spans import contiguous_runs, find_runs, laid_out_like, span_of
from zfunc.optim.transforms import ScaleByAdamState, ScaleByLearningRateState, decay_mask, global_norm
from zfunc.optim.update_graph import graphed_update
from zfunc.step_context import count_increment
from zfunc.tiers.placement import page_out
from zfunc.tree import keyed_alike, still_the_same, weak_refs

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOWP_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity, like the optimizer's closures
class AdamSpec:
    """What a fused Adam/AdamW kernel needs, and where the optimizer keeps its state.

    Attributes:
      mode: "adam" (L2 decay added to the gradient) or "adamw" (decoupled decay).
      b1, b2, eps, weight_decay: as in `zfunc.optim.adamw`.
      mask: which parameters decay (`zfunc.optim.decay_mask`'s forms).
      schedule: ``count -> lr``.
      adam_path, lr_path: index paths, inside the optimizer state, to its
        `ScaleByAdamState` and `ScaleByLearningRateState`.
      clip: the max norm of a ``clip_by_global_norm`` chained before, or None.
      graph: run the update, where it is one launch on one GPU, as the replay of a CUDA graph captured once
        per state layout (`zfunc.optim.update_graph`; set by `zfunc.optim.cuda_graphed`).
      tables: kernel tables built for this optimizer (weight-decay chunk tables
        of the GPU kernel), reused across steps; derived data, not configuration.
    """

    mode: Literal["adam", "adamw"]
    b1: float
    b2: float
    eps: float
    weight_decay: float
    mask: Any
    schedule: Callable[[torch.Tensor], torch.Tensor]
    adam_path: tuple[int, ...]
    lr_path: tuple[int, ...]
    clip: float | None = None
    graph: bool = False
    tables: dict = dataclasses.field(default_factory=dict, compare=False, repr=False, hash=False)

    def nested(self, index: int) -> "AdamSpec":
        """This spec for the optimizer placed at ``index`` of a chain (paths prefixed)."""
        return dataclasses.replace(self, adam_path=(index, *self.adam_path), lr_path=(index, *self.lr_path),
                                   tables={})

    def clipped(self, max_norm: float) -> "AdamSpec":
        return dataclasses.replace(self, clip=float(max_norm), tables={})

    # -- the state, by name ----------------------------------------------------
    def adam_state(self, opt_state) -> ScaleByAdamState:
        return _at(opt_state, self.adam_path, ScaleByAdamState)

    def lr_state(self, opt_state) -> ScaleByLearningRateState:
        return _at(opt_state, self.lr_path, ScaleByLearningRateState)

    def advanced(self, opt_state, mu: dict, nu: dict, lr: torch.Tensor, skip: torch.Tensor | None = None,
                 count: torch.Tensor | None = None):
        """The optimizer state after one update whose new moments are ``mu``/``nu`` (exactly the
        state ``tx.update`` would return: counts + 1, the rate used); where ``skip`` (a 0-d bool on the
        device) is set, the counts and rate stay. ``count``: the new Adam count, where the caller made it."""
        adam, rate = self.adam_state(opt_state), self.lr_state(opt_state)
        if skip is not None:
            one = count_increment(skip, adam.count.dtype)
            lr = torch.where(skip, rate.learning_rate, lr)
        else:
            one = 1
        return self.with_counts(opt_state, mu, nu, adam.count + one if count is None else count, rate.count + one, lr)

    def with_counts(self, opt_state, mu: dict, nu: dict, count: torch.Tensor, rate_count: torch.Tensor,
                    lr: torch.Tensor):
        """The optimizer state with these moments, counts and rate (as they are: no arithmetic)."""
        opt_state = _replace_at(opt_state, self.adam_path, ScaleByAdamState(count, mu, nu))
        return _replace_at(opt_state, self.lr_path, ScaleByLearningRateState(rate_count, lr))

    def weight_decays(self, params: dict) -> dict[str, float]:
        if self.mode == "adam" or self.mask is None:
            return dict.fromkeys(params, self.weight_decay)
        decays = decay_mask(self.mask, params)
        return {k: (self.weight_decay if decays[k] else 0.0) for k in params}


def _at(tree, path: tuple[int, ...], kind: type):
    node = tree
    for i in path:
        node = node[i]
    if not isinstance(node, kind):
        raise TypeError(f"the optimizer state at {path} is {type(node).__name__}, not {kind.__name__}: "
                        "this state was not made by this optimizer's init")
    return node


def _replace_at(tree, path: tuple[int, ...], value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    parts = list(tree)
    parts[head] = _replace_at(parts[head], rest, value)
    return type(tree)(*parts) if hasattr(tree, "_fields") else type(tree)(parts)


# ---------------------------------------------------------------------------
# The one dispatcher.


def fusable(params: dict, grads: dict, mu: dict, nu: dict) -> bool:
    """Whether the fused kernels take these: fp32 contiguous params and moments, float contiguous
    gradients; each parameter's state (param, moments) on one device, its gradient on that device or,
    for state on the host, on a GPU (streamed, `zfunc.optim.streamed`). Empty tensors may sit anywhere."""
    for k, p in params.items():
        if not p.numel():
            continue
        g, m, v = grads[k], mu[k], nu[k]
        if not (p.dtype == m.dtype == v.dtype == torch.float32 and g.dtype in GRAD_DTYPES
                and p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
            return False
        if not (p.device == m.device == v.device and (g.device == p.device or (p.device.type == "cpu"
                                                                              and g.device.type == "cuda"))):
            return False
    return True


def fused_update(spec: AdamSpec, params: dict, grads: dict, opt_state, compute_dtype: torch.dtype | None = None,
                 compute_into: dict | None = None, host_threads: int | None = None,
                 skip: torch.Tensor | None = None, skip_ready=None, landing=None,
                 check_grads: Callable[[dict, dict], None] | None = None):
    """One Adam/AdamW update through the fused kernels, in place; None if they cannot take these tensors.

    Computes what ``tx.update`` and ``apply_updates`` compute (see the module
    docstring): ``params`` and the moments are updated in place and returned
    with the new optimizer state. Each run of parameters goes to the kernel of
    where its state lives: the GPU kernel for state on a GPU, the CPU kernel
    for state on the host (streamed chunk by chunk when its gradients are on a
    GPU), so one update may span tiers (`offload`'s placement).

    Args:
      spec: the optimizer's fused form (``tx.fused``).
      params, grads: dicts keyed alike; params fp32, grads fp32/bf16/fp16.
      opt_state: the optimizer's state (its moments are updated in place).
      compute_dtype: also write the new parameters in this dtype (bf16/fp16 rounded to nearest
        even in the same pass; fp32: a copy), e.g. the compute copy of `mixed_precision`.
      compute_into: where to write them, per key (used where dtype and size fit and the device is the
        state's or the gradient's; elsewhere new tensors).
      host_threads: threads for the CPU kernel (default: torch's).
      skip: a 0-d bool tensor on the device; where set, nothing is updated (the GPU kernel reads it on the
        device; the host kernel, which needs its numbers on the host anyway, reads it there).
      skip_ready: a CUDA event recorded once ``skip`` was made: the host reads it after that event only, not
        after all the work queued since (the update then starts while the GPU still runs backward).
      landing: host gradients that may still be landing from the GPU (`zfunc.tiers.landing.HostLanding`): each
        is waited for just before it is read; the streamed runs are taken in the order their gradients land.
      check_grads: ``check_grads(params, grads)`` raises where the gradients are not shaped as the params
        (`zfunc.state.check_grads_match`). Called first, before anything else, except where the plan of the last
        step finds the gradients laid out as it expects, shapes included (`DevicePlan.gradients_at`): it reads
        them anyway, and the check would read them again.
    Returns:
      ``(params, opt_state, compute_copy)`` (``compute_copy`` None unless asked for), or None.
    """
    plan = spec.tables.get(_PLAN)
    found = None  # (the plan, the gradients' addresses) where its `gradients_at` passed
    if isinstance(plan, DevicePlan) and isinstance(params, dict) and isinstance(grads, dict):
        ptrs = plan.gradients_at(params, grads)
        found = None if ptrs is None else (plan, ptrs)
    if found is None and check_grads is not None:
        check_grads(params, grads)
    adam = spec.adam_state(opt_state)
    mu, nu = adam.mu, adam.nu
    if not (isinstance(params, dict) and isinstance(grads, dict) and (found is not None or keyed_alike(params, grads))
            and isinstance(mu, dict) and keyed_alike(mu, params)):  # (found: both keyed as the plan, `gradients_at`)
        return None
    planned = _device_plan(spec, params, grads, mu, nu, compute_dtype, compute_into, found)
    if planned is None and not fusable(params, grads, mu, nu):
        return None
    norm = None
    if spec.clip is not None:
        if landing is not None:  # (the norm reads every gradient)
            landing.wait_all()
        norm = global_norm(grads)  # (once: under shard a collective, which every rank runs alike)
    if planned is not None and spec.graph and landing is None:  # the plan's update as a CUDA graph's replay
        plan, grad_ptrs = planned
        new_state = graphed_update(spec, plan, grad_ptrs, opt_state, skip, norm)
        if new_state is not None:
            copy = None if plan.out_dtype is None else _keyed_like(compute_into, params)
            return params, new_state, copy
    lr = spec.schedule(spec.lr_state(opt_state).count)
    # g ← g · min(1, c / (‖g‖ + 1e-6)) = g / max(1, (‖g‖ + 1e-6) / c)
    divisor = None if norm is None else 1.0 / (spec.clip / (norm + 1e-6)).clamp(max=1.0)
    if planned is not None:  # all of the state on one GPU, laid out as last step: one launch
        plan, grad_ptrs = planned
        # The new count is the kernel's step (this update's 1-based index): one more where the update runs, and
        # where ``skip`` stops it the kernel reads nothing more than the flag. One addition for both.
        count = adam.count + (1 if skip is None else count_increment(skip, adam.count.dtype))
        plan.launch(spec, grad_ptrs, lr, count, divisor, skip)
        copy = None if plan.out_dtype is None else _keyed_like(compute_into, params)
        return params, spec.advanced(opt_state, mu, nu, lr, skip, count=count), copy
    step = adam.count + 1
    decays = spec.weight_decays(params)
    out_dtype = compute_dtype if compute_dtype in LOWP_DTYPES else None
    copy = _compute_targets(params, grads, compute_dtype, compute_into, skip) if compute_dtype is not None else None
    operands = [params, grads, mu, nu, *([copy] if copy is not None else [])]
    keys = [k for k, p in params.items() if p.numel()]
    host = _HostKernel(spec, lr, step, divisor, host_threads, skip, skip_ready)
    found = None if skip is None else skip.to(torch.float32)
    streamed = []
    for run in contiguous_runs(keys, operands, decays, cache=spec.tables):
        p, g, m, v, *out = (span_of(d, run) for d in operands)
        target = out[0] if out else None
        decay = decays[run[0]]
        # State on the host, with the gradient or the compute copy on a GPU (a gradient summed on the host
        # by `accumulate` goes up as new parameters all the same): streamed.
        if p.device.type == "cpu" and (g.device.type == "cuda" or (target is not None and target.device.type == "cuda")):
            if target is not None and target.device.type == "cpu":  # parameters kept on the host: in place
                streamed.append((p, g, m, v, None, decay, target))
            else:
                streamed.append((p, g, m, v, target, decay, None))
        elif on_host(p):
            if host.skipped:
                continue
            if landing is not None:
                landing.wait(g)
            host(p, g, m, v, target if out_dtype is not None else None, decay)
            if target is not None and out_dtype is None:
                target.copy_(p)
            for t in (p, m, v):  # state in NVMe tier files: back to the drive, out of host memory
                page_out(t)
        else:
            _gpu_run(spec, run, params, decays, p, g, m, v, target, out_dtype, lr, step, divisor, found)
    if streamed and not host.skipped:
        from zfunc.optim.streamed import streamed_update  # noqa: PLC0415

        ready = None
        if landing is not None:  # the units whose gradients landed first, first; those on the GPU last
            streamed.sort(key=lambda run: landing.order(run[1]) if run[1].device.type == "cpu" else math.inf)
            ready = landing.wait
        streamed_update(streamed, host, out_dtype, ready=ready)
    return params, spec.advanced(opt_state, mu, nu, lr, host.counted_skip(skip, adam.count)), copy


_PLAN = "device plan"  # spec.tables' entry: the DevicePlan of the last state, or _NOT_PLANNED


def _device_plan(spec: AdamSpec, params: dict, grads: dict, mu: dict, nu: dict, compute_dtype, into: dict | None,
                 found: tuple | None):
    """``(plan, gradient addresses)`` where the whole update is one launch of the GPU kernel
    (`zfunc.optim.fused_plan`): every nonempty parameter's state on one GPU (not `on_host`), the
    Triton backend there, a compute copy (if asked for) of bf16/fp16 written into ``into`` on that
    device, the gradients of one dtype. Else None: the general path.

    The plan of the last step is reused while the tensors are laid out as it expects (``found``: the plan and
    the gradients' addresses, where its `DevicePlan.gradients_at` passed; what is left is its `state_at`);
    otherwise it is built again (and where no plan can be made for these parameters, that is remembered for as
    long as they are the same tensors, so the general path pays one identity check per key for asking)."""
    plan = spec.tables.get(_PLAN)
    into = into if compute_dtype is not None else None
    if isinstance(plan, DevicePlan):
        if found is not None and found[0] is plan and plan.out_dtype == compute_dtype \
                and plan.state_at(params, mu, nu, into):
            return found
    elif plan is not None and still_the_same(plan, params.values()):
        return None  # these very parameters could not be planned
    plan = _build_plan(spec, params, grads, mu, nu, compute_dtype, into)
    spec.tables[_PLAN] = plan if plan is not None else weak_refs(params.values())
    if plan is None:
        return None
    ptrs = plan.grad_addresses(params, grads, mu, nu, into)
    return (plan, ptrs) if ptrs is not None else None


def _build_plan(spec, params, grads, mu, nu, compute_dtype, into) -> DevicePlan | None:
    keys = [k for k, p in params.items() if p.numel()]
    if not keys or any(on_host(params[k]) for k in keys) or compute_dtype not in (None, *LOWP_DTYPES):
        return None
    device = params[keys[0]].device
    try:
        if resolve_backend(device_backend(device), device) != "triton":
            return None
    except (ImportError, ValueError):
        return None
    if compute_dtype is not None:
        if into is None or into.keys() != params.keys() or not all(
                t.dtype == compute_dtype and t.numel() == params[k].numel() and t.is_contiguous()
                for k, t in into.items()):
            return None
    if not fusable(params, grads, mu, nu):
        return None
    operands = [params, grads, mu, nu] + ([into] if into is not None else [])
    return DevicePlan.build(find_runs(keys, operands, None), spec.weight_decays(params), params, grads, mu, nu,
                            into, compute_dtype)


def _keyed_like(d: dict, like: dict) -> dict:
    """``{k: d[k] for k in like}``: ``d`` itself where it is keyed in ``like``'s order already, as the compute copy
    a stack asks for is (the dict the stack handed over, its tensors written in place: the stack finds it
    unchanged by its version tag, `zfunc.optim.fused_plan`), else a dict made so."""
    return d if type(d) is dict and len(d) == len(like) and tuple(d) == tuple(like) \
        else dict(zip(like, map(d.__getitem__, like)))


def on_host(t: torch.Tensor) -> bool:
    """Whether a run whose state is ``t`` takes the host kernel (its state is in host memory) rather than
    the GPU one. The one seam of the dispatch: tests and ``benchmarks/update_host_time.py`` patch it (with
    `device_backend`) to drive the GPU path with CPU tensors, through Triton's interpreter."""
    return t.device.type == "cpu"


def device_backend(device: torch.device) -> str:
    """The `zfunc.kernels.gpu_adam` backend of the GPU path ("auto": Triton on CUDA); see `on_host`."""
    return "auto"


class _HostKernel:
    """The numba Adam/AdamW over one run or chunk: ``kernel(p, g, m, v, out_lowp, weight_decay)``.

    Its numbers (rate, step, clip divisor, skip flag) are read on the host when first needed, by a run
    whose state lives on the host: a step whose state is all on the GPU reads nothing."""

    def __init__(self, spec: AdamSpec, lr, step, divisor, threads, skip=None, skip_ready=None) -> None:
        self.spec, self.threads = spec, threads
        self._numbers = (lr, step, divisor, skip)
        self._skip_ready = skip_ready

    @functools.cached_property
    def skipped(self) -> bool:
        skip = self._numbers[3]
        if skip is None:
            return False
        if self._skip_ready is None or not skip.is_cuda:
            return bool(skip)
        # Read once the flag is made, on a stream with nothing queued: not after backward, queued since.
        self._skip_ready.synchronize()
        with torch.cuda.stream(torch.cuda.Stream(skip.device)):
            return bool(skip)

    def counted_skip(self, skip: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor | None:
        """The skip flag the new counts are computed with: the one this kernel already read on the host, as a
        host tensor, where the counts live on the host (offload's state), so they stay there; else ``skip``.

        (Counted with the device flag, a host count would become a device tensor, and the next step's host
        kernel would read its rate and step through a copy that waits for all the GPU work queued before it,
        backward included: the update could not start before backward ends.)"""
        if skip is None or "skipped" not in self.__dict__ or count.device.type != "cpu":
            return skip
        return torch.tensor(self.skipped, device=count.device)

    @functools.cached_property
    def lr(self) -> float:
        return float(self._numbers[0])

    @functools.cached_property
    def step(self) -> int:
        return int(self._numbers[1])

    @functools.cached_property
    def scale(self) -> float:
        divisor = self._numbers[2]
        return 1.0 if divisor is None else float(divisor)

    def __call__(self, p, g, m, v, out_lowp, weight_decay) -> None:
        from zfunc.kernels.cpu_adam import adamw_  # noqa: PLC0415 (numba loads lazily)

        spec = self.spec
        adamw_(p, g, m, v, lr=self.lr, beta1=spec.b1, beta2=spec.b2, eps=spec.eps, weight_decay=weight_decay,
               step=self.step, mode=spec.mode, grad_scale=self.scale, out_lowp=out_lowp, num_threads=self.threads)


def _gpu_run(spec, run, params, decays, p, g, m, v, target, out_dtype, lr, step, divisor, found=None) -> None:
    """One run on the GPU kernel; the new parameters into ``target`` (on another device: through a
    buffer on this one); nothing where ``found`` (a 0-d tensor on the device) is nonzero."""
    from zfunc.kernels.gpu_adam import adam_flat_  # noqa: PLC0415

    out = target if target is not None and target.device == p.device and out_dtype is not None else None
    if target is not None and out is None and out_dtype is not None:
        out = torch.empty(p.numel(), dtype=out_dtype, device=p.device)
        if found is not None:  # a skipped update writes nothing into it: the unchanged parameters then
            out.copy_(p)
    adam_flat_(p, g, m, v, _segments(spec, run, params, decays), lr=lr.to(p.device), step=step.to(p.device),
               beta1=spec.b1, beta2=spec.b2, eps=spec.eps, mode=spec.mode,
               grad_scale=None if divisor is None else divisor.to(p.device), out_lowp=out,
               found_inf=None if found is None else found.to(p.device), backend=device_backend(p.device))
    if target is not None and (out is None or out is not target):
        target.copy_(out if out is not None else p, non_blocking=target.device.type == "cuda")


def _compute_targets(params: dict, grads: dict, dtype: torch.dtype, into: dict | None,
                     skip: torch.Tensor | None = None) -> dict:
    """Where each parameter's new compute copy goes: ``into[k]`` where it fits (dtype, size, contiguous,
    on the state's or the gradient's device), else a new tensor laid out like the params (on the
    gradient's device for state on the host; holding the parameters' values already where the update
    may be skipped, which then writes nothing)."""
    out: dict[str, torch.Tensor] = {}
    fresh: dict[str, torch.Tensor] = {}
    for k, p in params.items():
        t = into.get(k) if into is not None else None
        if t is not None and t.dtype == dtype and t.numel() == p.numel() and t.is_contiguous() and \
                (t.device in (p.device, grads[k].device) or (p.device.type == "cpu" and t.device.type == "cuda")):
            out[k] = t
        else:
            fresh[k] = p
    if fresh:
        made = laid_out_like(fresh, dtype)
        for k, t in made.items():
            g = grads[k]
            out[k] = t.to(g.device) if g.device != t.device else t
            if skip is not None:
                out[k].copy_(params[k])
    return {k: out[k] for k in params}


def _segments(spec: AdamSpec, run: list[str], params: dict, decays: dict):
    """The GPU kernel's weight-decay table for one run (built once per layout, then reused)."""
    from zfunc.kernels.adam_segments import AdamSegments  # noqa: PLC0415

    device = params[run[0]].device
    key = (tuple(run), tuple(params[k].numel() for k in run), str(device))
    table = spec.tables.get(key)
    if table is None:
        runs, start = [], 0
        for k in run:
            runs.append((start, params[k].numel(), decays[k]))
            start += params[k].numel()
        table = spec.tables[key] = AdamSegments.build(runs, device)
    return table
