"""Host time of the optimizer phase of shard's stacks, through the GPU update path.

    python benchmarks/update_host_time.py [--stacks floor,s1,s1g,s2,s2g,s3,s3g] [--steps 30] [--profile s3]
    python benchmarks/update_host_time.py --device cuda        # on a GPU: real launches, GPU time too
    python benchmarks/update_host_time.py --device cuda --medium   # GPT-2 medium's real widths (355M)
    python benchmarks/update_host_time.py --stacks floor,s1,s2,s3 --fixed-grads --evict --steps 200

The model is `host_time.py`'s (GPT-2 medium's 24 blocks and 292 parameters at width 64), in
``shard(mixed_precision(step, "bf16"), stage=N)`` at world 1; the phase timed is the update: from
``value_and_grad``'s return to the end of the step (`mixed_precision`'s and `shard`'s
``apply_gradients``, the fused update, stage 1/2's gather of the new parameters). ``floor`` is torch's
``AdamW(fused=True)`` (on the fp32 master, then the bf16 copy); ``sNg`` is stage N with the optimizer in
`zf.optim.cuda_graphed`: the fused update captured once in a CUDA graph and replayed (the warm-up steps
capture it; the timed steps are replays). Columns: the phase's host and GPU time, the host time inside
`zfunc.optim.fused.fused_update` alone (the part the graph replaces: the plan's per-key check stays),
Triton launches per step (CPU), graph replays per timed step (1.00 for every ``sNg``, or the run fails),
and moves of the gradients' addresses to the device per timed step (`AdamRuns.set_grads` finding new
addresses: 0.00 where the gradients land where they did the step before, as the caching allocator
usually places them; each move also re-checks them against the state's buffers).

On the CPU (the default) the update takes the path it takes on a GPU (`zfunc.optim.fused.on_host`
patched), with every Triton launch replaced by a stub that only counts it (and a graph's replay by one that
counts one launch): what is timed is the Python and dispatcher work around the launches, which on
a GPU must hide under the kernels. The time
is this thread's CPU time (other processes taking the cores do not count), the least over
``--steps`` steps. Triton's own launch cost (~10-20 us per launch on an H100/H200 host) comes on top,
once per launch counted.

``--fixed-grads``: the model's forward and backward left out: the gradients (one per key, of its size and
the compute dtype, as the stacks at one rank hand them to the update) are made once and handed to every
step, so the phase is timed with no compute between steps (far less noise from other processes than the
full step, and the gradients at the same addresses each step, as the caching allocator gives them on a
GPU); with ``--evict``, a 64 MB buffer is written before each step, so that the state's tensors are cold in
the caches when the phase reads them, as on a GPU host after backward.

With ``--device cuda`` nothing is patched: the phase's host time (perf_counter, no sync inside the
phase) and its GPU time (CUDA events), medians over the steps; then the steps again, each phase begun on
an empty queue (a synchronization before it, outside its clock): *host ms, empty queue* is the host work
of issuing the phase alone. In the first figure a launch may also wait for the device: its launch queue is
bounded (about a thousand launches), and the backward before the phase runs far ahead of its kernels. ``--medium``: GPT-2 medium at its real
widths (355M parameters, vocabulary 50257; still 2 x 32 tokens), so that the update's GPU time is
the real one (gpt_zero's optimizer phase) and the host time can be set against it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's zfunc
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_zero import floor_update, lm_loss
from gpt_zero import make_model as make_gpt2
from host_time import BATCH, SEQ, VOCAB, make_model

import zfunc as zf
from zfunc import state as zf_state
from zfunc.kernels import adam_segments
from zfunc.optim import update_graph
from zfunc.transforms import mixed_precision, shard

STACKS = ("floor", "s1", "s1g", "s2", "s2g", "s3", "s3g")


class Launches:
    """Stand-ins for the Triton kernels: ``kernel[grid](*args, **kwargs)`` counts and returns."""

    def __init__(self) -> None:
        self.count = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            self.count += 1
        return launch


def stub_device_path(launches: Launches) -> None:
    """Route the CPU state through the GPU path, every Triton launch a counted no-op (module doc)."""
    os.environ["TRITON_INTERPRET"] = "1"  # (adam_flat_'s backend="triton" accepts CPU tensors then)
    from zfunc.kernels import triton_kernels
    from zfunc.optim import fused

    fused.on_host = lambda t: False
    fused.device_backend = lambda device: "triton"
    triton_kernels.kernels = lambda interpret: types.SimpleNamespace(
        **{name: launches for name in ("adam_kernel", "adam_multi_kernel")})
    update_graph.capture_for = lambda device: StubCapture(device, launches)


class StubCapture:
    """`zfunc.optim.update_graph.CudaCapture` on the CPU: the warm-up runs the body (its launches stubbed),
    a replay counts one launch and runs nothing."""

    def __init__(self, device, launches: Launches) -> None:
        self.device, self.launches = device, launches

    def warm_up(self, body) -> None:
        body()

    def capture(self, body):
        return lambda: self.launches[None]()

    @staticmethod
    def host_buffer(like):
        return torch.empty(like.shape, dtype=like.dtype)

    @staticmethod
    def event():
        return types.SimpleNamespace(record=lambda: None, synchronize=lambda: None)


# Graph replays, counted over the timed steps (every one of a ``sNg`` stack's must be one).
REPLAYS = [0]
# Host seconds inside `zfunc.optim.fused.fused_update` (the part of the phase the graph replaces), per call.
FUSED_HOST: list[float] = []
_fused_update = zf_state.fused_update


def _timed_fused_update(*args, **kwargs):
    clock = time.perf_counter if torch.cuda.is_available() else time.thread_time
    t = clock()
    try:
        return _fused_update(*args, **kwargs)
    finally:
        FUSED_HOST.append(clock() - t)


zf_state.fused_update = _timed_fused_update
_replay = update_graph.UpdateGraph.replay


def _counted_replay(self) -> None:
    REPLAYS[0] += 1
    _replay(self)


update_graph.UpdateGraph.replay = _counted_replay
# Gradient addresses moved to the device (`AdamRuns.set_grads` given addresses other than the last ones).
MOVES = [0]
_set_grads = adam_segments.AdamRuns.set_grads


def _counted_set_grads(self, ptrs, *args) -> None:
    MOVES[0] += ptrs != self._grad_ptrs
    _set_grads(self, ptrs, *args)


adam_segments.AdamRuns.set_grads = _counted_set_grads


class Phase:
    """Marks the update phase: host seconds (this thread's CPU time on the CPU, perf_counter on a GPU)
    and, on a GPU, CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host: list[float] = []
        self.events: list[tuple] = []
        self._t = 0.0
        self._e = None
        self.profiler: cProfile.Profile | None = None  # enabled over the phase only
        self.drained = False  # on a GPU: the phase begun on an empty queue (its host work alone, module doc)

    def begin(self) -> None:
        if self.cuda and self.drained:
            torch.cuda.synchronize()
        if self.cuda:
            self._e = torch.cuda.Event(enable_timing=True)
            self._e.record()
        self._t = time.perf_counter() if self.cuda else time.thread_time()
        if self.profiler is not None:
            self.profiler.enable()

    def end(self) -> None:
        if self.profiler is not None:
            self.profiler.disable()
        self.host.append((time.perf_counter() if self.cuda else time.thread_time()) - self._t)
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append((self._e, e))


def build(name: str, device: torch.device, phase: Phase, medium: bool = False, fixed_grads: bool = False):
    model = (make_gpt2(types.SimpleNamespace(model="medium", seq=SEQ)) if medium else make_model(24)).to(device)
    if name == "floor":
        master = [p.detach().clone() for p in model.parameters()]
        model.to(torch.bfloat16)
        params = list(model.parameters())
        opt = torch.optim.AdamW(master, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
        made = [p.detach().clone() for p in params] if fixed_grads else None  # (bf16, the parameters' shapes)

        def one(tokens):
            if made is None:
                lm_loss(model(input_ids=tokens, use_cache=False).logits, tokens).backward()
            else:
                for p, g in zip(params, made):
                    p.grad = g
            phase.begin()
            floor_update(master, params, opt)
            phase.end()

        return one
    apply_fn, params = zf.functional(model)

    def loss_fn(p, tokens):
        return lm_loss(apply_fn(p, input_ids=tokens, use_cache=False).logits, tokens)

    made = {k: (1e-3 * torch.randn(v.numel(), generator=torch.Generator().manual_seed(i))).to(device, torch.bfloat16)
            for i, (k, v) in enumerate(params.items())} if fixed_grads else None

    def train_step(state, tokens):
        if made is not None:
            phase.begin()
            return state.apply_gradients(dict(made)), {}
        loss, grads = zf.value_and_grad(loss_fn)(state.params, tokens)
        phase.begin()
        return state.apply_gradients(grads), {"loss": loss}

    step = shard(mixed_precision(train_step, "bf16"), stage=int(name[1]))
    tx = zf.optim.adamw(1e-4, weight_decay=0.1)
    box = [step.init(zf.TrainState.create(params, zf.optim.cuda_graphed(tx) if name.endswith("g") else tx))]

    def one(tokens):
        box[0], _ = step(box[0], tokens)
        phase.end()

    return one


def measure(name: str, device: torch.device, steps: int, launches: Launches, profile: bool = False,
            medium: bool = False, fixed_grads: bool = False, evict: bool = False) -> dict:
    phase = Phase(device)
    one = build(name, device, phase, medium, fixed_grads)
    if evict:  # (written before each step: the caches hold it, not the state, when the phase begins)
        buffer, step = torch.ones(16 * 2**20), one

        def one(tokens):
            buffer.add_(1.0)
            step(tokens)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    for _ in range(3):
        one(tokens)
    phase.host.clear()
    phase.events.clear()
    before, replayed, moved = launches.count, REPLAYS[0], MOVES[0]
    FUSED_HOST.clear()
    pr = phase.profiler = cProfile.Profile() if profile else None
    phase.drained = profile  # (a profile of host work, not of launches waiting for the device)
    for _ in range(steps):
        one(tokens)
    out = {"launches": (launches.count - before) / steps, "replays": (REPLAYS[0] - replayed) / steps,
           "moves": (MOVES[0] - moved) / steps,
           "fused_ms": 1e3 * statistics.median(FUSED_HOST) if FUSED_HOST else None}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["host_ms"] = 1e3 * statistics.median(phase.host)
        out["gpu_ms"] = statistics.median(a.elapsed_time(b) for a, b in phase.events)
        phase.host.clear()
        phase.drained = True
        for _ in range(steps):
            one(tokens)
        out["host_drained_ms"] = 1e3 * statistics.median(phase.host)
    else:
        out["host_ms"] = 1e3 * min(phase.host)
    if pr is not None:
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
        out["profile"] = s.getvalue()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated, of {', '.join(STACKS)}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", default=None, help="a stack to cProfile over the timed steps")
    p.add_argument("--medium", action="store_true", help="GPT-2 medium at its real widths (355M parameters)")
    p.add_argument("--fixed-grads", action="store_true",
                   help="no forward/backward: the same gradients handed to every step (module docstring)")
    p.add_argument("--evict", action="store_true", help="with --fixed-grads: flush the caches before each step")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    launches = Launches()
    if device.type == "cpu":
        torch.set_num_threads(1)
        stub_device_path(launches)
    names = args.stacks.split(",")
    if args.profile:
        print(measure(args.profile, device, args.steps, launches, profile=True, medium=args.medium,
                      fixed_grads=args.fixed_grads, evict=args.evict)["profile"])
        return
    where = "CPU, GPU path with stubbed launches" if device.type == "cpu" else torch.cuda.get_device_name(device)
    model = "GPT-2 medium (355M)" if args.medium else "GPT-2 medium's shape at width 64"
    print(f"# update phase, {model}, {where}, torch {torch.__version__}, least (CPU) / median (GPU) of "
          f"{args.steps} steps")
    print("| stack | host ms | host ms, empty queue | GPU ms | fused_update host ms | Triton launches | graph replays "
          "| address moves |\n|---|---|---|---|---|---|---|---|")
    failed = []
    for name in names:
        r = measure(name, device, args.steps, launches, medium=args.medium, fixed_grads=args.fixed_grads,
                    evict=args.evict)
        gpu = f"{r['gpu_ms']:.2f}" if "gpu_ms" in r else "-"
        count = f"{r['launches']:.0f}" if device.type == "cpu" and name != "floor" else "-"
        fused_ms = "-" if r["fused_ms"] is None else f"{r['fused_ms']:.3f}"
        moves = "-" if name == "floor" else f"{r['moves']:.2f}"
        drained = f"{r['host_drained_ms']:.2f}" if "host_drained_ms" in r else "-"
        print(f"| {name} | {r['host_ms']:.2f} | {drained} | {gpu} | {fused_ms} | {count} | {r['replays']:.2f} "
              f"| {moves} |", flush=True)
        if name.endswith("g") and r["replays"] != 1:  # (the graph route must have replayed at every timed step)
            failed.append(f"{name}: the update was replayed at {r['replays']:.2f} of the timed steps, not at every one")
    if failed:
        raise SystemExit("FAIL " + "; ".join(failed))


if __name__ == "__main__":
    main()
