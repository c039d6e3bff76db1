"""zfunc.io across layouts with pipeline: pp2 x dp2 (shard over dp) and tp2 x pp2 states save, consolidate and
restore exactly into other layouts (dp4, pp2, one process, tp2 x dp2 and back), and a step after a restore
is the step the saved run took next."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zfunc as zf
from tests.io_tools import rewrite_manifest
from tests.tp_cases import batch, make_step
from zfunc.cli import main as cli_main
from zfunc.mesh import make_mesh
from zfunc.testing import run_distributed
from zfunc.transforms import pipeline, shard, tensor_parallel, tp_plan

MICRO = 2


def build(dp: int = 1, pp: int = 1, tp: int = 1, stage: int = 1):
    """``(step, fresh state, dp rank, dp)`` of tiny GPT-2 (tied wte, frozen wpe; Adam with clipping) split
    dp x pp x tp: shard over dp (``stage``), pipeline over pp, tensor_parallel over tp."""
    apply_fn, step, state = make_step("gpt2")
    if dp * pp * tp == 1:
        return step, state, 0, 1
    mesh = make_mesh(dp=dp, pp=pp, tp=tp)
    if tp > 1:
        step = tensor_parallel(step, tp_plan(apply_fn), mesh)
    if pp > 1:
        step = pipeline(step, micro_batches=MICRO, mesh=mesh)
    if dp > 1:
        step = shard(step, stage=stage, mesh=mesh)
    return step, state, mesh["dp"].get_local_rank(), dp


def next_step(step, state, dp_rank: int, dp: int, pp: int):
    """One step on the batch after the saved ones (in one process over the pipeline's micro-batches, by
    `accumulate`)."""
    if dp * pp == 1:
        step = zf.transforms.accumulate(step, MICRO)
    return step(state, batch(1, dp_rank, dp))[0]


def train_and_save(directory: str, dp: int, pp: int, tp: int) -> dict:
    step, state, dp_rank, _ = build(dp, pp, tp)
    state = step.init(state)
    state, _ = step(state, batch(0, dp_rank, dp))
    zf.io.save(directory, state)
    saved = step.gather(state)
    return {"saved": saved, "next": step.gather(next_step(step, state, dp_rank, dp, pp))}


def restore_into(layouts: list, directory: str) -> list:
    """Restore ``directory`` into each layout ``(dp, pp, tp, stage, save_to)`` in turn (each from the previous
    one's save, if any): per layout, the restored weights and those after one more step."""
    out = []
    for dp, pp, tp, stage, save_to in layouts:
        step, state, dp_rank, _ = build(dp, pp, tp, stage)
        state, _ = zf.io.restore(directory, like=zf.init(step, state))
        if save_to:
            zf.io.save(save_to, state)
            directory = save_to
        restored = zf.gather(step, state)
        out.append({"restored": restored, "next": zf.gather(step, next_step(step, state, dp_rank, dp, pp))})
    return out


def assert_same(outs: list, saved: dict, nxt: dict, exact_next: bool = False) -> None:
    for i, out in enumerate(outs):
        assert out["restored"].keys() == saved.keys()
        for key, want in saved.items():  # the weights, bit for bit
            torch.testing.assert_close(out["restored"][key], want, rtol=0, atol=0, msg=lambda m, i=i, k=key: f"{i} {k}: {m}")
            # The optimizer state came along (Adam's moments: a lost one moves a weight by ~lr = 1e-2): the next
            # step is the saved run's next step, up to the order other layouts sum gradients in.
            tol = {"rtol": 0, "atol": 0} if exact_next else {"rtol": 1e-5, "atol": 2e-5}
            torch.testing.assert_close(out["next"][key], nxt[key], **tol, msg=lambda m, i=i, k=key: f"{i} {k}: {m}")


def manifest_of(directory: Path) -> dict:
    return json.loads((next(directory.glob("step_*")) / "manifest.json").read_text())


def as_format_3(source: Path, target: Path) -> Path:
    """A copy of the checkpoint ``source`` (a pipeline or a tensor-parallel one) as format 3 wrote it: one section,
    without the mesh (pipeline: its ranks the world's; tensor_parallel: each rank's (dp, tp) coordinates)."""
    shutil.copytree(source, target)
    step_dir = next(target.glob("step_*"))

    def older(m: dict) -> None:
        mesh = m.pop("mesh")
        m["format_version"] = 3
        if "tensor_parallel" in m:
            m["tensor_parallel"]["coords"] = [[dp, tp] for dp, _, tp in mesh["coords"]]

    rewrite_manifest(step_dir, older)
    return step_dir


# A format-4 manifest is validated field by field before anything is read (each rewrite re-seals the checksums).
FAULTS = {
    "coordinates repeat": (lambda m: m["mesh"]["coords"].__setitem__(1, m["mesh"]["coords"][0]),
                           r"field mesh.coords\[1\] repeats \[0, 0, 0\]"),
    "sizes not the world's": (lambda m: m["mesh"].update(dp=4), r"field mesh is dp4 x pp2 x tp1, not the world size 4"),
    "a holder beyond pp": (lambda m: m["pipeline"]["holders"].update({"transformer.ln_f.weight": 2}),
                           r"pipeline.holders\['transformer.ln_f.weight'\] must be in \[0, 1\], got 2"),
    "no pipeline section": (lambda m: m.pop("pipeline"), r"has pp=2, but the manifest lacks a 'pipeline' section"),
    "a layout over other ranks": (lambda m: m["layout"].update(world_size=4), r"field layout is for stage 1 on 4"),
    "a unit left out": (lambda m: m["layout"]["units"].pop(), r"field layout.units leave out parameters"),
}


def refused_without_shard(directory: str) -> list:
    """pipeline over pp2 of a dp2 x pp2 mesh with no shard around it: each dp replica would be its own state."""
    _, step, state = make_step("gpt2")
    mesh = make_mesh(dp=2, pp=2)
    stacked = pipeline(step, micro_batches=MICRO, mesh=mesh)
    state = stacked.init(state)
    out = []
    for call in (lambda: zf.io.save(directory, state), lambda: zf.io.restore(directory, like=state)):
        try:
            call()
        except zf.io.CheckpointError as err:
            out.append(str(err))
    return out


@pytest.mark.slow
def test_pp2_x_dp2_to_dp4_and_back_to_pp2_and_to_one_process_is_exact(tmp_path, capsys):
    first = run_distributed(train_and_save, 4, str(tmp_path / "pp2dp2"), 2, 2, 1)
    saved, nxt = first[0]["saved"], first[0]["next"]
    m = manifest_of(tmp_path / "pp2dp2")
    assert m["format_version"] == 4 and {k: m["mesh"][k] for k in ("dp", "pp", "tp")} == {"dp": 2, "pp": 2, "tp": 1}
    assert m["mesh"]["coords"] == [[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]]  # make_mesh's order: dp outermost
    holders = m["pipeline"]["holders"]
    assert holders["transformer.wte.weight"] == 0 and holders["transformer.ln_f.weight"] == 1  # pipeline ranks
    assert ["lm_head.weight", "transformer.wte.weight"] in m["ties"]
    assert m["layout"]["world_size"] == 2 and sorted(k for u in m["layout"]["units"] for k in u["keys"]) == \
        sorted(m["params"])  # every stage's units, each parameter once

    # dp4 (stage 3), saved; back into pp2 x dp2 from that; and a plain pp2 x dp2 mesh without shard is refused.
    dp4 = run_distributed(restore_into, 4, [(4, 1, 1, 3, str(tmp_path / "dp4")), (2, 2, 1, 1, None)],
                          str(tmp_path / "pp2dp2"))
    assert_same([out[0] for out in dp4], saved, nxt)
    assert_same([out[1] for out in dp4], saved, nxt, exact_next=True)  # the saving layout again: bit for bit
    for errors in run_distributed(refused_without_shard, 4, str(tmp_path / "refused")):
        assert len(errors) == 2 and all("dp1 x pp2 x tp1 (2 ranks" in e and "shard(..., mesh=mesh)" in e
                                        for e in errors), errors
    # pp2 (pipeline alone), saved; then one process from that.
    pp2 = run_distributed(restore_into, 2, [(1, 2, 1, 1, str(tmp_path / "pp2"))], str(tmp_path / "pp2dp2"))
    assert_same([out[0] for out in pp2], saved, nxt)
    alone = restore_into([(1, 1, 1, 0, None)], str(tmp_path / "pp2"))  # (in this process, after the forks)
    assert_same(alone, saved, nxt)
    older = as_format_3(tmp_path / "pp2", tmp_path / "pp2-format3")  # what zfunc wrote before format 4: still read
    assert_same(restore_into([(1, 1, 1, 0, None)], str(older)), saved, nxt)
    full = load_file(zf.io.consolidate(tmp_path / "pp2dp2", tmp_path / "full.safetensors", progress=False))
    for key, want in saved.items():
        torch.testing.assert_close(full[key], want, rtol=0, atol=0, msg=key)
    assert torch.equal(full["lm_head.weight"], full["transformer.wte.weight"])  # the tied head, recorded
    assert cli_main(["verify", str(tmp_path / "pp2dp2")]) == 0 and cli_main(["info", str(tmp_path / "pp2dp2")]) == 0
    assert "mesh dp2 x pp2 x tp1; stages of blocks: [1, 1]" in capsys.readouterr().out
    for name, (mutate, message) in FAULTS.items():
        shutil.copytree(tmp_path / "pp2dp2", tmp_path / name)
        rewrite_manifest(next((tmp_path / name).glob("step_*")), mutate)
        with pytest.raises(zf.io.CheckpointError, match=message):
            zf.io.consolidate(tmp_path / name, tmp_path / "never.safetensors", progress=False)


@pytest.mark.slow
def test_tp2_x_pp2_to_tp2_x_dp2_to_dp4_and_back_and_to_one_process_is_exact(tmp_path):
    first = run_distributed(train_and_save, 4, str(tmp_path / "tp2pp2"), 1, 2, 2)
    saved, nxt = first[0]["saved"], first[0]["next"]
    m = manifest_of(tmp_path / "tp2pp2")
    assert m["format_version"] == 4 and m["mesh"]["coords"] == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    assert m["layout"] is None and m["tensor_parallel"]["size"] == 2 and m["pipeline"]["pp"] == 2
    assert m["params"]["transformer.h.0.mlp.c_fc.weight"] == [16, 64]  # full shapes, not the tp shards'
    layouts = [(2, 1, 2, 3, str(tmp_path / "tp2dp2")), (4, 1, 1, 1, str(tmp_path / "dp4")), (1, 2, 2, 1, None)]
    outs = run_distributed(restore_into, 4, layouts, str(tmp_path / "tp2pp2"))
    for i in range(3):
        assert_same([out[i] for out in outs], saved, nxt, exact_next=i == 2)
    alone = restore_into([(1, 1, 1, 0, None)], str(tmp_path / "tp2pp2"))
    assert_same(alone, saved, nxt)
    older = as_format_3(tmp_path / "tp2dp2", tmp_path / "tp2dp2-format3")  # what zfunc wrote before format 4
    assert_same(restore_into([(1, 1, 1, 0, None)], str(older)), saved, nxt)
    full = load_file(zf.io.consolidate(tmp_path / "tp2pp2", tmp_path / "full.safetensors", progress=False))
    hf = zf.io.export_hf(tmp_path / "hf", tmp_path / "tp2pp2", config=None, progress=False)
    exported = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    for key, want in saved.items():
        torch.testing.assert_close(full[key], want, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(exported[key], want, rtol=0, atol=0, msg=key)
