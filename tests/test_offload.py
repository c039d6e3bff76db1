"""offload on a CPU-only machine: equivalence with the plain step, kernel and pytree paths, transfers."""

import pytest
import torch

import zfunc as zf
from tests.models import make_batch
from tests.shard_cases import build
from zfunc.transforms import accumulate, mixed_precision, offload
from zfunc.transforms.offload import copy_grouped, write_grouped

OPTIMIZERS = {
    "adamw+schedule": lambda: zf.optim.adamw(zf.optim.warmup_cosine(1e-2, 2, 10), weight_decay=0.1),
    "adamw+mask": lambda: zf.optim.adamw(1e-2, weight_decay=0.1, mask=lambda name: name.endswith("weight")),
    "adam+l2": lambda: zf.optim.adam(1e-2, weight_decay=0.05),
    "clip+adamw": lambda: zf.optim.chain(zf.optim.clip_by_global_norm(0.05), zf.optim.adamw(1e-2)),
    "sgd": lambda: zf.optim.sgd(0.1, momentum=0.9, nesterov=True),
    "lamb": lambda: zf.optim.lamb(1e-2, weight_decay=0.01),
}


def trained(wrap, make_opt, steps=4):
    step, state = build()
    state = state.replace(opt_state=make_opt().init(state.params), tx=make_opt())
    step = wrap(step)
    state = zf.init(step, state)
    for i in range(steps):
        state, _ = step(state, make_batch(8, seed=i))
    return zf.gather(step, state)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("path", ["cpu", "cpu-pytree"])
def test_offload_equals_plain_step(name, path):
    ref = trained(lambda s: s, OPTIMIZERS[name])
    got = trained(lambda s: offload(s, optimizer=path), OPTIMIZERS[name])
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-6, atol=1e-7, msg=f"{name} {path} {key}")


def test_offload_with_accumulate_and_mixed_precision():
    make = OPTIMIZERS["adamw+schedule"]
    ref = trained(lambda s: accumulate(s, micro_batches=2), make)
    got = trained(lambda s: offload(accumulate(s, micro_batches=2)), make)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-6, atol=1e-7)
    ref = trained(lambda s: mixed_precision(s, "bf16"), make)
    got = trained(lambda s: offload(mixed_precision(s, "bf16")), make)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-6, atol=1e-7)


def test_kernel_path_is_used_for_adam_and_updates_in_place():
    step, state = build()
    off = offload(step)
    state = off.init(state)
    moment = state.opt_state[0].mu["blocks.0.up.weight"]
    before = moment.clone()
    new, _ = off(state, make_batch(8))
    assert new.opt_state[0].mu["blocks.0.up.weight"] is moment  # in place (donated)
    assert not torch.equal(moment, before)
    assert int(new.opt_state[0].count) == 1


def test_grouped_transfers_batch_views_of_one_buffer():
    flat = torch.arange(20, dtype=torch.float32)
    views = {"a": flat[0:6].view(2, 3), "b": flat[6:10], "c": flat[10:20].view(5, 2)}
    copies = copy_grouped(views, lambda t: True)
    for k in views:
        assert torch.equal(copies[k], views[k]) and copies[k].data_ptr() != views[k].data_ptr()
    storages = {copies[k].untyped_storage().data_ptr() for k in copies}
    assert len(storages) == 1  # one host buffer, one copy
    dest = {k: torch.zeros_like(v) for k, v in views.items()}
    write_grouped({k: v + 1 for k, v in views.items()}, dest)
    for k in views:
        assert torch.equal(dest[k], views[k] + 1)


def test_bad_arguments():
    step, _ = build()
    with pytest.raises(ValueError, match="optimizer must be one of"):
        offload(step, optimizer="gpu")
    with pytest.raises(ValueError, match="threads"):
        offload(step, threads=0)
    assert repr(offload(step, threads=4)) == "offload(train_step, threads=4)"


def test_mixed_precision_compute_copy_comes_from_the_kernel():
    """bf16 grads go into the kernel as they are; it writes the bf16 compute copy in the same pass
    (into the parameters themselves on a CPU-only machine): bitwise the cast of the new master."""
    step, state = build()
    off = offload(mixed_precision(step, "bf16"))
    state = off.init(state)
    before = {k: v.data_ptr() for k, v in state.params.items()}
    state, _ = off(state, make_batch(8))
    master = state.extras["mixed_precision"].master
    for k, p in state.params.items():
        assert p.dtype == torch.bfloat16 and p.data_ptr() == before[k]
        assert torch.equal(p, master[k].to(torch.bfloat16))
    ref_step, ref_state = build()
    ref = mixed_precision(ref_step, "bf16")
    ref_state, _ = ref(ref.init(ref_state), make_batch(8))
    for k, p in ref_state.extras["mixed_precision"].master.items():
        torch.testing.assert_close(master[k], p, rtol=1e-6, atol=1e-7)


def test_fused_paths_cover_clipping_before_adam():
    assert OPTIMIZERS["clip+adamw"]().fused.clip == 0.05
    assert OPTIMIZERS["adam+l2"]().fused is not None
    assert OPTIMIZERS["sgd"]().fused is None
    assert OPTIMIZERS["lamb"]().fused is None
    assert zf.optim.chain(zf.optim.adamw(1e-3), zf.optim.clip_by_global_norm(1.0)).fused is None
    # the clipped update through the kernel keeps the chain's state layout
    step, state = build()
    tx = OPTIMIZERS["clip+adamw"]()
    state = state.replace(opt_state=tx.init(state.params), tx=tx)
    off = offload(step)
    new, _ = off(off.init(state), make_batch(8))
    assert zf.tree.tree_structure(new.opt_state) == zf.tree.tree_structure(state.opt_state)
    assert int(new.opt_state[1][0].count) == 1


def test_streamed_update_is_the_whole_update_bit_for_bit():
    """The chunked host update (gradients in, compute copy out, two buffers each) equals one kernel call
    over the whole state, for chunks that split runs anywhere (multiples of the kernel's width)."""
    from zfunc.kernels.cpu_adam import adamw_
    from zfunc.optim.streamed import streamed_update

    g = torch.Generator().manual_seed(0)
    sizes = [1000, 64, 3000]
    base = [(torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g) * 0.1,
             torch.rand(n, generator=g) * 0.01) for n in sizes]

    def kernel(p, gr, m, v, out, wd):
        adamw_(p, gr, m, v, lr=1e-2, step=3, weight_decay=wd, out_lowp=out)

    whole = [tuple(t.clone() for t in run) for run in base]
    outs_whole = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    for (p, gr, m, v), out in zip(whole, outs_whole):
        kernel(p, gr, m, v, out, 0.1)
    for chunk in (64, 128, 960, 1 << 20):
        runs = [tuple(t.clone() for t in run) for run in base]
        outs = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in sizes]
        streamed_update([(p, gr, m, v, out, 0.1) for (p, gr, m, v), out in zip(runs, outs)], kernel,
                        torch.bfloat16, chunk=chunk)
        for (p, _, m, v), (pw, _, mw, vw), out, ow in zip(runs, whole, outs, outs_whole):
            for a, b in ((p, pw), (m, mw), (v, vw), (out, ow)):
                assert torch.equal(a, b), chunk


def test_the_host_update_counts_with_the_skip_flag_it_read():
    """Where the optimizer's counts live on the host, the new counts are taken with the skip flag the host
    kernel already read (a host tensor), so they stay on the host; elsewhere with the device flag."""
    from zfunc.optim.fused import _HostKernel

    spec = zf.optim.adamw(1e-2).fused
    kernel = _HostKernel(spec, torch.tensor(1e-2), torch.tensor(1), None, 1, torch.ones((), dtype=torch.bool,
                                                                                         device="meta"))
    count = torch.zeros((), dtype=torch.int32)
    on_device = kernel.counted_skip(kernel._numbers[3], count)
    assert on_device.device.type == "meta"  # not read on the host (all state on the device): the device flag
    kernel.__dict__["skipped"] = True  # (as the host kernel caches it once it has read the flag)
    flag = kernel.counted_skip(kernel._numbers[3], count)
    assert flag.device.type == "cpu" and bool(flag)
    assert kernel.counted_skip(kernel._numbers[3], count.to("meta")).device.type == "meta"
    assert kernel.counted_skip(None, count) is None
