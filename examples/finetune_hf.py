"""Fine-tune a Hugging Face causal LM from its safetensors weights under ZeRO-3 + CPU offload, and save it back.

The model is built on the meta device (no memory), its pretrained weights are
streamed into the sharded training state unit by unit (`zfunc.io.load_pretrained`:
no rank ever holds the whole model, no random values are drawn first), it trains
under ``shard(offload(mixed_precision(train_step)), stage=3)``, and the result is
written in Hugging Face's format (`zfunc.io.export_hf`, one parameter at a time)
and loaded back with ``from_pretrained`` to check it::

    python examples/finetune_hf.py                    # ~1 min on 2 CPU cores
    python examples/finetune_hf.py --model-dir path/to/a/saved/model --steps 500
    torchrun --nproc-per-node 8 examples/finetune_hf.py --model-dir path/to/llama --seq-len 1024 \\
        --batch-size 64 --checkpoint                                     # 8 GPUs

Without network access a small Llama saved with ``save_pretrained`` stands in
for a hub model: it is created in ``--model-dir`` when the directory is absent.
The data is the generated corpus of `data`, as characters (the stand-in's
vocabulary), or through the model directory's own tokenizer if it has one.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # imported as part of the ``examples`` package (tests) ...
    from .common import distributed
    from .data import CharTokenizer, batches, make_corpus
except ImportError:  # ... or run as a script
    from common import distributed
    from data import CharTokenizer, batches, make_corpus

try:
    import zfunc as zf
except ImportError:  # running from a checkout without installing zfunc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import zfunc as zf

from zfunc.transforms import checkpoint, mixed_precision, offload, shard

DEFAULT_DIR = Path(tempfile.gettempdir()) / "zfunc-examples" / "tiny-llama"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_DIR),
                   help="a save_pretrained directory; created (a small Llama) if absent (default: %(default)s)")
    p.add_argument("--out-dir", default=None, help="where the fine-tuned model is written (default: "
                   "<model-dir>-finetuned)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300, help="optimizer updates (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=8, help="global batch in sequences (default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    g.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default: %(default)s)")
    g.add_argument("--mixed-precision", choices=["bf16", "fp16", "none"], default="bf16",
                   help="compute dtype over fp32 master weights (default: %(default)s)")
    g.add_argument("--checkpoint", action="store_true", help="recompute the blocks' activations in backward")
    g.add_argument("--seed", type=int, default=0, help="data order (default: 0)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda (default: %(default)s)")
    g.add_argument("--eval-batches", type=int, default=4, help="validation batches (default: %(default)s)")
    g.add_argument("--no-verify", action="store_true", help="skip loading the export with from_pretrained "
                   "(it holds the whole model in one process)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = p.add_argument_group("the stand-in model (only when --model-dir is absent)")
    s.add_argument("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    s.add_argument("--layers", type=int, default=2, help="decoder layers (default: %(default)s)")
    s.add_argument("--heads", type=int, default=2, help="attention heads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Fine-tune; returns a summary dict (``ok``: the loss stayed finite and the export loads, equal)."""
    args = parse_args(argv)
    with distributed(args.device) as world:
        return finetune(args, world)


def make_stand_in(model_dir: Path, args, vocab_size: int) -> None:
    """A small Llama (tied embeddings, as small Llamas have) saved like a hub download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=1,
                         max_position_embeddings=max(128, args.seq_len), tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(model_dir)


def _barrier(world) -> None:
    if world.size > 1:
        import torch.distributed as dist

        dist.barrier()


class _Tokens:
    """The model directory's tokenizer if it has one (read locally), else characters."""

    def __init__(self, model_dir: Path) -> None:
        self.hf = None
        if (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.chars = CharTokenizer()
        self.vocab_size = len(self.hf) if self.hf is not None else self.chars.vocab_size

    def encode(self, text: str) -> torch.Tensor:
        if self.hf is not None:
            return torch.tensor(self.hf(text)["input_ids"], dtype=torch.long)
        return self.chars.encode(text)


def finetune(args, world) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(args.model_dir)
    out_dir = Path(args.out_dir) if args.out_dir else model_dir.with_name(model_dir.name + "-finetuned")
    if not model_dir.exists():
        if world.main:
            world.log(f"{model_dir} is absent: saving a small Llama there to stand in for a downloaded model")
            make_stand_in(model_dir, args, CharTokenizer().vocab_size)
        _barrier(world)
    tokens = _Tokens(model_dir)
    text = make_corpus(200_000, seed=args.seed)
    ids = tokens.encode(text)
    n_val = len(ids) // 10
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]

    # ---- built on meta: shapes only, no memory ----
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if config.vocab_size < tokens.vocab_size:
        raise SystemExit(f"the model's vocabulary ({config.vocab_size}) is smaller than the data's "
                         f"({tokens.vocab_size})")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    apply_fn, params = zf.functional(model, init="hf")

    def loss_fn(params, batch):
        logits = apply_fn(params, input_ids=batch["x"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = train_step
    if args.mixed_precision != "none":
        step = mixed_precision(step, args.mixed_precision)
    if args.checkpoint:
        step = checkpoint(step)
    step = shard(offload(step), stage=3)
    schedule = zf.optim.warmup_cosine(args.lr, max(1, args.steps // 10), args.steps, min_lr=args.lr / 10)
    opt = zf.optim.adamw(schedule, b2=0.95, weight_decay=0.0)

    # ---- the pretrained weights, streamed into this rank's shards while step.init builds the state ----
    t0 = time.perf_counter()
    state, report = zf.io.load_pretrained(model_dir, like=zf.TrainState.create(params, opt), step=step,
                                          progress=not args.no_progress)
    load_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in params.values())
    del params
    world.log(report)
    world.log(f"zfunc example: {type(model).__name__} {n_params:,} parameters from {model_dir} in {load_s:.1f} s; "
              f"{world.size} rank(s) on {world.device}; step: {step!r}")

    val = batches(val_ids, args.batch_size, args.seq_len, seed=args.seed + 1)
    eval_set = [next(val) for _ in range(args.eval_batches)]
    data = batches(train_ids, args.batch_size, args.seq_len, seed=args.seed, rank=world.rank, world_size=world.size)

    losses, train_time, skipped = [], 0.0, 0
    bar = tqdm(range(1, args.steps + 1), disable=not world.main or args.no_progress, dynamic_ncols=True,
               desc="finetune", file=sys.stdout)
    for _ in bar:
        batch = {k: v.to(world.device, non_blocking=True) for k, v in next(data).items()}
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        loss = world.mean(metrics["loss"])
        train_time += time.perf_counter() - t0
        skipped += int(metrics.get("skipped", 0))
        losses.append(loss)
        bar.set_postfix({"loss": f"{loss:.3f}", "lr": f"{float(zf.optim.learning_rate(state.opt_state)):.1e}"},
                        refresh=False)
    bar.close()

    # ---- back to Hugging Face's format, one parameter at a time (rank 0 writes) ----
    t0 = time.perf_counter()
    zf.io.export_hf(out_dir, state, model=model, overwrite=True, progress=not args.no_progress)
    export_s = time.perf_counter() - t0
    check = verify(model_dir, out_dir, step, state, eval_set, world) if not args.no_verify else {}

    tail = losses[-10:] or [float("nan")]
    first, last = (losses[0] if losses else float("nan")), sum(tail) / len(tail)
    ok = all(math.isfinite(x) for x in losses) and check.get("equal", True)
    tps = len(losses) * args.batch_size * args.seq_len / train_time if train_time else 0.0
    world.log(f"loss {first:.2f} -> {last:.2f} in {train_time:.0f} s, {tps:,.0f} tokens/s (train loss: first step -> "
              f"mean of last {len(tail)}; loaded in {load_s:.1f} s, exported to {out_dir} in {export_s:.1f} s"
              + (f"; from_pretrained: {check['tensors']} tensors {'equal' if check['equal'] else 'NOT EQUAL'} to the "
                 f"trained weights, val loss {check['val_loss_start']:.2f} -> {check['val_loss']:.2f}" if check else "")
              + ")")
    return {"ok": ok, "losses": losses, "first_loss": first, "last_loss": last, "report": report,
            "out_dir": out_dir, "time_s": train_time, "tokens_per_s": tps, "skipped": skipped, **check}


def verify(model_dir: Path, out_dir: Path, step, state, eval_set, world) -> dict:
    """Load the export with ``from_pretrained`` (rank 0): its weights equal the trained fp32 master, element by
    element; and the validation loss of the original and of the fine-tuned model."""
    from transformers import AutoModelForCausalLM

    full = step.gather(state)  # a collective: every rank takes part
    if not world.main:
        return {}

    @torch.no_grad()
    def val_loss(model) -> float:
        model.eval()
        return float(torch.stack([F.cross_entropy(model(input_ids=b["x"]).logits.flatten(0, 1).float(),
                                                  b["y"].flatten()) for b in eval_set]).mean())

    back = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
    weights = back.state_dict()
    equal = all(torch.equal(weights[k], v.cpu()) for k, v in full.items())
    before = val_loss(AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True))
    return {"equal": equal, "tensors": len(full), "val_loss": val_loss(back), "val_loss_start": before}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
