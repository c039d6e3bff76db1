"""Host (Python and dispatcher) time per block of a training step, on the CPU.

    python benchmarks/host_time.py [--stacks floor,s3,s3-checkpoint] [--steps 20] [--profile s3] [--count [--world 2]]

A GPT-2-medium-shaped model (transformers' GPT2LMHeadModel: 24 blocks, each with
GPT-2's twelve parameters) at a tiny width (64, 2 heads, 2 x 32 tokens), so its
arithmetic costs next to nothing and a step's time on the CPU is what PyTorch
and zfunc spend issuing it: on a GPU, the host time that must hide under the
kernels (benchmarks/gpt_zero.py measures both there).

Each stack is built at two depths (``--layers`` and half of it) and timed per
phase (forward: until the loss function returns; backward: until
``value_and_grad`` returns; update: the rest of the step). The cost of one block
is the difference between the two depths divided by the blocks between them,
so the per-step work outside the blocks (the update of the root unit, the
step's own bookkeeping) cancels out; the totals at full depth are reported too.

Stacks: ``floor`` (the plain model in bf16 with an fp32 master and torch's
AdamW, as gpt_zero's floor), ``s1``, ``s2``, ``s3`` (``shard(mixed_precision(
step, "bf16"), stage=N)``), ``s3-checkpoint`` (``shard(checkpoint(
mixed_precision(step, "bf16")), stage=3)``). ``--profile NAME`` prints
cProfile's top functions and the Python calls per block of that stack; ``--count``
counts the calls per block and phase instead of timing (the same on every run: a
measure that other processes on the machine do not disturb).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's zfunc
# One thread for numba's CPU Adam (the update of these stacks on the CPU): its idle OpenMP workers spin for a
# while after each kernel and took the core the next forward ran on (a bf16 addmm 20x slower, at random).
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

from gpt_zero import floor_update, lm_loss

import zfunc as zf
from zfunc.transforms import checkpoint, mixed_precision, shard

WIDTH, HEADS, VOCAB, SEQ, BATCH = 64, 2, 128, 32, 2
STACKS = ("floor", "s1", "s2", "s3", "s3-checkpoint")


def make_model(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = GPT2Config(n_embd=WIDTH, n_layer=layers, n_head=HEADS, n_positions=SEQ, vocab_size=VOCAB,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


class Clock:
    """Marks within one step: the phases' durations are the gaps between marks."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def mark(self) -> None:
        # The CPU time of this thread, not the wall clock: other processes taking the cores do not count.
        # (CPU autograd runs backward on the calling thread, so backward is in it too.)
        self.marks.append(time.thread_time())


def build_floor(layers: int, clock: Clock):
    model = make_model(layers)
    master = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = torch.optim.AdamW(master, lr=1e-4, weight_decay=0.1)

    def one(tokens):
        clock.mark()
        loss = lm_loss(model(input_ids=tokens, use_cache=False).logits, tokens)
        clock.mark()
        loss.backward()
        clock.mark()
        floor_update(master, params, opt)
        clock.mark()

    return one


def build_zfunc(name: str, layers: int, clock: Clock):
    apply_fn, params = zf.functional(make_model(layers))

    def loss_fn(p, tokens):
        loss = lm_loss(apply_fn(p, input_ids=tokens, use_cache=False).logits, tokens)
        clock.mark()
        return loss

    def train_step(state, tokens):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, tokens)
        clock.mark()
        return state.apply_gradients(grads), {"loss": loss}

    inner = mixed_precision(train_step, "bf16")
    if name.endswith("checkpoint"):
        inner = checkpoint(inner)
    step = shard(inner, stage=int(name[1]))
    box = [step.init(zf.TrainState.create(params, zf.optim.adamw(1e-4, weight_decay=0.1)))]

    def one(tokens):
        clock.mark()
        box[0], _ = step(box[0], tokens)
        clock.mark()

    return one


def time_phases(name: str, layers: int, steps: int, warmup: int = 3) -> list[float]:
    """The least ms of [forward, backward, update, step] over ``steps`` steps (each phase its own least: the
    host work is the same every step; what varies is other processes taking the caches)."""
    clock = Clock()
    one = build_floor(layers, clock) if name == "floor" else build_zfunc(name, layers, clock)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    rows = []
    for i in range(warmup + steps):
        clock.marks.clear()
        one(tokens)
        m = clock.marks
        if i >= warmup:
            rows.append([m[1] - m[0], m[2] - m[1], m[3] - m[2], m[3] - m[0]])
    return [1e3 * min(col) for col in zip(*rows)]


def count_calls(name: str, layers: int) -> list[list[int]]:
    """Python calls and calls of built-in functions (tensor methods, torch ops called from Python) in one
    step, per phase: ``[[python, builtin] for forward, backward, update]``. Unlike time, the same on every
    run, whatever else the machine does."""
    clock = Clock()
    one = build_floor(layers, clock) if name == "floor" else build_zfunc(name, layers, clock)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(4):  # (past the first forwards, which zfunc watches more closely: zfunc.data_access)
        one(tokens)
    counts = [[0, 0] for _ in range(4)]
    phase = [0]
    mark = clock.mark

    def marked() -> None:
        phase[0] += 1
        mark()

    def tally(frame, event, arg) -> None:
        if event == "call":
            counts[phase[0]][0] += 1
        elif event == "c_call":
            counts[phase[0]][1] += 1

    clock.mark, phase[0] = marked, -1
    sys.setprofile(tally)
    try:
        one(tokens)
    finally:
        sys.setprofile(None)
        clock.mark = mark
    return counts[:3]


def count_on_ranks(name: str, layers: int, world: int) -> list[list[int]]:
    """`count_calls` on rank 0 of ``world`` forked ranks (gloo; the floor and ``world`` 1 in this process).

    At one rank stages 2 and 3 run the blocks on the shards themselves (nothing to gather or reduce); at
    two, the gather, release and per-unit gradient machinery runs as on more GPUs: its host work is what
    this counts."""
    if world == 1 or name == "floor":
        return count_calls(name, layers)
    from zfunc.testing import run_distributed

    return run_distributed(count_calls, world, name, layers, timeout=600)[0]


def profile(name: str, layers: int, steps: int) -> None:
    """cProfile's view of ``steps`` steps: the top functions, and Python calls per block and step."""
    clock = Clock()
    one = build_floor(layers, clock) if name == "floor" else build_zfunc(name, layers, clock)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        one(tokens)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        one(tokens)
    pr.disable()
    out = io.StringIO()
    stats = pstats.Stats(pr, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    print(out.getvalue())
    calls = sum(v[1] for v in stats.stats.values())  # (primitive calls)
    print(f"{name}: {calls / steps:.0f} Python calls per step, {calls / steps / layers:.0f} per block")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stacks", default="floor,s3,s3-checkpoint", help=f"comma-separated, of {', '.join(STACKS)}")
    p.add_argument("--profile", default=None, help="a stack to profile instead of timing")
    p.add_argument("--count", action="store_true", help="count calls per block instead of timing")
    p.add_argument("--world", type=int, default=1,
                   help="with --count: ranks (forked, gloo) each stack runs on; rank 0's calls are counted")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.profile:
        profile(args.profile, args.layers, args.steps)
        return
    names = args.stacks.split(",")
    unknown = [n for n in names if n not in STACKS]
    if unknown:
        p.error(f"unknown stacks {unknown}; choose from {', '.join(STACKS)}")
    half = args.layers // 2
    if args.count:
        print(f"# calls per block ({args.layers} vs {half} blocks): Python functions / built-ins (tensor methods, "
              "torch functions), per phase")
        print("| stack | forward | backward | update |\n|---|---|---|---|")
        for name in names:
            full, short = count_on_ranks(name, args.layers, args.world), count_on_ranks(name, half, args.world)
            per = [[(a - b) / (args.layers - half) for a, b in zip(f, h)] for f, h in zip(full, short)]
            print(f"| {name} | " + " | ".join(f"{py:.0f} / {c:.0f}" for py, c in per) + " |", flush=True)
        return
    rows = []
    for name in names:
        full = time_phases(name, args.layers, args.steps)
        print(f"[{time.strftime('%H:%M:%S')}] {name}, {args.layers} blocks: "
              + ", ".join(f"{x:.1f}" for x in full) + " ms (fwd, bwd, update, step)", file=sys.stderr, flush=True)
        short = time_phases(name, half, args.steps)
        print(f"[{time.strftime('%H:%M:%S')}] {name}, {half} blocks: "
              + ", ".join(f"{x:.1f}" for x in short) + " ms", file=sys.stderr, flush=True)
        per_block = [(a - b) / (args.layers - half) for a, b in zip(full, short)]
        rows.append((name, full, per_block))
    print(f"# host time per block (CPU, torch {torch.__version__}, this thread's CPU time, width {WIDTH}, "
          f"{args.layers} vs {half} blocks, least of {args.steps} steps)")
    print("| stack | ms/step | fwd / bwd / update ms per step | ms per block | fwd / bwd / update ms per block |")
    print("|---|---|---|---|---|")
    base = rows[0][2][3] if rows[0][0] == "floor" else None
    for name, full, per in rows:
        ratio = f" ({per[3] / base:.2f}x)" if base else ""
        print(f"| {name} | {full[3]:.1f} | {full[0]:.1f} / {full[1]:.1f} / {full[2]:.1f} | {per[3]:.3f}{ratio} | "
              f"{per[0]:.3f} / {per[1]:.3f} / {per[2]:.3f} |")


if __name__ == "__main__":
    main()
