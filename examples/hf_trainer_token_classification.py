"""Token classification with Hugging Face's Trainer and a DeepSpeed ZeRO-2 + CPU-offload config, trained by zfunc.

The classic DeepSpeed-with-Hugging-Face setup (a Longformer token classifier,
``TrainingArguments(deepspeed="ds_config_zero2.json")`` with the documentation's
config, ``"auto"`` everywhere) changed by one import::

    from zfunc.hf import Trainer, TrainingArguments    # instead of: from transformers import ...

zfunc reads the config (``print(trainer.engine)`` shows what each key became),
DeepSpeed is never imported. Runs on the CPU in well under a minute with a tiny
randomly initialised Longformer on generated data (nothing is downloaded)::

    python examples/hf_trainer_token_classification.py
    torchrun --nproc-per-node 2 examples/hf_trainer_token_classification.py     # 2 ranks (gloo on CPU)

The task: tag each token with its class (3 classes, by token id; the first and
last tokens of a sequence are tagged by their neighbours, so the model must use
context) — the loss falls from ln 3 ≈ 1.1 within a few dozen updates.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

try:
    import zfunc  # noqa: F401
except ImportError:  # running from a checkout without installing zfunc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIG = Path(__file__).resolve().parent / "configs" / "hf_ds_config_zero2_offload.json"
VOCAB, NUM_LABELS = 60, 3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer updates (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch and rank (default: %(default)s)")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per update (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--config", default=str(CONFIG), help="DeepSpeed config (default: %(default)s)")
    p.add_argument("--output-dir", default=None, help="checkpoints and the final model (default: a temp dir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def label_of(ids: torch.Tensor) -> torch.Tensor:
    """Class of each token: by id, except the ends of a sequence, which take their neighbour's."""
    labels = ids * NUM_LABELS // VOCAB
    labels[..., 0], labels[..., -1] = labels[..., 1], labels[..., -2]
    return labels


def make_data(n: int, seq_len: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, seq_len), generator=g)
    labels = label_of(ids)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]


def tiny_longformer(seq_len: int):
    from transformers import LongformerConfig, LongformerForTokenClassification

    torch.manual_seed(0)
    config = LongformerConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, attention_window=[8, 8], max_position_embeddings=seq_len + 8,
                              num_labels=NUM_LABELS, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = LongformerForTokenClassification(config)
    # Longformer's forward takes **kwargs but does not use num_items_in_batch: say so, and the Trainer
    # averages the loss over the accumulation window (without it, transformers' Trainer sums it: the same
    # happens under zfunc, which reproduces the Trainer's normalization).
    model.accepts_loss_kwargs = False
    return model


def main(argv=None) -> dict:
    """Train; returns ``ok`` (the loss fell and stayed finite), the logged losses and the evaluation."""
    from zfunc.hf import Trainer, TrainingArguments

    args = parse_args(argv)
    out = args.output_dir or tempfile.mkdtemp(prefix="zfunc-hf-token-")
    steps_per_epoch = 4
    train = make_data(args.batch_size * args.accumulation * steps_per_epoch, args.seq_len, seed=1)
    val = make_data(32, args.seq_len, seed=2)

    training_args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=16,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=args.lr,
        warmup_steps=5, weight_decay=0.01, max_grad_norm=1.0, logging_steps=5, eval_strategy="no",
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
        disable_tqdm=args.no_progress, deepspeed=args.config)
    trainer = Trainer(model=tiny_longformer(args.seq_len), args=training_args, train_dataset=train, eval_dataset=val)
    before = trainer.evaluate()["eval_loss"]
    result = trainer.train()
    after = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero():
        print(trainer.engine, flush=True)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    ok = all(math.isfinite(x) for x in losses) and len(losses) >= 2 and losses[-1] < losses[0] and after < before
    if trainer.is_world_process_zero():
        print(f"train loss {' -> '.join(f'{x:.3f}' for x in losses)}; eval loss {before:.3f} -> {after:.3f} "
              f"({result.global_step} updates in {result.metrics['train_runtime']:.1f} s)", flush=True)
    return {"ok": ok, "losses": losses, "eval_before": before, "eval_after": after, "output_dir": out,
            "global_step": result.global_step}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
