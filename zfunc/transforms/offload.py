"""`offload`: optimizer state and its update on the host (ZeRO-Offload).

``offload(step)`` keeps the fp32 master parameters and the optimizer state in
host memory (pinned when a GPU is present). At each update the gradients go
device -> host, the optimizer runs on the host — Adam/AdamW in the fused numba
kernel (`zfunc.optim.fused`, which picks it because the tensors are on the
host), any other optimizer through its ordinary pytree update on host
tensors — and the updated parameters come back to the device in the compute
dtype, written by the kernel in the same pass. The device keeps the compute
copy of the parameters (and gradients until they are moved), so a GPU holds
2Ψ (+2Ψ gradients unless `shard` partitions them) instead of 16Ψ.

Where the master lives:

- under `mixed_precision`, its fp32 master (in ``extras["mixed_precision"]``)
  is moved to the host; the device keeps the bf16/fp16 copy;
- otherwise, if the parameters are on an accelerator, offload keeps its own
  fp32 host master in ``extras["offload"]``; if they are already on the CPU
  (a CPU-only machine: host and device coincide) the parameters themselves
  are the master and are updated in place.

Composes inside `shard` (``shard(offload(step), stage=...)``): each rank's
shard of the optimizer state lives on its host. Must not wrap `shard`.

The host kernel's thread count is passed into the kernel call
(`zfunc.primitives.UpdateRequest.host_threads`); nothing process-wide changes.

What was tried and dropped: updating each unit on the host while backward
still runs (an exact, speculative "update ahead", taken only when the step
handed exactly backward's gradients to the update). On an H200 box it was bit
for bit right and 2.7x slower (653 vs 238 ms per GPT-2-medium step): split
into per-unit calls, written out of place and competing with backward's
threads, the host update ran at ~55 instead of ~140 GB/s. BENCHMARKS.md keeps
the numbers.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Literal, NamedTuple

import torch

from zfunc.compiled import tracing
from zfunc.facts import Facts
from zfunc.interpret import Transform
from zfunc.optim.spans import contiguous_runs, span_of
from zfunc.primitives import Updated
from zfunc.step_context import current
from zfunc.transforms.grad_accumulator import GradAccumulator, keyed_grads, kept_host_buffers, optimizer_devices
from zfunc.tree import tree_map_tensors


class OffloadState(NamedTuple):
    """Offload's own state: the host fp32 master (only when params are not on the CPU)."""

    master: dict[str, torch.Tensor]


OPTIMIZER_PLACES = ("host", "cpu", "cpu-pytree", "nvme")
PARAM_PLACES = ("device", "host")


class offload(Transform):  # noqa: N801
    """ZeRO-Offload / ZeRO-Infinity: the optimizer state (and parameters) off the GPU.

    Args:
      step: the step to transform (inside `shard`, outside the compute transforms).
      optimizer: where the optimizer state (fp32 master, moments) and its update live:
        "host" (or its alias "cpu"): Adam/AdamW in the fused numba kernel, other
        optimizers through their pytree update on host tensors; "nvme": in files
        under ``nvme_dir``, streamed through the host kernel unit by unit;
        "cpu-pytree" forces the host pytree path (a reference for tests).
      threads: host threads for the update (default: see `host_threads`).
      params: stage 3 only: where the parameter shards live between their uses,
        "device" or "host" (pinned host memory, each unit copied to the GPU ahead
        of its use).
      device_fraction: the share of the optimizer state (by elements, whole units)
        kept on the GPU and updated there by the fused GPU kernel (DeepSpeed's
        Twin-Flow ``ratio`` read the other way); under `shard` only.
      nvme_fraction: the share in NVMe files (default: all but the device share
        with ``optimizer="nvme"``, none otherwise); the rest is on the host.
      nvme_dir: the directory for the NVMe tier's files (a local NVMe drive; the
        files are zfunc's own and removed when the process exits).
    """

    name = "offload"
    level = 1

    def __init__(self, step: Callable, optimizer: Literal["host", "cpu", "cpu-pytree", "nvme"] = "host",
                 threads: int | None = None, *, params: Literal["device", "host"] = "device",
                 device_fraction: float = 0.0, nvme_fraction: float | None = None,
                 nvme_dir: str | None = None) -> None:
        if optimizer not in OPTIMIZER_PLACES:
            raise ValueError(f"offload: optimizer must be one of {OPTIMIZER_PLACES}, got {optimizer!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"offload: threads must be a positive int or None, got {threads!r}")
        if params not in PARAM_PLACES:
            raise ValueError(f"offload: params must be one of {PARAM_PLACES}, got {params!r}")
        device_fraction = _fraction("device_fraction", device_fraction)
        if nvme_fraction is None:
            nvme_fraction = 1.0 - device_fraction if optimizer == "nvme" else 0.0
        nvme_fraction = _fraction("nvme_fraction", nvme_fraction)
        if device_fraction + nvme_fraction > 1.0 + 1e-9:
            raise ValueError(f"offload: device_fraction ({device_fraction}) + nvme_fraction ({nvme_fraction}) "
                             "exceed 1")
        if nvme_fraction > 0 and not nvme_dir:
            raise ValueError("offload: the NVMe tier needs nvme_dir=, a directory on a local NVMe drive")
        if nvme_dir is not None and not isinstance(nvme_dir, (str, os.PathLike)):
            raise ValueError(f"offload: nvme_dir must be a path, got {nvme_dir!r}")
        if optimizer == "cpu-pytree" and (device_fraction or nvme_fraction):
            raise ValueError("offload(optimizer='cpu-pytree') keeps the whole optimizer state on the host")
        super().__init__(step)
        self.optimizer = "host" if optimizer == "cpu" else optimizer
        self.threads, self.params = threads, params
        self.device_fraction, self.nvme_fraction = device_fraction, nvme_fraction
        self.nvme_dir = None if nvme_dir is None else os.fspath(nvme_dir)

    # Each rank's own NVMe directory and host threads: the same step whatever they are.
    rank_local_settings = ("nvme_dir", "threads")

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"optimizer": self.optimizer} if self.optimizer != "host" else {}
        if self.threads is not None:
            out["threads"] = self.threads
        if self.params != "device":
            out["params"] = self.params
        if self.device_fraction:
            out["device_fraction"] = self.device_fraction
        if self.nvme_fraction and self.optimizer != "nvme":
            out["nvme_fraction"] = self.nvme_fraction
        if self.nvme_dir is not None:
            out["nvme_dir"] = self.nvme_dir
        return out

    @property
    def split(self) -> tuple[float, float, float]:
        """The (device, host, nvme) shares of the optimizer state."""
        host = max(0.0, 1.0 - self.device_fraction - self.nvme_fraction)
        return (self.device_fraction, host, self.nvme_fraction)

    def declare(self, facts: Facts) -> Facts:
        fused = False if self.optimizer == "cpu-pytree" else (True if facts.fused_update is None else
                                                              facts.fused_update)
        split = self.split
        tier = ("device", "host", "nvme")[max(range(3), key=split.__getitem__)]
        return facts.replace(optimizer_tier=tier, optimizer_split=split, nvme_dir=self.nvme_dir,
                             params_tier=self.params, fused_update=fused)

    def check(self, facts: Facts) -> None:
        if self.params == "host" and facts.stage != 3:
            raise ValueError("offload(params='host') keeps parameter shards on the host and gathers them per "
                             "block: it needs shard(..., stage=3) around it")
        if (self.device_fraction or self.nvme_fraction) and facts.stage == 0:
            raise ValueError("offload(device_fraction=..., nvme_fraction=...) places the optimizer state unit by "
                             "unit: it needs shard(...) around it")

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

    # -- the gradients -----------------------------------------------------------
    def start(self, ctx, state) -> GradAccumulator | None:
        # One micro-batch under shard stages 2/3: each unit's gradient leaves the GPU for its optimizer
        # state's tier as soon as its reduction lands (host memory for host and NVMe units), in its own
        # dtype (nothing is summed: exact), so no full-size gradient waits on the GPU for the host update.
        # `accumulate` inside installs its own accumulator; compiled steps and pipelines reduce otherwise.
        # A GPU gradient goes straight into a page-locked host buffer, on a copy stream (`sums=False`): the update
        # waits for each unit just before it reads it, anything else that reads one before the update waits for
        # it then (`zfunc.tiers.landing`).
        if ctx.facts.stage < 2 or ctx.facts.accumulates or ctx.facts.pp > 1 or tracing():
            return None
        ctx.grad_sink = GradAccumulator(None, lambda: optimizer_devices(state), host_buffers=kept_host_buffers(ctx),
                                        sums=False)
        return ctx.grad_sink

    def run(self, state, batch):
        sink: GradAccumulator | None = self.call_scratch()
        try:
            return self.step(state, batch)
        finally:
            if sink is not None:
                sink.release()

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        sink: GradAccumulator | None = self.call_scratch()
        if sink is None:
            return next(fn, params, args, kwargs, has_aux)
        sink.settle()  # (a second gradient call in one step: the first one's gradients have landed)
        sink.begin()
        value, grads = next(fn, params, args, kwargs, has_aux)
        keyed, rebuild = keyed_grads(grads)
        sink.add_tree(keyed)  # (what `shard` did not feed unit by unit: taken as it is)
        out = rebuild(sink.mean(1, keyed))
        sink.guard_reads()  # until the update takes them, a read of a gradient still landing waits for it
        return value, out

    # -- the update ------------------------------------------------------------
    def apply_gradients(self, next, state, grads, request):
        ctx = current()
        if ctx is not None:
            ctx.state_consumed = True
        fused = ctx is not None and ctx.facts.fused_update and state.tx.fused is not None and not tracing()
        sink: GradAccumulator | None = self.call_scratch()
        if sink is not None:  # gradients still landing from the GPU: the fused update waits for each as it reads it
            sink.unguard()
            if sink.landing is not None and sink.landing.pending:
                if fused:
                    request = request._replace(grads_landing=sink.landing)
                else:
                    sink.landing.wait_all()
        if tracing():  # torch.compile: plain device-to-host copies the graph orders (`zfunc.compiled`)
            grads = {k: g.to("cpu") for k, g in grads.items()}
        elif not fused:  # the pytree update runs on host tensors: move the gradients there first
            grads = copy_grouped(grads, lambda t: t.device.type != "cpu")
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # the non-blocking copies must land first
        # (The fused update streams device gradients through the host kernel itself, chunk by chunk,
        # and writes the new compute parameters straight back: `zfunc.optim.streamed`.)
        own_master = state.extras.get("offload")
        device_params = state.params
        if not tracing():  # (the compiled update is Inductor's code, with its own threads)
            request = request._replace(host_threads=self.host_threads())
        if own_master is not None:  # no mixed_precision: the device params are fp32, written back from the master
            inner = state.replace(params=own_master.master)
            request = request._replace(compute_dtype=next_dtype(device_params), compute_into=dict(device_params))
        else:
            inner = state
        new = next(inner, grads, request)
        written = new.compute_copy if own_master is not None and new.compute_copy is not None else new.state.params
        # Back to the device, in the compute dtype, in place (what the kernel did not write there itself).
        fresh = {k: t for k, t in written.items() if t is not device_params[k]}
        if tracing():
            for k, t in fresh.items():
                device_params[k].copy_(t)
        else:
            write_grouped(fresh, device_params)
        extras = dict(new.state.extras)
        if own_master is not None:
            extras["offload"] = OffloadState(new.state.params)
        return Updated(new.state.replace(params=device_params, extras=extras), None)


def _fraction(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"offload: {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def next_dtype(params: dict) -> torch.dtype:
    """The dtype of the device parameters (what the update's compute copy must be)."""
    return next(iter(params.values())).dtype if params else torch.float32


def _on_cpu(params: dict) -> bool:
    return all(p.device.type == "cpu" for p in params.values())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: plain pageable memory, exactly its size. Only the chunk buffers that the
    copy engines read or write are pinned (`zfunc.optim.streamed`); pinning the whole state would round
    every allocation up to a power of two in torch's pinned-memory cache, and page-lock 12 bytes per
    parameter for nothing."""
    if t.device.type == "cpu":
        return t
    return t.to("cpu")


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

