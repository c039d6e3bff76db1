"""Per-example gradients (DP-SGD) and a custom transform, in a page each.

Two things no training engine offers, because zfunc's step is a plain function:

1. **Per-example gradients**: ``torch.func.vmap`` over ``zf.grad`` of the loss of
   one example, through ``apply_fn``. Here each example's gradient is clipped to
   an L2 norm of at most ``--clip`` before they are averaged (DP-SGD's clipping).
2. **A transform of your own**: `GradientNoise` is a `zf.Transform` of a dozen
   lines that handles the ``apply_gradients`` primitive: it reports the
   gradient's norm and adds Gaussian noise just before the optimizer runs
   (DP-SGD's noise, ``std = noise_multiplier × clip / batch``). It composes with
   zfunc's own transforms like any of them.

The model is a character n-gram MLP on the generated corpus of `data`::

    python examples/per_example_grads.py                        # ~1 min on 2 CPU cores
    python examples/per_example_grads.py --noise-multiplier 0   # clipping only
    python examples/per_example_grads.py --device cuda --batch-size 1024 --hidden 2048
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:  # imported as part of the ``examples`` package (tests) ...
    from .common import distributed
    from .data import load_dataset
except ImportError:  # ... or run as a script
    from common import distributed
    from data import load_dataset

try:
    import zfunc as zf
except ImportError:  # running from a checkout without installing zfunc
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import zfunc as zf


# --- 2. a transform of your own -------------------------------------------------------------------

class GradientNoise(zf.Transform):
    """Adds ``N(0, std²)`` to every gradient element right before the update; reports the gradient's global L2
    norm before the noise as ``metrics["grad_norm"]``.

    The noise of update ``t`` is drawn from a generator seeded with ``(seed, t)``, so a run is reproducible and
    a restored checkpoint continues the same noise. Under `shard` each rank sees its own slice of the
    gradients: ``zf.psum`` adds the ranks' partial squared norms, and the rank joins the seed.
    """

    name = "gradient_noise"
    level = 0  # a compute transform: shard and offload may wrap it

    def __init__(self, step, std: float, seed: int = 0) -> None:
        super().__init__(step)
        if not std >= 0:
            raise ValueError(f"std must be >= 0, got {std}")
        self.std, self.seed = float(std), int(seed)

    def settings(self) -> dict:
        return {"std": self.std, "seed": self.seed}

    def start(self, ctx, state) -> dict:
        return {}  # this call's metrics, filled by the handler below

    def run(self, state, batch):
        new_state, metrics = self.step(state, batch)
        return new_state, {**metrics, **self.call_scratch()}

    def apply_gradients(self, next, state, grads, request):
        squares = sum(g.float().square().sum() for g in grads.values())
        self.call_scratch()["grad_norm"] = zf.psum(squares).sqrt()
        if self.std > 0:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            device = _device_of(grads)
            gen = torch.Generator(device=device).manual_seed((self.seed * 1_000_003 + int(state.step)) * 4099 + rank)
            grads = {k: g + self.std * torch.randn(g.shape, generator=gen, device=device, dtype=g.dtype)
                     for k, g in grads.items()}
        return next(state, grads, request)


def _device_of(grads: dict) -> torch.device:
    return next(iter(grads.values())).device


# --- the model and 1. per-example gradients ------------------------------------------------------

class NGramMLP(nn.Module):
    """Next character from the ``context`` previous ones: embeddings, concatenated, through an MLP."""

    def __init__(self, vocab: int, context: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.mlp = nn.Sequential(nn.Linear(context * embed, hidden), nn.GELU(), nn.Linear(hidden, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x).flatten(-2))


def per_example_grads(apply_fn, params: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``{name: [batch, *shape]}``: the gradient of each example's loss alone."""
    def loss_one(p, xi, yi):
        return F.cross_entropy(apply_fn(p, xi[None]), yi[None])

    return torch.func.vmap(zf.grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def clip_and_average(grads: dict, clip: float) -> tuple[dict, torch.Tensor]:
    """Each example's gradient scaled to an L2 norm of at most ``clip``, then averaged; also the norms."""
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
    scale = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("b,b...->...", scale, g) / len(scale) for k, g in grads.items()}, norms


def windows(ids: torch.Tensor, context: int, batch: int, seed: int):
    """Endless ``(x [batch, context], y [batch])``: random windows of the text and the character after each."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1)
    while True:
        chunk = ids[torch.randint(len(ids) - context - 1, (batch,), generator=g)[:, None] + offsets]
        yield chunk[:, :-1], chunk[:, -1]


# --- the run ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="updates (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per update (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default: %(default)s)")
    p.add_argument("--clip", type=float, default=1.0, help="per-example gradient norm bound (default: %(default)s)")
    p.add_argument("--noise-multiplier", type=float, default=0.5,
                   help="noise std as a multiple of clip / batch (default: %(default)s; 0: none)")
    p.add_argument("--context", type=int, default=8, help="characters of context (default: %(default)s)")
    p.add_argument("--embed", type=int, default=32, help="embedding size (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=256, help="hidden units (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="init, data and noise (default: 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    with distributed(args.device) as world:
        if world.size > 1:
            raise SystemExit("this example runs one process: per-example gradients are taken by hand here, outside "
                             "shard's reduction (use --device cuda to scale up)")
        return train(args, world)


def train(args, world) -> dict:
    from tqdm.auto import tqdm

    torch.manual_seed(args.seed)
    tok, train_ids, val_ids = load_dataset(300_000, seed=args.seed)
    model = NGramMLP(tok.vocab_size, args.context, args.embed, args.hidden).to(world.device)
    apply_fn, params = zf.functional(model)

    def dp_step(state, batch):
        x, y = batch
        grads, norms = clip_and_average(per_example_grads(apply_fn, state.params, x, y), args.clip)
        with torch.no_grad():
            loss = F.cross_entropy(apply_fn(state.params, x), y)
        return state.apply_gradients(grads), {"loss": loss, "clipped": (norms > args.clip).float().mean()}

    std = args.noise_multiplier * args.clip / args.batch_size
    step = GradientNoise(dp_step, std=std, seed=args.seed)
    state = step.init(zf.TrainState.create(params, zf.optim.adam(args.lr)))
    world.log(f"zfunc example: DP-SGD on a character {args.context}-gram MLP, "
              f"{sum(p.numel() for p in params.values()):,} parameters; per-example clip {args.clip:g}, noise std "
              f"{std:.2g} ({args.noise_multiplier:g} × clip / batch {args.batch_size}) on {world.device}")
    world.log(f"step: {step!r}")

    @torch.no_grad()
    def val_loss() -> float:
        data = windows(val_ids, args.context, 512, seed=args.seed + 1)
        return float(torch.stack([F.cross_entropy(apply_fn(state.params, x.to(world.device)), y.to(world.device))
                                  for x, y in (next(data) for _ in range(4))]).mean())

    val0 = val_loss()
    data = windows(train_ids, args.context, args.batch_size, seed=args.seed)
    losses, clipped, train_time = [], [], 0.0
    bar = tqdm(range(1, args.steps + 1), disable=args.no_progress, dynamic_ncols=True, desc="dp-sgd", file=sys.stdout)
    for _ in bar:
        x, y = (t.to(world.device) for t in next(data))
        t0 = time.perf_counter()
        state, metrics = step(state, (x, y))
        losses.append(float(metrics["loss"]))
        train_time += time.perf_counter() - t0
        clipped.append(float(metrics["clipped"]))
        bar.set_postfix({"loss": f"{losses[-1]:.3f}", "grad_norm": f"{float(metrics['grad_norm']):.3f}",
                         "clipped": f"{clipped[-1]:.0%}"}, refresh=False)
    bar.close()
    val = val_loss()
    tail = losses[-20:] or [float("nan")]
    first, last = (losses[0] if losses else float("nan")), sum(tail) / len(tail)
    ok = all(math.isfinite(v) for v in losses) and math.isfinite(val)
    eps = len(losses) * args.batch_size / train_time if train_time else 0.0
    world.log(f"loss {first:.2f} -> {last:.2f} in {train_time:.0f} s, {eps:,.0f} examples/s (train loss: first step -> "
              f"mean of last {len(tail)}; val loss {val0:.2f} -> {val:.2f}; {sum(clipped) / max(len(clipped), 1):.0%} "
              f"of the examples clipped)")
    return {"ok": ok, "losses": losses, "first_loss": first, "last_loss": last, "val_loss": val,
            "val_loss_start": val0, "time_s": train_time, "step": step, "state": state}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
