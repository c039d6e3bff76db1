"""Shared pieces of the adversarial suite (``tests/test_adversarial_*.py``), and its tally.

Every case of the suite ends in one of these outcomes, recorded on the case with
``@outcome("...")`` (or ``pytest.param(..., marks=outcome("..."))``):

=============  ===============================================================
``right``      the exact right result (element-wise against the plain step or
               eager PyTorch), warnings included where something was adjusted
``clear``      an error that names the problem and says what to do
``obscure``    an error, but one that does not say what is wrong or what to do
``silent``     a wrong result without a word
``hang``       no answer (or a crash of the process group) instead of an error
``data_loss``  something the caller owns overwritten or lost
=============  ===============================================================

A case whose outcome is not ``right`` or ``clear`` is a failure of zfunc: its
test asserts the right behaviour and is marked ``xfail(strict=True, reason=...)``
with the fix it needs; the ``outcome`` mark records what happens today.

The class of a case is its file: ``test_adversarial_<class>.py``. Tally (the
table in RELIABILITY.md): ``python3 -m tests.adversarial``.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import zfunc as zf

OUTCOMES = ("right", "clear", "obscure", "silent", "hang", "data_loss")


@pytest.fixture
def single_thread():
    """Run a case with one intra-op thread (restored after): the suite's models are tiny, and on a small
    machine shared with other work, torch's thread team waiting for a descheduled thread made cases 3-5x
    slower. Each module uses it: ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def outcome(kind: str):
    """The mark recording what a case ends in (see the module docstring)."""
    if kind not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {kind!r}")
    return pytest.mark.outcome(kind)


def clear_error(fn: Callable, *words: str, exc: type | tuple = Exception) -> str:
    """Run ``fn``; it must raise ``exc`` whose message holds every one of ``words`` (case-insensitive,
    each a regular expression): the words that name the problem and say what to do. Returns the message."""
    with pytest.raises(exc) as info:
        fn()
    return says(str(info.value), *words)


def says(message: str, *words: str) -> str:
    """Assert that ``message`` holds every one of ``words`` (case-insensitive regular expressions)."""
    for word in words:
        assert re.search(word, message, re.IGNORECASE), f"{word!r} not in the message:\n{message}"
    return message


def assert_same(got: dict, want: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Element-wise equality of two dicts of tensors (bitwise unless a tolerance is given)."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        torch.testing.assert_close(got[key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def copies(params: dict) -> dict:
    """Fresh copies of a params dict (steps may update their state's tensors in place)."""
    return {k: v.detach().clone() for k, v in params.items()}


def train(step, state, batches) -> tuple:
    """``(state, metrics)`` after running ``step`` on each batch; ``state`` as `zf.init` left it."""
    state = zf.init(step, state)
    metrics = None
    for batch in batches:
        state, metrics = step(state, batch)
    return state, metrics


# --------------------------------------------------------------------------
# The tally


class _Collector:
    def __init__(self) -> None:
        self.items: list = []

    def pytest_collection_finish(self, session) -> None:
        self.items = list(session.items)


def tally(paths: list[str] | None = None) -> dict[str, Counter]:
    """``{class: Counter(outcome -> cases)}`` over the suite's collected cases (parametrized ones counted)."""
    root = Path(__file__).resolve().parent
    paths = paths or sorted(str(p) for p in root.glob("test_adversarial_*.py"))
    collector = _Collector()
    with contextlib.redirect_stdout(io.StringIO()):  # the table is the output, not pytest's listing
        code = pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", *paths], plugins=[collector])
    if code not in (0, 5):
        raise RuntimeError(f"collecting {paths} failed (pytest exit code {code})")
    table: dict[str, Counter] = {}
    for item in collector.items:
        mark = item.get_closest_marker("outcome")
        if mark is None:
            raise ValueError(f"{item.nodeid} has no outcome mark")
        klass = Path(item.path).stem.removeprefix("test_adversarial_")
        table.setdefault(klass, Counter())[mark.args[0]] += 1
    return table


def _print_table(table: dict[str, Counter]) -> None:
    print("| class | cases | " + " | ".join(OUTCOMES) + " |")
    print("|---|---:|" + "---:|" * len(OUTCOMES))
    total = Counter()
    for klass, counts in table.items():
        total.update(counts)
        cells = " | ".join(str(counts[o]) for o in OUTCOMES)
        print(f"| {klass} | {sum(counts.values())} | {cells} |")
    cells = " | ".join(f"**{total[o]}**" for o in OUTCOMES)
    print(f"| **total** | **{sum(total.values())}** | {cells} |")


if __name__ == "__main__":
    _print_table(tally(sys.argv[1:] or None))
