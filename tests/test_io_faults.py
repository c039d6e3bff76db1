"""zfunc.io and the zfunc CLI under attack: every fault ends in the right result or a clear error.

Each test's name starts with its class of fault (RELIABILITY.md tallies them):
``integrity`` (damaged bytes), ``confinement`` (reads outside the checkpoint,
links, crafted sizes), ``data_loss`` (deleting or overwriting what is not
zfunc's, ranks on separate disks, concurrent saves, names lost on export),
``hang`` (ranks that never meet) and ``unclear`` (malformed input that must
give a one-line, named error rather than a KeyError or a traceback). The
``kept`` tests guard what already worked (no pickle, other world sizes,
format-1 checkpoints).

A crafted manifest is re-sealed (`tests.io_tools.rewrite_manifest`: its
checksum and ``latest`` made to match) so that the test reaches the
validation behind the checksum, as an adversary who can write files would.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch

import zfunc as zf
from tests.io_tools import PathSpy, Replacement, as_format_1, flip_bit, rewrite_manifest, write_manifest_bytes
from tests.models import TinyLM, make_batch, tiny_lm_step
from zfunc.cli import main as cli_main
from zfunc.dist import CollectiveError
from zfunc.io import CheckpointError, consolidate, locate, read_manifest, restore, save
from zfunc.io.commit import SaveLock
from zfunc.testing import run_distributed
from zfunc.transforms import shard

STEP = "step_000002"


def build(stage: int = 3):
    """``(step, state, model)``: TinyLM (tied head, frozen parameter, buffer) under `shard(stage)` (0: none)."""
    model, params, train_step = tiny_lm_step(0.0)
    step = shard(train_step, stage=stage) if stage else train_step
    return step, zf.init(step, zf.TrainState.create(params, zf.optim.adamw(1e-2))), model


def tensors(state) -> list[torch.Tensor]:
    return [x for x in zf.tree.tree_leaves(state) if isinstance(x, torch.Tensor)]


def assert_same(a, b) -> None:
    la, lb = tensors(a), tensors(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


class Saved:
    """A pristine checkpoint (stage 3, one rank, trained two steps, with client_state) and what it holds."""

    def __init__(self, root: Path) -> None:
        step, state, _ = build()
        for i in range(2):
            state, _ = step(state, make_batch(seed=i))
        save(root / "ck", state, {"data_pos": 7, "mark": torch.arange(3)})
        self.root, self.state, self.full = root / "ck", state, step.gather(state)

    def copy(self, to: Path) -> Path:
        """A fresh copy of the save directory (``to/ck``)."""
        shutil.copytree(self.root, to / "ck", symlinks=True)
        return to / "ck"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Saved:
    return Saved(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def ck(pristine, tmp_path) -> Path:
    return pristine.copy(tmp_path)


def restored(path, **kw):
    """Restore into a fresh stage-3 template; returns ``(state, client_state)``."""
    return restore(path, like=build()[1], **kw)


def assert_restores(path, pristine: Saved) -> None:
    state, client = restored(path)
    assert_same(state, pristine.state)
    assert client["data_pos"] == 7 and torch.equal(client["mark"], torch.arange(3))


# ==========================================================================
# Integrity: damaged bytes are found, whichever file they are in


MANIFEST_SPOTS = ['"data_pos": ', '"cuda_devices": ', '"step": ', '"sha256": "', '"embed.weight": [\n',
                  '"world_size": ', '"weights": "', '"numpy": [\n']


@pytest.mark.parametrize("spot", MANIFEST_SPOTS + ["first byte", "last byte"])
def test_integrity_a_flipped_bit_in_the_manifest_is_caught(ck, spot):
    manifest = ck / STEP / "manifest.json"
    text = manifest.read_bytes()
    offset = {"first byte": 0, "last byte": len(text) - 1}.get(spot)
    if offset is None:  # the first character of the value after the spot
        offset = text.index(spot.encode()) + len(spot)
        while text[offset:offset + 1] in (b" ", b"\n", b"[", b'"'):
            offset += 1
    flip_bit(manifest, offset)
    with pytest.raises(CheckpointError, match=r"manifest\.json: checksum mismatch"):
        restored(ck)
    with pytest.raises(CheckpointError, match=r"manifest\.json: checksum mismatch"):
        consolidate(ck, ck.parent / "w.safetensors", progress=False)


def test_integrity_the_flip_that_used_to_pass_silently(ck):
    """The fault as found: client_state's value changed by one bit (7 -> 6) restored without a word."""
    manifest = ck / STEP / "manifest.json"
    text = manifest.read_bytes()
    flip_bit(manifest, text.index(b'"data_pos": 7') + len('"data_pos": '))
    assert b'"data_pos": 6' in manifest.read_bytes()
    with pytest.raises(CheckpointError, match=r"checksum mismatch.*the manifest is corrupted"):
        restored(ck)


@pytest.mark.parametrize("damage", ["another digit", "missing", "garbage", "symlink"])
def test_integrity_a_damaged_manifest_checksum_file_is_caught(ck, damage):
    sums = ck / STEP / "manifest.sha256"
    if damage == "another digit":
        text = sums.read_text()
        sums.write_text(("0" if text[0] != "0" else "1") + text[1:])
        expected = r"checksum mismatch"
    elif damage == "missing":
        sums.unlink()
        expected = r"manifest\.sha256: missing; a format 2 checkpoint has one"
    elif damage == "garbage":
        sums.write_text("not a checksum\n")
        expected = r"manifest\.sha256: corrupt"
    else:
        (ck.parent / "elsewhere.sha256").write_bytes(sums.read_bytes())
        sums.unlink()
        sums.symlink_to(ck.parent / "elsewhere.sha256")
        expected = r"manifest\.sha256: is a symbolic link"
    with pytest.raises(CheckpointError, match=expected):
        restored(ck / STEP)


def two_checkpoints(ck: Path, pristine: Saved) -> str:
    """Add step 3 beside step 2 (a re-save under another step number); returns the new latest line."""
    state = restored(ck)[0]
    save(ck, state.replace(step=torch.tensor(3)), {"data_pos": 8, "mark": torch.arange(3)})
    return (ck / "latest").read_text()


def test_integrity_a_flipped_step_number_in_latest_still_finds_its_checkpoint(ck, pristine):
    line = two_checkpoints(ck, pristine)
    assert line.startswith("step_000003 ")
    flip_bit(ck / "latest", len("step_00000"))  # "3" -> "2": it now names the older checkpoint
    assert (ck / "latest").read_text().startswith("step_000002 ")
    _, client = restored(ck)
    assert client["data_pos"] == 8  # the checksum in `latest` designates step 3, and step 3 it is


@pytest.mark.parametrize("damage", ["another hex digit", "not a hex digit"])
def test_integrity_a_damaged_checksum_in_latest_is_an_error(ck, pristine, damage):
    two_checkpoints(ck, pristine)
    text = (ck / "latest").read_text()
    swapped = {"another hex digit": "0" if text[-5] != "0" else "1", "not a hex digit": "g"}[damage]
    (ck / "latest").write_text(text[:-5] + swapped + text[-4:])
    expected = {"another hex digit": r"latest: records manifest checksum .* damaged",
                "not a hex digit": r"latest: not in the format zfunc writes .*damaged"}[damage]
    with pytest.raises(CheckpointError, match=expected):
        restored(ck)
    assert restored(ck, step=3)[1]["data_pos"] == 8  # and an explicit step still reads


def test_integrity_a_checkpoint_replaced_behind_latest_is_an_error(ck, pristine, tmp_path):
    two_checkpoints(ck, pristine)
    shutil.rmtree(ck / "step_000003")
    shutil.copytree(ck / STEP, ck / "step_000003")  # someone copied step 2 over step 3
    with pytest.raises(CheckpointError, match=r"step_000003 was replaced after it was saved"):
        restored(ck)


@pytest.mark.parametrize("where", ["client tensor", "rng state", "parameter slice", "header"])
def test_integrity_a_flipped_bit_in_a_rank_file_is_caught(ck, where):
    path = ck / STEP / "rank_00000.safetensors"
    with safetensors.safe_open(path, "pt") as f:
        names = list(f.keys())
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    name = {"client tensor": "client/0", "rng state": "rng/torch_cpu", "parameter slice": "params/embed.weight",
            "header": None}[where]
    assert name is None or name in names
    base = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    offset = 20 if name is None else base + header[name]["data_offsets"][0] + 1
    flip_bit(path, offset, 1)
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors: (checksum mismatch|corrupt)"):
        restored(ck)


def test_integrity_a_damaged_rng_state_is_refused_before_anything_is_written(ck, pristine):
    """Even without verify, a generator state of the wrong size is found before the template is touched."""
    path = ck / STEP / "rank_00000.safetensors"
    data = safetensors.torch.load_file(path)
    data["rng/python"] = data["rng/python"][:600]
    raw = _rewrite_rank_file(path, data)
    rewrite_manifest(ck / STEP, lambda m: m["files"][0]["parts"][0].update(bytes=len(raw[0]), sha256=raw[1]))
    like = build()[1]
    before = [t.clone() for t in tensors(like)]
    with pytest.raises(CheckpointError, match=r"generator state is damaged: rng/python: .* shape \[600\]"):
        restore(ck, like=like, verify=False)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors(like)))


def _rewrite_rank_file(path: Path, data: dict) -> tuple[bytes, str]:
    """Rewrite a rank file (same metadata) with other tensors; returns its bytes and SHA-256."""
    import hashlib

    with safetensors.safe_open(path, "pt") as f:
        metadata = f.metadata()
    safetensors.torch.save_file(data, path, metadata)
    raw = path.read_bytes()
    return raw, hashlib.sha256(raw).hexdigest()


def test_integrity_rank_files_swapped_between_ranks_are_caught_without_verify(two_ranks, tmp_path):
    ck = two_ranks.copy(tmp_path)
    d = ck / STEP
    a, b = d / "rank_00000.safetensors", d / "rank_00001.safetensors"
    a.rename(d / "swap")
    b.rename(a)
    (d / "swap").rename(b)
    rewrite_manifest(d, lambda m: [m["files"][r]["parts"][0].update(bytes=(d / rank).stat().st_size)
                                   for r, rank in enumerate(["rank_00000.safetensors", "rank_00001.safetensors"])])
    with pytest.raises(CheckpointError, match=r"written as part 0 of rank 1, but the manifest lists it as part 0 "
                                              r"of rank 0"):
        restore(ck, like=build(0)[1], verify=False, rng=False)


# ==========================================================================
# Confinement: nothing outside the checkpoint is opened, no link is followed, no size is trusted


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../../../../etc/passwd",
                                  "../other/step_000002/rank_00000.safetensors", "rank_00001.safetensors",
                                  "sub/rank_00000.safetensors", "", "rank_00000.safetensors/.."])
def test_confinement_a_manifest_naming_another_file_is_refused_before_opening(ck, monkeypatch, name):
    rewrite_manifest(ck / STEP, lambda m: m["files"][0]["parts"][0].update(file=name))
    spy = PathSpy(monkeypatch)
    for call in (lambda: restored(ck), lambda: consolidate(ck, ck.parent / "w.safetensors", progress=False)):
        with pytest.raises(CheckpointError, match=r"field files\[0\]\.parts\[0\]\.file must be "
                                                  r"'rank_00000\.safetensors'"):
            call()
    assert not spy.touched("passwd") and not spy.touched("other") and not spy.touched("sub/")
    monkeypatch.undo()
    assert cli_main(["verify", str(ck)]) == 2


def _link_rank_file(ck: Path) -> None:
    part = ck / STEP / "rank_00000.safetensors"
    outside = ck.parent / "outside.safetensors"  # a valid copy: only the link itself is wrong
    shutil.copy(part, outside)
    part.unlink()
    part.symlink_to(outside)


def _link_manifest(ck: Path) -> None:
    manifest = ck / STEP / "manifest.json"
    shutil.copy(manifest, ck.parent / "outside.json")
    manifest.unlink()
    manifest.symlink_to(ck.parent / "outside.json")


def _link_step_dir(ck: Path) -> None:
    shutil.move(ck / STEP, ck.parent / "other_run_step")
    (ck / STEP).symlink_to(ck.parent / "other_run_step")


def _link_latest(ck: Path) -> None:
    (ck.parent / "latest_elsewhere").write_bytes((ck / "latest").read_bytes())
    (ck / "latest").unlink()
    (ck / "latest").symlink_to(ck.parent / "latest_elsewhere")


@pytest.mark.parametrize("link, expected", [
    (_link_rank_file, r"rank_00000\.safetensors: is a symbolic link"),
    (_link_manifest, r"manifest\.json: is a symbolic link"),
    (_link_step_dir, r"names step_000002, which is a symbolic link"),
    (_link_latest, r"latest: not in the format zfunc writes \(a link"),
])
def test_confinement_symbolic_links_are_refused(ck, link, expected):
    link(ck)
    with pytest.raises(CheckpointError, match=expected):
        restored(ck)
    with pytest.raises(CheckpointError, match=expected):
        consolidate(ck, ck.parent / "w.safetensors", progress=False)


def test_confinement_a_step_directory_that_is_a_link_is_not_listed_nor_read_by_step(ck):
    _link_step_dir(ck)
    (ck / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"step_000002: is a symbolic link"):
        restored(ck, step=2)
    with pytest.raises(CheckpointError, match=r"not a zfunc checkpoint directory"):
        restored(ck)


def _grow(name: str, shape: list[int]):
    """A mutation giving parameter ``name`` another shape everywhere the manifest records it (a consistent lie)."""
    def mutate(m):
        m["params"][name] = shape
        for unit in m["layout"]["units"]:
            if name in unit["keys"]:
                unit["shapes"][unit["keys"].index(name)] = shape
    return mutate


@pytest.mark.parametrize("mutate, expected", [
    (_grow("embed.weight", [1 << 31, 1 << 20]), r"shapes describe \d+ bytes of tensors, but the files it lists hold"),
    (_grow("embed.weight", [1 << 62, 2]), r"field params\['embed.weight'\] describes"),
    (lambda m: m["leaves"]["step"].update(shape=[1 << 40]), r"shapes describe \d+ bytes"),
    (lambda m: [_grow("embed.weight", [1 << 20, 1 << 10])(m), m["files"][0]["parts"][0].update(bytes=1 << 40)],
     r"rank_00000\.safetensors: truncated: \d+ bytes, the manifest says 1099511627776"),
    (_grow("embed.weight", [14, 10]), r"'params/embed.weight' holds 130 elements of float32; the manifest says 140"),
])
def test_confinement_crafted_sizes_are_refused_without_allocating(ck, monkeypatch, mutate, expected):
    rewrite_manifest(ck / STEP, mutate)
    real_empty = torch.empty

    def bounded_empty(*shape, **kw):
        size = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if str(kw.get("device")) != "meta":  # shapes compared on the meta device cost nothing
            assert torch.Size(size).numel() < 1 << 24, f"allocated {size} from a crafted manifest"
        return real_empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", bounded_empty)
    with pytest.raises(CheckpointError, match=expected):
        consolidate(ck, ck.parent / "w.safetensors", progress=False)
    with pytest.raises(CheckpointError):
        restored(ck)


def test_confinement_a_rank_file_header_claiming_a_huge_tensor_is_refused(ck):
    path = ck / STEP / "rank_00000.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["params/embed.weight"].update(shape=[1 << 31, 1 << 31], data_offsets=[0, 1 << 64])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    import hashlib

    rewrite_manifest(ck / STEP, lambda m: m["files"][0]["parts"][0].update(
        bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest()))
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors: truncated: the header describes"):
        restored(ck)


def _no_pickle(monkeypatch) -> None:
    def refuse(*a, **kw):
        raise AssertionError("zfunc.io unpickled something")

    for module, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)


def test_kept_loading_never_unpickles(ck, pristine, monkeypatch, capsys):
    _no_pickle(monkeypatch)
    assert_restores(ck, pristine)
    consolidate(ck, ck.parent / "w.safetensors", progress=False)
    assert cli_main(["verify", str(ck)]) == 0 and cli_main(["info", str(ck)]) == 0


# ==========================================================================
# Unclear errors: a malformed manifest is a CheckpointError naming the field, never a KeyError


def _set(path: tuple, value):
    def mutate(m):
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _drop(path: tuple):
    def mutate(m):
        node = m
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


TOP_FIELDS = ["zfunc_version", "torch_version", "created", "step", "world_size", "stage", "layout", "params",
              "weights", "groups", "leaves", "ties", "files"]
MALFORMED = {
    **{f"missing {k}": (_drop((k,)), rf"lacks '{k}'") for k in TOP_FIELDS},
    "missing format": (_drop(("format",)), r"not a zfunc checkpoint manifest"),
    "missing format_version": (_drop(("format_version",)), r"corrupt \(format_version is None\)"),
    "format_version 0": (_set(("format_version",), 0), r"format_version is 0"),
    "format_version str": (_set(("format_version",), "2"), r"format_version is '2'"),
    "extra field": (_set(("surprise",), 1), r"has unexpected 'surprise'"),
    # Format 3 carries exactly one section: tensor_parallel's or pipeline's (never in a format 2 manifest).
    "format 2 with a section": (_set(("pipeline",), {}), r"has unexpected 'pipeline'"),
    "format 3 without a section": (_set(("format_version",), 3), r"has one of 'tensor_parallel' or 'pipeline'; "
                                                                    r"this one has neither"),
    "format 3 with both sections": (lambda m: m.update(format_version=3, tensor_parallel={}, pipeline={}),
                                    r"this one has 'tensor_parallel' and 'pipeline'"),
    "step -1": (_set(("step",), -1), r"field step must be in"),
    "step huge": (_set(("step",), 10 ** 30), r"field step must be in"),
    "step str": (_set(("step",), "2"), r"field step must be an integer, got str"),
    "step float": (_set(("step",), 2.5), r"field step must be an integer, got float"),
    "step bool": (_set(("step",), True), r"field step must be an integer, got bool"),
    "world_size 0": (_set(("world_size",), 0), r"field world_size must be in \[1"),
    "world_size 2": (_set(("world_size",), 2), r"field (layout is for stage 3 on 1 ranks|files must have 2)"),
    "stage 7": (_set(("stage",), 7), r"field stage must be in \[0, 3\]"),
    "stage 0 with layout": (_set(("stage",), 0), r"field layout must be null for stage 0"),
    "layout null": (_set(("layout",), None), r"field layout must be an object for stage 3"),
    "layout unit shape": (_set(("layout", "units", 0, "shapes", 0), [13, 11]), r"layout\.units\[0\]\.shapes\[0\] is"),
    "layout unit key": (_set(("layout", "units", 0, "keys", 0), "nope"), r"layout\.units\[0\]\.keys\[0\] 'nope'"),
    "layout unit dropped": (lambda m: m["layout"]["units"].pop(), r"layout\.units leave out parameters"),
    "layout world": (_set(("layout", "world_size"), 4), r"field layout is for stage 3 on 4 ranks"),
    "params list": (_set(("params",), []), r"field params must be an object, got list"),
    "params negative dim": (_set(("params", "embed.weight"), [-13, 10]), r"params\['embed.weight'\]\[0\] must be"),
    "params float dim": (_set(("params", "embed.weight"), [13.0, 10]), r"params\['embed.weight'\]\[0\] must be an"),
    "params str shape": (_set(("params", "embed.weight"), "13x10"), r"params\['embed.weight'\] must be a list"),
    "group lacks key": (_drop(("groups", "params", "embed.weight")), r"groups\['params'\] must hold exactly"),
    "group dtype": (_set(("groups", "params", "embed.weight"), "float128"), r"must name a dtype"),
    "group dtype attr": (_set(("groups", "params", "embed.weight"), "nn"), r"must name a dtype"),
    "weights elsewhere": (_set(("weights",), "opt_state/9"), r"field weights names 'opt_state/9'"),
    "leaf dtype": (_set(("leaves", "step", "dtype"), 64), r"leaves\['step'\]\.dtype must name a dtype"),
    "leaf lacks shape": (_drop(("leaves", "step", "shape")), r"leaves\['step'\] lacks 'shape'"),
    "tie to self": (_set(("ties",), [["embed.weight", "embed.weight"]]), r"field ties\[0\]"),
    "tie to nothing": (_set(("ties",), [["head.weight", "nope"]]), r"field ties\[0\]"),
    "ties str": (_set(("ties",), "head.weight"), r"field ties must be a list"),
    "tie short": (_set(("ties",), [["head.weight"]]), r"field ties\[0\] must have 2 entries"),
    "files empty": (_set(("files",), []), r"field files must have 1 entries, has 0"),
    "files rank": (_set(("files", 0, "rank"), 1), r"files\[0\]\.rank must be 0"),
    "parts empty": (_set(("files", 0, "parts"), []), r"files\[0\]\.parts is empty"),
    "part bytes -1": (_set(("files", 0, "parts", 0, "bytes"), -1), r"parts\[0\]\.bytes must be in \[8"),
    "part bytes str": (_set(("files", 0, "parts", 0, "bytes"), "1234"), r"parts\[0\]\.bytes must be an integer"),
    "part bytes huge": (_set(("files", 0, "parts", 0, "bytes"), 1 << 70), r"parts\[0\]\.bytes must be in"),
    "part sha256": (_set(("files", 0, "parts", 0, "sha256"), "zz"), r"parts\[0\]\.sha256 must be 64 hex digits"),
    "part lacks sha256": (_drop(("files", 0, "parts", 0, "sha256")), r"parts\[0\] lacks 'sha256'"),
    "part extra": (_set(("files", 0, "parts", 0, "mode"), "w"), r"parts\[0\] has unexpected 'mode'"),
    "rng lacks numpy": (_drop(("files", 0, "rng", "numpy")), r"files\[0\]\.rng lacks 'numpy'"),
    "rng cuda -1": (_set(("files", 0, "rng", "cuda_devices"), -1), r"rng\.cuda_devices must be in"),
    "rng numpy kind": (_set(("files", 0, "rng", "numpy", 0), "PCG64"), r"rng\.numpy\[0\] must be 'MT19937'"),
    "rng python version": (_set(("files", 0, "rng", "python", 0), 2), r"rng\.python\[0\] must be in \[3, 3\]"),
    "client ref other tensor": (_set(("files", 0, "client_state", "mark"), {"__tensor__": "params/embed.weight"}),
                                r"client_state\['mark'\] holds a malformed tensor reference"),
    "client ref int": (_set(("files", 0, "client_state", "mark"), {"__tensor__": 5}), r"malformed tensor reference"),
    "client ref missing": (_set(("files", 0, "client_state", "mark"), {"__tensor__": "client/9"}),
                           r"have no tensor 'client/9'"),
    "files not list": (_set(("files",), {"0": {}}), r"field files must be a list, got dict"),
    "manifest a list": (lambda m: Replacement([m]), r"not a zfunc checkpoint manifest"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_unclear_a_malformed_manifest_field_is_named(ck, capsys, case):
    mutate, expected = MALFORMED[case]
    rewrite_manifest(ck / STEP, mutate)
    with pytest.raises(CheckpointError, match=expected) as err:
        restored(ck)
    assert "manifest.json" in str(err.value) or "rank_00000" in str(err.value)
    if case == "client ref missing":  # client_state is restore's alone: the export is right regardless
        consolidate(ck, ck.parent / "w.safetensors", progress=False)
    else:
        with pytest.raises(CheckpointError, match=expected):
            consolidate(ck, ck.parent / "w.safetensors", progress=False)
    assert cli_main(["verify", str(ck)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("raw, expected", [
    ('"step": ' + "1" * 5000, r"not JSON"),                       # more digits than Python parses
    ('"step": NaN', r"field step must be an integer, got float"),
    ('"step": 1e400', r"field step must be an integer, got float"),
    ('"step": 2, "pad": "' + "[" * 100000, r"not JSON"),
    ('"step": 2, "deep": ' + "[" * 50000 + "]" * 50000, r"(nested too deeply|not JSON|unexpected 'deep')"),
    ('"step": 2, "bad": "\\udc80"', r"has unexpected 'bad'"),
], ids=["huge integer", "NaN", "1e400", "unterminated", "deeply nested", "lone surrogate"])
def test_unclear_raw_manifest_text_that_json_chokes_on(ck, raw, expected):
    path = ck / STEP / "manifest.json"
    text = path.read_text()
    start = text.index('"step": ')
    end = text.index(",", start)
    write_manifest_bytes(ck / STEP, (text[:start] + raw + text[end:]).encode())
    with pytest.raises(CheckpointError, match=expected):
        restored(ck)


def _paths(node, prefix=()):
    """Every path into a JSON value, skipping free-form data (client_state, RNG, version strings)."""
    yield prefix
    if prefix and prefix[-1] in ("client_state", "rng", "created", "zfunc_version", "torch_version"):
        return
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


ODD_VALUES = [None, -1, 0, 1 << 70, "x", "../../etc/passwd", [], {}, 1.5, True, [1, 2], {"a": 1}]


@pytest.mark.parametrize("seed", range(30))
def test_unclear_random_manifest_damage_is_a_clear_error_or_harmless(ck, pristine, seed):
    """Random structural edits (re-sealed): each restore either gives exactly the saved state or a CheckpointError."""
    rnd = random.Random(seed)

    def mutate(m):
        path = rnd.choice([p for p in _paths(m) if p])
        node = m
        for key in path[:-1]:
            node = node[key]
        action = rnd.choice(["replace", "replace", "delete", "add"])
        if action == "delete" and isinstance(node, dict):
            del node[path[-1]]
        elif action == "add" and isinstance(node, dict):
            node[f"extra{seed}"] = rnd.choice(ODD_VALUES)
        else:
            node[path[-1]] = rnd.choice(ODD_VALUES)

    rewrite_manifest(ck / STEP, mutate)
    try:
        state, client = restored(ck)
    except CheckpointError as e:
        assert str(ck) in str(e)
    else:
        assert_same(state, pristine.state)
        assert client["data_pos"] == 7


# ==========================================================================
# Data loss: ranks on separate disks


def _two_rank_save(root: Path):
    rank = torch.distributed.get_rank()
    step, state, _ = build(0)
    for i in range(2):
        state, _ = step(state, make_batch(seed=i))
    save(root / "ck", state, {"data_pos": 7, "mark": torch.arange(3), "rank": rank})
    return {k: v.clone() for k, v in state.params.items()} if rank == 0 else None


class TwoRanks(Saved):
    """A checkpoint two ranks saved (plain state: rank 0 writes it, each rank its RNG and client_state)."""

    def __init__(self, root: Path) -> None:
        self.root, self.params = root / "ck", run_distributed(_two_rank_save, 2, root)[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> TwoRanks:
    return TwoRanks(tmp_path_factory.mktemp("two_ranks"))


def _save_where(places: list[str], keep: int | None):
    """Each rank saves into ``ck`` relative to its own working directory ``places[rank]``: the same path
    string, different directories, as on nodes whose "ck" is a local disk each."""
    rank = torch.distributed.get_rank()
    os.chdir(places[rank])
    state = build(0)[1].replace(step=torch.tensor(5))
    try:
        save("ck", state, {"rank": rank}, keep=keep)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world, nodes", [(2, [0, 1]), (4, [0, 0, 1, 1]), (4, [0, 1, 1, 1])],
                         ids=["2 ranks 2 disks", "4 ranks 2 disks", "rank 0 alone"])
def test_data_loss_ranks_that_do_not_share_the_directory_all_raise_and_nothing_is_deleted(two_ranks, tmp_path,
                                                                                          world, nodes):
    places = []
    for node in range(2):
        place = tmp_path / f"node{node}"
        place.mkdir()
        two_ranks.copy(place)  # each node holds a copy of an older checkpoint under the same name
        places.append(str(place))
    errors = run_distributed(_save_where, world, [places[n] for n in nodes], 1)
    for e in errors:
        assert e is not None and "the ranks do not share" in e and "a filesystem all ranks share" in e, e
        assert "Nothing was committed and no checkpoint was deleted" in e
    for place in places:
        assert sorted(p.name for p in (Path(place) / "ck").iterdir()) == [".zfunc.lock", "latest", STEP]
        restore(Path(place) / "ck", like=build(0)[1], rng=False)


def _restore_where(places: list[str]):
    os.chdir(places[torch.distributed.get_rank()])
    try:
        restore("ck", like=build(0)[1])
    except CheckpointError as e:
        return str(e)
    return None


def test_data_loss_restore_on_ranks_that_do_not_share_the_directory_says_so(two_ranks, tmp_path):
    places = [tmp_path / "node0", tmp_path / "node1"]
    for place in places:
        place.mkdir()
    two_ranks.copy(places[0])  # only node 0 holds the checkpoint
    errors = run_distributed(_restore_where, 2, [str(p) for p in places])
    for e in errors:
        assert "ck: not a zfunc checkpoint directory" in e and "rank(s) [0] found the checkpoint" in e
        assert "do all ranks see the same filesystem?" in e


def _save_into(path: str):
    state = build(0)[1]
    save(path, state.replace(step=torch.tensor(5)), keep=1)
    return sorted(p.name for p in Path(path).iterdir())


def test_data_loss_ranks_that_share_the_directory_still_save(two_ranks, tmp_path):
    ck = two_ranks.copy(tmp_path)
    listing = run_distributed(_save_into, 2, str(ck))
    assert listing[0] == [".zfunc.lock", "latest", "step_000005"]


# ==========================================================================
# Data loss: only what zfunc wrote is deleted or replaced


def _foreign_manifest(d: Path) -> None:
    d.mkdir()
    (d / "manifest.json").write_text('{"model": "mine", "epochs": 3}')
    (d / "weights.bin").write_bytes(b"precious")


def _zfunc_copy_with_user_file(d: Path, ck: Path) -> None:
    shutil.copytree(ck / STEP, d)
    (d / "notes.txt").write_text("my notes")


def _edited_zfunc_copy(d: Path, ck: Path) -> None:
    shutil.copytree(ck / STEP, d)
    flip_bit(d / "manifest.json", 40)


def _linked_checkpoint(d: Path, ck: Path) -> None:
    shutil.copytree(ck / STEP, ck.parent / "linked")
    d.symlink_to(ck.parent / "linked")


@pytest.mark.parametrize("make", ["foreign manifest", "user file inside", "edited manifest", "symlink"])
def test_data_loss_keep_deletes_only_zfunc_checkpoints(ck, make):
    foreign = ck / "step_000001"
    {"foreign manifest": lambda: _foreign_manifest(foreign),
     "user file inside": lambda: _zfunc_copy_with_user_file(foreign, ck),
     "edited manifest": lambda: _edited_zfunc_copy(foreign, ck),
     "symlink": lambda: _linked_checkpoint(foreign, ck)}[make]()
    before = sorted(str(p.relative_to(ck.parent)) for p in ck.parent.rglob("*"))
    state = restored(ck)[0]
    with pytest.warns(UserWarning, match=r"left alone what zfunc cannot show it wrote: .*step_000001"):
        save(ck, state.replace(step=torch.tensor(9)), keep=1)
    after = sorted(str(p.relative_to(ck.parent)) for p in ck.parent.rglob("*"))
    assert [p for p in before if "step_000001" in p or "linked" in p] == \
        [p for p in after if "step_000001" in p or "linked" in p]
    assert not (ck / STEP).exists()  # zfunc's own older checkpoint was pruned
    assert [s for s, _ in zf.io.list_checkpoints(ck)] == ([1, 9] if make != "symlink" else [9])


def test_data_loss_debris_look_alikes_with_user_files_are_left_alone(ck):
    lookalike = ck / "step_000001.tmp-abc"
    lookalike.mkdir()
    (lookalike / "thesis.tex").write_text("years of work")
    state = restored(ck)[0]
    with pytest.warns(UserWarning, match=r"step_000001\.tmp-abc \(not only zfunc's files\)"):
        save(ck, state.replace(step=torch.tensor(9)))
    assert (lookalike / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("kind", ["text", "binary", "directory", "symlink", "long"])
def test_data_loss_a_foreign_latest_is_refused_not_overwritten(tmp_path, kind):
    root = tmp_path / "ck"
    root.mkdir()
    latest = root / "latest"
    if kind == "text":
        latest.write_text("my latest experiment notes\n")
    elif kind == "binary":
        latest.write_bytes(bytes(range(256)))
    elif kind == "directory":
        latest.mkdir()
        (latest / "x").write_text("x")
    elif kind == "symlink":
        (tmp_path / "target").write_text("step_000001\n")
        latest.symlink_to(tmp_path / "target")
    else:
        latest.write_text("step_000001 " + "0" * 64 + "\n" * 200)
    snapshot = sorted((str(p), p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match=r"latest: not in the format zfunc writes .*move it away"):
        save(root, build()[1])
    assert not list(root.glob("step_*"))
    after = sorted((str(p), p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")
                   if p.name != ".zfunc.lock")
    assert after == snapshot


def test_data_loss_a_foreign_directory_with_the_step_name_is_not_replaced(tmp_path):
    root = tmp_path / "ck"
    _foreign_manifest(root / "step_000000") if root.mkdir() is None else None
    with pytest.raises(CheckpointError, match=r"step_000000 exists and cannot be shown to be a checkpoint zfunc "
                                              r"wrote .*refusing to replace it"):
        save(root, build()[1])
    assert (root / "step_000000" / "weights.bin").read_bytes() == b"precious"
    assert not (root / "latest").exists()


# ==========================================================================
# Data loss: consolidate never writes into the checkpoint it reads


@pytest.mark.parametrize("target", [f"ck/{STEP}/rank_00000.safetensors", f"ck/{STEP}/manifest.json",
                                    f"ck/{STEP}/new.safetensors", f"ck/{STEP}", "ck/latest", "ck/.zfunc.lock",
                                    "ck/step_000001", "link_into_checkpoint.safetensors", "step dir itself",
                                    "latest beside the step dir read"])
def test_data_loss_consolidate_refuses_to_write_inside_its_checkpoint(ck, capsys, target):
    base = ck.parent
    source = ck / STEP if target in ("step dir itself", "latest beside the step dir read") else ck
    out = {"step dir itself": ck / STEP / "rank_00000.safetensors",
           "latest beside the step dir read": ck / "latest"}.get(target, base / target)
    if target.startswith("link"):
        out.symlink_to(ck / STEP / "rank_00000.safetensors")
    before = {p: p.read_bytes() for p in (ck / STEP).iterdir()}
    with pytest.raises(CheckpointError, match=r"consolidate: .*(inside the checkpoint it reads|would replace)"):
        consolidate(source, out, progress=False)
    assert cli_main(["consolidate", str(source), str(out), "-q"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (ck / STEP).iterdir()} == before


def test_data_loss_consolidate_beside_the_checkpoints_is_fine(ck, pristine):
    out = consolidate(ck, ck / "model.safetensors", progress=False)
    weights = safetensors.torch.load_file(out)
    assert all(torch.equal(weights[k], v) for k, v in pristine.full.items())


# ==========================================================================
# Data loss: two saves into one directory at once


def _hold_lock(directory: Path):
    """A forked process that takes zfunc's save lock on ``directory`` and keeps it: ``(pid, ready pipe)``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            lock = SaveLock(directory)
            os.write(write, b"x")
            time.sleep(60)
            lock.release()
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"x"
    os.close(read)
    return pid


def test_data_loss_a_second_save_into_a_locked_directory_says_so(ck, pristine):
    pid = _hold_lock(ck)
    try:
        before = sorted(p.name for p in ck.iterdir())
        with pytest.raises(CheckpointError, match=rf"another save is writing into .*\(pid {pid} on "):
            save(ck, pristine.state, keep=1)
        assert sorted(p.name for p in ck.iterdir()) == before
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    save(ck, pristine.state.replace(step=torch.tensor(3)), keep=1)  # the killed holder left no stale lock
    assert [s for s, _ in zf.io.list_checkpoints(ck)] == [3]


@pytest.mark.parametrize("content", [b"my own lock notes\n", b"pid 12 on host\n" + b"x" * 200])
def test_data_loss_a_user_file_named_like_the_lock_is_not_overwritten(tmp_path, content):
    (tmp_path / ".zfunc.lock").write_bytes(content)
    with pytest.raises(CheckpointError, match=r"\.zfunc\.lock exists and is not zfunc's lock file"):
        save(tmp_path, build()[1])
    assert (tmp_path / ".zfunc.lock").read_bytes() == content and not list(tmp_path.glob("step_*"))


def test_data_loss_a_filesystem_without_locks_saves_with_a_warning(tmp_path, pristine, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match=r"does not support file locks .*only one save writes into it at a time"):
        save(tmp_path, pristine.state)
    monkeypatch.undo()
    assert_same(restored(tmp_path)[0], pristine.state)


def _saver(directory: Path, start: int, seconds: float) -> None:
    """Child process: save steps start, start+2, ... for ``seconds``; exit 0 if every failure was the lock's."""
    code = 3
    try:
        torch.set_num_threads(1)  # forked after parallel work (see zfunc.testing)
        params = {"w": torch.zeros(1 << 12)}
        state = zf.TrainState.create(params, zf.optim.adam(1e-3))
        refused, deadline, s = 0, time.monotonic() + seconds, start
        while time.monotonic() < deadline:
            state.params["w"].fill_(s)
            try:
                save(directory, state.replace(step=torch.tensor(s)), {"s": s}, keep=2)
            except CheckpointError as e:
                if "another save is writing" not in str(e):
                    raise
                refused += 1
            s += 2
        code = 0 if refused else 4
    finally:
        os._exit(code)


def test_data_loss_concurrent_saves_never_fail_unexplained(tmp_path):
    pids = []
    for start in (1, 2):
        pid = os.fork()
        if pid == 0:
            _saver(tmp_path, start, 2.0)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes in ([0, 0], [0, 4], [4, 0]), codes  # 3: another error; 4: never refused (fine for one of two)
    like = zf.TrainState.create({"w": torch.zeros(1 << 12)}, zf.optim.adam(1e-3))
    state, client = restore(tmp_path, like=like, rng=False)
    assert int(state.step) == client["s"] and torch.equal(state.params["w"], torch.full((1 << 12,), client["s"]))
    assert cli_main(["verify", str(tmp_path)]) == 0


# ==========================================================================
# Data loss: tied weights, frozen parameters and buffers on export


def test_data_loss_tied_aliases_are_recorded_and_exported_by_default(ck, pristine):
    assert read_manifest(ck / STEP)["ties"] == [["head.weight", "embed.weight"]]
    weights = safetensors.torch.load_file(consolidate(ck, ck.parent / "w.safetensors", progress=False))
    assert torch.equal(weights["head.weight"], pristine.full["embed.weight"])
    model = TinyLM()
    result = model.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys and sorted(result.missing_keys) == ["frozen_scale", "offset"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"frozen_scale\", \"offset\""):
        TinyLM().load_state_dict(weights)  # documented: pass model= for a strict load


def test_data_loss_with_the_model_the_export_loads_strictly(ck, pristine):
    model = TinyLM()
    weights = safetensors.torch.load_file(consolidate(ck, ck.parent / "w.safetensors", model=model, progress=False))
    fresh = TinyLM(vocab=13)
    fresh.load_state_dict(weights)  # strict
    for k, v in pristine.full.items():
        assert torch.equal(dict(fresh.named_parameters())[k], v)
    assert torch.equal(fresh.frozen_scale, model.frozen_scale) and torch.equal(fresh.offset, model.offset)
    bf16 = safetensors.torch.load_file(consolidate(ck, ck.parent / "h.safetensors", torch.bfloat16, model=model,
                                                   progress=False))
    assert bf16["offset"].dtype == torch.bfloat16 and torch.equal(bf16["head.weight"],
                                                                  pristine.full["embed.weight"].bfloat16())


def test_data_loss_leaving_aliases_out_stays_possible(ck, pristine):
    weights = safetensors.torch.load_file(consolidate(ck, ck.parent / "w.safetensors", aliases="none",
                                                      progress=False))
    assert set(weights) == set(pristine.full)
    assert cli_main(["consolidate", str(ck), str(ck.parent / "c.safetensors"), "--no-aliases", "-q"]) == 0
    assert set(safetensors.torch.load_file(ck.parent / "c.safetensors")) == set(pristine.full)


def test_data_loss_another_model_is_refused_on_export(ck):
    with pytest.raises(CheckpointError, match=r"the model is not the one this checkpoint was trained from: shapes "
                                              r"differ \(blocks.0.up.weight: checkpoint \[23, 10\], model \[24, 10\]"):
        consolidate(ck, ck.parent / "w.safetensors", model=TinyLM(hidden=24), progress=False)
    with pytest.raises(CheckpointError, match=r"its trainable \['blocks.3"):
        consolidate(ck, ck.parent / "w.safetensors", model=TinyLM(depth=4), progress=False)
    assert not (ck.parent / "w.safetensors").exists()


def test_data_loss_cli_model_option_writes_a_strictly_loadable_file(ck, pristine):
    out = ck.parent / "w.safetensors"
    assert cli_main(["consolidate", str(ck), str(out), "--model", "tests.models:TinyLM", "-q"]) == 0
    TinyLM().load_state_dict(safetensors.torch.load_file(out))


# ==========================================================================
# Hangs: a rank that never comes is an error within the timeout, naming the call


def _only_rank_0(op: str, root: str):
    os.environ["ZFUNC_TIMEOUT_S"] = "0.5"
    rank = torch.distributed.get_rank()
    if rank != 0:
        time.sleep(2.0)
        torch.distributed.destroy_process_group()  # rank 0's collective never pairs: leave quietly
        return None
    state = build(0)[1]
    start = time.monotonic()
    try:
        if op == "save":
            save(root, state)
        else:
            restore(root, like=state)
    except CollectiveError as e:
        torch.distributed.destroy_process_group()
        return str(e), time.monotonic() - start
    return None


@pytest.mark.parametrize("op", ["save", "restore"])
def test_hang_a_call_on_rank_0_only_fails_fast_with_a_message(two_ranks, tmp_path, op):
    root = tmp_path / "ck" if op == "save" else two_ranks.copy(tmp_path)
    message, seconds = run_distributed(_only_rank_0, 2, op, str(root), timeout=60)[0]
    assert f"zf.io.{op}" in message and "every rank of the process group must call" in message
    assert "not only rank 0" in message and "ZFUNC_TIMEOUT_S" in message
    assert seconds < 5
    if op == "save":
        assert not root.exists()  # no lock, no files: nothing happened


def _one_rank_differs(case: str, root: str):
    """Rank 1 (of 2) does something the others do not; every rank must raise, none may wait forever."""
    import dataclasses

    from zfunc.io import writer

    os.environ["ZFUNC_TIMEOUT_S"] = "60"  # far above the answer's time: an answer is not a timeout
    rank = torch.distributed.get_rank()
    try:
        if case == "client_state":
            save(root, build(0)[1], {"ok": 1} if rank == 0 else {1: 2})
        elif case == "rng capture fails":
            if rank == 1:
                def broken():
                    raise RuntimeError("CUDA error: device lost")
                writer.capture_rng = broken
            save(root, build(0)[1])
        elif case == "template of another rank":
            like = build(3)[1]
            if rank == 1:
                layout = like.extras["shard"]
                like = like.replace(extras={**like.extras, "shard": dataclasses.replace(layout, rank=0)})
            restore(root, like=like)
        elif case == "different steps":
            restore(root, like=build(0)[1], step=None if rank == 0 else 2)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case, expected", [
    ("client_state", "dict keys must be str"),
    ("rng capture fails", "rank 1: RuntimeError: CUDA error: device lost"),
    ("template of another rank", "the template is sharded for rank 0 of 2, but this process is rank 1 of 2"),
    ("different steps", "ranks resolved different checkpoints"),
])
def test_hang_one_rank_that_differs_fails_every_rank(two_ranks, tmp_path, pristine, case, expected):
    root = two_ranks.copy(tmp_path)
    if case == "different steps":
        save(root, pristine.state.replace(step=torch.tensor(5)))  # latest is step 5 now
    start = time.monotonic()
    errors = run_distributed(_one_rank_differs, 2, case, str(root), timeout=120)
    assert all(e is not None and expected in e for e in errors), errors
    assert time.monotonic() - start < 30  # answered at once, not after the 60 s timeout


def _rank_3_skips_save(root: str):
    os.environ["ZFUNC_TIMEOUT_S"] = "0.5"
    if torch.distributed.get_rank() == 3:
        time.sleep(2.0)
        torch.distributed.destroy_process_group()
        return None
    try:
        save(root, build(0)[1])
    except CollectiveError as e:
        torch.distributed.destroy_process_group()
        return str(e)
    return None


def test_hang_one_rank_of_four_that_skips_save_fails_the_others_fast(tmp_path):
    errors = run_distributed(_rank_3_skips_save, 4, str(tmp_path / "ck"), timeout=60)
    assert errors[3] is None
    for e in errors[:3]:
        assert "zf.io.save (check): every rank of the process group must call zf.io.save" in e


def _save_while_other_restores(root: str):
    rank = torch.distributed.get_rank()
    state = build(0)[1]
    try:
        if rank == 0:
            save(root, state.replace(step=torch.tensor(7)))
        else:
            restore(root, like=state)
    except CheckpointError as e:
        return str(e)
    return None


def test_hang_ranks_in_different_calls_all_raise(two_ranks, tmp_path):
    root = two_ranks.copy(tmp_path)
    errors = run_distributed(_save_while_other_restores, 2, str(root))
    assert "rank 1 is in restore (locate)" in errors[0] and "rank 0 is in save (check)" in errors[1]
    assert all("every rank must call" in e for e in errors)


def _one_rank_fails_to_write(root: str):
    from zfunc.io import writer

    rank = torch.distributed.get_rank()
    state = build(0)[1]
    if rank == 1:
        def full_disk(*a, **kw):
            raise OSError(28, "No space left on device")
        writer.write_safetensors = full_disk
    try:
        save(root, state.replace(step=torch.tensor(9)), keep=1)
    except CheckpointError as e:
        return str(e)
    return None


def test_hang_a_rank_that_fails_mid_save_fails_every_rank_and_keeps_the_old_checkpoint(two_ranks, tmp_path):
    root = two_ranks.copy(tmp_path)
    errors = run_distributed(_one_rank_fails_to_write, 2, str(root))
    for e in errors:
        assert "rank 1 could not write its files" in e and "No space left on device" in e
    assert sorted(p.name for p in root.iterdir()) == [".zfunc.lock", "latest", STEP]
    restore(root, like=build(0)[1], rng=False)


# ==========================================================================
# Unclear errors: the CLI says what is wrong in one line, with status 2


def _cli_cases(ck: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    out = str(tmp / "w.safetensors")
    (tmp / "a_file").write_text("x")
    (tmp / "empty").mkdir()
    return {
        "missing directory": (["info", str(tmp / "nope")], "does not exist"),
        "empty directory": (["verify", str(tmp / "empty")], "not a zfunc checkpoint directory"),
        "a file": (["info", str(tmp / "a_file")], "not a zfunc checkpoint directory"),
        "bad dtype": (["consolidate", str(ck), out, "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        "negative step": (["consolidate", str(ck), out, "--step", "-1"], "argument --step: a step is >= 0"),
        "step not a number": (["info", str(ck), "--step", "two"], "expected a step number, got 'two'"),
        "step absent": (["verify", str(ck), "--step", "99"], "no complete checkpoint of step 99"),
        "output dir missing": (["consolidate", str(ck), str(tmp / "no" / "w.safetensors")], "does not exist"),
        "output is a dir": (["consolidate", str(ck), str(tmp / "empty")], "is a directory"),
        "output under a file": (["consolidate", str(ck), str(tmp / "a_file" / "w.safetensors")], "does not exist"),
        "aliases without colon": (["consolidate", str(ck), out, "--aliases", "tests.models"],
                                  "expected MODULE:FACTORY"),
        "aliases no module": (["consolidate", str(ck), out, "--aliases", "no_such_module_zz:f"],
                              "cannot import 'no_such_module_zz' (ModuleNotFoundError"),
        "aliases no factory": (["consolidate", str(ck), out, "--aliases", "tests.models:nope"],
                               "has no function 'nope'"),
        "aliases factory raises": (["consolidate", str(ck), out, "--aliases", "tests.models:lm_loss"],
                                   "lm_loss() raised TypeError"),
        "model not a module": (["consolidate", str(ck), out, "--model", "tests.models:make_batch"],
                               "returned a dict, not a torch.nn.Module"),
        "aliases and no-aliases": (["consolidate", str(ck), out, "--aliases", "a:b", "--no-aliases"],
                                   "not allowed with argument"),
        "unknown command": (["frobnicate"], "invalid choice: 'frobnicate'"),
        "no command": ([], "required: command"),
        "missing output": (["consolidate", str(ck)], "required: out"),
        "damaged checkpoint": (["verify", str(ck)], "checksum mismatch"),
    }


CLI_CASES = [
    "missing directory", "empty directory", "a file", "bad dtype", "negative step", "step not a number",
    "step absent", "output dir missing", "output is a dir", "output under a file", "aliases without colon",
    "aliases no module", "aliases no factory", "aliases factory raises", "model not a module",
    "aliases and no-aliases", "unknown command", "no command", "missing output", "damaged checkpoint"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_unclear_cli_user_errors_are_one_line_and_status_2(ck, tmp_path, capsys, case):
    argv, expected = _cli_cases(ck, tmp_path)[case]
    if case == "damaged checkpoint":
        flip_bit(ck / STEP / "rank_00000.safetensors", -3)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("zfunc: error: ") and expected in err and "Traceback" not in err, err


def test_unclear_cli_a_full_disk_is_one_line_and_leaves_nothing(ck, tmp_path, capsys, monkeypatch):
    import zfunc.io.format as fmt

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmt.HashingFile, "write", full)
    assert cli_main(["consolidate", str(ck), str(tmp_path / "w.safetensors"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err == f"zfunc: error: consolidate: cannot write {tmp_path / 'w.safetensors'} (No space left on device)\n"
    assert not list(tmp_path.glob("w.safetensors*"))


@pytest.mark.slow  # a fresh interpreter importing torch: 3-7 s
def test_unclear_python_m_zfunc_io_prints_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-m", "zfunc.io", "consolidate", str(tmp_path / "nope"),
                          str(tmp_path / "w.safetensors"), "--dtype", "fp16"], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert run.returncode == 2 and run.stderr.startswith("python -m zfunc.io: error: ")
    assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr


# ==========================================================================
# Kept: other world sizes, format 1, crash safety with the new files


def test_kept_a_checkpoint_from_two_ranks_restores_in_one_process(two_ranks, tmp_path):
    ck = two_ranks.copy(tmp_path)
    with pytest.warns(UserWarning, match="RNG states not restored"):
        state, client = restore(ck, like=build(0)[1])
    assert client["rank"] == 0
    for k, v in two_ranks.params.items():
        assert torch.equal(state.params[k], v)
    step, like, _ = build(3)  # and into another layout: stage 3 on one rank
    sharded, _ = restore(ck, like=like, rng=False)
    for k, v in step.gather(sharded).items():
        assert torch.equal(v, two_ranks.params[k])


def test_kept_format_1_checkpoints_still_restore_and_are_pruned_as_zfunc_s(ck, pristine):
    as_format_1(ck / STEP)
    with pytest.warns(UserWarning, match="a format-1 checkpoint: its manifest has no checksum"):
        assert_restores(ck, pristine)
    with pytest.warns(UserWarning, match="a format-1 checkpoint records no tied weights"):
        weights = safetensors.torch.load_file(consolidate(ck, ck.parent / "w.safetensors", progress=False))
    assert "head.weight" not in weights
    weights = safetensors.torch.load_file(consolidate(ck, ck.parent / "w.safetensors", model=TinyLM(),
                                                      progress=False))
    TinyLM().load_state_dict(weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = restored(ck)[0]
    save(ck, state.replace(step=torch.tensor(5)), keep=1)  # a format-1 checkpoint of zfunc's is pruned
    assert [s for s, _ in zf.io.list_checkpoints(ck)] == [5]


def test_kept_locate_resolves_the_same_checkpoint_after_hardening(ck):
    assert locate(ck) == ck / STEP and locate(ck / STEP) == ck / STEP and locate(ck, 2) == ck / STEP
