"""`offload`: optimizer state and its update on the host (ZeRO-Offload).

``offload(step)`` keeps the fp32 master parameters and the optimizer state in
host memory (pinned when a GPU is present). At each update the gradients go
device -> host, the optimizer runs on the host — Adam/AdamW in the fused numba
kernel `zfunc.kernels.cpu_adam.adamw_`, any other optimizer through its
ordinary pytree update on host tensors — and the updated parameters come back
to the device in the compute dtype. The device keeps the compute copy of the
parameters (and gradients until they are moved), so a GPU holds 2Ψ (+2Ψ
gradients unless `shard` partitions them) instead of 16Ψ.

Where the master lives:

- under `mixed_precision`, its fp32 master (in ``extras["mixed_precision"]``)
  is moved to the host; the device keeps the bf16/fp16 copy;
- otherwise, if the parameters are on an accelerator, offload keeps its own
  fp32 host master in ``extras["offload"]``; if they are already on the CPU
  (a CPU-only machine: host and device coincide) the parameters themselves
  are the master and are updated in place.

Composes inside `shard` (``shard(offload(step), stage=...)``): each rank's
shard of the optimizer state lives on its host. Must not wrap `shard`.

Overlap (``overlap=True``; off by default): under `shard`, each unit's
gradients go to the host and through the kernel as soon as their reduction
is issued, while backward goes on, into spare buffers that are taken only if
the step hands exactly those gradients to ``apply_gradients``
(`zfunc.transforms.update_ahead`); results are bit for bit those of the
update after backward.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Literal, NamedTuple

import torch

from zfunc.interpret import Transform, dispatch
from zfunc.optim.fused import FusedAdam
from zfunc.transforms.shard_layout import contiguous_runs, span_of
from zfunc.transforms.update_ahead import Spares, UpdateAhead
from zfunc.tree import tree_map_tensors


class OffloadState(NamedTuple):
    """Offload's own state: the host fp32 master (only when params are not on the CPU)."""

    master: dict[str, torch.Tensor]


class offload(Transform):  # noqa: N801
    """ZeRO-Offload: ``offload(step, optimizer="cpu")``.

    ``optimizer="cpu"``: Adam/AdamW run in the fused numba kernel, other
    optimizers through their pytree update on host tensors; ``"cpu-pytree"``
    forces the pytree path (a reference for tests and for optimizers the
    kernel does not cover). ``threads``: host threads for the update
    (default: see `host_threads`). ``overlap``: start each unit's host update
    during backward (under `shard`; default off, see `update_ahead`).
    """

    name = "offload"
    level = 1

    def __init__(self, step: Callable, optimizer: Literal["cpu", "cpu-pytree"] = "cpu",
                 threads: int | None = None, overlap: bool = False) -> None:
        if optimizer not in ("cpu", "cpu-pytree"):
            raise ValueError(f"offload: optimizer must be 'cpu' or 'cpu-pytree', got {optimizer!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"offload: threads must be a positive int or None, got {threads!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"offload: overlap must be True or False, got {overlap!r}")
        super().__init__(step)
        self.optimizer, self.threads = optimizer, threads
        # Off unless asked for: measured on an H200 box (BENCHMARKS.md), the host
        # update split by unit and written out of place ran ~2x slower than the
        # one in-place pass after backward, more than the overlap won back.
        self.overlap = overlap
        # Across steps: spare host buffers and the worker thread of the update
        # ahead, and whether the last step computed gradients exactly once.
        self._spares = Spares()
        self._executor: ThreadPoolExecutor | None = None
        self._single_gradient_call = False
        # Scratch of one call.
        self._ahead: UpdateAhead | None = None
        self._claimed: dict[str, torch.Tensor] | None = None
        self._gradient_calls = 0
        self._used_ahead = False
        # Scratch of one update (see _apply_on_host); empty between calls.
        self._lowp_targets: dict[str, torch.Tensor] | None = None
        self._lowp_written: dict[int, torch.Tensor] = {}

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"optimizer": self.optimizer} if self.optimizer != "cpu" else {}
        if self.threads is not None:
            out["threads"] = self.threads
        if self.overlap:
            out["overlap"] = self.overlap
        return out

    def host_threads(self) -> int:
        """Threads for the host update: ``threads`` if given; under torchrun this process's share
        of the cores; otherwise ``torch.get_num_threads()``.

        torchrun sets OMP_NUM_THREADS=1 for every process, which would leave
        the host optimizer on one core; the cores this process may use,
        divided among the ranks of this node (LOCAL_WORLD_SIZE), is what
        DeepSpeed's launcher gives its CPU Adam too.
        """
        if self.threads is not None:
            return self.threads
        local_ranks = os.environ.get("LOCAL_WORLD_SIZE")
        if local_ranks is None or "TORCHELASTIC_RUN_ID" not in os.environ:
            return torch.get_num_threads()  # not launched by torchrun: follow torch's own setting
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // max(1, int(local_ranks)))

    # -- layout --------------------------------------------------------------
    def init_state(self, state):
        extras = dict(state.extras)
        opt_state = tree_map_tensors(to_host, state.opt_state)
        if "mixed_precision" in extras:
            extras["mixed_precision"] = tree_map_tensors(to_host, extras["mixed_precision"])
        elif not _on_cpu(state.params):
            extras["offload"] = OffloadState({k: to_host(v.float()) for k, v in state.params.items()})
        return state.replace(opt_state=opt_state, extras=extras)

    def gather_params(self, state, next):
        if "offload" in state.extras:
            return next(state.replace(params=state.extras["offload"].master))
        return next(state)

    # -- the update ahead, during backward -------------------------------------
    def run(self, state, batch):
        self._ahead, self._gradient_calls = self._start_ahead(state), 0
        self._used_ahead = False
        try:
            new_state, metrics = self.step(state, batch)
            return new_state, {**metrics, "offload_ahead": self._used_ahead}
        finally:
            repeated = self._ahead is not None and self._ahead.repeated
            if self._ahead is not None:
                self._ahead.finish()  # nothing keeps running after the step
            self._ahead, self._claimed = None, None
            self._single_gradient_call = self._gradient_calls == 1 and not repeated

    def _start_ahead(self, state) -> UpdateAhead | None:
        """An `UpdateAhead` for this step, when the update can be known before backward ends."""
        if not (self.overlap and self._single_gradient_call and self.optimizer == "cpu"):
            return None
        from zfunc.interpret import transforms_of  # noqa: PLC0415
        from zfunc.transforms.mixed_precision import mixed_precision  # noqa: PLC0415

        if any(isinstance(t, mixed_precision) and t.scaling != "none" for t in transforms_of(self.step)):
            return None  # the update depends on a global overflow check
        master = self._master_of(state)
        if master is None or not FusedAdam.supports(state.tx):
            return None
        fused = FusedAdam.of(state.tx, state.opt_state, master)
        if fused is None or fused.clip is not None or not all(
                t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                for d in (master, fused.mu, fused.nu) for t in d.values()):
            return None
        lowp = self._compute_dtype()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zfunc-offload")
        threads = max(1, self.host_threads() - 1) if torch.cuda.is_available() else self.host_threads()
        return UpdateAhead(fused, state.tx, master, lowp, threads, self._spares, self._executor)

    @staticmethod
    def _master_of(state) -> dict[str, torch.Tensor] | None:
        """The host tensors the optimizer will update (see `init_state`)."""
        if "offload" in state.extras:
            return state.extras["offload"].master
        mp = state.extras.get("mixed_precision")
        # Else the params are their own master (all on the CPU), and under shard
        # the optimizer sees views of them made only at apply_gradients: no guess.
        return mp.master if mp is not None and mp.master else None

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        self._gradient_calls += 1
        if self._ahead is not None:
            if self._gradient_calls > 1:  # accumulating: the update needs the sum of all calls
                self._ahead.finish()
                self._ahead = None
            elif not dispatch("watch_gradients", lambda callback: False, self._ahead.on_grads):
                self._ahead = None  # nothing announces gradients early (no shard)
        out = next(fn, params, args, kwargs, has_aux)
        if self._ahead is not None:
            self._ahead.seal()
        return out

    # -- the update ------------------------------------------------------------
    def apply_gradients(self, next, state, grads):
        previous = torch.get_num_threads()
        torch.set_num_threads(self.host_threads())
        try:
            return self._apply_on_host(next, state, grads)
        finally:
            torch.set_num_threads(previous)

    def _apply_on_host(self, next, state, grads):
        self._claimed = self._ahead.claim(grads) if self._ahead is not None else None
        if self._claimed is not None:
            host_grads = self._claimed  # already on the host (claim waited for the copies), and already used
        else:
            host_grads = copy_grouped(grads, lambda t: t.device.type != "cpu")
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # the non-blocking copies must land first
        own_master = state.extras.get("offload")
        inner = state.replace(params=own_master.master) if own_master is not None else state
        device_params = state.params
        # Scratch of this update only: where the kernel may write the compute
        # copy (the parameters themselves when they live on the host), and the
        # copies it wrote, handed to mixed_precision through ``compute_copy``.
        self._lowp_targets = device_params if _on_cpu(device_params) else None
        try:
            new = next(inner, host_grads)
        finally:
            self._lowp_targets, self._lowp_written = None, {}
        # Back to the device, in the compute dtype, in place.
        write_grouped({k: t for k, t in new.params.items() if t is not device_params[k]}, device_params)
        extras = dict(new.extras)
        if own_master is not None:
            extras["offload"] = OffloadState(new.params)
        return new.replace(params=device_params, extras=extras)

    def update_params(self, next, tx, params, grads, opt_state):
        if self._claimed is not None:
            done = self._ahead.result(tx, params, grads, opt_state, self._claimed)
            self._claimed = None
            if done is not None:
                new_params, new_opt_state, lowp = done
                self._used_ahead = True
                if lowp is not None:
                    self._lowp_written = {id(new_params[k]): out for k, out in lowp.items()}
                return new_params, new_opt_state
        if self.optimizer == "cpu-pytree" or not _kernel_applies(tx, params, grads):
            return next(tx, params, grads, opt_state)
        lowp = self._compute_dtype()
        outs = None
        if lowp is not None and all(p.dtype != lowp for p in params.values()):
            outs = lowp_outputs(params, lowp, self._lowp_targets)
            self._lowp_written = {id(params[k]): out for k, out in outs.items()}
        return kernel_update(tx, params, grads, opt_state, outs)

    def compute_copy(self, next, master, dtype):
        """The compute copy the kernel wrote while updating ``master``, if it did; else cast."""
        from zfunc.transforms.mixed_precision import written_compute_copy  # noqa: PLC0415 (sibling)

        copies = written_compute_copy(self._lowp_written, master, dtype)
        return copies if copies is not None else next(master, dtype)

    def _compute_dtype(self) -> torch.dtype | None:
        from zfunc.transforms.mixed_precision import policy_of  # noqa: PLC0415

        policy = policy_of(self.step)
        return None if policy is None or policy.compute == policy.param else policy.compute


def kernel_update(tx, params: dict, grads: dict, opt_state, out_lowp: dict | None = None):
    """Adam/AdamW through the fused CPU kernel, in place on params and moments.

    Computes what ``tx.update`` + ``apply_updates`` compute (the same math and
    order as torch's fused AdamW). Parameters and moments are updated in
    place and returned; counters and the learning rate are new tensors.
    Gradients may be fp32, bf16 or fp16. ``out_lowp``: per key, a bf16/fp16
    tensor that receives the updated parameters in the same pass (the
    compute copy, rounded to nearest even exactly as ``.to()``).
    """
    fused = FusedAdam.of(tx, opt_state, params)
    divisor = fused.grad_divisor(grads)
    grad_scale = 1.0 if divisor is None else float(divisor)
    adam_over_runs(fused, list(params), params, grads, grad_scale, out_lowp, None, None)
    return params, fused.new_state()


# ---------------------------------------------------------------------------
# One kernel call per run of parameters, not per parameter: every call costs
# ~50 us of Python holding the GIL, which the main thread needs to drive
# backward. Under `shard` a unit's tensors are views of one flat buffer in
# every operand, so a unit with one weight decay is one call. (A run is one
# flat tensor to the kernel: its last ``numel % 8`` elements take torch's
# scalar-tail rounding, as `torch._fused_adamw_` would give for the flat
# buffer, where per parameter each one's tail would; an ulp apart at most.)


def adam_over_runs(fused: FusedAdam, keys: list[str], params: dict, grads: dict, grad_scale: float,
                   lowp: dict | None, into: tuple[dict, dict, dict] | None, threads: int | None) -> None:
    """The fused CPU Adam/AdamW kernel over ``keys``, one call per run (see above).

    ``into``: dicts of (param, exp_avg, exp_avg_sq) outputs, else in place.
    """
    from zfunc.kernels.cpu_adam import adamw_  # noqa: PLC0415 (numba loads lazily)

    operands = [params, grads, fused.mu, fused.nu, *(into or ()), *([lowp] if lowp is not None else [])]
    lr, step = float(fused.lr), int(fused.step)
    for run in contiguous_runs([k for k in keys if params[k].numel()], operands, fused.weight_decay):
        spans = [span_of(d, run) for d in operands]
        p, g, m, v = spans[:4]
        outputs = tuple(spans[4:7]) if into is not None else None
        adamw_(p, g, m, v, lr=lr, beta1=fused.b1, beta2=fused.b2, eps=fused.eps,
               weight_decay=fused.weight_decay[run[0]], step=step, mode=fused.mode, grad_scale=grad_scale,
               out_lowp=spans[-1] if lowp is not None else None, num_threads=threads, into=outputs)


def lowp_outputs(params: dict[str, torch.Tensor], dtype: torch.dtype,
                 targets: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Where the kernel writes the compute copy of each parameter.

    ``targets`` (the compute copy itself, when it lives on the host) where
    they fit; otherwise pinned buffers laid out like ``params`` (one per flat
    buffer), so the copy to the device is one transfer per buffer.
    """
    if targets is not None and all(
            k in targets and targets[k].dtype == dtype and targets[k].is_contiguous()
            and targets[k].numel() == p.numel() for k, p in params.items()):
        return {k: targets[k] for k in params}
    pin = torch.cuda.is_available()
    outs: dict[str, torch.Tensor] = {}
    for keys, start, length in _spans(params):
        if start is None:
            p = params[keys[0]]
            outs[keys[0]] = torch.empty(p.shape, dtype=dtype, pin_memory=pin)
            continue
        outs.update(_host_span(params, keys, start, length, dtype)[1])
    for k, p in params.items():
        if k not in outs:  # empty shards
            outs[k] = torch.empty(p.shape, dtype=dtype)
    return outs


def _kernel_applies(tx, params: dict, grads: dict) -> bool:
    if not FusedAdam.supports(tx):
        return False
    for key, p in params.items():
        g = grads[key]
        if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
            return False
        if g.device.type != "cpu" or g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    return True


def _on_cpu(params: dict) -> bool:
    return all(p.device.type == "cpu" for p in params.values())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (pinned when CUDA is available, for async copies)."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(t)


# ---------------------------------------------------------------------------
# Transfers: one copy per underlying buffer, not one per tensor.
#
# Under `shard` every per-parameter tensor is a view into one flat buffer per
# unit; moving each view separately costs a driver call (and, from pageable
# memory, a synchronous staging copy) per parameter: ~2,000 calls per step on
# GPT-2 medium, most of the offload step in a profile. Views of one buffer
# that cover a gap-free span move as one pinned copy instead.


def _spans(tensors: dict[str, torch.Tensor]):
    """Yield (keys, start, length) of each gap-free span of views (`contiguous_runs`), or
    ``([key], None, None)`` for a tensor that joins no other."""
    for keys in contiguous_runs([k for k, t in tensors.items() if t.numel()], [tensors]):
        if len(keys) > 1:
            yield keys, tensors[keys[0]].storage_offset(), sum(tensors[k].numel() for k in keys)
        else:
            yield keys, None, None


def _host_span(like: dict[str, torch.Tensor], keys: list[str], start: int, length: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A host buffer of ``length`` elements (pinned under CUDA) and, per key, the view of it
    that sits where ``like[key]`` sits in its own buffer (whose span starts at ``start``)."""
    flat = torch.empty(length, dtype=dtype, pin_memory=torch.cuda.is_available())
    views = {}
    for k in keys:
        offset = like[k].storage_offset() - start
        views[k] = flat[offset:offset + like[k].numel()].view(like[k].shape)
    return flat, views


def copy_grouped(tensors: dict[str, torch.Tensor], moves) -> dict[str, torch.Tensor]:
    """Host copies (pinned, non-blocking) of the tensors ``moves`` selects; others as they are."""
    out = {k: t for k, t in tensors.items() if not moves(t)}
    # Empty ones (a rank's empty slice of a parameter) still move: one device per dict.
    out.update({k: torch.empty(t.shape, dtype=t.dtype)
                for k, t in tensors.items() if k not in out and not t.numel()})
    pin = torch.cuda.is_available()
    for keys, start, length in _spans({k: t for k, t in tensors.items() if k not in out}):
        if start is None:
            t = tensors[keys[0]]
            out[keys[0]] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)
            continue
        host, views = _host_span(tensors, keys, start, length, tensors[keys[0]].dtype)
        host.copy_(span_of(tensors, keys), non_blocking=pin)
        out.update(views)
    return out


def write_grouped(fresh: dict[str, torch.Tensor], dest: dict[str, torch.Tensor]) -> None:
    """``dest[k].copy_(fresh[k])`` for every key, batching host-to-device copies per buffer."""
    on_host = {k: dest[k] for k in fresh if dest[k].device.type == "cpu" or fresh[k].device == dest[k].device}
    for k in on_host:
        dest[k].copy_(fresh[k])
    pin = torch.cuda.is_available()
    for keys, start, length in _spans({k: dest[k] for k in fresh if k not in on_host}):
        if start is None:
            dest[keys[0]].copy_(fresh[keys[0]], non_blocking=False)
            continue
        if _same_layout_span(fresh, keys, dest, start):  # already one pinned buffer laid out like dest
            span_of(dest, keys).copy_(span_of(fresh, keys), non_blocking=pin)
            continue
        staging, views = _host_span(dest, keys, start, length, dest[keys[0]].dtype)
        for k in keys:  # host-side copies (and casts) into one pinned buffer
            views[k].copy_(fresh[k])
        span_of(dest, keys).copy_(staging, non_blocking=pin)


def _same_layout_span(fresh: dict, keys: list[str], dest: dict, start: int) -> bool:
    """Whether ``fresh[keys]`` sit in one host buffer exactly as ``dest[keys]`` sit in theirs."""
    first = fresh[keys[0]]
    if first.device.type != "cpu" or not first.is_contiguous():
        return False
    base = first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for k in keys:
        f, d = fresh[k], dest[k]
        if (f.untyped_storage().data_ptr() != storage or f.dtype != d.dtype or not f.is_contiguous()
                or f.storage_offset() - base != d.storage_offset() - start):
            return False
    return True

