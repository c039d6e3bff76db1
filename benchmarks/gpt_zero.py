"""One run, every contender: zfunc ZeRO stages vs DDP, FSDP2 and DeepSpeed on a GPT-2-shaped LM.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 benchmarks/gpt_zero.py --model medium --json out.json

Model: transformers' GPT2LMHeadModel from a config (random init, dropout 0),
random tokens, sequence 1024, bf16 compute, AdamW (lr 1e-4, wd 0.1). Each
contender starts from the same weights and sees the same batches, so the loss
after the timed steps must agree. Reports median step time and spread,
tokens/s (all ranks), peak allocated/reserved memory per GPU, and per-phase
times (forward, backward, optimizer+gather) on the GPU and on the host
(`PhaseClock`; zfunc's phases come from a small observing transform), which
say whether a phase waits for the device or for Python. Each timed step is
synchronized before and after; then as many steps run back to back (``b2b``,
one synchronization at the end, as a training loop runs them: a step's host
work overlaps the previous step's GPU work). Batches come from page-locked
memory without a wait (a DataLoader's ``pin_memory=True``). After the warm-up
steps every contender's long-lived objects are frozen out of the garbage
collector (``gc.freeze``), so a rare full collection does not land in one
contender's timed steps and not another's. ``--nproc-per-node 1``
adds the single-GPU floor (bf16 params, fp32 master, torch fused AdamW).

``--compile`` adds compiled contenders: ``zfunc-sK-compiled`` (the same zfunc step
under ``torch.compile(step, fullgraph=True)``: forward, backward, collectives and
the pure AdamW update in one graph) and ``floor-compiled`` (the floor's model under
``torch.compile``, torch fused AdamW), each with ``compile_s``: the wall time of
the first step (the compile) less a timed step's median. ``zfunc-s3[-checkpoint]-blocks``
is regional compile (`zfunc.transforms.compile_blocks`: each block's forward compiled, once
for all identical blocks; the step eager). ``zfunc-s3[-checkpoint]-regather`` is
`zfunc.compile_step` (the whole-step compile with Inductor's regather pass: each block's
gathered weights gathered again for its backward; at one rank the same graph as
``-compiled``); not in ``--compile``'s list. ``--contenders`` may name
them directly; ``--smoke`` runs the tiny model for 2 steps on whatever is there
(the CPU with gloo when no GPU), to check the script end to end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

SHAPES = {  # name: (n_embd, n_layer, n_head, micro_batch)
    "tiny": (256, 4, 4, 4),
    "medium": (1024, 24, 16, 8),
    "1.3b": (2048, 24, 16, 4),
}
COMPILED = ["floor-compiled", "zfunc-s1-compiled", "zfunc-s2-compiled", "zfunc-s3-compiled",
            "zfunc-s3-checkpoint-compiled", "zfunc-s3-blocks", "zfunc-s3-checkpoint-blocks"]
ALL = ["floor", "zfunc-s1", "zfunc-s2", "zfunc-s3", "zfunc-s3-recompute", "zfunc-s3-checkpoint", "zfunc-s2-offload",
       "zfunc-s3-offload", "ddp", "fsdp2", "ds-z1", "ds-z2", "ds-z3", "ds-z2-offload", "ds-z3-offload"]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def make_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    n_embd, n_layer, n_head, _ = SHAPES[args.model]
    cfg = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=args.seq, vocab_size=50257,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def batch(args, i, device):
    """Step ``i``'s tokens on ``device``, copied from page-locked memory without waiting (as a DataLoader with
    ``pin_memory=True`` hands them): a pageable copy would make the host wait for the GPU every step."""
    g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    tokens = torch.randint(0, 50257, (args.micro_batch, args.seq), generator=g)
    if device.type == "cuda":
        return tokens.pin_memory().to(device, non_blocking=True)
    return tokens.to(device)


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


# --------------------------------------------------------------------------- contenders


def run_zfunc(args, stage, use_offload, device, reshard="release", use_checkpoint=False, compiled=False,
              regional=False, regather=False):
    import zfunc as zf
    from zfunc.interpret import Transform
    from zfunc.transforms import checkpoint, mixed_precision, offload, shard

    class phases(Transform):  # noqa: N801 - observes the primitives with a PhaseClock (its configuration)
        name, level = "phases", 9

        def __init__(self, step, clock):
            super().__init__(step)
            self.clock = clock

        def run(self, state, batch_):
            self.clock.start()
            out = self.step(state, batch_)
            self.clock.mark()
            return out

        def apply(self, next, call):
            out = next(call)
            self.clock.mark()  # end of the model's forward
            return out

        def apply_gradients(self, next, state, grads, request):
            self.clock.mark()  # end of backward (and reductions)
            return next(state, grads, request)

    model = make_model(args).to(device)
    apply_fn, params = zf.functional(model)

    def loss_fn(p, tokens):
        return lm_loss(apply_fn(p, input_ids=tokens, use_cache=False).logits, tokens)

    def train_step(state, tokens):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, tokens)
        return state.apply_gradients(grads), {"loss": loss}

    step = mixed_precision(train_step, "bf16")
    if regional:  # each block's forward compiled (once for all 24), the step eager
        from zfunc.transforms import compile_blocks  # (here: an A/B baseline without it runs the rest)

        torch._dynamo.reset()
        step = compile_blocks(step)
    if use_checkpoint:
        step = checkpoint(step)
    if use_offload:  # (--offload-threads: the host update's threads, default torch's: an A/B knob)
        step = offload(step, threads=args.offload_threads)
    step = shard(step, stage=stage, reshard=reshard)
    # The plan's predicted GPU peak, reported beside the measured one (allocated, above what was held before).
    planned = zf.plan(step, loss_fn, torch.empty(args.micro_batch, args.seq, dtype=torch.long, device=device), params,
                      world_size=dist.get_world_size(), baseline=0)
    # The phase observer marks CUDA events from Python, which a compiled graph cannot; a compiled step
    # is timed whole.
    step = step if compiled else phases(step, PhaseClock())
    state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-4, weight_decay=0.1)))
    del params
    apply_fn.release_module_params()
    if compiled:
        torch._dynamo.reset()  # each compiled contender compiles from scratch, as it would alone
    run = zf.compile_step(step) if regather else torch.compile(step, fullgraph=True) if compiled else step

    def one(i):
        nonlocal state
        state, metrics = run(state, batch(args, i, device))
        return metrics["loss"]

    result = time_steps(args, one, None if compiled else step.clock)
    result["planned_gpu_gib"] = planned.tiers["gpu"].peak / 2**30
    profile_steps(args, one)
    return result


def run_ddp(args, device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(args).to(device), device_ids=[device.index])
    return time_eager(args, model, device, autocast=True)


def run_fsdp2(args, device):
    """FSDP2 as torchtitan configures it: bf16 params, fp32 reductions, every block resharded after
    its forward except the last (its backward comes right after), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model(args).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.transformer.h)
    for i, block in enumerate(blocks):
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mp_policy=policy)
    return time_eager(args, model, device, autocast=False)


def time_eager(args, model, device, autocast: bool):
    """An eager torch training loop (fused AdamW) over ``model``, timed like every contender."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    clock = PhaseClock()

    def one(i):
        tokens = batch(args, i, device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(input_ids=tokens, use_cache=False).logits, tokens)
        clock.mark()
        loss.backward()
        clock.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    result = time_steps(args, one, clock)
    profile_steps(args, one)
    return result


def floor_update(master: list, params: list, opt) -> None:
    """The floor's update: the bf16 gradients into the fp32 master's, one AdamW step, the master copied back."""
    for m, p in zip(master, params):
        m.grad = p.grad.float()
        p.grad = None
    opt.step()
    with torch.no_grad():
        torch._foreach_copy_(params, master)


def run_floor(args, device, compiled=False):
    """One GPU, no communication: bf16 params, fp32 master, torch fused AdamW (``compiled``: the
    model's forward and backward under torch.compile)."""
    model = make_model(args).to(device)
    master = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = torch.optim.AdamW(master, lr=1e-4, weight_decay=0.1, fused=True)
    clock = PhaseClock()
    forward = torch.compile(model) if compiled else model

    def one(i):
        tokens = batch(args, i, device)
        loss = lm_loss(forward(input_ids=tokens, use_cache=False).logits, tokens)
        clock.mark()
        loss.backward()
        clock.mark()
        floor_update(master, params, opt)
        return loss.detach()

    result = time_steps(args, one, clock)
    profile_steps(args, one)
    return result


def run_deepspeed(args, stage, use_offload, device):
    import deepspeed

    model = make_model(args)
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if use_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    # DeepSpeed's own default optimizer: FusedAdam on the GPU, DeepSpeedCPUAdam with offload.
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    clock = PhaseClock()

    def one(i):
        tokens = batch(args, i, device)
        loss = lm_loss(engine(input_ids=tokens, use_cache=False).logits, tokens)
        clock.mark()
        engine.backward(loss)
        clock.mark()
        engine.step()
        return loss.detach()

    result = time_steps(args, one, clock)
    profile_steps(args, one)
    return result


# --------------------------------------------------------------------------- timing


class PhaseClock:
    """Forward, backward and optimizer time of each step, on the GPU and on the host.

    ``mark()`` at each phase boundary records a CUDA event and the host
    clock. GPU time between two events is how long the device took for the
    phase; host time is how long Python took to issue it. A phase whose GPU
    time is barely above its host time is launch-bound: the device waited for
    Python, and only less host work per step makes it faster. With
    ``--host-probe``, the same steps run once more ``drained`` (below), which
    tells a phase's host work from its launches' waits for a full queue.
    """

    NAMES = ("forward", "backward", "optimizer+gather")

    def __init__(self) -> None:
        self.marks: list[tuple[torch.cuda.Event | None, float, float]] = []  # (event, phase ended, next began)
        self.gpu_ms: list[list[float]] = []
        self.host_ms: list[list[float]] = []
        # ``drained``: each phase begins with the device's queue empty (a synchronization at each mark, outside
        # the host clock), so its host time is the work of issuing it alone. Pipelined (the timed steps), a
        # launch may wait: the device's launch queue is bounded (about a thousand launches), and where the
        # phases before ran tens of ms ahead of their kernels it is full as the next phase begins, so each of
        # that phase's launches waits for an earlier kernel to finish: the device is the bound, not host work.
        self.drained = False
        self.host_drained_ms: list[list[float]] = []

    def mark(self) -> None:
        ended = time.perf_counter()
        if self.drained and torch.cuda.is_available():
            torch.cuda.synchronize()  # (after the phase's host clock stopped: the wait is no phase's)
        event = torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else None
        if event is not None:
            event.record()
        self.marks.append((event, ended, time.perf_counter()))

    def start(self) -> None:
        self.marks = []
        self.mark()

    def finish(self) -> None:
        """After the step synchronized: keep its phases (a step with other marks is dropped)."""
        if len(self.marks) == 1 + len(self.NAMES):
            pairs = list(zip(self.marks, self.marks[1:]))
            host = [1e3 * (ended - began) for (_, _, began), (_, ended, _) in pairs]
            if self.drained:
                self.host_drained_ms.append(host)
            else:
                self.gpu_ms.append([a.elapsed_time(b) if a is not None else 0.0 for (a, _, _), (b, _, _) in pairs])
                self.host_ms.append(host)
        self.marks = []

    def summary(self, skip: int) -> dict:
        gpu, host = self.gpu_ms[skip:], self.host_ms[skip:]
        if not gpu:
            return {}
        median = lambda rows, j: statistics.median(r[j] for r in rows)  # noqa: E731
        return {"phases_ms": {n: median(gpu, j) for j, n in enumerate(self.NAMES)},
                "host_ms": {n: median(host, j) for j, n in enumerate(self.NAMES)},
                **({"host_drained_ms": {n: median(self.host_drained_ms, j) for j, n in enumerate(self.NAMES)}}
                   if self.host_drained_ms else {})}


class HostProbe:
    """``--host-probe``: where a step's host time goes, without a profiler (whose own cost would hide it).

    Over the timed steps: the host clock at the start of each transformer block's forward (a global
    forward pre-hook; the gaps between them are each block's host time, and the time before the first
    block and after the last show the step's own work), the caching allocator's device mallocs, frees
    and retries (``cudaMalloc``/``cudaFree`` wait for the device), and the garbage collections. Before
    the steps: how fast this process runs plain Python and plain tensor calls (``speed``), so a slow
    process and a slow step can be told apart.
    """

    def __init__(self) -> None:
        self.block_starts: list[float] = []
        self.steps: list[list[float]] = []
        self.collections = 0
        self.handle = None

    @staticmethod
    def speed() -> dict:
        start = time.perf_counter()
        total = 0
        for i in range(200_000):  # plain Python
            total += i & 7
        python_ms = 1e3 * (time.perf_counter() - start)
        x = torch.zeros(4, 4, device="cuda" if torch.cuda.is_available() else "cpu")
        start = time.perf_counter()
        for _ in range(20_000):  # the dispatcher, no kernel
            x.view(16).view(4, 4)
        view_us = 1e6 * (time.perf_counter() - start) / 40_000
        start = time.perf_counter()
        for _ in range(2_000):  # a kernel launch each
            x.add_(1)
        launch_us = 1e6 * (time.perf_counter() - start) / 2_000
        sync()
        return {"python_ms": python_ms, "view_us": view_us, "add_launch_us": launch_us}

    def _pre_hook(self, module, args) -> None:
        if type(module).__name__.endswith("Block"):
            self.block_starts.append(time.perf_counter())

    def begin(self) -> None:
        self.alloc_before = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        gc.callbacks.append(self._gc)

    def _gc(self, phase, info) -> None:
        if phase == "start":
            self.collections += 1

    def step_started(self) -> None:
        self.block_starts = []

    def step_ended(self, forward_start: float, forward_end: float | None) -> None:
        if self.block_starts and forward_end is not None:
            self.steps.append([forward_start, *self.block_starts, forward_end])

    def end(self) -> dict:
        self.handle.remove()
        gc.callbacks.remove(self._gc)
        after = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        alloc = {k: after.get(k, 0) - self.alloc_before.get(k, 0)
                 for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}
        if not self.steps:
            return {"allocator": alloc, "gc_collections": self.collections}
        med = statistics.median
        before = med(s[1] - s[0] for s in self.steps)
        after_blocks = med(s[-1] - s[-2] for s in self.steps)
        gaps = [b - a for s in self.steps for a, b in zip(s[1:-2], s[2:-1])]
        return {"before_blocks_ms": 1e3 * before, "block_ms_median": 1e3 * med(gaps),
                "block_ms_max": 1e3 * max(gaps), "block_ms_min": 1e3 * min(gaps),
                "after_blocks_ms": 1e3 * after_blocks, "allocator": alloc, "gc_collections": self.collections}


def time_steps(args, one, clock: PhaseClock | None = None):
    # Peak memory is reported above what was allocated when the contender started (0 when the
    # previous contenders freed everything), so one contender's leftovers never count for the next.
    baseline = args.allocated_before
    times, loss = [], None
    probe = HostProbe() if args.host_probe else None
    for i in range(args.warmup + args.steps):
        sync()
        if probe is not None and i == args.warmup:
            speed = probe.speed()
            probe.begin()
        if clock is not None:
            clock.start()
        if probe is not None:
            probe.step_started()
        start = time.perf_counter()
        loss = one(i)
        if clock is not None and len(clock.marks) == len(clock.NAMES):
            clock.mark()  # the end of an eager step (zfunc's observer marks it itself)
        sync()
        times.append(time.perf_counter() - start)
        if probe is not None and i >= args.warmup and clock is not None and len(clock.marks) > 1:
            probe.step_ended(clock.marks[0][2], clock.marks[1][1])  # (the forward: step start to loss)
        if clock is not None:
            clock.finish()
        if i == args.warmup - 1:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            # Every contender alike: what lives through the run (model, state, optimizer) is moved out of the
            # garbage collector's sight, so a full collection (~250 ms over a live training process, about once
            # every 60 steps) scans only what the steps themselves allocate, not the whole process.
            gc.collect()
            gc.freeze()
    # Back to back: the same number of steps with no synchronization between them, as a training loop runs
    # them: a step's host work overlaps the GPU work of the step before, so where a phase's host time is
    # below its GPU time the step takes its GPU time. (The timed steps above synchronize before and after
    # each step, so their host and GPU time never overlap across steps.)
    host_probe = {**probe.end(), **speed} if probe is not None else None
    peak_alloc, peak_reserved = max_allocated(), (torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0)
    sync()
    start = time.perf_counter()
    for i in range(args.warmup + args.steps, args.warmup + 2 * args.steps):
        loss = one(i)
    sync()
    back_to_back = (time.perf_counter() - start) / args.steps
    if clock is not None:
        clock.marks = []
        if args.host_probe:  # the same steps again, each phase begun on an empty queue (PhaseClock.drained)
            clock.drained = True
            for i in range(args.warmup + 2 * args.steps, args.warmup + 3 * args.steps):
                sync()
                clock.start()
                loss = one(i)
                if len(clock.marks) == len(clock.NAMES):
                    clock.mark()
                sync()
                clock.finish()
            clock.drained = False
    gc.unfreeze()
    timed = times[args.warmup:]
    loss = loss.float()
    dist.all_reduce(loss)
    world = dist.get_world_size()
    median = statistics.median(timed)
    compile_s = max(0.0, times[0] - median)  # the first step's extra time: compiling, for compiled ones
    return {"median_ms": 1e3 * median, "back_to_back_ms": 1e3 * back_to_back, "compile_s": compile_s, "min_ms": 1e3 * min(timed), "max_ms": 1e3 * max(timed),
            "tokens_per_s": world * args.micro_batch * args.seq / median,
            "peak_alloc_gib": (peak_alloc - baseline) / 2**30,  # (of the synchronized steps, as before)
            "peak_reserved_gib": peak_reserved / 2**30,
            "allocated_before_gib": baseline / 2**30,
            "loss": float(loss) / world,
            **(clock.summary(args.warmup) if clock is not None else {}),
            **({"host_probe": host_probe} if host_probe is not None else {})}


def max_allocated() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def profile_steps(args, one) -> None:
    """``--profile``: torch.profiler over 3 more steps; ``--cprofile``: Python's profiler over them.

    Every rank runs the steps (collectives must match); rank 0 prints.
    """
    if not (args.profile or args.cprofile):
        return
    steps = range(args.warmup + args.steps, args.warmup + args.steps + 3)
    if dist.get_rank() != 0:
        for i in steps:
            one(i)
        torch.cuda.synchronize()
        return
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for i in steps:
            one(i)
        torch.cuda.synchronize()
        profiler.disable()
        stats = pstats.Stats(profiler, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumtime").print_stats("zfunc", 30)
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in steps:
            one(i)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60),
          flush=True)
    # Where the host time goes, by operator and CUDA runtime call (self time: what each costs by itself).
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60),
          flush=True)
    if os.environ.get("GPT_ZERO_TRACE_DIR"):  # a Chrome trace per contender, for the gaps between kernels
        prof.export_chrome_trace(os.path.join(os.environ["GPT_ZERO_TRACE_DIR"], f"{args.contender_name}.json"))


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(SHAPES), default="medium")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--contenders", default="all", help="comma list from: " + ",".join(ALL))
    p.add_argument("--json")
    p.add_argument("--offload-threads", type=int, default=None,
                   help="threads of offload's host update (default: torch.get_num_threads())")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over 3 extra steps (rank 0 prints the kernels by GPU time)")
    p.add_argument("--cprofile", action="store_true", help="cProfile over 3 extra steps: where the host time goes")
    p.add_argument("--host-probe", action="store_true",
                   help="per contender: each block's host time in forward, allocator and gc events over the "
                        "timed steps, and this process's Python and dispatcher speed (see HostProbe); then the "
                        "steps again with each phase begun on an empty queue: its host work alone "
                        "(PhaseClock.drained)")
    p.add_argument("--compile", action="store_true",
                   help="add the compiled contenders: " + ",".join(COMPILED) + " (see the module docstring)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 steps: check the script end to end")
    args = p.parse_args()
    if args.smoke:
        args.model, args.seq, args.steps, args.warmup = "tiny", 64, 2, 1
    args.micro_batch = args.micro_batch or SHAPES[args.model][3]
    if os.environ.get("GPT_ZERO_DEBUG"):
        import logging

        logging.basicConfig(level=logging.DEBUG if int(os.environ.get("LOCAL_RANK", 0)) == 0 else logging.WARNING)
        logging.getLogger("zfunc").setLevel(logging.DEBUG)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:  # --smoke on a machine without a GPU: gloo, CPU tensors, no CUDA timing
        device = torch.device("cpu")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    world = dist.get_world_size()
    names = ALL if args.contenders == "all" else args.contenders.split(",")
    if world == 1 and args.contenders == "all":
        names = ["floor", "zfunc-s3", "zfunc-s3-offload"]
    if args.compile:
        names += [n for n in COMPILED if n not in names]
    import transformers

    log(f"# gpt_zero {args.model} mb={args.micro_batch} seq={args.seq} world={world} "
        f"{device_name()} torch {torch.__version__} transformers {transformers.__version__} "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
    results = {}
    for name in names:
        args.contender_name = name
        args.allocated_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        try:
            if name in ("floor", "floor-compiled"):
                r = run_floor(args, device, compiled=name.endswith("compiled"))
            elif name == "ddp":
                r = run_ddp(args, device)
            elif name == "fsdp2":
                r = run_fsdp2(args, device)
            elif name.startswith("zfunc-s"):
                r = run_zfunc(args, int(name[7]), "offload" in name, device,
                              reshard="recompute" if name.endswith("recompute") else "release",
                              use_checkpoint="-checkpoint" in name,
                              compiled=name.endswith(("compiled", "-regather")),
                              regional=name.endswith("-blocks"), regather=name.endswith("-regather"))
            elif name.startswith("ds-z"):
                r = run_deepspeed(args, int(name[4]), name.endswith("offload"), device)
            else:
                raise ValueError(f"unknown contender {name}")
            results[name] = r
            ph, hs = r.get("phases_ms"), r.get("host_ms")
            log(f"{name:18s} {r['median_ms']:8.1f} ms [{r['min_ms']:.1f}-{r['max_ms']:.1f}] "
                + (f"b2b {r['back_to_back_ms']:.1f} ms " if "back_to_back_ms" in r else "")
                + f"{r['tokens_per_s'] / 1e3:7.1f}k tok/s  alloc {r['peak_alloc_gib']:5.1f} GiB  "
                f"reserved {r['peak_reserved_gib']:5.1f} GiB  loss {r['loss']:.4f}"
                + (f"  compile {r['compile_s']:.1f} s" if name.endswith(("compiled", "-blocks", "-regather")) else "")
                + (f"  (+{r['allocated_before_gib']:.1f} GiB held before)" if r["allocated_before_gib"] > 0.05 else "")
                + (f"  planned {r['planned_gpu_gib']:.1f} GiB" if "planned_gpu_gib" in r else "")
                + (f"  fwd {ph['forward']:.1f}/{hs['forward']:.1f} bwd {ph['backward']:.1f}/{hs['backward']:.1f} "
                   f"opt {ph['optimizer+gather']:.1f}/{hs['optimizer+gather']:.1f} (GPU/host ms)" if ph else "")
                + ("  host on an empty queue: " + "/".join(f"{v:.1f}" for v in r["host_drained_ms"].values())
                   if "host_drained_ms" in r else ""))
            if "host_probe" in r:
                hp = r["host_probe"]
                log(f"{'':18s} probe: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in hp.items()))
        except Exception as err:  # keep going: one broken contender must not lose the table
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            log(f"{name:18s} FAILED {type(err).__name__}: {str(err)[:300]}")
            if os.environ.get("GPT_ZERO_TRACEBACK"):
                traceback.print_exc()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        dist.barrier()
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world": world, "device": device_name(),
                       "torch": torch.__version__, "results": results}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
