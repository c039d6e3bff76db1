"""The fused update of state on one GPU as the replay of a CUDA graph, captured once per state layout.

Where all of the optimizer state is on one GPU, `zfunc.optim.fused.fused_update`
runs the update as one Triton launch over every run of a `DevicePlan`, plus the
small operations around it: the rate ``schedule(count)``, the step ``count + 1``,
the clip divisor, the new counts and rate (kept where the step is skipped). Each
is a launch the host must issue. Opted into with `cuda_graphed` (``tx.fused.graph``),
they are captured once in a CUDA graph and, at every later step, replayed by one
call: the host issues one or two copies and the replay.

What the graph reads, and where it lives (a replay reads the same addresses as the
capture did):

* the state's buffers (params, moments, compute copy) and the kernel's tables: the
  plan's, which it checks every step (a state laid out otherwise gets a new plan,
  and so a new graph: a graph is only replayed with the plan it was captured with);
* the gradients: through the plan's table of their addresses on the device
  (`zfunc.kernels.adam_segments.AdamRuns.set_grads`, updated before the replay
  where they moved), so new gradient buffers need no new capture (their dtype and
  16-byte alignment are part of the key below: the kernel is compiled for them);
* the scalars, in buffers the graph owns: the adam count, the rate's count and the
  rate (read and advanced in place by the replay), the skip flag and the clip norm
  (copied in before each replay: the skip flag is made anew by each step; the norm
  is not captured, since under `shard` it is a collective that zfunc's communicator
  orders on the host).

The kernel needs no variant for this: `zfunc.kernels.gpu_adam.adam_runs_` reads
the rate, the step, the clip divisor and the skip flag from device memory
(pointers, not launch arguments), and only the betas and eps, fixed per
optimizer, as numbers. A replay launches the kernel the eager route launches,
with the same values: the same bits.

So the optimizer state a replayed step returns holds the graph's count and rate
buffers, and the next step, given that state, copies nothing in: like the
parameters and moments, **the counts and the rate are updated in place**; a
value of them to keep past the next step must be cloned. Given a state whose
counts are other tensors (restored, or from the eager route), they are copied
into the buffers first.

The key of a graph: its plan (layout, addresses, weight decays, dtypes), whether
there is a skip flag and a clip norm, the dtypes, shapes and device of the
scalars, the gradients' alignment and the kernel's launch configuration
(`zfunc.kernels.gpu_adam.TRITON_CONFIG`). The hyperparameters (betas, eps, clip,
schedule) are the spec's, which holds its graph in ``spec.tables``. A step whose
key differs from the graph's drops the graph (its memory pool is freed) and runs
the eager route; a second step in a row with one key warms it up (the eager body
on a side stream: this step's update) and captures it; later steps replay it.
A capture that fails warns and leaves that plan on the eager route.

A learning-rate schedule of zfunc's (`zfunc.optim.schedules`, tensor operations
only), or a user's marked `zfunc.optim.schedules.tensor_ops_only`, is captured.
Any other user's Python callable may read the count on the host
(``float(count)``), which no capture can hold, so it is evaluated on the host,
on a CPU int64 0-d count, and its rate copied into the graph's rate input before
the replay: from a pinned buffer, without waiting. The count it is given is
the graph's count as the last replay left it, copied back to a pinned buffer
after that replay, behind a CUDA event. Ordering: the host waits on that event
before reading the count (it waits for the previous step's update, not for this
step's forward and backward queued since), and only then writes the pinned rate
buffer, whose last copy to the device was queued before that update, so has run.
(A callable of tensor operations gives the same numbers on the host as on the
GPU, up to the last bit of a transcendental function where CPU and CUDA differ.)

The host waits for the GPU only at a capture (`torch.cuda.graph` synchronizes
the device first) and, with a user's schedule, where the count must be read from
a state the graph did not make (its first step, a restored state).

Capture rules kept: every buffer the graph reads is allocated before the capture
(the temporaries of the captured body come from the graph's private pool and are
never used outside it); nothing in the body reads the host or synchronizes; the
gradients' address table is never written during the capture (`set_grads`
refuses); the warm-up runs on the stream the capture uses, as torch documents.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from zfunc.kernels.adam_segments import all_16_byte_aligned
from zfunc.kernels.gpu_adam import TRITON_CONFIG
from zfunc.optim.base import GradientTransformation
from zfunc.optim.fused_plan import DevicePlan
from zfunc.optim.schedules import user_callable

_GRAPH = "update graph"  # spec.tables' entry: the _Slot of this optimizer


def cuda_graphed(tx: GradientTransformation) -> GradientTransformation:
    """``tx``, whose fused update (where all of its state is on one GPU, in one launch) runs as the replay of a
    CUDA graph captured once per state layout (module docstring: what it reads, when it is captured again, and
    that the counts and the rate are then updated in place). The same numbers as ``tx``'s eager fused update,
    bit for bit. Elsewhere (state on the host or the general path, a layout that changes every step, no CUDA)
    ``tx`` runs as it would.

    Opt-in, not automatic, for two reasons: it changes one observable thing (the counts and the rate
    become buffers updated in place, like the parameters), and what it saves is host time only (about a
    dozen small launches and the Triton launch per step, each some microseconds of Python and driver
    work), which pays where the update phase is launch-bound: its host time at or above its GPU time
    (``benchmarks/update_host_time.py --device cuda`` measures both, with and without). Its GPU work is the
    eager route's (the same kernels, replayed) plus a copy of the skip flag, and of the norm where it clips.

    Usage::

        tx = zf.optim.cuda_graphed(zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(3e-4)))
        step = shard(mixed_precision(train_step, "bf16"), stage=1)
        state = step.init(zf.TrainState.create(params, tx))

    Raises:
      ValueError: ``tx`` has no fused form (only adam/adamw, alone or after ``clip_by_global_norm``, have one).
    """
    if not isinstance(tx, GradientTransformation) or tx.fused is None:
        raise ValueError("cuda_graphed takes an optimizer with a fused form: zf.optim.adam or zf.optim.adamw, "
                         "alone or chained after zf.optim.clip_by_global_norm; others have no kernel to capture")
    return tx._replace(fused=dataclasses.replace(tx.fused, graph=True, tables={}))


# ---------------------------------------------------------------------------
# How a body is captured: CUDA's, or a test's stand-in on the CPU.


class CudaCapture:
    """Warm-up and capture on one side stream of ``device`` (torch's recipe), replay on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def warm_up(self, body) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            body()
        current.wait_stream(self.stream)

    def capture(self, body):
        """The replay of ``body`` captured (not run). ``thread_local``: other threads (a data loader pinning
        memory) may go on with what a capture forbids in this one."""
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(graph, stream=self.stream,
                                                                  capture_error_mode="thread_local"):
                body()
        finally:  # (where capture_end raises, torch.cuda.graph leaves its stream current: not ours to keep)
            if torch.cuda.current_stream(self.device) != before:
                torch.cuda.set_stream(before)
        return graph.replay  # (holds the graph, and so its memory pool, for as long as the replay is kept)

    @staticmethod
    def host_buffer(like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    @staticmethod
    def event():
        return torch.cuda.Event()


def capture_for(device: torch.device):
    """How the update on ``device`` is captured (`CudaCapture`), or None where it cannot be (not CUDA). The one
    seam of the route: the CPU tests patch it with a stand-in that runs the captured body at each replay."""
    return CudaCapture(device) if device.type == "cuda" else None


# ---------------------------------------------------------------------------
# The route.


@dataclasses.dataclass
class _Slot:
    """What an optimizer remembers across steps: its graph, the (plan, key) of the last step that ran eagerly
    (captured when the next step has the same), a plan whose capture failed (eager while it lives), and how it
    captures (one side stream for all of its graphs)."""

    graph: UpdateGraph | None = None
    seen: tuple | None = None
    refused: DevicePlan | None = None
    capture: Any = None


def graphed_update(spec, plan: DevicePlan, grad_ptrs: list[int], opt_state, skip: torch.Tensor | None,
                   norm: torch.Tensor | None):
    """The optimizer state after this step's update ran as the plan's graph (module docstring), or None where
    the graph does not take this step: the caller then runs the plan eagerly (nothing was changed).

    Args:
      spec: the optimizer's `AdamSpec` (``spec.graph`` set).
      plan, grad_ptrs: the step's `DevicePlan`, checked for these tensors, and its gradients' addresses.
      opt_state: the optimizer state (its moments are the plan's).
      skip: the step's skip flag (a 0-d bool on the device) or None.
      norm: the gradients' global norm where the spec clips, else None.
    """
    slot = spec.tables.get(_GRAPH)
    if slot is None:
        slot = spec.tables[_GRAPH] = _Slot()
    if slot.refused is plan:
        return None
    capture = slot.capture
    if capture is None or capture.device != plan.device:
        capture = slot.capture = capture_for(plan.device)
    adam, rate = spec.adam_state(opt_state), spec.lr_state(opt_state)
    inputs = (adam.count, rate.count, rate.learning_rate, skip, norm)
    key = None if capture is None else _key(plan, grad_ptrs, *inputs)
    graph = slot.graph
    if graph is not None and (graph.plan is not plan or graph.key != key):
        slot.graph = graph = None  # another layout or key: this graph is never replayed again
    if key is None:
        return None
    plan.table.set_grads(grad_ptrs)  # (outside any capture: the kernel reads them from the table)
    if graph is None:
        if slot.seen != (plan, key):  # a layout seen once: eager (it may not last)
            slot.seen = (plan, key)
            return None
        slot.seen = None
        graph = UpdateGraph(spec, plan, key, capture, *inputs)
        graph.load(*inputs)
        try:
            graph.warm_up()  # this step's update
        except _NotCapturable:
            slot.refused = plan
            return None  # (refused before anything was written)
        try:
            graph.capture()
        except Exception as error:  # noqa: BLE001 (any failure of the capture: the eager route is still right)
            slot.refused = plan
            warnings.warn(f"zfunc: the optimizer update could not be captured in a CUDA graph ({error!r}); this "
                          "state layout runs without one", RuntimeWarning, stacklevel=2)
        else:
            slot.graph = graph
        return graph.state(spec, opt_state)
    graph.load(*inputs)
    graph.replay()
    return graph.state(spec, opt_state)


def _key(plan: DevicePlan, grad_ptrs, count, rate_count, rate, skip, norm) -> tuple | None:
    """What a graph is compiled and captured for besides its plan (module docstring), or None where the scalars
    are not where a graph can hold them (not on the plan's device, not 1-element, counts of two dtypes...)."""
    device = plan.device
    for t in (count, rate_count, rate, skip, norm):
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != device or t.numel() != 1):
            return None
    if count.dtype != rate_count.dtype or count.dtype.is_floating_point or count.dtype == torch.bool \
            or not rate.dtype.is_floating_point or (skip is not None and skip.dtype != torch.bool) \
            or (norm is not None and not norm.dtype.is_floating_point):
        return None
    return (count.dtype, count.shape, rate_count.shape, rate.dtype, rate.shape,
            None if skip is None else skip.shape, None if norm is None else (norm.dtype, norm.shape),
            all_16_byte_aligned(grad_ptrs),
            int(TRITON_CONFIG["adam_block"]), int(TRITON_CONFIG["adam_warps"]))


class _NotCapturable(Exception):
    """The body cannot be captured as it is (found before it wrote anything)."""


class UpdateGraph:
    """One captured update of one plan (module docstring): the scalar buffers it reads and writes, its replay.

    Attributes:
      plan, key: what it was captured for.
      count, rate_count, rate: the optimizer's adam count, rate count and rate, advanced in place by each replay
        (the state a replay returns holds these very tensors).
      skip, norm, lr: inputs copied in before each replay (None where the key has none): the step's skip flag,
        the clip norm, the rate a host schedule gave.
    """

    def __init__(self, spec, plan: DevicePlan, key: tuple, capture, count, rate_count, rate, skip, norm) -> None:
        self.spec, self.plan, self.key, self._capture = spec, plan, key, capture
        # (allocated here, outside any capture: ordinary memory, at the addresses every replay reads)
        self.count, self.rate_count, self.rate = (torch.empty_like(t) for t in (count, rate_count, rate))
        self.skip = None if skip is None else torch.empty_like(skip)
        self.norm = None if norm is None else torch.empty_like(norm)
        self.host_rates = user_callable(spec.schedule)
        self.lr = torch.empty_like(rate) if self.host_rates else None
        if self.host_rates:
            self._count_host = capture.host_buffer(rate_count)
            self._lr_host = capture.host_buffer(rate)
            self._count_copied = capture.event()
        self._count_current = False  # whether _count_host holds rate_count as the last replay left it
        self._replay = None

    def load(self, count, rate_count, rate, skip, norm) -> None:
        """This step's inputs into the graph's buffers (copied only where the state holds other tensors)."""
        for buffer, given in ((self.count, count), (self.rate_count, rate_count), (self.rate, rate)):
            if given is not buffer:
                buffer.copy_(given)
                self._count_current = False
        if skip is not None:
            self.skip.copy_(skip)
        if norm is not None:
            self.norm.copy_(norm)
        if self.host_rates:
            self._rate_from_host()

    def _rate_from_host(self) -> None:
        """The user's schedule at the current count, on the host, into ``self.lr`` (module docstring: ordering)."""
        if not self._count_current:  # a count given by the caller: read once (waits for the work queued before)
            self._count_host.copy_(self.rate_count, non_blocking=True)
            self._count_copied.record()
        self._count_copied.synchronize()  # (the previous update, and with it the last copy out of _lr_host)
        lr = self.spec.schedule(self._count_host.clone())
        if not isinstance(lr, torch.Tensor) or lr.dtype != self.rate.dtype or lr.shape != self.rate.shape:
            raise TypeError(f"the learning-rate schedule gave {lr!r}; under cuda_graphed it must give a rate of "
                            f"the state's dtype {self.rate.dtype} and shape {tuple(self.rate.shape)}")
        self._lr_host.copy_(lr)
        self.lr.copy_(self._lr_host, non_blocking=True)

    def _body(self) -> None:
        """The update, from the buffers: what the eager route computes (`zfunc.optim.fused.fused_update` and
        `AdamSpec.advanced`), the counts and rate written in place."""
        spec = self.spec
        lr = self.lr if self.host_rates else spec.schedule(self.rate_count)
        if lr.dtype != self.rate.dtype or lr.shape != self.rate.shape:
            raise _NotCapturable  # (the eager route returns the schedule's rate as it is: keep to it)
        step = self.count + 1
        divisor = None if self.norm is None else 1.0 / (spec.clip / (self.norm + 1e-6)).clamp(max=1.0)
        self.plan.launch(spec, None, lr, step, divisor, self.skip)
        if self.skip is None:
            self.count.add_(1)
            self.rate_count.add_(1)
            self.rate.copy_(lr)
        else:
            one = (~self.skip).to(self.count.dtype)
            new_rate = torch.where(self.skip, self.rate, lr)
            self.count.add_(one)
            self.rate_count.add_(one)
            self.rate.copy_(new_rate)

    def _after(self) -> None:
        if self.host_rates:  # the new count back to the host, for the next step's schedule
            self._count_host.copy_(self.rate_count, non_blocking=True)
            self._count_copied.record()
            self._count_current = True

    def warm_up(self) -> None:
        """The body run once, eagerly (this step's update), on the capture's stream."""
        self._capture.warm_up(self._body)
        self._after()

    def capture(self) -> None:
        self._replay = self._capture.capture(self._body)

    def replay(self) -> None:
        self._replay()
        self._after()

    def state(self, spec, opt_state) -> Any:
        """The optimizer state after the update: its moments, the graph's counts and rate."""
        adam = spec.adam_state(opt_state)
        return spec.with_counts(opt_state, adam.mu, adam.nu, self.count, self.rate_count, self.rate)
