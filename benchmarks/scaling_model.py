"""ZeRO scaling: measured state bytes and communication on CPU (gloo, N = 1, 2, 4), and a model
that predicts per-GPU throughput at N = 8, 64 and 1024.

    python benchmarks/scaling_model.py                # measure on CPU, then predict
    python benchmarks/scaling_model.py --no-measure   # predictions only

Measurement: a GPT-shaped model (examples/gpt.py) under ``shard(stage=k)``
with fp32 AdamW, on N forked gloo ranks; per rank, the bytes of distinct
tensor storage in the state after one step and the elements moved by its
collectives (``metrics["comm_elements"]``), against the ZeRO formulas with
this model's padding: stage 1/2 hold 4Ψ + 8Ψ/N bytes (fp32 params + Adam's
m, v) and move 2Ψ elements; stage 3 holds 12Ψ/N and moves 3Ψ (2Ψ for the
root unit, which is gathered once per step).

Model (per GPU, one step): compute time ``T_c`` (forward + backward, from the
single-GPU floor), optimizer ``T_o / N`` (sharded), and communication
``V_k(N) · bytes / B(N)`` where ``V_k`` is the per-rank ring traffic,
``(N-1)/N · {2,2,3}Ψ`` elements for stages 1/2/3 in bf16, and ``B(N)`` the
per-GPU bus bandwidth: NVLink inside a node of 8, the network beyond it.
Stage 1 communicates after backward (exposed); stages 2 and 3 overlap it with
backward, so the step is ``max(T_c, T_comm) + T_o/N`` for them and
``T_c + T_comm + T_o/N`` for stage 1. These are the figures a scaling run on
4 and 8 GPUs must confirm (issue "Scaling run").
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# GPT-2 medium on one H200, measured (BENCHMARKS.md): forward+backward and optimizer.
PSI = 355e6
TOKENS_PER_GPU = 8 * 1024
T_COMPUTE = 0.082
T_OPTIMIZER = 0.010
NVLINK_GBPS = 450.0  # per GPU, one direction, H200 NVLink 4 (900 GB/s bidirectional)
NETWORK_GBPS = 50.0  # per GPU: one 400 Gb/s NIC per GPU across nodes
GPUS_PER_NODE = 8


def predict(stage: int, n: int) -> dict:
    volume = {1: 2, 2: 2, 3: 3}[stage] * PSI * (n - 1) / n  # elements each rank sends (ring)
    bandwidth = NVLINK_GBPS if n <= GPUS_PER_NODE else NETWORK_GBPS
    t_comm = volume * 2 / (bandwidth * 1e9)  # bf16
    t_opt = T_OPTIMIZER / n
    step = (T_COMPUTE + t_comm if stage == 1 else max(T_COMPUTE, t_comm)) + t_opt
    state_bytes = {1: 4 * PSI + 12 * PSI / n, 2: 2 * PSI + 14 * PSI / n, 3: 16 * PSI / n}[stage]
    return {"step_ms": 1e3 * step, "comm_ms": 1e3 * t_comm, "tokens_per_s_per_gpu": TOKENS_PER_GPU / step,
            "efficiency_vs_1": (T_COMPUTE + T_OPTIMIZER) / step, "state_gib": state_bytes / 2**30}


def measure_rank(stage: int) -> dict:
    import torch

    import zfunc as zf
    from examples.gpt import GPT, GPTConfig
    from tests.shard_cases import rank_and_world, state_bytes
    from zfunc.transforms import shard

    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=48))
    apply_fn, params = zf.functional(model)

    def train_step(state, batch):
        def loss_fn(p, b):
            logits = apply_fn(p, b["x"])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["y"].flatten())
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = shard(train_step, stage=stage)
    state = step.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.adamw(1e-3)))
    x = torch.randint(0, 64, (4, 16))
    state, metrics = step(state, {"x": x, "y": x})
    layout = state.extras["shard"]
    return {"bytes": state_bytes(state), "comm": metrics["comm_elements"],
            "psi": sum(u.numel for u in layout.units), "padded": sum(u.padded for u in layout.units),
            "root": sum(u.padded for u in layout.units if u.name == "")}


def expected(stage: int, n: int, padded: int, root: int) -> tuple[int, int]:
    if stage in (1, 2):
        return 4 * padded + 8 * padded // n, (2 * padded if n > 1 else 0)
    return 12 * padded // n, (3 * (padded - root) + 2 * root if n > 1 else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-measure", action="store_true")
    args = p.parse_args()
    if not args.no_measure:
        from zfunc.testing import run_distributed

        print("measured on CPU (gloo): per-rank state bytes and elements moved per step vs the ZeRO formulas")
        print(f"{'stage':>5} {'N':>3} {'Ψ':>8} {'state bytes':>12} {'formula':>12} {'comm elems':>11} {'formula':>9}")
        for stage in (1, 2, 3):
            for n in (1, 2, 4):
                r = run_distributed(measure_rank, n, stage)[0]
                want_bytes, want_comm = expected(stage, n, r["padded"], r["root"])
                ok = want_bytes <= r["bytes"] <= want_bytes + 64 and r["comm"] == want_comm
                print(f"{stage:>5} {n:>3} {r['psi']:>8} {r['bytes']:>12} {want_bytes:>12} {r['comm']:>11} "
                      f"{want_comm:>9} {'ok' if ok else 'MISMATCH'}", flush=True)
    print("\npredicted, GPT-2 medium (355M), micro-batch 8 x 1024 per GPU, bf16, H200s "
          f"(NVLink {NVLINK_GBPS:.0f} GB/s within {GPUS_PER_NODE}, {NETWORK_GBPS:.0f} GB/s per GPU beyond)")
    print(f"{'stage':>5} {'N':>5} {'step ms':>8} {'comm ms':>8} {'tok/s/GPU':>10} {'eff. vs 1':>9} {'state GiB':>9}")
    for stage in (1, 2, 3):
        for n in (2, 8, 64, 1024):
            r = predict(stage, n)
            print(f"{stage:>5} {n:>5} {r['step_ms']:8.1f} {r['comm_ms']:8.1f} {r['tokens_per_s_per_gpu']:10.0f} "
                  f"{r['efficiency_vs_1']:9.2f} {r['state_gib']:9.2f}")


if __name__ == "__main__":
    main()
