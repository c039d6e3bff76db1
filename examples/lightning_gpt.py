"""Train a small character-level GPT as a LightningModule under zfunc's Lightning strategies.

The module is ordinary Lightning code (``configure_model``, ``training_step``
with ``self.log``, ``configure_optimizers`` returning AdamW and a warmup +
cosine schedule); only the strategy name says zfunc::

    python examples/lightning_gpt.py                                   # zfunc_stage_2, ~20 s on 2 CPU cores
    python examples/lightning_gpt.py --strategy zfunc_stage_3_offload --precision bf16-mixed
    python examples/lightning_gpt.py --strategy zfunc_stage_3 --accumulate 2 --ckpt-dir ckpts
    python examples/lightning_gpt.py --strategy auto                   # plain Lightning, for comparison

Under ``torchrun --nproc-per-node N`` (or ``--devices N``) each process
trains on its share of the batches, as with any Lightning DDP-family strategy.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # run as a script: this checkout's zfunc, and the examples beside this file
    sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

try:  # imported as part of the ``examples`` package (tests) ...
    from .data import load_dataset
    from .gpt import GPT, GPTConfig, generate
except ImportError:  # ... or run as a script
    from data import load_dataset
    from gpt import GPT, GPTConfig, generate

import lightning as L

import zfunc.lightning  # noqa: F401 (registers the zfunc_* strategies)


class CharGPT(L.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float, warmup: int, total_steps: int) -> None:
        super().__init__()
        self.cfg, self.lr, self.warmup, self.total_steps = cfg, lr, warmup, total_steps
        self.gpt: GPT | None = None

    def configure_model(self) -> None:
        if self.gpt is None:   # (called again by test/predict after fit)
            self.gpt = GPT(self.cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(x)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler
        warm = max(1, self.warmup)
        schedule = sched.SequentialLR(opt, [sched.LinearLR(opt, 0.1, 1.0, total_iters=warm),
                                            sched.CosineAnnealingLR(opt, T_max=max(1, self.total_steps - warm),
                                                                    eta_min=self.lr / 10)], milestones=[warm])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Windows(torch.utils.data.Dataset):
    """Every ``seq_len + 1`` characters of the corpus from a seeded set of start positions."""

    def __init__(self, ids: torch.Tensor, seq_len: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(ids) - seq_len - 1, (count,), generator=g)
        self.chunks = ids[starts[:, None] + torch.arange(seq_len + 1)]

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int):
        return self.chunks[i, :-1], self.chunks[i, 1:]


class PrintLoss(L.Callback):
    """A line every ``every`` updates (the progress bar shows the rest)."""

    def __init__(self, every: int) -> None:
        self.every, self.losses = every, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.fit_loop._should_accumulate():
            return
        loss = float(outputs["loss"]) * trainer.accumulate_grad_batches
        self.losses.append(loss)
        if self.every and trainer.is_global_zero and (trainer.global_step % self.every == 0 or trainer.global_step == 1):
            print(f"step {trainer.global_step:4d}  loss {loss:.3f}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="zfunc_stage_2", help="a zfunc_* strategy name, or 'auto' (default: %(default)s)")
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, bf16-true (default: %(default)s)")
    p.add_argument("--accelerator", default="cpu", help="cpu or gpu (default: %(default)s)")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--steps", type=int, default=150, help="optimizer updates (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (0: none)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--corpus-chars", type=int, default=100_000)
    p.add_argument("--print-every", type=int, default=25)
    p.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint directory (zfunc checkpoints, save_last)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sample-chars", type=int, default=40)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(0, verbose=False)
    tok, train_ids, val_ids = load_dataset(args.corpus_chars)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    batches = args.steps * args.accumulate * args.devices
    train = torch.utils.data.DataLoader(Windows(train_ids, args.seq_len, batches * args.batch_size, seed=1),
                                        batch_size=args.batch_size)
    val = torch.utils.data.DataLoader(Windows(val_ids, args.seq_len, 4 * args.batch_size, seed=2),
                                      batch_size=args.batch_size)
    model = CharGPT(cfg, args.lr, args.warmup, args.steps)
    printer = PrintLoss(args.print_every)
    callbacks = [printer]
    if args.ckpt_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True))
    trainer = L.Trainer(strategy=args.strategy, precision=args.precision, accelerator=args.accelerator,
                        devices=args.devices,
                        max_epochs=1, accumulate_grad_batches=args.accumulate,
                        gradient_clip_val=args.clip or None, val_check_interval=1.0, limit_val_batches=4,
                        num_sanity_val_steps=0, logger=False, callbacks=callbacks,
                        enable_checkpointing=bool(args.ckpt_dir), enable_progress_bar=not args.no_progress,
                        enable_model_summary=False)
    start = time.perf_counter()
    trainer.fit(model, train, val)
    seconds = time.perf_counter() - start
    test_loss = trainer.test(model, val, verbose=False)[0]["test_loss"]
    losses = printer.losses
    first, last = losses[0], sum(losses[-10:]) / len(losses[-10:])
    tokens = trainer.global_step * args.accumulate * args.batch_size * args.seq_len * args.devices
    ok = all(math.isfinite(x) for x in losses) and last < first
    sample = ""
    if args.sample_chars and trainer.is_global_zero:
        prompt = tok.encode("the ")[None].to(model.device)
        with torch.no_grad():
            out = generate(lambda _, x: model.gpt(x), None, prompt, args.sample_chars, cfg.block_size, temperature=0)
        sample = tok.decode(out[0])
    if trainer.is_global_zero:
        print(f"strategy {args.strategy}, precision {args.precision}: loss {first:.3f} -> {last:.3f} "
              f"(test {test_loss:.3f}) in {trainer.global_step} updates, {seconds:.1f} s, "
              f"{tokens / seconds:.0f} tokens/s")
        if sample:
            print(f"sample: {sample!r}")
    return {"ok": ok, "losses": losses, "first_loss": first, "last_loss": last, "test_loss": float(test_loss),
            "steps": trainer.global_step, "sample": sample}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
