"""Train a small character-level GPT with zfunc.

The training step is a pure function ``(state, batch) -> (state, metrics)``;
every memory-saving strategy is a transform of that function, switched on by a
flag::

    python examples/train_gpt.py                          # plain fp32 step, ~1 min on 2 CPU cores
    python examples/train_gpt.py --mixed-precision bf16 --checkpoint
    python examples/train_gpt.py --micro-batches 4        # gradient accumulation
    python examples/train_gpt.py --zero-stage 3           # ZeRO-3 in a world of one process
    torchrun --nproc-per-node 2 examples/train_gpt.py --zero-stage 2 --offload

``--batch-size`` is the *global* batch: under torchrun each of N ranks trains on
its own ``batch_size / N`` rows of the same global batch, so any world size
follows the same trajectory as one process (zfunc's equivalence invariant).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # imported as part of the ``examples`` package (tests) ...
    from .data import batches, load_dataset
    from .gpt import GPT, GPTConfig, generate
except ImportError:  # ... or run as a script: ``python examples/train_gpt.py``
    from data import batches, load_dataset
    from gpt import GPT, GPTConfig, generate

try:
    import zfunc as zf
except ImportError:  # running from a checkout without installing zfunc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import zfunc as zf


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=600, help="optimizer steps (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=16,
                   help="global batch in sequences, split over ranks (default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=64, help="characters per sequence (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="model init, data order and sampling (default: 0)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: %(default)s)")
    g.add_argument("--eval-every", type=int, default=100,
                   help="val loss every this many steps, 0: only at the end (default: %(default)s)")
    g.add_argument("--eval-batches", type=int, default=4, help="val batches per eval (default: %(default)s)")
    g.add_argument("--sample-chars", type=int, default=160,
                   help="characters generated at the end (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")

    t = p.add_argument_group("transforms")
    t.add_argument("--micro-batches", type=int, default=1,
                   help="zf.accumulate: gradients of this many micro-batches, one update (default: 1)")
    t.add_argument("--mixed-precision", choices=["none", "bf16", "fp16"], default="none",
                   help="compute dtype; fp32 master weights, fp16 with a dynamic loss scale (default: none)")
    t.add_argument("--checkpoint", action="store_true", help="recompute block activations in backward")
    t.add_argument("--offload", action="store_true", help="optimizer state and update on the host")
    t.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=0,
                   help="shard(stage=...): 1 optimizer state, 2 + gradients, 3 + parameters; 0 no shard")

    m = p.add_argument_group("model and data")
    m.add_argument("--n-layer", type=int, default=4, help="transformer blocks (default: %(default)s)")
    m.add_argument("--n-head", type=int, default=4, help="attention heads (default: %(default)s)")
    m.add_argument("--n-embd", type=int, default=128, help="model width (default: %(default)s)")
    m.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default: %(default)s)")
    m.add_argument("--corpus-chars", type=int, default=300_000,
                   help="size of the generated corpus (default: %(default)s)")
    return p.parse_args(argv)


# --- helpers around the step --------------------------------------------------

def _transform(name: str, flag: str):
    """``zfunc.transforms.<name>``, imported only when its flag asks for it."""
    import importlib
    import types

    try:
        transform = getattr(importlib.import_module("zfunc.transforms"), name, None)
        if transform is None or isinstance(transform, types.ModuleType):  # not re-exported (yet)
            transform = getattr(importlib.import_module(f"zfunc.transforms.{name}"), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"{flag} needs zfunc.transforms.{name}, which this zfunc does not provide ({e})")
    return transform


def _describe(step) -> str:
    if isinstance(step, zf.Transform):
        return repr(step)
    return f"{getattr(step, '__name__', repr(step))} (plain step, no transforms)"


def _setup_distributed(args):
    """``(rank, world_size, device, created_group)``.

    Under torchrun (WORLD_SIZE set) join its process group: gloo on CPU, NCCL
    on CUDA. ``shard`` without torchrun runs in a world of one process, in a
    group backed by an in-process store (no rendezvous, no environment).
    """
    import torch.distributed as dist

    launched = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank if launched else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)

    created = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if launched:
            dist.init_process_group(backend)
            created = True
        elif args.zero_stage > 0:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            created = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if world > 1 and args.zero_stage == 0:
        if created:
            dist.destroy_process_group()
        raise SystemExit(f"{world} processes without --zero-stage would train {world} independent "
                         "copies; data parallelism comes from shard: pass --zero-stage 1, 2 or 3")
    return rank, world, device, created


def _global_mean(x: torch.Tensor, world: int) -> float:
    """A metric averaged over ranks (each reports the loss of its own local batch)."""
    if world == 1:
        return float(x)
    import torch.distributed as dist

    x = x.detach().float().clone()
    dist.all_reduce(x)
    return float(x) / world


def _learning_rate(state, schedule, step_index: int):
    """The learning rate of the latest update, for display; None if it cannot be read."""
    try:
        return float(zf.optim.learning_rate(state.opt_state))
    except (AttributeError, ValueError, TypeError):  # an optimizer without one, or an older zfunc
        try:
            return float(schedule(torch.tensor(step_index)))
        except Exception:  # noqa: BLE001 (display only)
            return None


# --- main ---------------------------------------------------------------------

def main(argv=None) -> dict:
    """Train; returns a summary dict (``ok`` is False if the loss became NaN)."""
    args = parse_args(argv)
    if args.micro_batches < 1:
        raise SystemExit("--micro-batches must be >= 1")
    rank, world, device, created_group = _setup_distributed(args)
    try:
        return _train(args, rank, world, device)
    finally:
        if created_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(args, rank: int, world: int, device: torch.device) -> dict:
    from tqdm.auto import tqdm

    log = print if rank == 0 else (lambda *a, **k: None)
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the world size {world}")
    local_batch = args.batch_size // world
    if local_batch % args.micro_batches:
        raise SystemExit(f"the per-rank batch {local_batch} must be divisible by --micro-batches "
                         f"{args.micro_batches}")

    # data and model (same seed on every rank: every rank builds the same full model)
    torch.manual_seed(args.seed)
    tok, train_ids, val_ids = load_dataset(args.corpus_chars, seed=args.seed)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=args.seq_len, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    model = GPT(cfg).to(device)
    tokens_per_step = args.batch_size * args.seq_len

    # ---- the zfunc part: a pure step, then a flat stack of transforms ----
    apply_fn, params = zf.functional(model)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    schedule = zf.optim.warmup_cosine(args.lr, warmup, args.steps, min_lr=args.lr / 10)
    # decay the matrices and the (tied) embedding, not biases and LayerNorm gains
    opt = zf.optim.adamw(schedule, b2=0.95, weight_decay=args.weight_decay,
                         mask=lambda name: name.endswith("weight") and "ln_" not in name)

    def loss_fn(params, batch):
        logits = apply_fn(params, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = train_step
    if args.micro_batches > 1:
        accumulate = getattr(zf, "accumulate", None)
        if accumulate is None:
            raise SystemExit("--micro-batches needs zf.accumulate, which this zfunc does not provide")
        step = accumulate(step, micro_batches=args.micro_batches)
    if args.mixed_precision != "none":
        step = _transform("mixed_precision", "--mixed-precision")(step, args.mixed_precision)
    if args.checkpoint:
        step = _transform("checkpoint", "--checkpoint")(step)
    if args.offload:
        step = _transform("offload", "--offload")(step)
    if args.zero_stage:
        step = _transform("shard", "--zero-stage")(step, stage=args.zero_stage)

    # step.init(state) for a transformed step (shards, master copies, host placement), as is for a plain one
    state = zf.init(step, zf.TrainState.create(params, opt))
    # From here on the state owns the parameters and the module is only apply_fn's template
    # (apply_fn swaps every weight in and re-ties lm_head itself): release the module's own
    # copy, or every rank would keep a full replica next to its shards.
    n_params = sum(p.numel() for p in params.values())  # the tied embedding once
    del params
    model.to("meta")
    # ----------------------------------------------------------------------

    def full_params(state):
        """Full fp32 parameters on every rank (a collective under shard: all ranks call it)."""
        return zf.gather(step, state)  # step.gather(state), or state.params for a plain step

    eval_data = batches(val_ids, args.batch_size, args.seq_len, seed=args.seed + 1)
    eval_set = [next(eval_data) for _ in range(args.eval_batches)]

    @torch.no_grad()
    def evaluate(params) -> float:
        was_training = model.training
        model.eval()  # apply_fn runs the module: this switches dropout off
        try:
            dev = next(iter(params.values())).device
            losses = [F.cross_entropy(apply_fn(params, b["x"].to(dev)).flatten(0, 1).float(),
                                      b["y"].to(dev).flatten()) for b in eval_set]
            return torch.stack(losses).mean().item()
        finally:
            model.train(was_training)

    log(f"zfunc example: GPT {n_params:,} parameters ({cfg.n_layer} blocks, d={cfg.n_embd}, "
        f"{cfg.n_head} heads, tied lm_head), vocab {tok.vocab_size}, corpus {len(train_ids):,} train / "
        f"{len(val_ids):,} val characters")
    log(f"config: steps={args.steps} batch={args.batch_size} (x{world} ranks of {local_batch}) "
        f"seq_len={args.seq_len} lr={args.lr:g} warmup={warmup} wd={args.weight_decay:g} "
        f"micro_batches={args.micro_batches} mixed_precision={args.mixed_precision} "
        f"checkpoint={args.checkpoint} offload={args.offload} zero_stage={args.zero_stage} "
        f"device={device} seed={args.seed}")
    log(f"step: {_describe(step)}")

    if args.eval_every:
        val0 = evaluate(full_params(state))
        log(f"step {0:5d} | val loss {val0:.4f}")

    train_data = batches(train_ids, args.batch_size, args.seq_len, seed=args.seed, rank=rank,
                         world_size=world)
    losses: list[float] = []
    ok, bad_in_a_row, skipped = True, 0, 0
    train_time, window_t, window_n = 0.0, 0.0, 0
    bar = tqdm(range(1, args.steps + 1), disable=rank != 0 or args.no_progress, dynamic_ncols=True,
               desc="train", file=sys.stdout)
    for i in bar:
        batch = {k: v.to(device, non_blocking=True) for k, v in next(train_data).items()}
        t0 = time.perf_counter()
        try:
            state, metrics = step(state, batch)
        except FloatingPointError as err:  # a NaN/inf loss: the step stopped before its update, state intact
            log(f"step {i}: {str(err).splitlines()[0][:160]}; stopping (the last state is intact)")
            ok = False
            break
        loss = _global_mean(metrics["loss"], world)  # also waits for the step to finish
        dt = time.perf_counter() - t0
        train_time += dt
        window_t, window_n = window_t + dt, window_n + 1
        losses.append(loss)
        skipped += int(metrics.get("skipped", 0))  # fp16 steps whose gradients overflowed

        if not math.isfinite(loss):
            bad_in_a_row += 1
            # under fp16 a few overflowing steps are expected: the loss scaler skips them
            if math.isnan(loss) and (args.mixed_precision != "fp16" or bad_in_a_row > 10):
                log(f"step {i}: loss is NaN, stopping")
                ok = False
                break
        else:
            bad_in_a_row = 0

        if window_t > 0.5 or i == args.steps:
            postfix = {"loss": f"{loss:.3f}", "tok/s": f"{window_n * tokens_per_step / window_t:,.0f}"}
            lr = _learning_rate(state, schedule, i)
            if lr is not None:
                postfix["lr"] = f"{lr:.2e}"
            if "loss_scale" in metrics:  # reported by mixed_precision("fp16")
                postfix["scale"] = f"{float(metrics['loss_scale']):g}"
                postfix["skipped"] = skipped
            bar.set_postfix(postfix, refresh=False)
            window_t, window_n = 0.0, 0

        if args.eval_every and (i % args.eval_every == 0 or i == args.steps):
            val = evaluate(full_params(state))
            msg = f"step {i:5d} | train loss {loss:.4f} | val loss {val:.4f}"
            if rank == 0:
                bar.write(msg, file=sys.stdout)
    bar.close()

    final = full_params(state)
    val_loss = evaluate(final)
    n = len(losses)
    tail = losses[-min(10, n):] if n else [float("nan")]
    first, last = (losses[0] if n else float("nan")), sum(tail) / len(tail)
    tps = n * tokens_per_step / train_time if train_time else 0.0
    if not math.isfinite(val_loss):
        ok = False
    log(f"loss {first:.2f} -> {last:.2f} in {train_time:.0f} s, {tps:,.0f} tokens/s "
        f"(train loss: first step -> mean of last {len(tail)}; val loss {val_loss:.2f}; {n} steps"
        + (f", {skipped} skipped by the fp16 loss scaler" if skipped else "") + ")")

    sample = ""
    if rank == 0 and args.sample_chars > 0 and ok:
        g = torch.Generator().manual_seed(args.seed)
        dev = next(iter(final.values())).device
        prompt = tok.encode("the ").to(dev)[None]
        model.eval()
        out = generate(apply_fn, final, prompt, args.sample_chars, cfg.block_size, generator=g)
        model.train()
        sample = tok.decode(out[0])
        log("sample:\n" + sample)

    return {"ok": ok, "losses": losses, "skipped": skipped, "first_loss": first, "last_loss": last, "val_loss": val_loss,
            "time_s": train_time, "tokens_per_s": tps, "sample": sample, "step": step}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
