"""BERT masked-language-model pre-training, configured by a DeepSpeed config (ZeRO-1 + CPU offload + fp16).

The model is transformers' ``BertForMaskedLM`` built from a small config; the
data a generated corpus with BERT's masking (`mlm_data`); the training setup
the classic DeepSpeed one, read from ``examples/configs/bert_mlm_zero1_offload_fp16.json``
by `zfunc.deepspeed.from_config`, which prints what each key became::

    python examples/bert_mlm.py                                   # ~1 min on 2 CPU cores
    python examples/bert_mlm.py --config my_ds_config.json --steps 1000
    torchrun --nproc-per-node 8 examples/bert_mlm.py --hidden 768 --layers 12 --heads 12 \\
        --seq-len 128 --micro-batch-size 32 --steps 10000                   # BERT-base on 8 GPUs

The config's ``"auto"`` values (batch sizes, learning rate, warmup, total
steps) come from the flags, as transformers' Trainer fills them from its
arguments; any other value is the config's own.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # imported as part of the ``examples`` package (tests) ...
    from .common import distributed
    from .mlm_data import load_mlm_dataset, mask_tokens, mlm_batches
except ImportError:  # ... or run as a script
    from common import distributed
    from mlm_data import load_mlm_dataset, mask_tokens, mlm_batches

try:
    import zfunc as zf
except ImportError:  # running from a checkout without installing zfunc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import zfunc as zf

CONFIG = Path(__file__).resolve().parent / "configs" / "bert_mlm_zero1_offload_fp16.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG), help="DeepSpeed config (default: %(default)s)")
    g = p.add_argument_group("training (fill the config's \"auto\" values)")
    g.add_argument("--steps", type=int, default=150, help="optimizer updates (default: %(default)s)")
    g.add_argument("--micro-batch-size", type=int, default=32, help="sequences per rank per micro-batch "
                   "(default: %(default)s)")
    g.add_argument("--accumulation", type=int, default=2, help="micro-batches per update (default: %(default)s)")
    g.add_argument("--lr", type=float, default=5e-3, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup", type=float, default=0.1, help="warmup: updates, or a share of --steps if < 1 "
                   "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="model init, data and masking (default: 0)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda (default: %(default)s)")
    g.add_argument("--eval-batches", type=int, default=4, help="validation batches at the start and end "
                   "(default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("model and data")
    m.add_argument("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    m.add_argument("--layers", type=int, default=2, help="transformer layers (default: %(default)s)")
    m.add_argument("--heads", type=int, default=2, help="attention heads (default: %(default)s)")
    m.add_argument("--dropout", type=float, default=0.0, help="dropout (default: %(default)s)")
    m.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default: %(default)s)")
    m.add_argument("--corpus-chars", type=int, default=300_000, help="generated corpus size (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Train; returns a summary dict (``ok`` is False if the loss became NaN)."""
    args = parse_args(argv)
    with distributed(args.device) as world:
        return train(args, world)


def train(args, world) -> dict:
    from tqdm.auto import tqdm
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(args.seed)  # every rank builds the same model
    tok, train_ids, val_ids = load_mlm_dataset(args.corpus_chars, args.seq_len, seed=args.seed)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        max_position_embeddings=args.seq_len, hidden_dropout_prob=args.dropout,
                        attention_probs_dropout_prob=args.dropout)
    model = BertForMaskedLM(config).to(world.device)

    # ---- the DeepSpeed config, translated: the transform stack, the optimizer, the batch sizes ----
    setup = zf.deepspeed.from_config(args.config, model, learning_rate=args.lr, warmup_steps=args.warmup,
                                     max_steps=args.steps, per_device_train_batch_size=args.micro_batch_size,
                                     gradient_accumulation_steps=args.accumulation)
    world.log(setup)  # the stack, the optimizer, the batch, and what every key of the config became

    apply_fn, params = zf.functional(model)

    def loss_fn(params, batch):
        logits = apply_fn(params, input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = setup.wrap(train_step)  # shard(offload(mixed_precision(accumulate(train_step, 2), "fp16")), stage=1)
    state = step.init(zf.TrainState.create(params, setup.optimizer))
    n_params = sum(p.numel() for p in params.values())
    del params
    world.log(f"zfunc example: BertForMaskedLM {n_params:,} parameters ({args.layers} layers, d={args.hidden}), "
              f"vocab {tok.vocab_size} words, {len(train_ids):,} train / {len(val_ids):,} val sequences of "
              f"{args.seq_len}; {world.size} rank(s) on {world.device}")
    world.log(f"step: {step!r}")

    g = torch.Generator().manual_seed(args.seed + 1)
    eval_set = [mask_tokens(val_ids[torch.randint(len(val_ids), (32,), generator=g)], tok.vocab_size, g)
                for _ in range(args.eval_batches)]

    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        """Validation loss and masked-token accuracy (full fp32 weights, dropout off)."""
        full = zf.gather(step, state)
        model.eval()
        try:
            losses, right, total = [], 0, 0
            for inputs, labels in eval_set:
                logits = apply_fn(full, input_ids=inputs.to(world.device)).logits.float()
                labels = labels.to(world.device)
                losses.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
                hit = labels != -100
                right += int((logits.argmax(-1)[hit] == labels[hit]).sum())
                total += int(hit.sum())
            return float(torch.stack(losses).mean()), right / max(total, 1)
        finally:
            model.train()

    val0, acc0 = evaluate()
    per_rank = setup.micro_batch_size * setup.micro_batches
    data = mlm_batches(train_ids, per_rank * world.size, tok.vocab_size, seed=args.seed, rank=world.rank,
                       world_size=world.size)
    losses, skipped, train_time, ok = [], 0, 0.0, True
    tokens_per_step = setup.train_batch_size * args.seq_len
    bar = tqdm(range(1, args.steps + 1), disable=not world.main or args.no_progress, dynamic_ncols=True,
               desc="bert mlm", file=sys.stdout)
    for i in bar:
        batch = {k: v.to(world.device, non_blocking=True) for k, v in next(data).items()}
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        loss = world.mean(metrics["loss"])
        train_time += time.perf_counter() - t0
        skipped += int(metrics.get("skipped", 0))  # fp16 steps whose gradients overflowed
        losses.append(loss)
        if math.isnan(loss) and not bool(metrics.get("skipped", False)):
            world.log(f"step {i}: loss is NaN, stopping")
            ok = False
            break
        bar.set_postfix({"loss": f"{loss:.3f}", "scale": f"{float(metrics['loss_scale']):g}",
                         "lr": f"{float(zf.optim.learning_rate(state.opt_state)):.1e}", "skipped": skipped},
                        refresh=False)
    bar.close()

    val, acc = evaluate()
    ok = ok and math.isfinite(val)
    tail = losses[-10:] or [float("nan")]
    first, last = (losses[0] if losses else float("nan")), sum(tail) / len(tail)
    tps = len(losses) * tokens_per_step / train_time if train_time else 0.0
    world.log(f"loss {first:.2f} -> {last:.2f} in {train_time:.0f} s, {tps:,.0f} tokens/s (train loss: first step "
              f"-> mean of last {len(tail)}; val loss {val0:.2f} -> {val:.2f}, masked-token accuracy "
              f"{acc0:.0%} -> {acc:.0%}; {len(losses)} updates, {skipped} skipped by the fp16 loss scaler)")
    return {"ok": ok, "losses": losses, "first_loss": first, "last_loss": last, "val_loss": val,
            "val_loss_start": val0, "accuracy": acc, "accuracy_start": acc0, "skipped": skipped,
            "time_s": train_time, "tokens_per_s": tps, "setup": setup, "step": step}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
