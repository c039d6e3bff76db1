"""The ``zfunc`` command (also ``python -m zfunc.io``).

    zfunc consolidate CKPT_DIR OUT [--dtype fp32|bf16|fp16] [--step N] [--model MODULE:FACTORY]
                                   [--aliases MODULE:FACTORY | --no-aliases] [--no-verify] [-q]
    zfunc info CKPT_DIR [--step N]          what a checkpoint holds (from its manifest)
    zfunc verify CKPT_DIR [--step N]        check every file of a checkpoint against its checksum and manifest
    zfunc launch [--hostfile H ...] SCRIPT [ARGS]   torchrun on this node for a DeepSpeed hostfile
    zfunc plan MODULE:FACTORY --batch 8x1024 [--stage 3] [--mixed-precision bf16] [--checkpoint] [--choose-micro-batches]
               [--offload] [--world-size N] [--gpu-gib G --host-gib H --nvme-gib D]
                                            the memory plan of a stack (model built on the meta device)

``CKPT_DIR`` is a save directory (its ``latest`` checkpoint, or ``--step``)
or one ``step_*`` directory. ``MODULE:FACTORY`` names a function that builds
the model (``mypkg.models:build``; the current directory is importable):
``--model`` writes its frozen parameters and buffers too, so that
``model.load_state_dict(load_file(OUT))`` loads strictly.

Every user error (a missing or damaged checkpoint, a bad option, an output
that cannot be written, a factory that cannot be imported or fails) prints
one line, ``zfunc: error: ...``, on stderr and exits with status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class UsageError(Exception):
    """A command line that cannot be run as given: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised (then printed in one line) instead of a usage block and exit."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is >= 0, got {value}")
    return value


def build_model(spec: str, option: str) -> torch.nn.Module:
    """The model ``MODULE:FACTORY`` builds (``FACTORY()``), or `UsageError` saying what went wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{option} {spec!r}: expected MODULE:FACTORY, e.g. mypkg.models:build")
    if os.getcwd() not in sys.path:  # `zfunc` is a script in bin/: let it import the user's package as -m does
        sys.path.insert(0, os.getcwd())
    try:
        factory = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 (the user's module: any failure is reported in one line)
        raise UsageError(f"{option} {spec}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise UsageError(f"{option} {spec}: {module_name} has no function {attr!r}")
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{option} {spec}: {attr}() raised {type(e).__name__}: {e}") from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{option} {spec}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _plan(args: argparse.Namespace) -> int:
    import torch.nn.functional as F

    import zfunc as zf
    from zfunc.plan import GiB, plan
    from zfunc.transforms import checkpoint, mixed_precision, offload, shard

    try:
        batch, seq = (int(x) for x in args.batch.lower().split("x"))
    except ValueError:
        raise UsageError(f"--batch {args.batch!r}: expected BATCHxSEQ, e.g. 8x1024") from None
    with torch.device("meta"):
        model = build_model(args.model, "plan")
    apply_fn, params = zf.functional(model)
    # Hugging Face models return a key/value cache unless told not to: training keeps none.
    extra = {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", False) else {}

    def loss_fn(p, tokens):
        out = apply_fn(p, tokens, **extra)
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())

    def train_step(state, tokens):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, tokens)
        return state.apply_gradients(grads), {"loss": loss}

    step = train_step if args.mixed_precision == "fp32" else mixed_precision(train_step, args.mixed_precision)
    step = checkpoint(step) if args.checkpoint else step
    step = offload(step) if args.offload else step
    step = shard(step, stage=args.stage) if args.stage else step
    budgets = {f"{t}_bytes": int(getattr(args, f"{t}_gib") * GiB) for t in ("gpu", "host", "nvme")
               if getattr(args, f"{t}_gib") is not None}
    print(plan(step, loss_fn, torch.zeros(batch, seq, dtype=torch.long), params, world_size=args.world_size,
               choose_micro_batches=args.choose_micro_batches, **budgets))
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from zfunc.io import consolidate

    model = build_model(args.model, "--model") if args.model else None
    aliases = "none" if args.no_aliases else build_model(args.aliases, "--aliases") if args.aliases else "recorded"
    out = consolidate(args.ckpt_dir, args.out, DTYPES[args.dtype], step=args.step, aliases=aliases, model=model,
                      verify=not args.no_verify, progress=not args.quiet)
    if not args.quiet:
        print(f"wrote {out}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from zfunc.io import locate, read_manifest

    step_dir = locate(args.ckpt_dir, args.step)
    m = read_manifest(step_dir)
    n = sum(_prod(s) for s in m["params"].values())
    print(f"{step_dir}\n  step {m['step']}, world size {m['world_size']}, stage {m['stage'] or 'plain'}, "
          f"format {m['format_version']} (zfunc {m.get('zfunc_version')}, torch {m.get('torch_version')}), "
          f"created {m.get('created')}")
    print(f"  {len(m['params'])} parameters, {n:,} elements; weights: {m['weights']}")
    if "mesh" in m:  # (format 4: how the state was split beyond the ranks' count)
        print(f"  mesh dp{m['mesh']['dp']} x pp{m['mesh']['pp']} x tp{m['mesh']['tp']}"
              + (f"; stages of blocks: {[len(b) for b in m['pipeline']['stage_blocks']]}" if "pipeline" in m else ""))
    if m.get("ties"):
        print(f"  tied: {', '.join(f'{a} = {k}' for a, k in m['ties'])}")
    for path, dtypes in m["groups"].items():
        print(f"  {path}/*  ({', '.join(sorted(set(dtypes.values())))})")
    for path, leaf in m["leaves"].items():
        print(f"  {path}  {leaf['dtype']} {leaf['shape']}")
    parts = [p for f in m["files"] for p in f["parts"]]
    print(f"  {len(parts)} files from {len(m['files'])} ranks, {sum(p['bytes'] for p in parts) / 2**20:.1f} MiB")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from zfunc.io import locate, read_manifest
    from zfunc.io.reader import check_entries, check_files, open_ranks

    step_dir = locate(args.ckpt_dir, args.step)
    m = read_manifest(step_dir)
    check_files(step_dir, m)
    files = open_ranks(step_dir, m, range(m["world_size"]), check=True)
    try:
        check_entries(m, files, m["groups"], records=True)
    finally:
        for f in files.values():
            f.close()
    parts = sum(len(f["parts"]) for f in m["files"])
    print(f"{step_dir}: {m['world_size']} ranks, {parts} files OK")
    return 0


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def parser(prog: str = "zfunc") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="zfunc command-line tools")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("consolidate", help="write a checkpoint's full weights to one safetensors file")
    c.add_argument("ckpt_dir", help="save directory (uses its latest checkpoint) or one step_* directory")
    c.add_argument("out", help="output .safetensors file (outside the checkpoint)")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the written weights")
    c.add_argument("--step", type=_step, default=None, help="checkpoint step (default: latest)")
    c.add_argument("--model", metavar="MODULE:FACTORY",
                   help="the model FACTORY() builds: also write its frozen parameters, buffers and tied names, "
                        "so that model.load_state_dict(load_file(OUT)) loads strictly")
    names = c.add_mutually_exclusive_group()
    names.add_argument("--aliases", metavar="MODULE:FACTORY",
                       help="write the tied-weight names of this model's (default: those the checkpoint recorded)")
    names.add_argument("--no-aliases", action="store_true", help="write each tied weight under one name only")
    c.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the rank files")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(run=_consolidate)

    for name, run, text in (("info", _info, "describe a checkpoint"),
                            ("verify", _verify, "check every file of a checkpoint against its checksum")):
        s = sub.add_parser(name, help=text)
        s.add_argument("ckpt_dir")
        s.add_argument("--step", type=_step, default=None)
        s.set_defaults(run=run)

    pl = sub.add_parser("plan", help="the memory plan per tier of a stack, before running (zfunc.plan)")
    pl.add_argument("model", metavar="MODULE:FACTORY", help="a function building the model (run on meta)")
    pl.add_argument("--batch", required=True, help="one rank's micro-batch of token ids, BATCHxSEQ (e.g. 8x1024)")
    pl.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    pl.add_argument("--mixed-precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    pl.add_argument("--checkpoint", action="store_true", help="recompute the model's blocks in backward")
    pl.add_argument("--offload", action="store_true", help="optimizer state off the GPU (the plan places it)")
    pl.add_argument("--choose-micro-batches", action="store_true",
                    help="--batch is one rank's batch for a whole update: choose the fewest micro-batches that fit")
    pl.add_argument("--world-size", type=int, default=1)
    for tier in ("gpu", "host", "nvme"):
        pl.add_argument(f"--{tier}-gib", type=float, default=None, help=f"what the {tier} tier may hold per rank")
    pl.set_defaults(run=_plan)

    from zfunc import launch

    lp = sub.add_parser("launch", help="run torchrun on this node for a DeepSpeed hostfile (see zfunc.launch)")
    launch.add_arguments(lp)
    lp.set_defaults(run=launch.main)
    return p


def main(argv: Sequence[str] | None = None, prog: str = "zfunc") -> int:
    """Run the command; returns the exit status (0, or 2 after a one-line error on stderr)."""
    from zfunc.io import CheckpointError

    try:
        args = parser(prog).parse_args(argv)
        return args.run(args)
    except UsageError as e:
        return _fail(str(e), prog)
    except CheckpointError as e:
        return _fail(str(e), prog)
    except OSError as e:  # unreadable directories, a full disk: the path and the reason
        return _fail(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}", prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _fail(message: str, prog: str) -> int:
    text = "; ".join(line.strip() for line in message.splitlines() if line.strip())
    print(f"{prog}: error: {text}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
