"""Checkpoint throughput: zfunc.io save/restore next to torch.distributed.checkpoint (DCP), same state.

    python benchmarks/io_throughput.py                       # 1B parameters on a GPU machine, 50M on CPU
    python benchmarks/io_throughput.py --params 50e6 --repeat 3 --json io.json

The state is an AdamW `TrainState` (fp32 params, mu, nu: 12 bytes per
parameter, plus counters) of ``--params`` parameters in ``--tensors``
2-D tensors, on ``--device`` (default: cuda if present). Measured, in one
process, each ``--repeat`` times (the best run is reported):

- zfunc save: `zfunc.io.save` (write, SHA-256, fsync, atomic commit);
- zfunc restore: `zfunc.io.restore` into a template state, with and without
  checksum verification (``verify=False``);
- DCP save / load: `torch.distributed.checkpoint.save`/`load` of the same
  tensors as one state dict (FileSystemWriter defaults: fsync on, one thread).

GB/s = state bytes / seconds (10^9 bytes). Reads come from the page cache
unless ``--drop-caches`` can drop it (root only) before each read. Prints a
table and writes JSON (``--json``, default stdout's last line).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from zfunc.io import restore, save  # noqa: E402


def make_state(n_params: int, n_tensors: int, device: str, seed: int = 0) -> zf.TrainState:
    cols = 1024
    rows = max(1, n_params // (n_tensors * cols))
    g = torch.Generator(device=device).manual_seed(seed)
    params = {f"layers.{i}.weight": torch.randn(rows, cols, generator=g, device=device) for i in range(n_tensors)}
    state = zf.TrainState.create(params, zf.optim.adamw(1e-3))
    for m in state.opt_state[0].mu.values():
        m.normal_(generator=g)
    for v in state.opt_state[0].nu.values():
        v.uniform_(generator=g)
    return state


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in zf.tree.tree_leaves(state) if isinstance(t, torch.Tensor))


def as_state_dict(state) -> dict:
    adam, lr = state.opt_state
    return {"step": state.step, "params": state.params, "mu": adam.mu, "nu": adam.nu,
            "count": adam.count, "lr_count": lr.count, "lr": lr.learning_rate}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(device: str, fn, *args, **kwargs) -> float:
    sync(device)
    t = time.perf_counter()
    fn(*args, **kwargs)
    sync(device)
    return time.perf_counter() - t


def check_equal(a, b) -> None:
    for x, y in zip(zf.tree.tree_leaves(a), zf.tree.tree_leaves(b)):
        if isinstance(x, torch.Tensor) and not torch.equal(x, y):
            raise AssertionError("restored state differs from the saved one")


def main(argv=None) -> dict:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=1e9 if default_device == "cuda" else 50e6,
                   help="number of parameters (default: 1e9 with CUDA, 5e7 without)")
    p.add_argument("--tensors", type=int, default=48, help="how many parameter tensors")
    p.add_argument("--device", default=default_device)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before each read (root)")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    progress = not args.no_progress
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # DCP without a process group

    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from tqdm.auto import tqdm  # noqa: PLC0415

    base = Path(args.dir or tempfile.mkdtemp(prefix="zfunc-io-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"building a state of {args.params:.3g} parameters on {args.device} ...", file=sys.stderr)
    state = make_state(int(args.params), args.tensors, args.device)
    template = make_state(int(args.params), args.tensors, args.device, seed=1)
    nbytes = state_bytes(state)
    times: dict[str, list[float]] = {k: [] for k in ("zfunc save", "zfunc restore", "zfunc restore (no verify)",
                                                     "DCP save", "DCP load")}
    dropped = None
    phases = tqdm(total=args.repeat * 5, desc="benchmark", disable=not progress, position=0)
    try:
        for r in range(args.repeat):
            zdir, ddir = base / f"zfunc-{r}", base / f"dcp-{r}"
            phases.set_postfix_str("zfunc save")
            times["zfunc save"].append(timed(args.device, save, zdir, state, progress=progress))
            phases.update()
            for verify, key in ((True, "zfunc restore"), (False, "zfunc restore (no verify)")):
                if args.drop_caches:
                    dropped = drop_caches()
                phases.set_postfix_str(key)
                times[key].append(timed(args.device, restore, zdir, like=template, verify=verify, progress=progress))
                check_equal(state, template)
                phases.update()
            phases.set_postfix_str("DCP save")
            times["DCP save"].append(timed(args.device, dcp.save, as_state_dict(state), checkpoint_id=ddir))
            phases.update()
            if args.drop_caches:
                dropped = drop_caches()
            fresh = make_state(int(args.params), args.tensors, args.device, seed=2)
            phases.set_postfix_str("DCP load")
            times["DCP load"].append(timed(args.device, dcp.load, as_state_dict(fresh), checkpoint_id=ddir))
            check_equal(state, fresh)
            del fresh
            phases.update()
            shutil.rmtree(zdir)
            shutil.rmtree(ddir)
    finally:
        phases.close()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    best = {k: min(v) for k, v in times.items()}
    result = {
        "params": int(args.params), "tensors": args.tensors, "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
        or platform.machine(),
        "state_bytes": nbytes, "repeat": args.repeat, "page_cache_dropped": dropped,
        "torch": torch.__version__, "zfunc": zf.__version__, "cpus": os.cpu_count(),
        "seconds": best, "gb_per_s": {k: nbytes / t / 1e9 for k, t in best.items()},
        "ratio_zfunc_over_dcp": {"save": best["DCP save"] / best["zfunc save"],
                                 "restore": best["DCP load"] / best["zfunc restore"],
                                 "restore (no verify)": best["DCP load"] / best["zfunc restore (no verify)"]},
    }
    print(f"\nstate: {args.params:.3g} parameters, {nbytes / 1e9:.2f} GB on {args.device} "
          f"(best of {args.repeat}; page cache {'dropped' if dropped else 'warm'})")
    print(f"{'operation':<28}{'seconds':>10}{'GB/s':>10}")
    for k, t in best.items():
        print(f"{k:<28}{t:>10.3f}{nbytes / t / 1e9:>10.2f}")
    print("zfunc vs DCP (speed ratio, >1 = zfunc faster): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratio_zfunc_over_dcp"].items()))
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
