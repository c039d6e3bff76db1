"""`zfunc launch`: a DeepSpeed hostfile (and its ``--include``/``--exclude``) as a torchrun command.

DeepSpeed's launcher reads a hostfile (``worker-1 slots=4``), filters it with
``--include``/``--exclude`` (``worker-1:0,2@worker-2``), ``--num_nodes`` and
``--num_gpus``, and starts every node over SSH. torchrun instead runs once on
each node. This module does the first half only: for the node this command
runs on (``--node-rank``) it computes the torchrun arguments and runs
``python -m torch.distributed.run`` with them. It never opens a socket and
never logs into another machine: run the same command on every node (by
hand, from a cluster scheduler, or with your own pdsh/ssh loop), changing
only ``--node-rank``.

The mapping, for the selected hosts in hostfile order (node rank = position):

==============================  ===================================================================
DeepSpeed                       torchrun (on node R)
==============================  ===================================================================
hosts left after filtering      ``--nnodes N``
slots selected on host R        ``--nproc-per-node K`` (and ``CUDA_VISIBLE_DEVICES`` set to the
                                selected slots when they are not all of ``0..slots-1``, as
                                DeepSpeed's per-node launcher does)
``--master_addr/--master_port`` ``--master-addr A --master-port P`` (static rendezvous: global
                                ranks follow the hostfile order, as in DeepSpeed) or, with
                                ``--rdzv-backend c10d``, ``--rdzv-endpoint A:P`` (node order is
                                then chosen by the rendezvous)
==============================  ===================================================================

    zfunc launch --hostfile hosts --node-rank 0 --master-addr 10.0.0.1 train.py --lr 3e-4
    zfunc launch --hostfile hosts --include "worker-1:0,2@worker-2" --node-rank 1 ... --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

DEFAULT_MASTER_PORT = 29500   # DeepSpeed's and torchrun's default
_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)\s*(#.*)?$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


class LaunchError(ValueError):
    """A hostfile, filter or launch option that cannot describe a run; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What to run on one node: ``argv`` (``python -m torch.distributed.run ...``) with ``env`` added
    to this process's environment. ``hosts``: the selected hosts and slots, in node-rank order."""

    hosts: tuple[tuple[str, tuple[int, ...]], ...]
    node_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def nproc_per_node(self) -> int:
        return len(self.hosts[self.node_rank][1])

    @property
    def world_size(self) -> int:
        return sum(len(slots) for _, slots in self.hosts)

    def command(self) -> str:
        """The command as a shell line (environment first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


# --------------------------------------------------------------------------
# Hostfile and filters


def parse_hostfile(text: str, name: str = "hostfile") -> dict[str, int]:
    """``host slots=N`` lines (``#`` comments and blank lines allowed) -> ``{host: N}`` in file order."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST_LINE.match(line)
        if match is None:
            raise LaunchError(f"{name}, line {number}: {raw!r} is not 'HOST slots=N' (e.g. 'worker-1 slots=4')")
        host, slots = match["host"], match["slots"]
        if not slots.isdigit() or int(slots) < 1:
            raise LaunchError(f"{name}, line {number}: slots must be a positive whole number, got {slots!r}")
        if host in hosts:
            raise LaunchError(f"{name}, line {number}: host {host!r} is listed twice; give each host one line")
        hosts[host] = int(slots)
    if not hosts:
        raise LaunchError(f"{name} lists no hosts; write one 'HOST slots=N' line per node")
    return hosts


def parse_node_spec(spec: str, option: str = "--include") -> dict[str, list[int] | None]:
    """``NAME[:SLOT[,SLOT...]][@NAME...]`` -> ``{host: sorted slots, or None for all}``."""
    out: dict[str, list[int] | None] = {}
    if not spec.strip():
        raise LaunchError(f"{option} is empty; write e.g. 'worker-1:0,2@worker-2'")
    for part in spec.split("@"):
        host, colon, slots_text = part.strip().partition(":")
        if not host or not _HOST_NAME.match(host):
            raise LaunchError(f"{option} {spec!r}: {part!r} does not name a host (NAME or NAME:SLOT,SLOT)")
        if colon:
            try:
                slots = [int(s) for s in slots_text.split(",")]
            except ValueError:
                raise LaunchError(f"{option} {spec!r}: slots of {host!r} must be comma-separated GPU indices, "
                                  f"got {slots_text!r}") from None
            if any(s < 0 for s in slots):
                raise LaunchError(f"{option} {spec!r}: GPU indices are >= 0, got {slots_text!r}")
        if host in out and (out[host] is None or not colon):
            raise LaunchError(f"{option} {spec!r}: {host!r} appears twice, once with all its slots")
        if colon:
            out[host] = sorted(set((out.get(host) or []) + slots))
        else:
            out[host] = None
    return out


def select(hosts: Mapping[str, int], include: str = "", exclude: str = "", num_nodes: int | None = None,
           num_gpus: int | None = None) -> dict[str, list[int]]:
    """DeepSpeed's resource filter: the hosts and GPU slots to run on, in hostfile order.

    ``include``: only these hosts (all slots, or the listed ones); ``exclude``:
    everything but these (whole hosts, or single slots); ``num_nodes``: the
    first N hosts; ``num_gpus``: slots ``0..K-1`` of each host. ``include`` and
    ``exclude`` exclude each other and the two counts, as in DeepSpeed.
    """
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be combined (as in DeepSpeed); use one")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise LaunchError("--num-nodes/--num-gpus cannot be combined with --include/--exclude (as in DeepSpeed)")
    chosen = {host: list(range(n)) for host, n in hosts.items()}
    spec = parse_node_spec(include or exclude, "--include" if include else "--exclude") if include or exclude \
        else {}
    for host, slots in spec.items():
        if host not in hosts:
            raise LaunchError(f"{'--include' if include else '--exclude'}: host {host!r} is not in the hostfile "
                              f"(hosts: {', '.join(hosts)})")
        for slot in slots or []:
            if slot >= hosts[host]:
                raise LaunchError(f"{'--include' if include else '--exclude'}: GPU {slot} of {host!r} is beyond its "
                                  f"slots={hosts[host]} (indices 0..{hosts[host] - 1})")
    if include:
        chosen = {host: (list(range(hosts[host])) if spec[host] is None else spec[host])
                  for host in hosts if host in spec}
    elif exclude:
        for host, slots in spec.items():
            chosen[host] = [] if slots is None else [s for s in chosen[host] if s not in slots]
    if num_nodes is not None:
        if num_nodes < 1 or num_nodes > len(chosen):
            raise LaunchError(f"--num-nodes {num_nodes}: the hostfile has {len(chosen)} hosts")
        chosen = dict(list(chosen.items())[:num_nodes])
    if num_gpus is not None:
        too_few = [host for host in chosen if hosts.get(host, num_gpus) < num_gpus]
        if num_gpus < 1 or too_few:
            raise LaunchError(f"--num-gpus {num_gpus}: more than the slots of {', '.join(too_few)} "
                              f"({', '.join(f'slots={hosts[h]}' for h in too_few)})" if too_few
                              else f"--num-gpus must be >= 1, got {num_gpus}")
        chosen = {host: list(range(num_gpus)) for host in chosen}
    chosen = {host: slots for host, slots in chosen.items() if slots}
    if not chosen:
        raise LaunchError("the filters leave no GPU to run on")
    return chosen


# --------------------------------------------------------------------------
# The torchrun command


def plan(script: str, script_args: Sequence[str] = (), *, hostfile: str | None = None, include: str = "",
         exclude: str = "", num_nodes: int | None = None, num_gpus: int | None = None,
         node_rank: int | None = None, master_addr: str | None = None, master_port: int = DEFAULT_MASTER_PORT,
         rdzv_backend: str = "static", rdzv_id: str | None = None, module: bool = False,
         python: str = sys.executable) -> LaunchPlan:
    """The torchrun command of this node. Without a hostfile: one node (``localhost``) with
    ``num_gpus`` processes (default: the visible CUDA devices).

    Args:
      node_rank: this node's position among the selected hosts; default 0 for
        one node, else the host whose name is this machine's hostname.
      master_addr: address of node 0, reachable from every node (required for
        several nodes; 127.0.0.1 for one).
      rdzv_backend: ``"static"`` (node ranks as given: DeepSpeed's rank order)
        or ``"c10d"`` (elastic rendezvous at master_addr:master_port).
    """
    if hostfile is not None:
        try:
            with open(hostfile, encoding="utf-8") as f:
                hosts = parse_hostfile(f.read(), hostfile)
        except FileNotFoundError:
            raise LaunchError(f"hostfile {hostfile!r} does not exist") from None
    else:
        if include or exclude:
            raise LaunchError("--include/--exclude need a --hostfile (without one there is only localhost)")
        if num_nodes not in (None, 1):
            raise LaunchError(f"--num-nodes {num_nodes} needs a --hostfile listing the nodes")
        hosts = {"localhost": num_gpus or _local_gpus()}
    chosen = select(hosts, include, exclude, num_nodes, num_gpus)
    rank = _node_rank(chosen, node_rank)
    if len(chosen) > 1 and not master_addr:
        raise LaunchError(f"{len(chosen)} nodes need --master-addr: the address of {next(iter(chosen))!r} "
                          "(node 0) that every node can reach")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise LaunchError(f"--master-port must be a port number in 1..65535, got {master_port!r}")
    if rdzv_backend not in ("static", "c10d"):
        raise LaunchError(f"--rdzv-backend must be 'static' or 'c10d', got {rdzv_backend!r}")
    addr = master_addr or "127.0.0.1"
    host, slots = list(chosen.items())[rank]
    argv = [python, "-m", "torch.distributed.run", f"--nnodes={len(chosen)}", f"--nproc-per-node={len(slots)}"]
    if rdzv_backend == "static":
        argv += [f"--node-rank={rank}", f"--master-addr={addr}", f"--master-port={master_port}"]
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={addr}:{master_port}",
                 f"--rdzv-id={rdzv_id or 'zfunc'}"]
    if module:
        argv.append("--module")
    argv += [script, *script_args]
    env = {} if slots == list(range(hosts[host])) else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}
    return LaunchPlan(tuple((h, tuple(s)) for h, s in chosen.items()), rank, tuple(argv), env)


def _local_gpus() -> int:
    import torch  # noqa: PLC0415 (only when no hostfile says how many)

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise LaunchError("no GPU here: pass --num-gpus N for N processes (each a CPU rank on gloo)")
    return count


def _node_rank(chosen: Mapping[str, list[int]], node_rank: int | None) -> int:
    names = list(chosen)
    if node_rank is not None:
        if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < len(names):
            raise LaunchError(f"--node-rank must be in 0..{len(names) - 1} (the selected hosts: "
                              f"{', '.join(names)}), got {node_rank!r}")
        return node_rank
    if len(names) == 1:
        return 0
    hostname = platform.node()   # this machine's own name: no lookup, no network
    matches = [i for i, name in enumerate(names) if name in (hostname, hostname.split(".")[0])]
    if len(matches) != 1:
        raise LaunchError(f"pass --node-rank: this machine ({hostname!r}) is not exactly one of the selected "
                          f"hosts ({', '.join(names)})")
    return matches[0]


def run(launch: LaunchPlan) -> int:
    """Run the plan's torchrun in the foreground; its exit status."""
    env = {**os.environ, **launch.env}
    try:
        return subprocess.run(launch.argv, env=env, check=False).returncode
    except KeyboardInterrupt:   # torchrun got the same Ctrl-C and stops its workers
        return 130


# --------------------------------------------------------------------------
# The command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``zfunc launch`` (DeepSpeed's underscore spellings work too)."""
    p.add_argument("--hostfile", "-H", help="DeepSpeed hostfile: one 'HOST slots=N' line per node")
    p.add_argument("--include", "-i", default="", help="only these hosts/GPUs, e.g. 'worker-1:0,2@worker-2'")
    p.add_argument("--exclude", "-e", default="", help="all but these hosts/GPUs, e.g. 'worker-1:1'")
    p.add_argument("--num-nodes", "--num_nodes", type=int, default=None, help="use the first N hosts")
    p.add_argument("--num-gpus", "--num_gpus", type=int, default=None, help="processes per node (GPU 0..N-1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None,
                   help="this node's position among the selected hosts (default: found by hostname)")
    p.add_argument("--master-addr", "--master_addr", default=None, help="address of node 0 (several nodes)")
    p.add_argument("--master-port", "--master_port", type=int, default=DEFAULT_MASTER_PORT)
    p.add_argument("--rdzv-backend", choices=("static", "c10d"), default="static",
                   help="static: ranks in hostfile order (DeepSpeed's); c10d: elastic rendezvous")
    p.add_argument("--rdzv-id", default=None, help="run id of the c10d rendezvous (default: 'zfunc')")
    p.add_argument("--module", "-m", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("script", help="the training script (or module with --module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def main(args: argparse.Namespace) -> int:
    """Run (or with ``--dry-run`` print) the torchrun command of ``args``; errors print one line, status 2."""
    try:
        launch = plan(args.script, args.script_args, hostfile=args.hostfile, include=args.include,
                      exclude=args.exclude, num_nodes=args.num_nodes, num_gpus=args.num_gpus,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                      rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id, module=args.module)
    except LaunchError as err:
        print(f"zfunc launch: error: {err}", file=sys.stderr)
        return 2
    hosts = ", ".join(f"{h}:{','.join(map(str, s))}" for h, s in launch.hosts)
    print(f"zfunc launch: node {launch.node_rank} of {launch.nnodes} ({hosts}); {launch.nproc_per_node} "
          f"processes here, {launch.world_size} in all", file=sys.stderr)
    if args.dry_run:
        print(launch.command())
        return 0
    return run(launch)
