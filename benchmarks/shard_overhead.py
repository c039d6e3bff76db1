"""Python overhead of `shard` per step, on the CPU: many tiny blocks, so the host work dominates.

    python benchmarks/shard_overhead.py [--layers 24] [--steps 10]

A GPT-2-shaped model (transformers' GPT2LMHeadModel, width 64, 24 blocks,
batch 2 x 16 tokens) is far too small for its arithmetic to matter: the step
time is what zfunc and PyTorch spend in Python and dispatch per block, which
on a GPU is the time the device waits between kernels. Reports the median
step of the plain step and of `shard` stages 1/2/3 at world size 1, and their
ratio to the plain step (``--policy bf16``: all of them under
`mixed_precision`, as in benchmarks/gpt_zero.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

import zfunc as zf
from zfunc.transforms import mixed_precision, shard


def build(layers: int, stage: int | None, policy: str | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=32, vocab_size=128,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    apply_fn, params = zf.functional(GPT2LMHeadModel(cfg))

    def loss_fn(p, tokens):
        logits = apply_fn(p, input_ids=tokens, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    def train_step(state, tokens):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, tokens)
        return state.apply_gradients(grads), {"loss": loss}

    step = train_step if policy is None else mixed_precision(train_step, policy)
    step = step if stage is None else shard(step, stage=stage)
    return step, zf.init(step, zf.TrainState.create(params, zf.optim.adamw(1e-3)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--policy", default=None, help="wrap the step in mixed_precision(policy), e.g. bf16")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, stage in tqdm([("plain step", None), ("shard stage 1", 1), ("shard stage 2", 2),
                             ("shard stage 3", 3)], desc="configs"):
        step, state = build(args.layers, stage, args.policy)
        times = []
        for i in range(3 + args.steps):
            start = time.perf_counter()
            state, _ = step(state, tokens)
            if i >= 3:
                times.append(time.perf_counter() - start)
        rows.append((name, 1e3 * statistics.median(times)))
    base = rows[0][1]
    print(f"# shard overhead, {args.layers} blocks, torch {torch.__version__}, {args.threads} thread(s)"
          + (f", mixed_precision {args.policy}" if args.policy else ""))
    print("| config | median ms/step | vs plain step |\n|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
