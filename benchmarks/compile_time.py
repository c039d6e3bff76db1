"""Compile time of zfunc steps against the floor's ``torch.compile(model)``, cold and with a warm cache.

    python benchmarks/compile_time.py                      # tiny GPT, CPU or GPU, one process per run
    python benchmarks/compile_time.py --model medium --seq 1024 --micro-batch 8   # GPT-2 medium on a GPU
    python benchmarks/compile_time.py --layers 12 --contenders floor,zfunc-s3-compiled   # deeper tiny GPT, CPU
    python benchmarks/compile_time.py --nodes --layers 4 --contenders floor,zfunc-s3-compiled   # what is compiled

Each contender runs in a fresh process (so nothing of one compile helps another) twice with one
cache directory (``TORCHINDUCTOR_CACHE_DIR``, the FX graph and AOTAutograd caches torch keeps by
default): **cold**, the directory empty; **warm**, the directory the cold run filled, as in a
second run of a training script. Compile time is the first step's wall time less a later step's
median (what the first step spent compiling); the table gives it and its ratio to the floor's cold
and warm figures, the same in CPU seconds (robust to the load of a shared machine; with
``TORCHINDUCTOR_COMPILE_THREADS=1`` it includes the build), the 1-minute load average around each run, and the JSON (``--json``) each run's time per phase of the compile (``phases``:
dynamo's tracing, Inductor's lowering, scheduling and code generation, the build of the generated code),
summed over the process's compiles from dynamo's own timers, and ``caches``: the AOTAutograd and FX graph
cache hits, misses and bypasses (a warm run that misses or bypasses a cache compiles again what the cold run
stored; AOTAutograd's cache refuses a graph holding an autograd Function, for one), and ``kernels``: the fused
kernels Inductor generated (``generated``, one per launch site) and their distinct sources (``distinct``: each
defined and built once per graph; a count that grows with the depth would mean identical blocks no longer
share their kernels). ``--layers`` sets the depth (the tiny
model's default is 4; blocks dominate a compile from about 12). ``--nodes`` times nothing: it counts
the operator nodes of each contender's graphs after AOTAutograd (what Inductor schedules; its fusion
search grows faster than the count) by the zfunc, model or script line that made them.

Contenders (one world-1 process group; the model: transformers' GPT2LMHeadModel from a config):

- ``floor``: ``torch.compile(model)``, forward and backward compiled, torch's AdamW eager;
- ``zfunc-s3``: the eager step, nothing compiled: its "compile" figure is what a first step costs
  besides compiling (building the shard layout's tables, the CPU Adam kernel's JIT on a CPU), to
  subtract from the compiled zfunc contenders' figures;
- ``zfunc-s3-compiled``: ``torch.compile(shard(mixed_precision(step), stage=3), fullgraph=True)``,
  the whole step in one graph (every block unrolled); ``zfunc-s1-compiled`` / ``zfunc-s2-compiled``: the
  same at stage 1 / 2;
- ``zfunc-s3-compiled-sgd``: the same with plain SGD instead of AdamW: the part of the compile that is
  the optimizer update (in the graph, one update per parameter tensor; the floor's optimizer is eager);
- ``zfunc-s3-blocks`` / ``zfunc-s3-checkpoint-blocks``: ``compile_blocks`` (regional compile: each
  block's forward compiled once for all identical blocks, the step eager), without / with
  ``checkpoint``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

CONTENDERS = ["floor", "zfunc-s3", "zfunc-s1-compiled", "zfunc-s2-compiled", "zfunc-s3-compiled",
              "zfunc-s3-compiled-sgd", "zfunc-s3-blocks", "zfunc-s3-checkpoint-blocks"]
SHAPES = {"tiny": (128, 4, 4, 512), "medium": (1024, 24, 16, 50257)}  # n_embd, n_layer, n_head, vocab


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    n_embd, n_layer, n_head, vocab = SHAPES[args.model]
    n_layer = args.layers or n_layer
    cfg = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=args.seq, vocab_size=vocab,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def tokens(args, i, device):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, SHAPES[args.model][3], (args.micro_batch, args.seq), generator=g).to(device)


def floor_step(args, device):
    model = make_model(args).to(device)
    forward = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def one(i):
        x = tokens(args, i, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(forward(input_ids=x, use_cache=False).logits, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return one


def zfunc_step(args, device, name):
    import zfunc as zf
    from zfunc.transforms import checkpoint, compile_blocks, mixed_precision, shard

    model = make_model(args).to(device)
    apply_fn, params = zf.functional(model)

    def loss_fn(p, x):
        return lm_loss(apply_fn(p, input_ids=x, use_cache=False).logits, x)

    def train_step(state, x):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, x)
        return state.apply_gradients(grads), {"loss": loss}

    step = mixed_precision(train_step, "bf16")
    if name.endswith("-blocks"):
        step = compile_blocks(step)
    if "-checkpoint" in name:
        step = checkpoint(step)
    step = shard(step, stage=int(name.split("-")[1][1:]))  # (zfunc-sN...: stage N)
    # (-sgd: plain SGD, the smallest update there is: what the rest of the compile costs without Adam's)
    tx = zf.optim.sgd(1e-4) if name.endswith("-sgd") else zf.optim.adamw(1e-4, weight_decay=0.1)
    box = {"state": step.init(zf.TrainState.create(params, tx))}
    del params
    apply_fn.release_module_params()
    run = torch.compile(step, fullgraph=True) if "-compiled" in name else step

    def one(i):
        box["state"], metrics = run(box["state"], tokens(args, i, device))
        return metrics["loss"]

    return one


def counting_backend(counts: dict):
    """A torch.compile backend that runs AOTAutograd (forward and backward graphs, as Inductor would get
    them) and counts their operator nodes by the source line that made each: ``{"file:function": n}``."""
    from torch._functorch.aot_autograd import aot_module_simplified

    def count(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op != "call_function":
                continue
            frames = [line for line in (node.meta.get("stack_trace") or "").splitlines()
                      if line.strip().startswith("File")]
            # The innermost frame in zfunc, the model or this script (not torch's own).
            where = next((f.split('"')[1].rsplit("/", 1)[-1] + ":" + f.rsplit(" in ", 1)[-1].strip()
                          for f in reversed(frames) if "/torch/" not in f.split('"')[1]), "(torch)")
            counts[where] = counts.get(where, 0) + 1
            counts["total"] = counts.get("total", 0) + 1
        return graph_module

    def backend(graph_module, example_inputs):
        return aot_module_simplified(graph_module, example_inputs, fw_compiler=count, bw_compiler=count)

    return backend


def measure(args) -> dict:
    """One contender in this process: the first step's time, the later steps' median."""
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    counts: dict = {}
    if args.nodes:  # (count the graphs' nodes instead of compiling them with Inductor)
        compile_ = torch.compile
        torch.compile = lambda fn, **kw: compile_(fn, **{**kw, "backend": counting_backend(counts)})
    one = floor_step(args, device) if args.one == "floor" else zfunc_step(args, device, args.one)
    if args.nodes:
        one(0)
        dist.destroy_process_group()
        return {"nodes": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}
    times, cpu, loss = [], [], None
    for i in range(1 + args.steps):
        sync()
        start, start_cpu = time.perf_counter(), cpu_seconds()
        if i == 0 and args.profile:  # (the first step, its compile, under cProfile: where the seconds go)
            import cProfile

            profiler = cProfile.Profile()
            loss = profiler.runcall(one, i)
            profiler.dump_stats(os.path.join(args.profile, f"{args.one}-{args.tag}.prof"))
        else:
            loss = one(i)
        sync()
        times.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    median = statistics.median(times[1:])
    dist.destroy_process_group()
    return {"first_s": times[0], "step_ms": 1e3 * median, "compile_s": max(0.0, times[0] - median),
            "compile_cpu_s": max(0.0, cpu[0] - statistics.median(cpu[1:])), "loss": float(loss), "phases": phases(),
            "caches": caches(), "kernels": kernels()}


def kernels() -> dict:
    """What Inductor generated in this process (a cold run; a warm one loads its code): ``generated``, the
    fused kernels of the graphs (one per launch site, as Inductor counts them), and ``distinct``, the kernel
    sources among them (identical sources are defined and compiled once per graph: the dedupe that spares
    identical blocks their build) — counts that transfer between the CPU's C++ and the GPU's Triton, where
    seconds do not."""
    import re

    from torch._inductor import metrics

    distinct = 0
    for path in output_code_files(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")):
        with open(path, errors="replace") as f:  # (a graph's output code: its kernels, each source defined once)
            distinct += len(re.findall(r"= async_compile\.(?:cpp_pybinding|triton)\(", f.read()))
    return {"generated": metrics.generated_kernel_count, "distinct": distinct}


def cpu_seconds() -> float:
    """CPU time of this process and its waited-for children (the C++ compiler Inductor runs): on a machine
    shared with other work, a compile's CPU time moves far less with the load than its wall time. (Inductor's
    pool of compile workers is not waited for: run with TORCHINDUCTOR_COMPILE_THREADS=1 to count its work.)"""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# Where a compile spends its time (dynamo's timers, seconds summed over the process's compiles):
# tracing the Python (dynamo), AOTAutograd's joint graph and partition, Inductor's lowering,
# scheduling and code generation, the C++/Triton compile of the generated code.
PHASES = {"dynamo": "bytecode_tracing", "aot+inductor": "create_aot_dispatcher_function",
          "inductor": "compile_fx_inner", "lowering": "GraphLowering.run", "scheduling": "Scheduler.__init__",
          "codegen": "Scheduler.codegen", "build": "async_compile.wait", "guards": "build_guards"}


def phases() -> dict:
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    found = dict(zip(names, (float(v) for v in values)))
    return {phase: round(found[key], 2) for phase, key in PHASES.items() if key in found}


def caches() -> dict:
    """The compile caches' hits and misses in this process (AOTAutograd's and Inductor's FX graph cache; a
    warm run that misses compiles again what the cold run stored), and dynamo's graphs, graph breaks and
    recompiles."""
    from torch._dynamo.utils import counters

    wanted = {"aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass",
                               "autograd_cache_guard_miss"),
              "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
    out = {name: counters[group][name] for group, names in wanted.items() for name in names if counters[group][name]}
    out["graphs"] = counters["stats"]["unique_graphs"]
    out.update({k: sum(v.values()) for k, v in counters.items() if k in ("graph_break", "recompiles") and v})
    return out


def output_code_files(cache: str) -> list[str]:
    """The graphs' output code in an Inductor cache directory: the modules holding ``async_compile.wait``
    (each defines its graph's kernels once and the ``call`` that launches them)."""
    import glob

    found = []
    for path in glob.glob(os.path.join(cache, "**", "*.py"), recursive=True):
        with open(path, errors="replace") as f:
            if "async_compile.wait" in f.read():
                found.append(path)
    return sorted(found)


def keep_output_code(cache: str, into: str) -> None:
    import shutil

    os.makedirs(into, exist_ok=True)
    for path in output_code_files(cache):
        shutil.copy(path, os.path.join(into, os.path.basename(path)))


def run_one(args, name: str, cache: str, tag: str = "cold") -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (zfunc from this checkout)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "TORCHINDUCTOR_CACHE_DIR": cache, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + os.getpid() % 300)}
    cmd = [sys.executable, __file__, "--one", name, "--model", args.model, "--seq", str(args.seq),
           "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--layers", str(args.layers)]
    cmd += ["--nodes"] if args.nodes else []
    cmd += ["--inductor", args.inductor, "--tag", tag]
    cmd += ["--profile", args.profile] if args.profile else []
    load_before = os.getloadavg()[0]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        # (The exception's own line: torch prints warnings after it, at exit; its "Warning" lines are not it.)
        text = [line for line in (done.stderr or done.stdout).strip().splitlines()
                if "Warning" not in line and "warn(" not in line]
        raised = [line for line in text if re.search(r"\w*(Error|Exception|Unsupported): ", line)]
        return {"error": (raised or text or ["no output"])[-1:], "exit": done.returncode, "stderr_tail": text[-30:]}
    # The 1-minute load average before and after the run: on a shared machine, a compile's time is only
    # comparable to another's made at the same load.
    return {**json.loads(lines[-1]), "load": [round(load_before, 1), round(os.getloadavg()[0], 1)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=0, help="blocks (0: the model's own)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--nodes", action="store_true",
                   help="instead of timing: the operator nodes of each contender's compiled graphs (after "
                        "AOTAutograd, what Inductor schedules), by the source line that made them")
    p.add_argument("--inductor", default="{}",
                   help="Inductor config for every contender, as JSON (e.g. "
                        "'{\"max_fusion_buffer_group_pairwise_attempts\": 16}': its fusion search)")
    p.add_argument("--cold-only", action="store_true",
                   help="one cold run per contender, no warm one (half the time: the figure the 2x goal is about)")
    p.add_argument("--json")
    p.add_argument("--profile", metavar="DIR",
                   help="cProfile each run's first step (its compile) into DIR/CONTENDER-cold.prof / -warm.prof "
                        "(read with python -m pstats; sort by cumulative time); its times then include the profiler's overhead")
    p.add_argument("--keep-code", metavar="DIR",
                   help="copy each contender's generated output code (one .py per graph: its kernels' sources and the "
                        "wrapper that launches them) into DIR/CONTENDER/, to read what Inductor made of it")
    p.add_argument("--tag", default="cold", help=argparse.SUPPRESS)  # (internal: cold or warm, for --profile)
    p.add_argument("--one", help=argparse.SUPPRESS)  # (internal: measure one contender in this process)
    args = p.parse_args()
    unknown = sorted(set(args.contenders.split(",")) - set(CONTENDERS))
    if unknown:  # (a misspelt name would otherwise run as whatever its parts happen to select)
        p.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    if args.one:
        import torch._inductor.config as inductor_config

        with inductor_config.patch(**json.loads(args.inductor)):
            print(json.dumps(measure(args)), flush=True)
        return
    if args.profile:
        args.profile = os.path.abspath(args.profile)
        os.makedirs(args.profile, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"# compile_time {args.model} mb={args.micro_batch} seq={args.seq} {device} torch {torch.__version__} "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results = {}
    if args.nodes:
        for name in args.contenders.split(","):
            if name != "floor" and "-compiled" not in name:
                continue  # (eager steps: their graphs are per block, see the timing)
            with tempfile.TemporaryDirectory(prefix="zfunc-compile-cache-") as cache:
                results[name] = run_one(args, name, cache)
            nodes = results[name].get("nodes", results[name])
            top = list(nodes.items())[:16]
            print(f"  {name}: " + ", ".join(f"{where} {n}" for where, n in top), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=2)
        return
    for name in args.contenders.split(","):
        # (A contender named twice runs twice, e.g. floor,zfunc-s3-compiled,floor: on a shared machine, the
        # floor before and after bounds how the load moved; the ratios are to the first floor.)
        key = name if name not in results else f"{name}#{sum(k.split('#')[0] == name for k in results) + 1}"
        with tempfile.TemporaryDirectory(prefix="zfunc-compile-cache-") as cache:
            results[key] = {"cold": run_one(args, name, cache)}
            results[key]["warm"] = results[key]["cold"] if args.cold_only else run_one(args, name, cache, "warm")
            if args.keep_code:
                keep_output_code(cache, os.path.join(args.keep_code, key))
        print(f"  {key}: {json.dumps(results[key])}", flush=True)
    floor = results.get("floor", {})
    print("\n| contender | cold compile s | vs floor cold | cold compile CPU s | vs floor | warm compile s | vs floor warm "
          "| step ms | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = []
    for name, r in results.items():
        cold, warm = r["cold"], r["warm"]
        if "error" in cold or "error" in warm:
            print(f"| {name} | error: {cold.get('error') or warm.get('error')} | | | | | | | |")
            failed.append(name)
            continue

        def ratio(kind, r=r, what="compile_s"):
            base = floor.get(kind, {}).get(what)
            return f"{r[kind][what] / base:.2f}x" if base else "-"

        print(f"| {name} | {cold['compile_s']:.1f} | {ratio('cold')} | {cold['compile_cpu_s']:.1f} "
              f"| {ratio('cold', what='compile_cpu_s')} | {warm['compile_s']:.1f} | {ratio('warm')} "
              f"| {warm['step_ms']:.1f} | {cold['load'][0]}-{cold['load'][1]} |")
    for name in failed:  # (what the failed run printed last: the JSON keeps it too)
        r = results[name]
        tail = (r["cold"] if "error" in r["cold"] else r["warm"]).get("stderr_tail", [])
        print(f"\n{name} failed; the end of its output:\n" + "\n".join(tail), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device, "torch": torch.__version__, "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
