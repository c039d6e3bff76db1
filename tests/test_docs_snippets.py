"""Every code block of README.md and docs/*.md runs as written (issue 26).

A new user copies the README's code; it must run. So every fenced ```python block of
README.md and docs/*.md (found anew each run: a new section or file is picked up with
nothing to register) runs here, in file order, all blocks of one file in one namespace,
as a reader reads them: a later block uses what an earlier one defined. What a block
assumes and does not define (the user's model, data, config files) is given by the
stand-ins below, the only difference from the text:

- `STAND_INS`: a name a block uses and no earlier block of its file defines gets this
  value (built only when a block names it);
- `FILES`: written into the directory the file's blocks run in (their working
  directory, fresh per doc file, so relative paths such as "ckpt" land there);
- `REWRITES`: text replaced in a block before it runs (absolute paths on the user's
  machine, what transformers needs on a machine without a GPU); each must occur in some
  block, so the list cannot go stale;
- `ENVIRONMENT`: the variables torchrun sets, for a world of one process, so that a
  block's ``dist.init_process_group(...)`` makes a group of one (gloo on this CPU
  machine: the docs pick "nccl" only when CUDA is available). A group a section leaves
  initialized (it failed halfway) is destroyed after it.

A block that is not meant to run (another library's API shown for comparison, a sketch
with placeholders) is preceded by ``<!-- not run: why -->``; the reason is required,
and such blocks should stay rare. A block importing an optional dependency that is not
installed (`OPTIONAL`: transformers, lightning, ...), or naming a stand-in that needs
one, skips its section; nothing else skips.

One test per section holding python blocks (``README.md::Coming from DeepSpeed``); a
section runs the file's earlier sections first (once per session), and is skipped if
one of them failed (that one's own test fails). To add a section (e.g. "Coming from
Hugging Face", "Coming from Lightning"): write it; its blocks are found and run. A name
they use that nothing defines: define it in the doc, or add a stand-in here saying what
it is ("SECTION::name" for one that holds in that section only and replaces what an
earlier section defined, such as the README's ``model``, a GPT).

```bash blocks are checked as far as is cheap: every ``zfunc`` command parses with the
CLI's parser, ``zfunc launch`` ones run with ``--dry-run`` (printing the torchrun
command, starting nothing; where the doc shows the output as ``# `` lines after the
command, it must match), every ``torchrun`` command parses with torchrun's own parser,
and every ``python``/``torchrun`` command of ``examples/NAME.py`` parses with that
script's ``parse_args``.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import importlib.util
import json
import re
import shlex
import socket
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DATA = Path(__file__).resolve().parent / "data"

VOCAB, SEQ, BATCH, BATCHES = 32, 16, 8, 2
HF_TRAIN = 32  # examples in the Hugging Face Trainer's train set


def _gpt_classes():
    from examples.gpt import GPT, GPTConfig

    return GPT, GPTConfig


def _loader(run):
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(BATCHES):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        batches.append({"x": x, "y": torch.roll(x, -1, dims=1)})
    return batches


# What a block names -> (what the test gives it, how it is built from the file's run). A key "SECTION::name" holds
# in that section only (SECTION: its heading's text) and replaces what earlier sections defined, e.g.
# "Coming from Hugging Face::model" for a Hugging Face model where the README's first section built a GPT.
STAND_INS = {
    "GPT": ("examples.gpt.GPT, the repository's small GPT (tied embedding, a ModuleList of blocks)",
            lambda run: _gpt_classes()[0]),
    "cfg": (f"GPTConfig(vocab_size={VOCAB}, block_size={SEQ}, n_layer=2, n_head=2, n_embd=32)",
            lambda run: _gpt_classes()[1](vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32)),
    "model": ("GPT(cfg), built on the CPU", lambda run: run.given("GPT")(run.given("cfg"))),
    "loader": (f"{BATCHES} batches {{'x': token ids, 'y': the next tokens}} of {BATCH} sequences of {SEQ} "
               "(= accumulate's 4 micro-batches of 2, = ds_config.json's 4 x 2 per rank)", _loader),
    "one_micro_batch": ("loader's first batch cut to its first 2 sequences (one of accumulate's 4 slices)",
                        lambda run: {k: v[:2] for k, v in run.given("loader")[0].items()}),
    "resuming": ("False; a block naming it runs a second time with True, in the same directory, and must then "
                 "resume: its `state` ends at twice the first run's step (restored, then trained on)",
                 lambda run: False),
    "args": ("transformers' TrainingArguments values, as an object with those attribute names (from_config "
             "takes any such object)", lambda run: types.SimpleNamespace(**HF_ARGS)),
    # The Hugging Face Trainer's inputs (README's section and docs/huggingface.md's).
    "Coming from Hugging Face::model": (f"a GPT2LMHeadModel from GPT2Config(vocab_size={VOCAB}, n_positions={SEQ}, "
                                        "n_embd=32, n_layer=2, n_head=2)", lambda run: _tiny_gpt2()),
    "Coming from Hugging Face::train": (f"{HF_TRAIN} examples {{'input_ids', 'labels'}} of {SEQ} tokens (one update "
                                        "of 4 x 8 per epoch)", lambda run: _token_examples(HF_TRAIN, seed=1)),
    "Coming from Hugging Face::val": ("8 such examples", lambda run: _token_examples(8, seed=2)),
    "Coming from Hugging Face::test": ("8 such examples", lambda run: _token_examples(8, seed=3)),
    "Coming from Hugging Face::collate": ("transformers.default_data_collator (stacks the examples' tensors)",
                                          lambda run: importlib.import_module("transformers").default_data_collator),
    # Lightning's (README's section and docs/lightning.md's).
    "Coming from Lightning::model": (f"examples.lightning_gpt.CharGPT, a LightningModule around GPT(cfg) (cfg as "
                                     "above), AdamW with a warmup", lambda run: _char_gpt(run.given("cfg"))),
    "Coming from Lightning::train_loader": (f"a DataLoader of {BATCH * 4} (x, y) token windows in batches of {BATCH} "
                                            "(one update of 4 batches per epoch)",
                                            lambda run: _windows_loader(BATCH * 4, seed=1)),
    "Coming from Lightning::val_loader": (f"{BATCH} such windows", lambda run: _windows_loader(BATCH, seed=2)),
    "Coming from Lightning::test_loader": (f"{BATCH} such windows", lambda run: _windows_loader(BATCH, seed=3)),
}


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def _token_examples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]  # (GPT2LMHeadModel shifts the labels itself)


def _char_gpt(cfg):
    from examples.lightning_gpt import CharGPT

    return CharGPT(cfg, lr=1e-3, warmup=1, total_steps=4)


def _windows_loader(n: int, seed: int):
    x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=BATCH)

HF_ARGS = dict(learning_rate=3e-4, warmup_steps=10, max_steps=100, per_device_train_batch_size=4,
               gradient_accumulation_steps=2, fp16=False, bf16=True, adam_beta1=0.9, adam_beta2=0.999,
               adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0)

# A DeepSpeed config as users write them: ZeRO-2 with the optimizer on the CPU, bf16, AdamW with warmup, clipping;
# 4 examples per micro-batch x 2 micro-batches = the loader's 8 per rank.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True},
}

# File name -> (what it is, its text), written into the directory a doc file's blocks run in.
FILES = {
    "ds_config.json": ("DS_CONFIG above", lambda: json.dumps(DS_CONFIG)),
    "ds_config_zero2.json": ("transformers' ZeRO-2 config, full of \"auto\" (tests/data/deepspeed/hf_zero2.json)",
                             lambda: (DATA / "deepspeed" / "hf_zero2.json").read_text()),
    "ds_config_zero3.json": ("transformers' ZeRO-3 config, full of \"auto\" (tests/data/deepspeed/hf_zero3.json)",
                             lambda: (DATA / "deepspeed" / "hf_zero3.json").read_text()),
    "hosts": ("docs/multinode.md's hostfile: worker-1 and worker-2, 4 slots each",
              lambda: "worker-1 slots=4\nworker-2 slots=4\n"),
}

# Text in a block -> (what replaces it, built from the run's directory).
REWRITES = {
    '"/nvme"': ("a fresh directory in the run's directory, quoted (the user's NVMe mount)",
                lambda workdir: repr(str(workdir / "nvme"))),
    "bf16=True,": ("the same plus use_cpu=True where there is no GPU (transformers' TrainingArguments refuses bf16 "
                   "on a machine without one unless told to train on the CPU)",
                   lambda workdir: "bf16=True," + ("" if torch.cuda.is_available() else " use_cpu=True,")),
}

# Environment while a block runs: what torchrun sets in each process, here for a world of one.
ENVIRONMENT = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "<a free port>"}

# An imported module (or a package of it) -> the distribution it needs; a block importing one that is missing
# skips its section.
OPTIONAL = {"transformers": "transformers", "accelerate": "accelerate", "lightning": "lightning",
            "pytorch_lightning": "pytorch_lightning", "zfunc.hf": "transformers", "zfunc.lightning": "lightning"}

NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<why>.*?)\s*-->$")


# -- reading the docs --------------------------------------------------------------


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line in the file
    lang: str
    text: str
    section: str
    not_run: str | None  # the reason, when marked not to run

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file, with their section (the last ``## `` heading) and mark."""
    blocks, section, previous = [], "", ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang = line[3:].strip().split()[0] if line[3:].strip() else ""
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            mark = NOT_RUN.match(previous.strip())
            blocks.append(Block(path, i + 2, lang, "\n".join(lines[i + 1:end]) + "\n", section,
                                mark.group("why") if mark else None))
            i, previous = end + 1, ""
            continue
        if line.startswith("## "):
            section = line[3:].strip()
        if line.strip():
            previous = line
        i += 1
    return blocks


def python_sections(path: Path) -> list[str]:
    """The sections of ``path`` holding python blocks that run, in file order."""
    out = []
    for block in read_blocks(path):
        if block.lang == "python" and block.not_run is None and block.section not in out:
            out.append(block.section)
    return out


def free_names(tree: ast.AST) -> set[str]:
    """Names a block reads that it never binds (nor Python's builtins): what it assumes exists."""
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def missing_optional(tree: ast.AST) -> list[str]:
    """Distributions in `OPTIONAL` that the block imports and this machine lacks."""
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.append(node.module)
    missing = []
    for module in modules:
        parts = module.split(".")
        for k in range(len(parts), 0, -1):
            dist_name = OPTIONAL.get(".".join(parts[:k]))
            if dist_name and importlib.util.find_spec(dist_name) is None and dist_name not in missing:
                missing.append(dist_name)
    return missing


# -- running them ------------------------------------------------------------------


class SectionSkipped(Exception):
    pass


class DocRun:
    """One doc file's blocks run in order in one namespace, section by section, each section at most once."""

    def __init__(self, path: Path, workdir: Path) -> None:
        self.path, self.workdir = path, workdir
        self.namespace: dict = {"__name__": f"doc:{path.name}"}
        self.outcomes: dict[str, BaseException | None] = {}  # section -> None (ran) or what it raised
        self.built: dict = {}
        for name, (_, text) in FILES.items():
            (workdir / name).write_text(text())
        (workdir / "nvme").mkdir()

    def given(self, key: str):
        """The stand-in `STAND_INS[key]` (built once per file; a missing optional dependency skips)."""
        if key not in self.built:
            try:
                self.built[key] = STAND_INS[key][1](self)
            except ModuleNotFoundError as e:
                if e.name and e.name.split(".")[0] in OPTIONAL.values():
                    raise SectionSkipped(f"the stand-in {key!r} needs {e.name}, not installed") from e
                raise
        return self.built[key]

    def run_through(self, section: str) -> None:
        """Run every section up to ``section``; raise what ``section`` raised (a skip included)."""
        for earlier in python_sections(self.path):
            if earlier not in self.outcomes:
                try:
                    self._run_section(earlier)
                    self.outcomes[earlier] = None
                except BaseException as e:  # noqa: BLE001 (pytest's Skipped is a BaseException)
                    self.outcomes[earlier] = e
            if earlier == section:
                break
            failed = self.outcomes[earlier]
            if failed is not None and not isinstance(failed, SectionSkipped):
                pytest.skip(f"needs the section {earlier!r} of {self.path.name}, which failed (see its test)")
        outcome = self.outcomes[section]
        if isinstance(outcome, SectionSkipped):
            pytest.skip(str(outcome))
        if outcome is not None:
            raise outcome

    def _run_section(self, section: str) -> None:
        blocks = [b for b in read_blocks(self.path)
                  if b.lang == "python" and b.not_run is None and b.section == section]
        # The section's own stand-ins ("SECTION::name") replace what earlier sections defined, from its start.
        named = set().union(*(free_names(ast.parse(b.text)) for b in blocks))
        for key in STAND_INS:
            scope, _, name = key.rpartition("::")
            if scope == section and name in named:
                self.namespace[name] = self.given(key)
        for block in blocks:
            source = block.text
            for old, (_, new) in REWRITES.items():
                source = source.replace(old, new(self.workdir))
            tree = ast.parse(source)
            missing = missing_optional(tree)
            if missing:
                raise SectionSkipped(f"{block.where} imports what {', '.join(missing)} provides, not installed")
            assumed = sorted(n for n in free_names(tree) if n not in self.namespace)
            unknown = [n for n in assumed if n not in STAND_INS]
            assert not unknown, (
                f"{block.where} uses {unknown}, which no earlier block of {self.path.name} defines and "
                "tests/test_docs_snippets.py has no stand-in for: define it in the doc, or add a stand-in "
                "(STAND_INS) saying what it is")
            for name in assumed:
                self.namespace[name] = self.given(name)
            code = compile("\n" * (block.line - 1) + source, str(block.path), "exec")
            self._exec(code)
            if "resuming" in assumed:  # run again, resuming from what the first run saved
                first = int(self.namespace["state"].step)
                self.namespace["resuming"] = True
                self._exec(code)
                resumed = int(self.namespace["state"].step)
                assert resumed == 2 * first, (
                    f"{block.where} run with resuming=True ended at step {resumed}, not {2 * first}: it did not "
                    f"resume from the {first} steps its first run saved")

    def _exec(self, code) -> None:
        had_group = dist.is_available() and dist.is_initialized()
        with pytest.MonkeyPatch.context() as mp:
            for key, value in ENVIRONMENT.items():
                mp.setenv(key, value if key != "MASTER_PORT" else str(_free_port()))
            mp.chdir(self.workdir)
            torch.manual_seed(0)
            # (One intra-op thread: the models are tiny, and on a small shared machine torch's thread team
            # waiting for a descheduled thread made such steps several times slower; see tests/adversarial.py.)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                exec(code, self.namespace)
            finally:
                torch.set_num_threads(threads)
                if not had_group and dist.is_available() and dist.is_initialized():
                    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory):
    runs: dict[Path, DocRun] = {}

    def get(path: Path) -> DocRun:
        if path not in runs:
            runs[path] = DocRun(path, tmp_path_factory.mktemp(path.stem))
        return runs[path]

    return get


SECTIONS = [(path, section) for path in DOCS for section in python_sections(path)]


@pytest.mark.parametrize("path,section", SECTIONS,
                         ids=[f"{p.relative_to(ROOT)}::{s or '(top)'}" for p, s in SECTIONS])
def test_the_python_blocks_of_a_section_run_as_written(path, section, doc_runs):
    doc_runs(path).run_through(section)


def test_blocks_that_do_not_run_say_why_and_are_few():
    marked = [b for path in DOCS for b in read_blocks(path) if b.not_run is not None]
    for block in marked:
        assert block.not_run, f"{block.where}: '<!-- not run: why -->' needs its reason"
        assert block.lang == "python", f"{block.where}: only python blocks run; the mark is for python blocks"
    runnable = [b for path in DOCS for b in read_blocks(path) if b.lang == "python" and b.not_run is None]
    assert len(marked) <= max(2, len(runnable) // 3), (
        f"{len(marked)} python blocks are marked not to run, against {len(runnable)} that run: make them run")
    # A mark that does not sit right before a fence would silently mark nothing.
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if NOT_RUN.match(line.strip()):
                following = next((x for x in lines[i + 1:] if x.strip()), "")
                assert following.startswith("```"), f"{path.name}:{i + 1}: a not-run mark that no block follows"


def test_every_rewrite_and_stand_in_is_still_used():
    """The substitutions stay the few the docs need: one that no block needs any more is removed."""
    python = [b for path in DOCS for b in read_blocks(path) if b.lang == "python" and b.not_run is None]
    text = "".join(b.text for b in python)
    for old in REWRITES:
        assert old in text, f"REWRITES[{old!r}] occurs in no block: remove it"
    files = "".join(b.text for path in DOCS for b in read_blocks(path))
    for key in STAND_INS:
        scope, _, name = key.rpartition("::")
        used = set().union(*(free_names(ast.parse(b.text)) for b in python if not scope or b.section == scope))
        assert name in used, f"STAND_INS[{key!r}]: no block {'of ' + scope + ' ' if scope else ''}uses it: remove it"
    for name in FILES:
        assert name in files, f"FILES[{name!r}]: no block names it: remove it"


def test_a_block_is_marked_only_when_its_mark_sits_right_before_it(tmp_path):
    """The reader itself: a mark holds for the next block only, and sections follow ``## `` headings."""
    doc = tmp_path / "x.md"
    doc.write_text("## A\n\n<!-- not run: shown only -->\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = 2\n```\n"
                   "## B\n```bash\nls\n```\n")
    a, b, c = read_blocks(doc)
    assert (a.not_run, a.section, a.line, a.text) == ("shown only", "A", 6, "x = 1\n")
    assert (b.not_run, b.section) == (None, "A")
    assert (c.lang, c.section) == ("bash", "B")
    assert python_sections(doc) == ["A"]
    assert free_names(ast.parse("import os\ndef f(a):\n    return a + b\nc = f(d)\n")) == {"b", "d"}
    assert missing_optional(ast.parse("from zfunc.hf import Trainer\nimport os\n")) == (
        [] if importlib.util.find_spec("transformers") else ["transformers"])
    assert missing_optional(ast.parse("import surely_not_a_module_zfunc\n")) == []  # (not optional: it fails)


def test_new_sections_run_in_order_and_skip_only_for_a_missing_optional_dependency(tmp_path, monkeypatch):
    """What a section added later gets: it is found and run after the earlier ones, in their namespace; its own
    stand-ins replace earlier definitions; it is skipped when it imports a missing optional package, and only
    then; a section after a failed one is skipped (the failed one's test fails)."""
    doc = tmp_path / "new.md"
    doc.write_text("intro\n\n## First\n```python\nmodel = 'the first section\\'s'\nseen = [model]\n```\n"
                   "## Coming from Elsewhere\n```python\nseen.append(model)\n```\n"
                   "## Needs a package\n```python\nimport zfunc_surely_missing_pkg.sub\nseen.append('ran')\n```\n"
                   "## After it\n```python\nseen.append(len(loader))\n```\n"
                   "## Broken\n```python\nraise RuntimeError('boom')\n```\n## Later\n```python\nseen.clear()\n```\n")
    monkeypatch.setitem(OPTIONAL, "zfunc_surely_missing_pkg", "zfunc_surely_missing_pkg")
    monkeypatch.setitem(STAND_INS, "Coming from Elsewhere::model", ("a section's own", lambda run: "its own"))
    (tmp_path / "run").mkdir()
    run = DocRun(doc, tmp_path / "run")
    assert python_sections(doc) == ["First", "Coming from Elsewhere", "Needs a package", "After it", "Broken", "Later"]
    run.run_through("Coming from Elsewhere")
    with pytest.raises(pytest.skip.Exception, match="zfunc_surely_missing_pkg"):
        run.run_through("Needs a package")
    run.run_through("After it")
    assert run.namespace["seen"] == ["the first section's", "its own", BATCHES]
    with pytest.raises(RuntimeError, match="boom"):
        run.run_through("Broken")
    with pytest.raises(pytest.skip.Exception, match="Broken"):
        run.run_through("Later")
    assert run.namespace["seen"]  # (Later never ran)


# -- bash blocks ---------------------------------------------------------------------


def shell_commands(block: Block) -> list[tuple[list[str], list[str]]]:
    """``(argv, expected output lines)`` of each command of a bash block: continuation lines joined, ``&&``/``;``
    chains split, leading ``VAR=value`` assignments and ``srun`` dropped, shell variables read as 1; the ``# `` lines right after a command
    are its output as the doc shows it."""
    out: list[tuple[list[str], list[str]]] = []
    logical, pending = [], ""
    for line in block.text.splitlines():
        if pending or not line.lstrip().startswith("#"):
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            logical.append(("cmd", pending + line))
            pending = ""
        else:
            logical.append(("comment", line.strip()[1:].strip()))
    last = None
    for kind, text in logical:
        if kind == "comment":
            if last is not None and text:
                last[1].append(text)
            continue
        last = None
        if not text.strip():
            continue
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        commands, argv = [], []
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append(argv)
                argv = []
            else:
                argv.append(token)
        for argv in [*commands, argv]:
            argv = [re.sub(r"\$\{?\w+\}?", "1", a) for a in argv]  # ($SLURM_NODEID and co.: any value parses)
            while argv and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) or argv[0] == "srun"):
                argv = argv[1:]
            if argv:
                last = (argv, [])
                out.append(last)
    return out


def _script_args(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(examples module, its arguments)`` of a python/torchrun command running ``examples/NAME.py``."""
    for i, arg in enumerate(argv):
        m = re.fullmatch(r"examples/(\w+)\.py", arg)
        if m and (argv[0].startswith("python") or argv[0] == "torchrun"):
            return m.group(1), argv[i + 1:]
    return None


BASH = [b for path in DOCS for b in read_blocks(path) if b.lang == "bash"]


@pytest.mark.parametrize("block", BASH, ids=[b.where for b in BASH])
def test_the_commands_of_a_bash_block_parse(block, tmp_path, monkeypatch, capsys):
    from zfunc import cli

    (tmp_path / "hosts").write_text(FILES["hosts"][1]())
    monkeypatch.chdir(tmp_path)
    for argv, shown in shell_commands(block):
        if argv[0] == "zfunc":
            args = argv[1:]
            try:
                cli.parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{block.where}: `{shlex.join(argv)}` does not parse: {capsys.readouterr().err}")
            if args[0] != "launch":
                continue
            if "--dry-run" not in args:
                args = ["launch", "--dry-run", *args[1:]]
            capsys.readouterr()
            status = cli.main(args)
            printed = capsys.readouterr()
            assert status == 0, f"{block.where}: `{shlex.join(argv)}` failed: {printed.err}"
            if shown:
                # (The command names the interpreter running it by its path; the doc, as "python3".)
                got = [line.replace(sys.executable, "python3")
                       for line in (printed.err + printed.out).splitlines() if line.strip()]
                assert got == shown, f"{block.where}: `{shlex.join(argv)}` prints\n" + "\n".join(got)
            continue
        if argv[0] == "torchrun":
            from torch.distributed.run import get_args_parser

            try:
                get_args_parser().parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{block.where}: `{shlex.join(argv)}`: torchrun does not take these arguments: "
                            f"{capsys.readouterr().err}")
        if (script := _script_args(argv)) is not None:
            module = importlib.import_module(f"examples.{script[0]}")
            try:
                module.parse_args(script[1])
            except SystemExit:
                pytest.fail(f"{block.where}: `{shlex.join(argv)}`: examples/{script[0]}.py does not take "
                            f"these arguments: {capsys.readouterr().err}")


def test_the_shell_reader_joins_lines_and_takes_the_shown_output():
    block = Block(Path("x.md"), 1, "bash", "A=1 zfunc launch --hostfile hosts \\\n    --dry-run train.py\n"
                  "# out 1\n# out 2\n\npip install x && python3 examples/train_gpt.py --offload  # note\n", "", None)
    assert shell_commands(block) == [
        (["zfunc", "launch", "--hostfile", "hosts", "--dry-run", "train.py"], ["out 1", "out 2"]),
        (["pip", "install", "x"], []),
        (["python3", "examples/train_gpt.py", "--offload"], [])]
    assert _script_args(["torchrun", "--nproc-per-node", "2", "examples/train_gpt.py", "--zero-stage", "2"]) == (
        "train_gpt", ["--zero-stage", "2"])
