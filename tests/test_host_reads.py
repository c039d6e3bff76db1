"""No host reads in a steady-state step (issue 25, item 1).

A read of a value from a device tensor (``.item()``, ``.tolist()``, ``bool(t)``,
``.cpu()``, ``nonzero()``, ``torch.equal``, ...) makes the host wait until the GPU
has drained its queue; the GPU then waits for Python to issue the next kernels.
Here everything runs on the CPU, where no read waits, so the test records the
*calls that would sync on a GPU*: the aten ops that hand a value to the host
(seen by a `TorchDispatchMode`) and the Tensor methods that do so without an
aten op (patched for the duration). Each read is recorded with the zfunc frames
that made it, so a failure names the code.

Two kinds of reads are not device reads and are left out, by the function that
makes them: `Pending.raise_if_found` reads the host copy of a step's findings
(on a GPU: pinned memory behind an event), the numba kernel's `_HostKernel`
runs only for optimizer state that lives on the host (here: all of it, on a GPU
without `offload`: none), `zfunc.dist.announce` runs in a step only where
the process group's device is the CPU (gloo), and `zfunc.dist.exchange_on_host`
(shard's ``verify``) only over a gloo group, beside NCCL on a GPU. tests/gpu/host_reads.py runs the same stacks under
``torch.cuda.set_sync_debug_mode("error")``, where nothing is left out.
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zfunc as zf
from tests.models import make_batch, tiny_lm_step
from zfunc.dist import Group, announce, exchange_on_host
from zfunc.donation import Pending
from zfunc.optim import fused
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

# aten ops whose result is a host value, or whose output shape depends on values (nonzero & co)
_READ_OPS = {"_local_scalar_dense", "is_nonzero", "nonzero", "nonzero_static", "equal", "allclose", "masked_select",
             "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "bincount", "histc"}
# Tensor methods that hand values to the host without such an op (or move them there)
_READ_METHODS = ("tolist", "numpy", "cpu", "__array__")

# (`dist.announce` checks that ranks are in the same call; a step calls it only where the group's device is the
# CPU, i.e. gloo, where the exchange is on the host anyway. `dist.exchange_on_host` runs only over a gloo group:
# shard's verify compares which units each rank ran, values the host knows, over a gloo group beside NCCL.)
_HOST_WORK = {Pending.raise_if_found.__code__, fused._HostKernel.__call__.__code__, announce.__code__,
              exchange_on_host.__code__,
              *(getattr(fused._HostKernel, name).func.__code__ for name in ("skipped", "lr", "step", "scale"))}


def _where() -> str | None:
    """The zfunc frames of the caller (innermost first), or None for a read made by host work (above)."""
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        if frame.f_code in _HOST_WORK:
            return None
        name = frame.f_code.co_filename
        if "/zfunc/" in name and "/zfunc/testing/" not in name:
            frames.append(f"{name.rsplit('/zfunc/', 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}")
        elif "/tests/" in name and not name.endswith("test_host_reads.py"):
            frames.append(f"{name.rsplit('/tests/', 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(frames[:6]) or "(outside zfunc)"


class HostReads(TorchDispatchMode):
    """Records, while active, every call that would read a device value on the host (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()
        self._saved: dict = {}

    def _record(self, what: str) -> None:
        where = _where()
        if where is not None:
            self.reads[f"{what} at {where}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _READ_OPS:
            self._record(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in _READ_METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def patched(t, *a, _name=name, _original=original, **k):
                self._record(f".{_name}()")
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def _optimizer(kind: str):
    if kind == "clip":  # the usual recipe: clip, then AdamW on a schedule (a fused form)
        return zf.optim.chain(zf.optim.clip_by_global_norm(0.5),
                              zf.optim.adamw(zf.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1))
    return zf.optim.sgd(zf.optim.warmup_cosine(0.1, 1, 10), momentum=0.9)  # no fused form: the pure update


def _sharded(inner, **settings):
    """A shard stack; ``shard_settings`` passed to `steady_state_reads` are added to ``settings``."""
    return lambda s, **more: shard(inner(s), **settings, **more)


# Every stack without offload (the NaN-loss check is on in all: the default of zf.value_and_grad).
STACKS = {
    "mixed_precision-bf16": lambda s: mixed_precision(s, "bf16"),
    "mixed_precision-fp16": lambda s: mixed_precision(s, "fp16"),
    "accumulate": lambda s: accumulate(s, 2),
    "checkpoint": checkpoint,
    "checkpoint-accumulate-bf16": lambda s: checkpoint(mixed_precision(accumulate(s, 2), "bf16")),
    "shard1": _sharded(lambda s: s, stage=1),
    "shard2-bf16": _sharded(lambda s: mixed_precision(s, "bf16"), stage=2),
    "shard2-fp16-accumulate": _sharded(lambda s: mixed_precision(accumulate(s, 2), "fp16"), stage=2),
    "shard3": _sharded(lambda s: s, stage=3),
    "shard3-checkpoint-bf16": _sharded(lambda s: checkpoint(mixed_precision(s, "bf16")), stage=3),
    "shard3-checkpoint-fp16-accumulate": _sharded(lambda s: checkpoint(mixed_precision(accumulate(s, 2), "fp16")),
                                                  stage=3),
    "shard3-recompute": _sharded(lambda s: mixed_precision(s, "bf16"), stage=3, reshard="recompute"),
}
SHARDED = [name for name in STACKS if name.startswith("shard")]
OFFLOAD = {
    "offload": offload,
    "shard2-offload-bf16": lambda s: shard(offload(mixed_precision(s, "bf16")), stage=2),
    "shard3-offload-params-bf16": lambda s: shard(offload(mixed_precision(s, "bf16"), params="host"), stage=3),
}

WARM_STEPS, COUNTED_STEPS = 2, 2


def steady_state_reads(name: str, optimizer: str = "clip", rank: int = 0, world: int = 1,
                       stacks: dict = STACKS, **shard_settings) -> dict[str, int]:
    """The host reads of ``COUNTED_STEPS`` steps of stack ``name`` after ``WARM_STEPS`` first ones."""
    _, params, train_step = tiny_lm_step()
    step = stacks[name](train_step, **shard_settings)
    state = step.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, _optimizer(optimizer)))
    recorder = HostReads()
    for i in range(WARM_STEPS + COUNTED_STEPS):
        batch = {k: v.chunk(world)[rank] for k, v in make_batch(8, seed=i).items()}
        if i < WARM_STEPS:
            state, metrics = step(state, batch)
            continue
        with recorder:
            state, metrics = step(state, batch)
    assert torch.isfinite(metrics["loss"]).all()  # (read here, outside the counted steps)
    return dict(recorder.reads)


@pytest.mark.parametrize("optimizer", ["clip", "sgd"])
@pytest.mark.parametrize("name", list(STACKS))
def test_a_steady_state_step_reads_nothing_on_the_host(name, optimizer):
    reads = steady_state_reads(name, optimizer)
    assert not reads, f"{name}: host reads in steady-state steps:\n" + "\n".join(f"{n}x {r}" for r, n in reads.items())


def _sharded_reads_on_ranks(**shard_settings):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return {name: steady_state_reads(name, "clip", rank, world, **shard_settings) for name in SHARDED}


@pytest.mark.slow
def test_a_steady_state_step_reads_nothing_on_the_host_at_world_2():
    for rank, per_stack in enumerate(run_distributed(_sharded_reads_on_ranks, 2, verify=False, timeout=600)):
        bad = {name: reads for name, reads in per_stack.items() if reads}
        assert not bad, f"rank {rank}: host reads in steady-state steps: {bad}"


@pytest.mark.slow
def test_shards_verify_exchange_reads_nothing_at_world_2():
    """shard(verify=True), the default, compares the units each rank ran once per backward pass: over a host
    (gloo) group (`dist.exchange_on_host`), so nothing is read back from a device."""
    for rank, per_stack in enumerate(run_distributed(_sharded_reads_on_ranks, 2, timeout=600)):
        bad = {name: reads for name, reads in per_stack.items() if reads}
        assert not bad, f"rank {rank}: host reads in steady-state steps: {bad}"


def test_the_host_exchange_refuses_a_device_group():
    group = Group(None, 0, 2, torch.device("meta"))
    with pytest.raises(ValueError, match="host \\(gloo\\) group"):
        exchange_on_host({}, group, "a test")


def test_the_recorder_names_the_code_that_reads():  # (the test above can fail)
    recorder = HostReads()
    x = torch.ones(3)
    with recorder:
        x.sum().item()
        bool(x.max() > 0)
        x.tolist()
        x.nonzero()
        torch.equal(x, x)
    kinds = {read.split(" at ")[0]: n for read, n in recorder.reads.items()}
    assert kinds == {"_local_scalar_dense": 2, ".tolist()": 1, "nonzero": 1, "equal": 1}, kinds
    with recorder:
        zf.value_and_grad(lambda p: (p["w"] ** 2).sum())({"w": torch.ones(2)})  # a plain step reads its loss
    assert any("autodiff.py" in read and "_refuse_nonfinite_loss" in read for read in recorder.reads), recorder.reads


def test_offload_stacks_read_only_for_their_host_work():
    """Offload stacks may read what their host work needs (listed here when run with -s); none of it may come
    from the compute transforms or the interpreter."""
    for name in OFFLOAD:
        reads = steady_state_reads(name, "clip", stacks=OFFLOAD)
        print(name, reads)
        assert all("optim/" in r or "tiers/" in r or "offload.py" in r for r in reads), (name, reads)


def _leaves_on(tree, device_type: str, path: str = "") -> list[str]:
    """The paths of the tensors in ``tree`` (dicts, sequences, NamedTuples, dataclass-like objects) on
    ``device_type``."""
    if isinstance(tree, torch.Tensor):
        return [path or "(root)"] if tree.device.type == device_type else []
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _leaves_on(v, device_type, f"{path}[{k!r}]")]
    if isinstance(tree, (list, tuple)):
        names = getattr(tree, "_fields", None) or range(len(tree))
        return [p for name, v in zip(names, tree) for p in _leaves_on(v, device_type, f"{path}.{name}")]
    if hasattr(tree, "__dict__"):
        return [p for k, v in vars(tree).items() for p in _leaves_on(v, device_type, f"{path}.{k}")]
    return []


@pytest.mark.parametrize("name", list(STACKS) + list(OFFLOAD))
def test_a_step_makes_its_tensors_where_its_state_lives(name):
    """A tensor a step makes without naming its device lands on the default device, the host's: on a GPU, a
    host scalar among the step's outputs (a flag, a count) costs a copy per step eagerly and, compiled, a C++
    kernel and its build (a minute of the compile). With the default device set to ``meta`` for a steady-state
    step, every such tensor shows up as a meta leaf of the new state or the metrics."""
    stacks = {**STACKS, **OFFLOAD}
    _, params, train_step = tiny_lm_step()
    step = stacks[name](train_step)
    state = step.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, _optimizer("clip")))
    for i in range(WARM_STEPS):
        state, _ = step(state, make_batch(8, seed=i))
    batch = make_batch(8, seed=WARM_STEPS)
    with torch.device("meta"):
        state, metrics = step(state, batch)
    made_on_the_default = _leaves_on((state, metrics), "meta")
    assert not made_on_the_default, f"{name}: made without a device: {made_on_the_default}"
