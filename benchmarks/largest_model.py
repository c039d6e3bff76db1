"""The largest model one GPU box trains: zfunc's planned tiers vs DeepSpeed ZeRO-3 offload and FSDP2 CPU offload.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    python benchmarks/largest_model.py --sizes 2.7b,6.7b,13b --contenders zfunc,deepspeed,fsdp2 \\
        --tokens-per-step 32768 --micro-batch 8 --json out.json

Model: transformers' GPT2LMHeadModel from a config (GPT-2-shaped: ``SIZES``,
head size 128, sequence 1024, vocabulary 50257, dropout 0), random tokens,
bf16 compute, fp32 AdamW (lr 1e-4, weight decay 0.1), full activation
recompute, and the same tokens per optimizer step for every contender
(micro-batches accumulated).

Each (size, contender) runs in its own process, so that one running out of
memory loses nothing else; this driver samples the process's resident host
memory (its whole process group) and the disk used in ``--nvme-dir`` twice a
second, kills it past ``--host-limit-gib`` (reported as host out of memory,
before the kernel's OOM killer picks a victim) or ``--limit-s``, and reports
per contender and size: trains or not (and why), step time, tokens/s, model
TFLOP/s (6·N·tokens per step / step time), peak GPU (allocated and reserved),
peak host, disk used, init time, and for zfunc the plan's predicted GPU and
host peaks beside the measured ones and the placement it chose.

Contenders:
- ``zfunc``: ``shard(offload(checkpoint(mixed_precision(accumulate(step)))), stage=3)``, the model built on
  the meta device and materialized unit by unit, the placement from `zf.plan` for this machine's GPU,
  host memory and disk (GPU first, then host, then NVMe);
- ``zfunc-host``: the same with the whole optimizer state on the host (``device_fraction=0``): host bytes
  per parameter of the optimizer-offload path;
- ``deepspeed``: ZeRO-3, ``offload_param`` and ``offload_optimizer`` to pinned CPU memory, ``zero.Init``,
  its default optimizer for offload (DeepSpeedCPUAdam), Hugging Face gradient checkpointing;
- ``deepspeed-nvme``: the same with parameters and optimizer state on NVMe (ZeRO-Infinity), if its async
  I/O op builds here (reported otherwise);
- ``deepspeed-z2`` / ``deepspeed-z3``: DeepSpeed at its best for a model that fits on the GPU: ZeRO-2 / ZeRO-3
  without offload, its default optimizer for that case (FusedAdam, from ``"type": "AdamW"``), bf16,
  Hugging Face gradient checkpointing;
- ``fsdp2``: ``fully_shard`` per block and the root with ``CPUOffloadPolicy`` and bf16/fp32 mixed
  precision (torchtitan's settings), torch AdamW (fused, on the CPU), gradient checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

SIZES = {  # name: (n_embd, n_layer)
    "tiny": (256, 4),
    "350m": (1024, 24),
    "2.7b": (2560, 32),
    "6.7b": (4096, 32),
    "13b": (5120, 40),
    "17b": (5120, 54),
    "19b": (5120, 60),
    "20b": (6144, 44),
    "22b": (6144, 48),
}
CONTENDERS = ("zfunc", "zfunc-host", "deepspeed", "deepspeed-nvme", "deepspeed-z2", "deepspeed-z3", "fsdp2")
SEQ, VOCAB = 1024, 50257
GiB = 1 << 30


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- one run (a child process)


def config(size: str):
    from transformers import GPT2Config

    n_embd, n_layer = SIZES[size]
    cfg = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_embd // 128 if n_embd >= 1024 else 4,
                     n_positions=SEQ, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def parameters_of(size: str) -> int:
    n_embd, n_layer = SIZES[size]
    return n_layer * (12 * n_embd * n_embd + 13 * n_embd) + (VOCAB + SEQ) * n_embd + 2 * n_embd


def tokens(i: int, rows: int, device):
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g).to(device, non_blocking=True)


def lm_loss(logits, ids):
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def chunked_lm(model, chunks: int):
    """``model`` (a GPT2LMHeadModel) whose forward returns the language-model loss computed over ``chunks``
    slices of the tokens, each slice's logits recomputed in backward (torch's checkpoint): the full logits
    (tokens x vocabulary, in bf16 and fp32, and their gradient) never exist at once. The same loss as
    `lm_loss` on the full logits, up to the order of the sum."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint as recompute

    class ChunkedLM(torch.nn.Module):
        def __init__(self, lm) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            hidden = self.lm.transformer(input_ids=ids, use_cache=False).last_hidden_state[:, :-1].flatten(0, 1)
            targets = ids[:, 1:].flatten()
            weight = self.lm.lm_head.weight

            def piece(h, y):
                return F.cross_entropy((h @ weight.t()).float(), y, reduction="sum")

            total = sum(recompute(piece, h, y, use_reentrant=False)
                        for h, y in zip(hidden.chunk(chunks), targets.chunk(chunks)))
            return total / targets.numel()

    return ChunkedLM(model)


def run_zfunc(args, device, micro_batches):
    import torch

    import zfunc as zf
    from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

    with torch.device("meta"):
        from transformers import GPT2LMHeadModel

        model = GPT2LMHeadModel(config(args.size))
    # (the chunked loss wraps the model: Hugging Face's own init, given as a function of a module)
    init = model._init_weights if args.loss_chunks > 1 else "hf"
    if args.loss_chunks > 1:
        model = chunked_lm(model, args.loss_chunks)
    apply_fn, params = zf.functional(model, init=init)

    def loss_fn(p, ids):
        if args.loss_chunks > 1:
            return apply_fn(p, ids)
        return lm_loss(apply_fn(p, input_ids=ids, use_cache=False).logits, ids)

    def train_step(state, ids):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, ids)
        return state.apply_gradients(grads), {"loss": loss}

    def inner(k):
        return checkpoint(mixed_precision(accumulate(train_step, k) if k > 1 else train_step, "bf16"))

    nvme = {"nvme_dir": args.nvme_dir}
    forced = {"device_fraction": 0.0} if args.contender == "zfunc-host" else {}
    # The host budget is what the limit leaves above this process as it stands (CUDA context, libraries).
    budgets = {"gpu_bytes": torch.cuda.mem_get_info(device)[0] + int(args.gpu_extra_gib * GiB),
               "host_bytes": int((args.host_limit_gib - args.host_margin_gib) * GiB) - _group_rss(os.getpgid(0)),
               "nvme_bytes": _disk_free(args.nvme_dir)}
    start = time.perf_counter()
    rows = args.micro_batch * micro_batches  # one update's rows
    choose = args.zfunc_micro_batch == "auto"
    if not choose:  # as asked: one micro-batch of --zfunc-micro-batch rows, accumulated
        micro_batches = rows // int(args.zfunc_micro_batch)
    memory_plan = zf.plan(shard(offload(inner(1 if choose else micro_batches), **nvme, **forced), stage=3), loss_fn,
                          torch.empty(rows if choose else rows // micro_batches, SEQ, dtype=torch.long,
                                      device=device), params, fit=not forced, choose_micro_batches=choose, **budgets)
    micro_batches = memory_plan.micro_batches if choose else micro_batches
    log(f"planned in {time.perf_counter() - start:.1f} s:\n{memory_plan}")
    step = shard(offload(inner(micro_batches), **nvme, **(forced or memory_plan.offload_kwargs)), stage=3)
    log("@phase init")
    start = time.perf_counter()
    state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-4, weight_decay=0.1)), init_device=device)
    torch.cuda.synchronize()
    init_s = time.perf_counter() - start
    log(f"init {init_s:.1f} s; state placed:\n{zf.describe(state)}")
    del params

    def one(i):
        nonlocal state
        state, metrics = step(state, tokens(i, rows, device))
        return metrics["loss"]

    planned = {"gpu_gib": memory_plan.tiers["gpu"].peak / GiB, "host_gib": memory_plan.tiers["host"].peak / GiB,
               "nvme_gib": memory_plan.tiers["nvme"].peak / GiB, "placement": memory_plan.placement,
               "fits": memory_plan.fits}
    return one, {"init_s": init_s, "planned": planned, "micro_batch": rows // micro_batches,
                 "micro_batches": micro_batches}


def run_deepspeed(args, device, micro_batches, nvme: bool, stage: int = 3, offload: bool = True):
    import deepspeed
    import torch
    from transformers import GPT2LMHeadModel

    if nvme:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible():
            raise Unavailable("DeepSpeed's async I/O op (aio) does not build here (libaio missing)")
    where = ({"device": "nvme", "nvme_path": args.nvme_dir, "pin_memory": True} if nvme
             else {"device": "cpu", "pin_memory": True})
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": micro_batches,
           "bf16": {"enabled": True}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}}
    if offload:
        cfg["zero_optimization"].update(offload_optimizer=dict(where), **({"offload_param": dict(where)} if stage == 3 else {}))
    log("@phase init")
    start = time.perf_counter()
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = GPT2LMHeadModel(config(args.size))
    else:
        model = GPT2LMHeadModel(config(args.size))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch.cuda.synchronize()
    init_s = time.perf_counter() - start

    def one(i):
        ids = tokens(i, args.micro_batch * micro_batches, device)
        total = 0.0
        for chunk in ids.chunk(micro_batches):
            loss = lm_loss(engine(input_ids=chunk, use_cache=False).logits, chunk)
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
            total += loss.detach()
        return total / micro_batches

    one.engine = engine  # the driver reports which optimizer DeepSpeed chose
    return one, {"init_s": init_s}


def run_fsdp2(args, device, micro_batches):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import GPT2LMHeadModel

    log("@phase init")
    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT2LMHeadModel(config(args.size))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=True)
    blocks = list(model.transformer.h)
    for i, block in enumerate(blocks):
        fully_shard(block, mp_policy=policy, offload_policy=offload_policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mp_policy=policy, offload_policy=offload_policy)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if "ln" in name and name.endswith("weight"):
                local.fill_(1.0)
            elif name.endswith("bias"):
                local.zero_()
            else:
                local.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    init_s = time.perf_counter() - start

    def one(i):
        ids = tokens(i, args.micro_batch * micro_batches, device)
        total = 0.0
        for chunk in ids.chunk(micro_batches):
            loss = lm_loss(model(input_ids=chunk, use_cache=False).logits, chunk) / micro_batches
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return one, {"init_s": init_s}


class Unavailable(Exception):
    """A contender that cannot run on this machine (reported, not a failure of the contender's code)."""


def run_one(args) -> dict:
    import torch
    import torch.distributed as dist

    micro_batches = args.tokens_per_step // (args.micro_batch * SEQ)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    try:
        if args.contender.startswith("zfunc"):
            one, extra = run_zfunc(args, device, micro_batches)
        elif args.contender in ("deepspeed-z2", "deepspeed-z3"):
            one, extra = run_deepspeed(args, device, micro_batches, nvme=False, stage=int(args.contender[-1]),
                                       offload=False)
            extra["optimizer"] = type(getattr(one.engine.optimizer, "optimizer", one.engine.optimizer)).__name__
        elif args.contender.startswith("deepspeed"):
            one, extra = run_deepspeed(args, device, micro_batches, nvme=args.contender.endswith("nvme"))
        else:
            one, extra = run_fsdp2(args, device, micro_batches)
        log("@phase steps")
        times, loss = [], None
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = float(one(i))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            log(f"step {i + 1}/{args.warmup + args.steps}: {times[-1]:.2f} s, loss {loss:.4f}"
                + (" (warm-up)" if i < args.warmup else ""))
            if i == args.warmup - 1:
                torch.cuda.reset_peak_memory_stats()
        median = statistics.median(times[args.warmup:])
        n, tokens_per_step = parameters_of(args.size), micro_batches * args.micro_batch * SEQ
        return {"trains": True, "step_s": median, "steps_s": times, "tokens_per_step": tokens_per_step,
                "micro_batch": args.micro_batch, "micro_batches": micro_batches,
                "tokens_per_s": tokens_per_step / median, "model_tflops": 6 * n * tokens_per_step / median / 1e12,
                "gpu_alloc_gib": torch.cuda.max_memory_allocated() / GiB,
                "gpu_reserved_gib": torch.cuda.max_memory_reserved() / GiB, "loss": loss, **extra}
    except Unavailable as e:
        return {"trains": False, "why": str(e)}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the driver


def _disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _disk_used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _group_rss(pgid: int) -> int:
    """Resident bytes of every process in the process group ``pgid``."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total


def supervise(args, size: str, contender: str) -> dict:
    """Run one (size, contender) in a child process; sample its host memory and the disk; kill it past the
    limits; return its result with the driver's measurements."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--size", size, "--contender", contender,
           "--micro-batch", str(args.micro_batch), "--tokens-per-step", str(args.tokens_per_step),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--nvme-dir", args.nvme_dir,
           "--host-limit-gib", str(args.host_limit_gib),
           "--host-margin-gib", str(args.host_margin_gib), "--loss-chunks", str(args.loss_chunks),
           "--gpu-extra-gib", str(args.gpu_extra_gib), "--zfunc-micro-batch", args.zfunc_micro_batch]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "PYTHONUNBUFFERED": "1"}
    disk_before = _disk_used(args.nvme_dir)
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    fd = child.stdout.fileno()
    os.set_blocking(fd, False)
    start, phase, peaks, disk_peak, result, killed, tail = time.time(), "start", {}, 0, None, None, []
    buffer = ""
    while True:
        try:
            chunk = os.read(fd, 1 << 20).decode(errors="replace")
        except BlockingIOError:
            chunk = ""
        buffer += chunk
        *lines, buffer = buffer.split("\n")
        for line in lines:
            if line.startswith("@phase "):
                phase = line.split()[1]
            elif line.startswith("@result "):
                result = json.loads(line[len("@result "):])
            else:
                if "warn" not in line.lower():
                    log(f"  [{size} {contender}] {line}")
                tail = (tail + [line])[-15:]
        rss = _group_rss(child.pid)
        peaks[phase] = max(peaks.get(phase, 0), rss)
        disk_peak = max(disk_peak, _disk_used(args.nvme_dir) - disk_before)
        if child.poll() is not None and not chunk:
            break
        if killed is None and rss > args.host_limit_gib * GiB:
            killed = f"host out of memory: resident {rss / GiB:.1f} GiB > {args.host_limit_gib} GiB in {phase}"
        elif killed is None and time.time() - start > args.limit_s:
            killed = f"time limit: {args.limit_s} s in {phase}"
        if killed is not None and child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        time.sleep(0.5)
    out = result or {"trains": False}
    if result is None:
        out["why"] = killed or f"exit {child.returncode}: " + " | ".join(t for t in tail[-4:] if t.strip())[-600:]
    out.update(size=size, contender=contender, parameters=parameters_of(size), wall_s=time.time() - start,
               host_peak_gib=max(peaks.values(), default=0) / GiB,
               host_peak_by_phase_gib={k: v / GiB for k, v in peaks.items()}, disk_peak_gib=disk_peak / GiB)
    if out.get("trains"):
        out["host_bytes_per_param"] = max(peaks.values()) / out["parameters"]
        # Above the process before the model existed (torch, the CUDA context, the plan): the model's own.
        out["host_bytes_per_param_model"] = (max(peaks.values()) - peaks.get("start", 0)) / out["parameters"]
    return out


def table(rows: list[dict]) -> str:
    head = ("size", "contender", "trains", "tok/step", "mb x k", "step s", "tok/s", "TFLOP/s", "GPU alloc", "GPU resv",
            "host peak", "B/param (model)", "disk", "init s", "plan GPU", "plan host", "why / placement")
    lines = [head]
    for r in rows:
        p = r.get("planned", {})
        ok = r.get("trains")
        lines.append((r["size"], r["contender"], "yes" if ok else "no",
                      f"{r.get('tokens_per_step', 0)}" if ok else "",
                      f"{r.get('micro_batch')} x {r.get('micro_batches')}" if ok else "", f"{r['step_s']:.2f}" if ok else "",
                      f"{r['tokens_per_s']:.0f}" if ok else "", f"{r['model_tflops']:.1f}" if ok else "",
                      f"{r['gpu_alloc_gib']:.1f}" if ok else "", f"{r['gpu_reserved_gib']:.1f}" if ok else "",
                      f"{r['host_peak_gib']:.1f}", f"{r['host_bytes_per_param']:.1f} ({r['host_bytes_per_param_model']:.1f})" if ok else "",
                      f"{r['disk_peak_gib']:.1f}", f"{r['init_s']:.0f}" if "init_s" in r else "",
                      f"{p['gpu_gib']:.1f}" if p else "", f"{p['host_gib']:.1f}" if p else "",
                      str(p.get("placement", "")) if ok else r.get("why", "")[:160]))
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2.7b,6.7b,13b")
    ap.add_argument("--contenders", default="zfunc,zfunc-host,deepspeed,deepspeed-nvme,fsdp2")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (the incumbents)")
    ap.add_argument("--zfunc-micro-batch", default="auto",
                    help="rows per micro-batch for zfunc, or 'auto': the plan chooses the fewest micro-batches "
                         "that fit (zf.plan(..., choose_micro_batches=True))")
    ap.add_argument("--tokens-per-step", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=2, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--nvme-dir", default=os.environ.get("TMPDIR", "/tmp"), help="the NVMe tier's directory")
    ap.add_argument("--host-limit-gib", type=float, default=115.0, help="kill a run whose resident memory passes this")
    ap.add_argument("--loss-chunks", type=int, default=1,
                    help="zfunc: the loss over this many slices of the tokens, each slice's logits recomputed in "
                         "backward (1: the full logits, as the incumbents)")
    ap.add_argument("--gpu-extra-gib", type=float, default=0.0,
                    help="added to the GPU budget zfunc plans with (a diagnostic: what a plan that counted the GPU "
                         "closer would place)")
    ap.add_argument("--host-margin-gib", type=float, default=8.0,
                    help="left out of zfunc's host budget below --host-limit-gib: page-locked staging buffers "
                         "(rounded up by torch's pinned cache) and NVMe pages in flight, which the plan does not count")
    ap.add_argument("--limit-s", type=float, default=540.0, help="kill a run that takes longer")
    ap.add_argument("--stop-after-failure", action="store_true",
                    help="per contender, skip the larger sizes once one size did not train")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("@result " + json.dumps(run_one(args)), flush=True)
        return 0
    if args.tokens_per_step % (args.micro_batch * SEQ):
        ap.error(f"--tokens-per-step must be a multiple of --micro-batch x {SEQ}")
    import torch

    os.makedirs(args.nvme_dir, exist_ok=True)
    log(f"# largest_model {time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()} torch {torch.__version__}, "
        f"{os.cpu_count()} cores, host {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GiB:.0f} GiB, "
        f"disk free in {args.nvme_dir}: {_disk_free(args.nvme_dir) / GiB:.0f} GiB")
    rows, failed = [], set()
    for size in args.sizes.split(","):
        for contender in args.contenders.split(","):
            if contender in failed:
                rows.append({"size": size, "contender": contender, "trains": False, "why": "a smaller size did not",
                             "host_peak_gib": 0, "disk_peak_gib": 0})
                continue
            log(f"== {size} ({parameters_of(size) / 1e9:.2f}B) {contender}")
            row = supervise(args, size, contender)
            rows.append(row)
            log(f"== {size} {contender}: " + (f"{row['step_s']:.2f} s/step, {row['model_tflops']:.1f} TFLOP/s, "
                                              f"host peak {row['host_peak_gib']:.1f} GiB" if row.get("trains")
                                              else f"does not train: {row.get('why')}"))
            if not row.get("trains") and args.stop_after_failure:
                failed.add(contender)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    log(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
