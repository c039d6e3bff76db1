"""The zfunc transform stack a DeepSpeed config asks for, as data, and the one function that builds it.

`TransformCall` records ``name(step, **kwargs)`` and, for each keyword, the
DeepSpeed key it came from. `build_transform` builds one, so a keyword the
installed transform does not take yet (the planned parameter and NVMe
placement of `offload`) surfaces as a `NotImplementedError` naming the
DeepSpeed key when the stack is built, while `from_config` itself still
succeeds and its result shows the planned arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

TransformName = Literal["accumulate", "mixed_precision", "checkpoint", "offload", "shard"]

# Innermost first: shard(offload(checkpoint(mixed_precision(accumulate(step)))))
ORDER: tuple[TransformName, ...] = ("accumulate", "mixed_precision", "checkpoint", "offload", "shard")

# Spellings the planned API renames; tried when the installed transform refuses the new one.
_OLDER_SPELLING: dict[tuple[str, str, Any], Any] = {("offload", "optimizer", "host"): "cpu"}


@dataclasses.dataclass(frozen=True)
class TransformCall:
    """``name(step, **kwargs)``; ``sources[keyword]`` is the DeepSpeed key (or keys) it came from."""

    name: TransformName
    kwargs: Mapping[str, Any]
    sources: Mapping[str, str]

    def __post_init__(self) -> None:
        if self.name not in ORDER:
            raise ValueError(f"unknown transform {self.name!r}; one of {ORDER}")
        missing = set(self.kwargs) - set(self.sources)
        if missing:
            raise ValueError(f"{self.name}: no DeepSpeed key recorded for {sorted(missing)}")

    def __str__(self) -> str:
        args = ", ".join(f"{k}={show_value(v)}" for k, v in self.kwargs.items())
        return f"{self.name}(step{', ' + args if args else ''})"


def show_value(value: Any) -> str:
    short = getattr(value, "short", None)
    if callable(short):   # a mixed-precision Policy: its preset name when it is one
        value = short()
    return repr(value)


def constructor(name: TransformName) -> Callable[..., Any]:
    from zfunc import transforms  # noqa: PLC0415 (imported when a stack is built)

    return getattr(transforms, name)


def build_transform(call: TransformCall, step: Callable) -> Callable:
    """``call.name(step, **call.kwargs)`` with the installed transform.

    Raises:
      NotImplementedError: the installed transform does not take one of the
        keywords, or refuses its value (after trying an older spelling of it),
        naming the DeepSpeed key that asked for it.
    """
    make = constructor(call.name)
    accepted = inspect.signature(make).parameters
    for keyword, value in call.kwargs.items():
        if keyword not in accepted:
            raise NotImplementedError(
                f"{call.sources[keyword]} maps to {call.name}({keyword}={show_value(value)}), and this version "
                f"of zfunc's {call.name} does not take {keyword}= yet. Remove that key from the config (or use "
                f"a zfunc whose {call.name} has it)")
    try:
        return make(step, **call.kwargs)
    except ValueError as err:
        older = {k: _OLDER_SPELLING.get((call.name, k, v), v) for k, v in call.kwargs.items()}
        if older != dict(call.kwargs):
            try:
                return make(step, **older)
            except ValueError:
                pass
        keys = ", ".join(dict.fromkeys(call.sources.values()))
        raise NotImplementedError(
            f"{keys} map to {call}, which this version of zfunc's {call.name} refuses ({err}). Remove "
            f"those keys from the config (or use a zfunc whose {call.name} takes them)") from err


def build_stack(calls: tuple[TransformCall, ...], step: Callable) -> Callable:
    """Wrap ``step`` in ``calls`` (innermost first)."""
    for call in calls:
        step = build_transform(call, step)
    return step


def check_order(calls: tuple[TransformCall, ...]) -> None:
    positions = [ORDER.index(call.name) for call in calls]
    if positions != sorted(set(positions)):
        raise ValueError(f"transform calls must be in zfunc's order {ORDER} (innermost first), each once; "
                         f"got {[call.name for call in calls]}")
