"""The ``zfunc`` command.

    zfunc consolidate CKPT_DIR OUT [--dtype fp32|bf16|fp16] [--step N] [--aliases MODULE:FACTORY]
    zfunc info CKPT_DIR [--step N]          what a checkpoint holds (from its manifest)
    zfunc verify CKPT_DIR [--step N]        check every rank file against the manifest's SHA-256
    zfunc launch [--hostfile H ...] SCRIPT [ARGS]   torchrun on this node for a DeepSpeed hostfile

``CKPT_DIR`` is a save directory (its ``latest`` checkpoint, or ``--step``)
or one ``step_*`` directory. Errors in the checkpoint print one line and exit
with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def _consolidate(args: argparse.Namespace) -> int:
    from zfunc.io import consolidate  # noqa: PLC0415 (keep `zfunc --help` light)

    aliases = None
    if args.aliases:
        module, _, factory = args.aliases.partition(":")
        aliases = getattr(importlib.import_module(module), factory)()
    out = consolidate(args.ckpt_dir, args.out, DTYPES[args.dtype], step=args.step, aliases=aliases,
                      verify=not args.no_verify, progress=not args.quiet)
    if not args.quiet:
        print(f"wrote {out}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from zfunc.io import locate, read_manifest  # noqa: PLC0415

    step_dir = locate(args.ckpt_dir, args.step)
    m = read_manifest(step_dir)
    n = sum(_prod(s) for s in m["params"].values())
    print(f"{step_dir}\n  step {m['step']}, world size {m['world_size']}, stage {m['stage'] or 'plain'}, "
          f"format {m['format_version']} (zfunc {m.get('zfunc_version')}, torch {m.get('torch_version')}), "
          f"created {m.get('created')}")
    print(f"  {len(m['params'])} parameters, {n:,} elements; weights: {m['weights']}")
    for path, dtypes in m["groups"].items():
        print(f"  {path}/*  ({', '.join(sorted(set(dtypes.values())))})")
    for path, leaf in m["leaves"].items():
        print(f"  {path}  {leaf['dtype']} {leaf['shape']}")
    parts = [p for f in m["files"] for p in f["parts"]]
    print(f"  {len(parts)} files from {len(m['files'])} ranks, {sum(p['bytes'] for p in parts) / 2**20:.1f} MiB")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from zfunc.io.format import read_manifest  # noqa: PLC0415
    from zfunc.io.reader import check_files, locate, open_ranks  # noqa: PLC0415

    step_dir = locate(args.ckpt_dir, args.step)
    m = read_manifest(step_dir)
    check_files(step_dir, m)
    for f in open_ranks(step_dir, m, range(m["world_size"]), check=True).values():
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
    p = argparse.ArgumentParser(prog=prog, description="zfunc command-line tools")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("consolidate", help="write a checkpoint's full weights to one safetensors file")
    c.add_argument("ckpt_dir", help="save directory (uses its latest checkpoint) or one step_* directory")
    c.add_argument("out", help="output .safetensors file")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the written weights")
    c.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    c.add_argument("--aliases", metavar="MODULE:FACTORY",
                   help="also write tied-weight aliases of the model FACTORY() builds (e.g. mypkg.models:build)")
    c.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the rank files")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(run=_consolidate)

    for name, run, text in (("info", _info, "describe a checkpoint"),
                            ("verify", _verify, "check every rank file of a checkpoint against its checksum")):
        s = sub.add_parser(name, help=text)
        s.add_argument("ckpt_dir")
        s.add_argument("--step", type=int, default=None)
        s.set_defaults(run=run)

    from zfunc import launch  # noqa: PLC0415 (standard library only)

    lp = sub.add_parser("launch", help="run torchrun on this node for a DeepSpeed hostfile (see zfunc.launch)")
    launch.add_arguments(lp)
    lp.set_defaults(run=launch.main)
    return p


def main(argv: Sequence[str] | None = None, prog: str = "zfunc") -> int:
    args = parser(prog).parse_args(argv)
    from zfunc.io import CheckpointError  # noqa: PLC0415

    try:
        return args.run(args)
    except CheckpointError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
