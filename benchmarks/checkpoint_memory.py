"""Peak memory and step time of a training step with and without the `checkpoint` transform.

Models: a deep residual MLP (``--depth`` blocks ``x + W2 gelu(W1 x)`` of width
``--width``; one row per batch size in ``--batch``: at 512 its activations
are about its parameter count, at 4096 they dominate) and, if ``examples/gpt.py`` is importable, the
example GPT. Policies: none (the plain step), ``recompute``, ``save_ops``,
``offload_inputs``. Each (model, policy) runs in a fresh process.

What is measured, per process:

- ``grad peak``: the growth of peak memory during one ``zf.value_and_grad``
  (forward + backward, the phase checkpointing acts on), over the memory
  held just before it (params, optimizer state, batch);
- ``step peak``: the same for whole training steps (AdamW included), which
  is what a run needs. The optimizer's own temporaries can dominate it for a
  small batch: that is why both are shown;
- ``step time``: the median over ``--steps`` steps (after a warm-up step).

How memory is measured (no tracemalloc, which does not see torch's
allocations): on CUDA ``torch.cuda.max_memory_allocated`` (reset per
phase), which counts every tensor byte exactly. On CPU the process's peak
resident memory (the kernel's high-water mark ``VmHWM``, what ``ru_maxrss``
reports) minus its resident memory just before the phase; the mark is reset
before each phase by writing 5 to ``/proc/self/clear_refs`` (Linux >= 4.0),
after one warm-up grad call and step, so one-time costs (code loaded on first
use) are not counted. The child runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so
that every tensor is its own mmap, returned to the OS when freed, and RSS
tracks live tensor bytes (plus a few MiB of allocator noise).

    python benchmarks/checkpoint_memory.py                 # CPU (or --device cuda)
    python benchmarks/checkpoint_memory.py --depth 16 --width 1024 --batch 512 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ["none", "recompute", "save_ops", "offload_inputs"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Meter:
    """Peak growth of memory over a phase: exact CUDA allocator counts, or process RSS on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.resettable = True

    def start(self) -> None:
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            self.resettable = reset_peak_rss() and self.resettable
            self.before = rss_bytes()

    def peak_growth(self) -> int:
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.before
        return peak_rss_bytes() - self.before


def build(model_name: str, args):
    import torch
    import torch.nn.functional as F
    from torch import nn

    device = args.device
    if model_name.startswith("mlp"):
        batch_size = int(model_name.partition("@")[2] or args.batch.split(",")[0])
        class Block(nn.Module):
            def __init__(self, width: int) -> None:
                super().__init__()
                self.up = nn.Linear(width, width)
                self.down = nn.Linear(width, width)

            def forward(self, x):
                return x + self.down(F.gelu(self.up(x)))

        class MLP(nn.Module):
            def __init__(self, depth: int, width: int) -> None:
                super().__init__()
                self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x

        model = MLP(args.depth, args.width).to(device)
        batch = {"x": torch.randn(batch_size, args.width, device=device)}

        def loss_of(apply_fn):
            return lambda p, b: apply_fn(p, b["x"]).square().mean()
        return model, batch, loss_of

    sys.path.insert(0, str(ROOT))
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=args.gpt_vocab, block_size=args.gpt_seq, n_layer=args.gpt_layers,
                    n_head=args.gpt_heads, n_embd=args.gpt_width, dropout=0.1)
    model = GPT(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.gpt_batch, args.gpt_seq + 1), generator=g).to(device)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}

    def loss_of(apply_fn):
        def loss_fn(p, b):
            logits = apply_fn(p, b["x"])
            return F.cross_entropy(logits.flatten(0, 1), b["y"].flatten())
        return loss_fn
    return model, batch, loss_of


def child(model_name: str, policy: str, args) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import zfunc as zf
    from zfunc.transforms.checkpoint import checkpoint

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, batch, loss_of = build(model_name, args)
    apply_fn, params = zf.functional(model)  # params share the module's storage: no copy
    loss_fn = loss_of(apply_fn)

    def grad_only(state, b):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, b)
        return state, {"loss": loss, "grads": grads}

    def train_step(state, b):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, b)
        return state.apply_gradients(grads), {"loss": loss}

    wrap = (lambda s: s) if policy == "none" else (lambda s: checkpoint(s, policy=policy))
    state = zf.TrainState.create(params, zf.optim.adamw(1e-4))
    meter = Meter(args.device)

    grad_step, step = wrap(grad_only), wrap(train_step)
    # Warm-up: first calls load code and caches (tens of MiB of RSS) that are no activation memory.
    del grad_step(state, batch)[1]["grads"]
    state, _ = step(state, batch)

    meter.start()
    _, metrics = grad_step(state, batch)
    grad_peak = meter.peak_growth()
    del metrics

    meter.start()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        float(metrics["loss"])  # wait for the device
        times.append(time.perf_counter() - t0)
    step_peak = meter.peak_growth()
    if not meter.resettable:
        print("warning: cannot reset the peak-RSS mark (/proc/self/clear_refs); peaks include the warm-up",
              file=sys.stderr)
    n_params = sum(v.numel() for v in params.values())
    return {"grad_peak": grad_peak, "step_peak": step_peak, "step_time": statistics.median(times),
            "params": n_params, "loss": float(metrics["loss"])}


def child_args(args) -> list[str]:
    out = []
    for key, value in vars(args).items():
        if key in ("child", "json", "models", "policies") or value is None:
            continue
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", default="512,4096",
                        help="MLP batch sizes, comma-separated: one row each")
    parser.add_argument("--gpt-layers", type=int, default=8)
    parser.add_argument("--gpt-width", type=int, default=256)
    parser.add_argument("--gpt-heads", type=int, default=8)
    parser.add_argument("--gpt-seq", type=int, default=256)
    parser.add_argument("--gpt-batch", type=int, default=16)
    parser.add_argument("--gpt-vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after a warm-up step)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_name, policy = args.child.split(":")
        print(json.dumps(child(model_name, policy, args)))
        return

    import torch

    models = []
    for name in args.models.split(","):
        models += [f"mlp@{b}" for b in args.batch.split(",")] if name == "mlp" else [name]
    if "gpt" in models and not (ROOT / "examples" / "gpt.py").exists():
        print("examples/gpt.py not found: skipping the GPT row")
        models.remove("gpt")
    policies = args.policies.split(",")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"torch {torch.__version__} | device {args.device} | {platform.processor() or platform.machine()} | "
          f"python {platform.python_version()}")
    print(f"mlp@B: {args.depth} blocks x + W2 gelu(W1 x), width {args.width}, batch B")
    print(f"gpt: {args.gpt_layers} layers, width {args.gpt_width}, {args.gpt_heads} heads, seq {args.gpt_seq}, "
          f"batch {args.gpt_batch}, dropout 0.1")
    results: dict = {}
    total, done = len(models) * len(policies), 0
    for model_name in models:
        for policy in policies:
            done += 1
            print(f"  [{done}/{total}] {model_name} / {policy} ...", end=" ", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child", f"{model_name}:{policy}", *child_args(args)],
                                  capture_output=True, text=True, env=env)
            if proc.returncode:
                print("failed\n" + proc.stderr[-3000:])
                raise SystemExit(1)
            results[(model_name, policy)] = r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{time.perf_counter() - t0:.0f}s (grad peak {r['grad_peak'] / 2**20:.0f} MiB, "
                  f"step {r['step_time'] * 1e3:.0f} ms)", flush=True)

    header = (f"\n{'model':9s} {'policy':15s} {'params':>8s} {'grad peak MiB':>14s} {'ratio':>6s} "
              f"{'step peak MiB':>14s} {'ratio':>6s} {'step ms':>9s} {'ratio':>6s} {'final loss':>12s}")
    print(header)
    print("-" * (len(header) - 1))
    for model_name in models:
        base = results.get((model_name, "none"))
        for policy in policies:
            r = results[(model_name, policy)]

            def ratio(key, r=r, base=base):
                return f"{r[key] / base[key]:6.2f}" if base and base[key] > 0 else "     -"
            print(f"{model_name:9s} {policy:15s} {r['params'] / 1e6:7.1f}M {r['grad_peak'] / 2**20:14.0f} "
                  f"{ratio('grad_peak')} {r['step_peak'] / 2**20:14.0f} {ratio('step_peak')} "
                  f"{r['step_time'] * 1e3:9.0f} {ratio('step_time')} {r['loss']:12.7f}")
    print("\nratio: this policy / no checkpoint. Peaks are growths over the memory held before the phase "
          "(params + optimizer state + batch).\nfinal loss: the loss of the last step; equal across policies "
          "(dropout included) because a checkpointed step computes the same thing.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__,
                       "results": {f"{m}:{p}": r for (m, p), r in results.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
