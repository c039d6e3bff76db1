"""On a GPU: gradients leave the GPU as backward makes them (`offload` under `shard`, one micro-batch).

    NCCL_NVLS_ENABLE=0 python tests/gpu/grad_tiers.py [--width 2048 --depth 16]

One process, one GPU. ``shard(offload(checkpoint(mixed_precision(step, "bf16")), device_fraction=0), stage=3)``
keeps the whole optimizer state on the host. Each unit's gradient goes to the host as its backward ends (the
step's sink), so the GPU never holds the model's full gradient: the peak a step allocates above what the
state holds stays below the full gradient's bytes plus the activations and a few units. The control is the
same step with the sink switched off (the gradients kept on the GPU until the update streams them down).
Both must train to the same weights, element-wise; the script prints peaks and step times and exits
nonzero on a failure.

Then how the gradients land (`zfunc.tiers.landing`), with a step that reads its gradients before the update
(their norm) and returns them: each lands straight in a page-locked kept host buffer (``is_pinned()``),
registered once over all steps, with no staging buffer or host thread (no `HostAdder`); the norm the step
took while they were landing equals the norm of the gradients it returned (a read before a copy landed
would differ); the gradients a step returned are unchanged by the next step; and how many units were still
landing when the update began (more than none: the update starts while backward's last copies run), with the
optimizer's counts still on the host (read there without waiting for backward).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard
from zfunc.transforms.offload import offload as offload_cls


class Deep(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
        self.head = nn.Linear(width, 1000, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def model_and_loss(args):
    """``(params, loss_fn)`` of the meta-built `Deep` model (the same model and loss for every check here)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Deep(args.width, args.depth)
    apply_fn, params = zf.functional(model, init="reset_parameters")

    def loss_fn(p, ids):
        return F.cross_entropy(apply_fn(p, ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())

    return params, loss_fn


def run(args, sink: bool, k: int) -> dict:
    params, loss_fn = model_and_loss(args)

    def train_step(state, ids):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, ids)
        return state.apply_gradients(grads), {"loss": loss}

    inner = mixed_precision(accumulate(train_step, k) if k > 1 else train_step, "bf16")
    step = shard(offload(checkpoint(inner), device_fraction=0.0), stage=3)
    start = offload_cls.start
    if not sink:
        offload_cls.start = lambda self, ctx, state: None
    try:
        state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-4, weight_decay=0.1)), init_device="cuda")
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 1000, (args.rows, 129), generator=g).cuda() for _ in range(args.steps)]
        times = []
        for i, ids in enumerate(batches):
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t = time.perf_counter()
            state, metrics = step(state, ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() - before
        weights = {key: v.float().cpu() for key, v in step.gather(state).items()}
    finally:
        offload_cls.start = start
    grad_bytes = 2 * sum(v.numel() for v in params.values())
    return {"peak": peak, "grad_bytes": grad_bytes, "step_s": sorted(times[1:])[len(times[1:]) // 2],
            "weights": weights}


def probe_landing(args) -> list[str]:
    """The landing checks of the module docstring; returns the failures."""
    from zfunc.tiers import placement
    from zfunc.transforms import grad_accumulator

    params, loss_fn = model_and_loss(args)

    def train_step(state, ids):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, ids)
        norm = sum(g.float().pow(2).sum() for g in grads.values())  # read while they land: the guard waits
        return state.apply_gradients(grads), {"loss": loss, "norm": norm, "grads": grads}

    counts = {"registered": 0, "adders": 0, "landing at update": [], "update began": []}
    register, adder_init, apply = placement.register_host, grad_accumulator.HostAdder.__init__, offload_cls.apply_gradients

    def counting_register(ptr, nbytes):
        counts["registered"] += 1
        return register(ptr, nbytes)

    def counting_adder(self, *a, **kw):
        counts["adders"] += 1
        adder_init(self, *a, **kw)

    def noting_apply(self, next, state, grads, request):
        sink = self.call_scratch()
        landing = sink.landing if sink is not None else None
        counts["landing at update"].append(len(landing.pending) if landing is not None else -1)
        backward_done = torch.cuda.Event(enable_timing=True)
        backward_done.record()  # (reached by the GPU when it has run all of backward)
        counts["update began"].append((time.perf_counter(), backward_done))
        return apply(self, next, state, grads, request)

    placement.register_host, grad_accumulator.HostAdder.__init__ = counting_register, counting_adder
    offload_cls.apply_gradients = noting_apply
    failures = []
    try:  # (the stacks are built after the patches: a stack binds its transforms' handlers once)
        step = shard(offload(checkpoint(mixed_precision(train_step, "bf16")), device_fraction=0.0), stage=3)
        state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-4, weight_decay=0.1)), init_device="cuda")
        g = torch.Generator().manual_seed(1)
        returned = []
        for i in range(args.steps):
            ids = torch.randint(0, 1000, (args.rows, 129), generator=g).cuda()
            state, metrics = step(state, ids)
            grads = metrics["grads"]
            after = sum(t.float().pow(2).sum() for t in grads.values())
            if not torch.equal(metrics["norm"].cpu(), after.cpu()):
                failures.append(f"step {i}: the norm read while the gradients landed, {metrics['norm'].item()}, "
                                f"is not that of the gradients returned, {after.item()}")
            if not all(t.device.type == "cpu" and t.is_pinned() for t in grads.values()):
                failures.append(f"step {i}: a gradient is not in page-locked host memory")
            returned.append((grads, {k: t.clone() for k, t in grads.items()}))
        for i, (held, copy) in enumerate(returned):
            if not all(torch.equal(held[k], copy[k]) for k in copy):
                failures.append(f"the gradients step {i} returned changed afterwards")
        units = len(state.extras["shard"].units)
        # (every step returned its gradients, so each registered fresh buffers: the caller holds the old ones)
        if counts["registered"] != args.steps * units:
            failures.append(f"{counts['registered']} registrations over {args.steps} steps of {units} units")
        del returned, held, copy, grads, metrics
        # Without returning them: the kept buffers are reused, nothing more is registered.
        plain = shard(offload(checkpoint(mixed_precision(
            lambda s, ids: (s.apply_gradients(zf.value_and_grad(loss_fn)(s.params, ids)[1]), {}), "bf16")),
            device_fraction=0.0), stage=3)
        state = plain.init(zf.TrainState.create(params, zf.optim.adamw(1e-4)), init_device="cuda")
        counts["registered"] = 0
        leads = []  # how long before the GPU finished backward the host update began (ms; < 0: after)
        for _ in range(args.steps):
            ids = torch.randint(0, 1000, (args.rows, 129), generator=g).cuda()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            counts["update began"].clear()
            state, _ = plain(state, ids)
            torch.cuda.synchronize()
            began, backward_done = counts["update began"][0]
            leads.append(start.elapsed_time(backward_done) - 1e3 * (began - t0))
        torch.cuda.synchronize()
        if counts["registered"] != units:
            failures.append(f"{counts['registered']} registrations over {args.steps} steps (kept buffers): "
                            f"expected {units}, once each")
        if counts["adders"]:
            failures.append(f"{counts['adders']} HostAdder(s) made at one micro-batch (staging buffers)")
        # The optimizer's counts stay on the host with its state: the host update reads its rate and step without
        # waiting for the GPU work queued before (backward), so it can start while backward's tail runs.
        on_gpu = [t.device for t in zf.tree.tree_leaves(state.opt_state)
                  if isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type != "cpu"]
        if on_gpu:
            failures.append(f"{len(on_gpu)} of the optimizer's counts moved to the GPU ({on_gpu[0]})")
        print(f"landing: units still landing when the update began, per step: {counts['landing at update']} "
              f"(of {units}); the host update began {', '.join(f'{x:.1f}' for x in leads)} ms before the GPU had "
              "run all of backward (negative: after)", flush=True)
    finally:
        placement.register_host, grad_accumulator.HostAdder.__init__ = register, adder_init
        offload_cls.apply_gradients = apply
    return failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    failures = []
    try:
        fed, held = run(args, True, 1), run(args, False, 1)
        print(f"one micro-batch: peak above the state {fed['peak'] / 2**30:.2f} GiB (gradients to the host as "
              f"made) vs {held['peak'] / 2**30:.2f} GiB (held on the GPU); full bf16 gradient "
              f"{fed['grad_bytes'] / 2**30:.2f} GiB; step {fed['step_s'] * 1e3:.0f} vs {held['step_s'] * 1e3:.0f} ms",
              flush=True)
        # (a unit's gradient is freed once its copy to the host has landed: on a model this small, whose backward
        # outruns the copies, several are in flight at once, so the bound is a quarter of the whole gradient)
        if not fed["peak"] + fed["grad_bytes"] / 4 < held["peak"]:
            failures.append("the sink did not keep the full gradient off the GPU")
        for key, w in held["weights"].items():
            if not torch.equal(fed["weights"][key], w):
                failures.append(f"{key} differs: max {(fed['weights'][key] - w).abs().max().item():.3g}")
                break
        failures += probe_landing(args)
        two = run(args, True, 2)  # two micro-batches: fp32 sums on the host (HostAdder), kept buffers
        print(f"two micro-batches: peak above the state {two['peak'] / 2**30:.2f} GiB; step "
              f"{two['step_s'] * 1e3:.0f} ms", flush=True)
    finally:
        dist.destroy_process_group()
    print("\n".join(failures) or "grad_tiers: OK", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
