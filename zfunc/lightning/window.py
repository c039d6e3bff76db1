"""One accumulation window of Lightning's loop as one zfunc step.

Lightning hands a strategy one micro-batch at a time: with
``accumulate_grad_batches=k`` it runs the closure (``training_step`` +
backward) of the first k - 1 batches on their own and calls
``optimizer_step`` on the k-th, and between them it fetches data, logs and
runs callbacks. A zfunc step is one call that takes *all* micro-batches of
an update (`accumulate` splits them) and must see them inside that call:
`shard`'s reductions, `mixed_precision`'s loss scale and the single update
belong to it.

`Window` reconciles the two without copying Lightning's loop: the zfunc
step of a window runs in a worker thread, and its loss function asks the
window for each micro-batch in turn. ``feed`` (Lightning's thread, from the
strategy's ``training_step``) hands one micro-batch over and waits until
the step has run its forward *and* backward, then returns what
``training_step`` returned; the loop goes on to the next batch while the
step waits for it. After the window's last micro-batch the step applies the
update and returns, and ``result`` hands the new state over. Exactly one of
the two threads runs at any time (each waits for the other), so the order
of every operation, random draws and collectives included, is the order of
a single-threaded run.

Why a thread and not a replay at the window's end: Lightning logs each
micro-batch's loss and ``self.log`` values right after its closure, so the
forward of each micro-batch must happen when Lightning asks for it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch


class WindowCancelled(Exception):
    """Raised inside a window's step when Lightning stops before the window's last micro-batch."""


_CANCEL = object()
_NONE = object()


class Window:
    """The zfunc step of one accumulation window, running in a worker thread.

    Args:
      run: ``run(window) -> result``: calls the zfunc step; its loss function
        calls `next_micro_batch` once per micro-batch.
      micro_batches: how many micro-batches this window has.
      device: the CUDA device the worker makes current (its own thread would
        otherwise default to device 0), or None.
    """

    def __init__(self, run: Callable[[Window], Any], micro_batches: int, device: torch.device | None) -> None:
        self.micro_batches = micro_batches
        self.fed = 0
        self._pending: Any = _NONE
        self._to_step: queue.Queue = queue.Queue(maxsize=1)
        self._to_loop: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._main, args=(run, device), name="zfunc-window", daemon=True)

    def start(self) -> Window:
        """Start the step's thread (after whoever its loss function asks for the window holds it)."""
        self._thread.start()
        return self

    # -- Lightning's thread --------------------------------------------------------------------------
    def feed(self, micro_batch: Callable[[], Any]) -> Any:
        """Run ``micro_batch`` (a thunk that runs ``training_step`` with the step's parameters swapped in) as
        the window's next micro-batch; return its output once its backward pass is done."""
        if self.fed >= self.micro_batches:
            raise RuntimeError(f"zfunc: an accumulation window of {self.micro_batches} micro-batches got one more")
        self.fed += 1
        self._to_step.put(micro_batch)
        kind, value = self._to_loop.get()
        if kind == "error":
            raise value
        return value

    @property
    def complete(self) -> bool:
        return self.fed == self.micro_batches

    def result(self) -> Any:
        """The step's result once every micro-batch was fed (waits for the update)."""
        if not self.complete:
            raise RuntimeError(f"zfunc: the window's update was asked for after {self.fed} of its "
                               f"{self.micro_batches} micro-batches")
        kind, value = self._to_loop.get()
        self._thread.join()
        if kind == "error":
            raise value
        return value

    def cancel(self) -> None:
        """Abandon the window (Lightning stopped inside it): the step raises `WindowCancelled` before any
        update, so the state it was given stays usable."""
        if not self._thread.is_alive():
            return
        try:
            self._to_step.put_nowait(_CANCEL)
        except queue.Full:
            pass
        self._thread.join()

    # -- the step's thread ---------------------------------------------------------------------------
    def next_micro_batch(self) -> Callable[[], Any]:
        """Called by the step's loss function: the micro-batch Lightning feeds next. The previous micro-batch's
        backward pass has returned by now, so its output is handed to Lightning first."""
        if self._pending is not _NONE:
            self._deliver()
        item = self._to_step.get()
        if item is _CANCEL:
            raise WindowCancelled("Lightning stopped inside an accumulation window; no update was applied")
        return item

    def output(self, value: Any) -> None:
        """The output of the micro-batch being run (``training_step``'s return value)."""
        self._pending = value

    def updated(self) -> None:
        """Called by the step after its update: the last micro-batch's ``feed`` returns."""
        self._deliver()

    def _deliver(self) -> None:
        value, self._pending = self._pending, _NONE
        self._to_loop.put(("output", value))

    def _main(self, run: Callable[[Window], Any], device: torch.device | None) -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            out = run(self)
        except WindowCancelled:
            return
        except BaseException as err:  # noqa: BLE001 (handed to Lightning's thread, which raises it)
            self._to_loop.put(("error", err))
            return
        self._to_loop.put(("result", out))
