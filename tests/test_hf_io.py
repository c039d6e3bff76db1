"""Hugging Face weights in and out (zfunc.io.load_pretrained / export_hf), compared with transformers itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import zfunc as zf
from tests.shard_cases import rank_and_world, to_numpy
from zfunc.io import CheckpointError, export_hf, load_pretrained
from zfunc.testing import run_distributed
from zfunc.transforms import mixed_precision, offload, shard

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

transformers.logging.set_verbosity_error()
ROOT = Path(__file__).resolve().parent.parent


def configs():
    return {
        "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_embd=32, n_layer=3, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0, eos_token_id=0)),
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, tie_word_embeddings=True)),
        "llama-untied": (transformers.LlamaForCausalLM, transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False)),
    }


def meta_model(name: str, dtype: torch.dtype | None = None):
    cls, cfg = configs()[name]
    with torch.device("meta"):
        model = cls(cfg)
    return model.to(dtype) if dtype is not None else model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{name: directory}``: each tiny model saved by save_pretrained (and a sharded GPT-2 copy)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, (cls, cfg)) in enumerate(configs().items()):
        torch.manual_seed(10 + i)
        model = cls(cfg)
        with torch.no_grad():  # no zeros or ones anywhere: every tensor tells where it came from
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(root / name)
        out[name] = root / name
        if name == "gpt2":
            model.save_pretrained(root / "gpt2-sharded", max_shard_size="20KB")
            out["gpt2-sharded"] = root / "gpt2-sharded"
    return out


def hf_weights(directory, name="gpt2", dtype=None):
    cls, _ = configs()[name]
    model = cls.from_pretrained(directory, **({"dtype": dtype} if dtype else {}))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def empty_step(s, b):
    return s, {}


STACKS = {
    "plain": lambda s: s,
    "stage1": lambda s: shard(s, stage=1),
    "stage2": lambda s: shard(s, stage=2),
    "stage3": lambda s: shard(s, stage=3),
    "stage3+offload+mixed": lambda s: shard(offload(mixed_precision(s, "bf16")), stage=3),
}


def load_everywhere(directory, name, stacks):
    """Every stack, both ways of loading: the gathered weights and the compute copies' consistency."""
    out = {}
    for stack in stacks:
        for mode in ("ranges", "units"):
            model = meta_model(name)
            _, params = zf.functional(model, init="hf")
            step = STACKS[stack](empty_step)
            state = zf.TrainState.create(params, zf.optim.adamw(1e-3))
            if mode == "ranges":
                state, report = load_pretrained(directory, like=zf.init(step, state), progress=False)
            else:
                state, report = load_pretrained(directory, like=state, step=step, progress=False)
            assert report.mode == mode
            master = state.extras.get("mixed_precision")
            if master is not None:  # the bf16 compute copy is the master rounded, as the transform makes it
                for k, v in state.params.items():
                    assert torch.equal(v, master.master[k].to(torch.bfloat16)), k
            out[stack, mode] = to_numpy(zf.gather(step, state))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_load_equals_from_pretrained(saved, name, world):
    stacks = [s for s in STACKS if world == 1 or s != "plain"]
    want = to_numpy(hf_weights(saved[name], name))
    for per_rank in run_distributed(load_everywhere, world, saved[name], name, stacks):
        for (stack, mode), got in per_rank.items():
            assert set(got) <= set(want)
            for k, v in got.items():
                np.testing.assert_array_equal(v, want[k], err_msg=f"{stack} {mode} {k}")


def test_sharded_checkpoint(saved):
    index = json.loads((saved["gpt2-sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    want = to_numpy(hf_weights(saved["gpt2"]))
    for per_rank in run_distributed(load_everywhere, 2, saved["gpt2-sharded"], "gpt2", ["stage3"]):
        for got in per_rank.values():
            for k, v in got.items():
                np.testing.assert_array_equal(v, want[k], err_msg=k)


def train_after_load(directory):
    """Two steps from the loaded state equal two steps from transformers' own model (same stack)."""
    rank, world = rank_and_world()
    batches = [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(i)).chunk(world)[rank]
               for i in range(2)]
    results = []
    for source in ("load_pretrained", "from_pretrained"):
        if source == "load_pretrained":
            model = meta_model("gpt2")
            apply_fn, params = zf.functional(model, init="hf")
        else:
            model = transformers.GPT2LMHeadModel.from_pretrained(directory)
            apply_fn, params = zf.functional(model)
        model.eval()  # no dropout: the two runs must draw nothing

        def train_step(state, x, apply_fn=apply_fn):
            loss, grads = zf.value_and_grad(lambda p, x: apply_fn(p, x, labels=x).loss)(state.params, x)
            return state.apply_gradients(grads), {"loss": loss}

        step = shard(offload(mixed_precision(train_step, "bf16")), stage=3)
        state = zf.TrainState.create(params, zf.optim.adamw(1e-2))
        if source == "load_pretrained":
            state, _ = load_pretrained(directory, like=state, step=step, progress=False)
        else:
            state = step.init(state)
        losses = []
        for x in batches:
            state, metrics = step(state, x)
            losses.append(float(metrics["loss"]))
        results.append((losses, to_numpy(step.gather(state))))
    return results


def test_training_from_loaded_weights_equals_training_from_from_pretrained(saved):
    for (loaded_losses, loaded), (ref_losses, ref) in run_distributed(train_after_load, 2, saved["gpt2"]):
        assert loaded_losses == ref_losses
        for k, v in ref.items():
            np.testing.assert_array_equal(loaded[k], v, err_msg=k)


# -- names ------------------------------------------------------------------------------------------


def load_plain(directory, name="gpt2", mode="ranges", model=None, **kw):
    model = model if model is not None else meta_model(name)
    _, params = zf.functional(model, init="hf")
    state = zf.TrainState.create(params, zf.optim.sgd(0.1))
    if mode == "ranges":
        torch.manual_seed(0)
        return load_pretrained(directory, like=zf.init(empty_step, state), progress=False, **kw)
    return load_pretrained(directory, like=state, step=empty_step, progress=False, **kw)


def write_variant(tmp_path, saved, edit, name="gpt2") -> Path:
    """The checkpoint of ``name`` rewritten by ``edit(dict) -> dict``, as one model.safetensors."""
    tensors = edit(load_file(saved[name] / "model.safetensors"))
    out = tmp_path / "variant"
    out.mkdir(exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("mode", ["ranges", "units"])
def test_base_model_prefix_added_and_removed(saved, tmp_path, mode):
    want = hf_weights(saved["gpt2"])
    base = write_variant(tmp_path, saved, lambda t: {k.removeprefix("transformer."): v for k, v in t.items()})
    state, report = load_plain(base, mode=mode)  # GPT2Model's names into GPT2LMHeadModel
    assert report.renamed["transformer.h.0.attn.c_attn.weight"] == "h.0.attn.c_attn.weight"
    for k, v in state.params.items():
        assert torch.equal(v, want[k]), k
    # and GPT2LMHeadModel's names into GPT2Model
    with torch.device("meta"):
        bare = transformers.GPT2Model(configs()["gpt2"][1])
    state, report = load_plain(saved["gpt2"], mode=mode, model=bare)
    assert report.renamed["h.0.attn.c_attn.weight"] == "transformer.h.0.attn.c_attn.weight"
    for k, v in state.params.items():
        assert torch.equal(v, want["transformer." + k]), k


def test_rename_dict_callable_and_dropped(saved, tmp_path):
    want = hf_weights(saved["gpt2"])
    odd = write_variant(tmp_path, saved, lambda t: {k.replace("transformer.", "gpt."): v for k, v in t.items()}
                        | {"gpt.extra_scale": torch.ones(3)})
    with pytest.raises(CheckpointError, match=r"not in the model \(41\)"):
        load_plain(odd, prefix=None)
    state, report = load_plain(odd, rename=lambda n: None if n == "gpt.extra_scale" else
                               n.replace("gpt.", "transformer."))
    assert report.dropped == ("gpt.extra_scale",) and len(report.renamed) == 40
    for k, v in state.params.items():
        assert torch.equal(v, want[k]), k
    as_dict = {k: k.replace("gpt.", "transformer.") for k in load_file(odd / "model.safetensors")}
    state, report = load_plain(odd, rename=as_dict, allow_unexpected=["*.extra_*"])
    assert report.unexpected == ("gpt.extra_scale",)
    with pytest.raises(CheckpointError, match="filled by several checkpoint tensors"):
        load_plain(odd, rename=lambda n: "transformer.ln_f.bias" if "ln_f" in n else n.replace("gpt.", "transformer."))


@pytest.mark.parametrize("mode", ["ranges", "units"])
def test_missing_is_an_error_unless_allowed(saved, tmp_path, mode):
    holey = write_variant(tmp_path, saved, lambda t: {k: v for k, v in t.items() if "ln_f" not in k})
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(2\): transformer.ln_f.weight, "
                                              r"transformer.ln_f.bias"):
        load_plain(holey, mode=mode)
    state, report = load_plain(holey, mode=mode, allow_missing=["transformer.ln_f.*"])
    assert report.missing == ("transformer.ln_f.weight", "transformer.ln_f.bias")
    # kept their values: the model's initializer's (ones and zeros for a LayerNorm under init="hf")
    assert torch.equal(state.params["transformer.ln_f.weight"], torch.ones(32))
    assert torch.equal(state.params["transformer.ln_f.bias"], torch.zeros(32))
    state, _ = load_plain(holey, mode=mode, allow_missing=re.compile(r".*ln_f\..*"))


def test_shapes_must_agree(saved, tmp_path):
    bad = write_variant(tmp_path, saved, lambda t: t | {"transformer.ln_f.bias": torch.zeros(31)})
    with pytest.raises(CheckpointError, match=r"transformer.ln_f.bias: the model's shape is \[32\], .* \[31\]"):
        load_plain(bad)


@pytest.mark.parametrize("mode", ["ranges", "units"])
def test_tied_weights_from_either_name(saved, tmp_path, mode):
    want = hf_weights(saved["gpt2"])
    wte = "transformer.wte.weight"
    only_head = write_variant(tmp_path, saved, lambda t: {("lm_head.weight" if k == wte else k): v
                                                          for k, v in t.items()})
    state, report = load_plain(only_head, mode=mode)
    assert torch.equal(state.params[wte], want[wte]) and report.loaded[wte] == "lm_head.weight"
    both = write_variant(tmp_path, saved, lambda t: t | {"lm_head.weight": torch.zeros_like(t[wte])})
    state, report = load_plain(both, mode=mode)
    assert torch.equal(state.params[wte], want[wte]) and report.copies == ("lm_head.weight",)
    assert report.tied == {"lm_head.weight": wte}


def test_untied_model_gets_both(saved):
    want = hf_weights(saved["llama-untied"], "llama-untied")
    state, _ = load_plain(saved["llama-untied"], "llama-untied", mode="units")
    assert not torch.equal(state.params["lm_head.weight"], state.params["model.embed_tokens.weight"])
    for k, v in state.params.items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("mode", ["ranges", "units"])
def test_casts_exact_allowed_lossy_refused(saved, tmp_path, mode):
    want = hf_weights(saved["gpt2"])
    half = write_variant(tmp_path, saved, lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    state, report = load_plain(half, mode=mode)  # bf16 -> fp32 is exact
    assert report.casts["transformer.wte.weight"] == ("bfloat16", "float32")
    for k, v in state.params.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k].to(torch.bfloat16).float()), k
    narrow = meta_model("gpt2", torch.bfloat16)
    with pytest.raises(CheckpointError, match="float32 in the checkpoint, bfloat16 in the model: a lossy cast"):
        load_plain(saved["gpt2"], mode=mode, model=narrow)
    state, _ = load_plain(saved["gpt2"], mode=mode, model=meta_model("gpt2", torch.bfloat16), allow_lossy_cast=True)
    for k, v in state.params.items():
        assert torch.equal(v, want[k].to(torch.bfloat16)), k


def test_exact_cast_rule():
    from zfunc.io.hf_names import exact_cast
    assert exact_cast(torch.bfloat16, torch.float32) and exact_cast(torch.float16, torch.float32)
    assert not exact_cast(torch.float32, torch.bfloat16) and not exact_cast(torch.bfloat16, torch.float16)
    assert not exact_cast(torch.float16, torch.bfloat16) and exact_cast(torch.int32, torch.int64)
    assert exact_cast(torch.int16, torch.float32) and not exact_cast(torch.int64, torch.float32)
    assert not exact_cast(torch.float32, torch.int64) and exact_cast(torch.bool, torch.float32)


def test_pickled_weights_are_refused_unread(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError, match="pickled weights .*pytorch_model.bin.* never loads"):
        load_plain(tmp_path)
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_plain(tmp_path / "..")


def test_index_names_only_files_inside_and_all_must_exist(saved, tmp_path):
    import shutil
    shard_dir = tmp_path / "sharded"
    shutil.copytree(saved["gpt2-sharded"], shard_dir)
    index_path = shard_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    for bad, message in [("../model.safetensors", "only .safetensors files inside its directory"),
                         ("/etc/passwd", "only .safetensors files inside its directory"),
                         ("model-99999-of-99999.safetensors", r"not in .* \(an incomplete download\?\)")]:
        index_path.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], first: bad}}))
        with pytest.raises(CheckpointError, match=message):
            load_plain(shard_dir)


def test_hub_cache_links_are_followed(saved, tmp_path):
    """The hub cache links snapshots/<rev>/model.safetensors to a blob: a Hugging Face directory may be links."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for f in saved["gpt2"].iterdir():
        (blobs / f"sha-{f.name}").write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(blobs / f"sha-{f.name}")
    state, _ = load_plain(snapshot)
    want = hf_weights(saved["gpt2"])
    for k, v in state.params.items():
        assert torch.equal(v, want[k]), k


def test_meta_state_needs_step_and_initialized_state_refuses_it(saved):
    _, params = zf.functional(meta_model("gpt2"), init="hf")
    state = zf.TrainState.create(params, zf.optim.sgd(0.1))
    with pytest.raises(TypeError, match="pass step="):
        load_pretrained(saved["gpt2"], like=state)
    with pytest.raises(TypeError, match="leave step out"):
        load_pretrained(saved["gpt2"], like=zf.init(empty_step, state), step=empty_step)


def test_report_says_what_came_from_where(saved, tmp_path):
    half = write_variant(tmp_path, saved, lambda t: {k.removeprefix("transformer."): v.to(torch.bfloat16)
                                                     for k, v in t.items()})
    _, report = load_plain(half)
    text = str(report)
    assert "40 tensors loaded" in text and "renamed (40)" in text and "tied (1): lm_head.weight" in text
    assert "cast (40)" in text and "bfloat16 -> float32" in text


# -- frozen parameters and buffers live in the module ---------------------------------------------


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)
        self.register_buffer("offset", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def reset_parameters(self):
        self.scale.data.fill_(1.0)
        self.offset.zero_()
        self.steps.zero_()
        self.cache.fill_(5.0)


@pytest.mark.parametrize("mode", ["ranges", "units"])
def test_frozen_parameters_and_buffers(tmp_path, mode):
    values = {"embed.weight": torch.randn(7, 4), "scale": torch.tensor([2.0, 3.0, 4.0, 5.0]),
              "offset": torch.tensor([0.5, -0.5, 0.25, 1.0]), "steps": torch.tensor(41)}
    save_file(values, tmp_path / "model.safetensors")
    if mode == "ranges":
        model = Frozen()
        _, params = zf.functional(model)
        step = shard(empty_step, stage=2)
        state = step.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
        with pytest.raises(CheckpointError, match=r"not in the model \(3\): .*\n.*without model= .*pass the model"):
            load_pretrained(tmp_path, like=state, progress=False)
        state, report = load_pretrained(tmp_path, like=state, model=model, progress=False)
    else:
        with torch.device("meta"):
            model = Frozen()
        _, params = zf.functional(model)
        step = shard(empty_step, stage=2)
        state, report = load_pretrained(tmp_path, like=zf.TrainState.create(params, zf.optim.sgd(0.1)), step=step,
                                        progress=False)
        assert torch.equal(model.cache, torch.full((2,), 5.0))  # non-persistent: from the model's initializer
    assert set(report.loaded) == set(values) and report.tied == {"head.weight": "embed.weight"}
    assert torch.equal(step.gather(state)["embed.weight"], values["embed.weight"])
    for k in ("scale", "offset", "steps"):
        assert torch.equal(model.state_dict()[k], values[k]), k


# -- ranks ---------------------------------------------------------------------------------------


def one_rank_elsewhere(good, bad):
    rank, _ = rank_and_world()
    _, params = zf.functional(meta_model("gpt2"), init="hf")
    step = shard(empty_step, stage=3)
    try:
        load_pretrained(bad if rank == 1 else good, like=zf.TrainState.create(params, zf.optim.sgd(0.1)), step=step,
                        progress=False)
    except CheckpointError as e:
        return str(e)
    return None


def test_every_rank_learns_of_one_ranks_failure(saved, tmp_path):
    messages = run_distributed(one_rank_elsewhere, 2, saved["gpt2"], tmp_path / "absent")
    assert all(m is not None and "absent: no such checkpoint" in m for m in messages), messages
    messages = run_distributed(one_rank_elsewhere, 2, saved["gpt2"], saved["gpt2-sharded"])
    assert all(m is not None and "opened different checkpoints" in m for m in messages), messages


# -- export ----------------------------------------------------------------------------------------


def export_from_state(directory, out, name, dtype, max_shard_size):
    model = meta_model(name)
    _, params = zf.functional(model, init="hf")
    step = shard(offload(mixed_precision(empty_step, "bf16")), stage=3)
    state, _ = load_pretrained(directory, like=zf.TrainState.create(params, zf.optim.sgd(0.1)), step=step,
                               progress=False)
    export_hf(out, state, model=model, dtype=dtype, max_shard_size=max_shard_size, progress=False)
    return sorted(os.listdir(out))


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-untied"])
@pytest.mark.parametrize("dtype, max_shard_size", [(None, "5GB"), (torch.bfloat16, 40_000)])
def test_export_from_a_sharded_state_loads_with_from_pretrained(saved, tmp_path, name, dtype, max_shard_size):
    out = tmp_path / "export"
    files = run_distributed(export_from_state, 2, saved[name], out, name, dtype, max_shard_size)[0]
    assert ("model.safetensors.index.json" in files) == (max_shard_size != "5GB"), files
    cls, _ = configs()[name]
    back = cls.from_pretrained(out)
    want = hf_weights(saved[name], name)
    assert back.dtype == (dtype or torch.float32)
    assert back.get_output_embeddings().weight is back.get_input_embeddings().weight or name == "llama-untied"
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k].to(back.dtype)), k
    written = {k for f in out.glob("*.safetensors") for k in load_file(f)}
    assert ("lm_head.weight" in written) == (name == "llama-untied")  # tied: written once, as HF does
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype or torch.float32)[6:]


def save_checkpoint(directory, ckpt):
    _, params = zf.functional(meta_model("gpt2"), init="hf")
    step = shard(mixed_precision(empty_step, "bf16"), stage=2)
    state, _ = load_pretrained(directory, like=zf.TrainState.create(params, zf.optim.adamw(0.1)), step=step,
                               progress=False)
    zf.io.save(ckpt, state)


def test_export_from_a_zfunc_checkpoint(saved, tmp_path):
    run_distributed(save_checkpoint, 2, saved["gpt2"], tmp_path / "ckpt")
    model = meta_model("gpt2")
    export_hf(tmp_path / "out", tmp_path / "ckpt", model=model, max_shard_size="30KB", progress=False)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    want = hf_weights(saved["gpt2"])
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k
    with pytest.raises(CheckpointError, match="inside the checkpoint"):
        export_hf(tmp_path / "ckpt" / "step_000000" / "x", tmp_path / "ckpt", model=model, progress=False)


def test_export_from_full_weights_and_overwrite_rules(saved, tmp_path):
    model = transformers.GPT2LMHeadModel.from_pretrained(saved["gpt2"])
    _, params = zf.functional(model)
    out = export_hf(tmp_path / "out", dict(params), model=model, max_shard_size="30KB", progress=False)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    with pytest.raises(CheckpointError, match="already holds .*overwrite=True"):
        export_hf(out, dict(params), model=model, progress=False)
    with pytest.raises(CheckpointError, match="model-00001-of-.* which this export would not replace"):
        export_hf(out, dict(params), model=model, overwrite=True, progress=False)  # one file now: stale shards
    (out / "keep.txt").write_text("mine")
    export_hf(out, dict(params), model=model, overwrite=True, max_shard_size="30KB", progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    back = transformers.GPT2LMHeadModel.from_pretrained(out)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# -- memory: peak host memory is a few tensors, not the model ---------------------------------------

MEASURE = textwrap.dedent("""
    import gc, json, sys, torch
    import zfunc as zf
    from examples.gpt import GPT, GPTConfig
    from zfunc.transforms import shard, mixed_precision
    torch.set_num_threads(1)

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    mode, stack = sys.argv[3].split(":")
    with torch.device("meta"):
        model = GPT(GPTConfig(**json.loads(sys.argv[2])))
    _, params = zf.functional(model)
    empty = lambda s, b: (s, {})
    step = shard(mixed_precision(empty, "bf16") if stack == "mixed" else empty, stage=3)
    state = zf.TrainState.create(params, zf.optim.sgd(0.1))
    if mode == "ranges":
        state = step.init(state)
    gc.collect()
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from the current RSS
    if mode == "ranges":
        state, _ = zf.io.load_pretrained(sys.argv[1], like=state, progress=False)
    elif mode == "units":
        state, _ = zf.io.load_pretrained(sys.argv[1], like=state, step=step, progress=False)
    else:  # random values, for comparison: what step.init of a meta-built model holds anyway
        state = step.init(state)
    held = sum(t.numel() * t.element_size() for t in zf.tree.tree_leaves(state) if isinstance(t, torch.Tensor))
    print(json.dumps({"mode": mode, "stack": stack, "before": before, "peak": status("VmHWM"), "state": held}))
""")

BIG = {"vocab_size": 50257, "block_size": 1024, "n_layer": 6, "n_head": 12, "n_embd": 768}  # GPT-2 shaped: 82M parameters


def write_random_checkpoint(path: Path, config: dict) -> int:
    """A safetensors file of the model's shapes with random values, written one tensor at a time (the test
    process never holds the model); returns its size."""
    from examples.gpt import GPT, GPTConfig
    from zfunc.io.format import write_safetensors

    with torch.device("meta"):
        model = GPT(GPTConfig(**config))
    shapes = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once, as HF does
    write_safetensors(path, [(k, torch.float32, list(v.shape)) for k, v in shapes.items()],
                      (torch.randn(v.shape) * 0.02 for v in shapes.values()), {"format": "pt"})
    return path.stat().st_size


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_peak_host_memory_is_a_few_tensors_not_the_model(tmp_path):
    """Into an initialized state: the peak stays within a staging buffer of the state itself. Into a meta-built
    model unit by unit: no more than step.init holds when it draws random values instead."""
    size = write_random_checkpoint(tmp_path / "model.safetensors", BIG)
    assert size > 300e6
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    extra = {}
    runs = ["ranges:plain", "ranges:mixed", "init:plain", "units:plain"]  # each in a fresh process, all at once
    procs = [subprocess.Popen([sys.executable, "-c", MEASURE, str(tmp_path), json.dumps(BIG), run], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for run in runs]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        m = json.loads(out.strip().splitlines()[-1])
        # above what the process held before and the state it holds after (built during "init" and "units")
        extra[m["mode"], m["stack"]] = m["peak"] - m["before"] - (m["state"] if m["mode"] != "ranges" else 0)
        print(f"{m['mode']} {m['stack']}: checkpoint {size / 2**20:.0f} MiB, state {m['state'] / 2**20:.0f} MiB, "
              f"peak beyond the state {extra[m['mode'], m['stack']] / 2**20:.0f} MiB")
    assert extra["ranges", "plain"] < 16 << 20, extra  # read straight into the state's tensors
    assert extra["ranges", "mixed"] < 40 << 20, extra  # the bf16 copy through an 8 MiB staging buffer
    # Unit by unit: what step.init of a meta-built model holds anyway when it draws random values (shard keeps
    # up to three copies of the unit in hand: its values, packed, and this rank's region), the embeddings here.
    root_unit = (BIG["vocab_size"] + BIG["block_size"] + 2) * BIG["n_embd"] * 4
    assert extra["units", "plain"] < 3 * root_unit + (32 << 20), extra
    assert extra["init", "plain"] < 3 * root_unit + (32 << 20), extra
