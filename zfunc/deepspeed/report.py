"""What became of each key of a DeepSpeed config: `Report`, and the `Section` reader that fills it.

Every *leaf* of the config (a value that is not a dict, or an empty dict) is
named by its dotted path (``"zero_optimization.offload_optimizer.device"``)
and must end up in the report exactly once, either

- ``mapped``: it changed (or confirmed) what zfunc builds; ``to`` says into
  what, e.g. ``"shard(stage=2)"``; or
- ``ignored``: it has no effect on what zfunc computes; ``to`` says why
  (a performance knob zfunc has no use for, a logging option, ...).

Anything else raises `DeepSpeedConfigError` naming the key: a feature zfunc
does not have, a value it cannot honour, or a key nobody knows. The mapping
code reads the config through `Section`, which records each key as it is
decided; `ReportBuilder.finish` then refuses any leaf no handler decided.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Literal

Status = Literal["mapped", "ignored"]
AUTO = "auto"
_MISSING = object()


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config key zfunc cannot honour; ``key`` is its dotted path ("" for the whole config)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


@dataclasses.dataclass(frozen=True)
class ReportEntry:
    """One config key: its ``value`` as written, ``status``, and ``to`` (mapped: what it became;
    ignored: why). ``auto``: for an ``"auto"`` value, what filled it."""

    key: str
    value: Any
    status: Status
    to: str
    auto: str | None = None


@dataclasses.dataclass(frozen=True)
class Report:
    """How each key of a DeepSpeed config was mapped, in the config's order. ``print(report)``
    shows a table; ``report[key]`` is the `ReportEntry` of a dotted key."""

    entries: tuple[ReportEntry, ...]

    def __getitem__(self, key: str) -> ReportEntry:
        for entry in self.entries:
            if entry.key == key:
                return entry
        raise KeyError(f"no key {key!r} in this config (keys: {', '.join(self.keys())})")

    def __iter__(self) -> Iterator[ReportEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def keys(self) -> list[str]:
        return [e.key for e in self.entries]

    @property
    def mapped(self) -> tuple[ReportEntry, ...]:
        return tuple(e for e in self.entries if e.status == "mapped")

    @property
    def ignored(self) -> tuple[ReportEntry, ...]:
        return tuple(e for e in self.entries if e.status == "ignored")

    def __str__(self) -> str:
        if not self.entries:
            return "DeepSpeed config: (empty)"
        rows = [(e.key, _short(e.value) + (f" -> {_short_text(e.auto)}" if e.auto else ""), e.status, e.to)
                for e in self.entries]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"DeepSpeed config: {len(self.mapped)} keys mapped, {len(self.ignored)} ignored"]
        for key, value, status, to in rows:
            lines.append(f"  {key:<{widths[0]}}  {value:<{widths[1]}}  {status:<{widths[2]}}  {to}")
        return "\n".join(lines)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return _short_text(text, limit)


def _short_text(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def leaf_paths(config: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` of every leaf: values that are not dicts, and empty dicts."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from leaf_paths(value, path + ".")
        else:
            yield path, value


class ReportBuilder:
    """Collects `ReportEntry`s while the mapping code reads the config.

    ``ignore``: dotted keys (or section prefixes) the caller reads itself;
    they are reported as ignored with that reason. `without_ignored` gives
    the config the mapping code should read: without them.
    """

    def __init__(self, config: Mapping, ignore: tuple[str, ...] = ()) -> None:
        self._leaves = dict(leaf_paths(config))
        self._entries: dict[str, ReportEntry] = {}
        self._autos: dict[str, str] = {}
        self._ignore = tuple(ignore)
        for prefix in self._ignore:
            if not isinstance(prefix, str) or not prefix:
                raise TypeError(f"ignore= takes dotted config keys as strings, got {prefix!r}")
            matched = [p for p in self._leaves if p == prefix or p.startswith(prefix + ".")]
            if not matched:
                raise DeepSpeedConfigError(prefix, "passed in ignore=, but the config has no such key")
            for path in matched:
                self.record(path, "ignored", "yours: passed in ignore=")

    def without_ignored(self, config: dict) -> dict:
        """A copy of ``config`` without the keys passed in ``ignore``."""
        out = copy.deepcopy(config)
        for path in self._ignore:
            parts = path.split(".")
            nodes = [out]
            for part in parts[:-1]:
                nodes.append(nodes[-1][part])
            del nodes[-1][parts[-1]]
            # A section the caller emptied goes too (its keys are all reported as theirs).
            for node, part in zip(reversed(nodes[:-1]), reversed(parts[:-1])):
                if node[part]:
                    break
                del node[part]
        return out

    def note_auto(self, path: str, origin: str) -> None:
        """Remember that ``path`` was ``"auto"`` and what filled it (shown in the report)."""
        self._autos[path] = origin

    def record(self, path: str, status: Status, to: str) -> None:
        if path not in self._leaves:
            raise AssertionError(f"zfunc.deepspeed reported {path!r}, which is not a key of the config")
        if path in self._entries:
            raise AssertionError(f"zfunc.deepspeed reported {path!r} twice")
        self._entries[path] = ReportEntry(path, self._leaves[path], status, to, self._autos.get(path))

    def decided(self, path: str) -> bool:
        return path in self._entries

    def finish(self) -> Report:
        """The report; raises `DeepSpeedConfigError` for the first key no handler decided."""
        for path in self._leaves:
            if path not in self._entries:
                raise DeepSpeedConfigError(
                    path, "not a DeepSpeed config key zfunc knows, so it cannot tell what it would change. "
                    f"Remove it, or pass ignore=[{path!r}] to from_config if your own code reads it")
        return Report(tuple(self._entries[p] for p in self._leaves))


class Section:
    """Reads one dict of the config (at dotted ``path``) and reports each key it decides.

    ``value(key, default)`` reads a value (refusing an unfilled ``"auto"``),
    ``mapped``/``ignored`` report a key (a key absent from the config is not
    reported: the report lists the config's own keys only).
    """

    def __init__(self, data: Mapping, path: str, report: ReportBuilder,
                 auto_hint: Mapping[str, str] | None = None) -> None:
        if not isinstance(data, Mapping):
            raise DeepSpeedConfigError(path, f"must be a dict of options, got {type(data).__name__} {data!r}")
        self.data, self.path, self.report = data, path, report
        self._auto_hint = auto_hint or {}

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def keys(self) -> list[str]:
        return list(self.data)

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as written (``"auto"`` included), or ``default`` when absent."""
        return self.data.get(key, default)

    def value(self, key: str, default: Any = _MISSING) -> Any:
        """The value; ``default`` when absent (required when no default). Refuses ``"auto"``."""
        if key not in self.data:
            if default is _MISSING:
                raise DeepSpeedConfigError(self.key_path(key), "is required here")
            return default
        value = self.data[key]
        if isinstance(value, str) and value == AUTO:
            hint = self._auto_hint.get(self.key_path(key))
            raise DeepSpeedConfigError(self.key_path(key), "is 'auto' and nothing fills it: " + (
                hint or "Hugging Face's integration does not fill this key; write a value"))
        return value

    def section(self, key: str) -> Section:
        return Section(self.data.get(key, {}), self.key_path(key), self.report, self._auto_hint)

    def error(self, key: str, message: str) -> DeepSpeedConfigError:
        return DeepSpeedConfigError(self.key_path(key), message)

    def mapped(self, key: str, to: str) -> None:
        self._record(key, "mapped", to)

    def ignored(self, key: str, why: str) -> None:
        self._record(key, "ignored", why)

    def _record(self, key: str, status: Status, to: str) -> None:
        if key not in self.data:
            return
        value = self.data[key]
        if isinstance(value, Mapping) and value:  # a whole section: every leaf under it
            for path, _ in leaf_paths(value, self.key_path(key) + "."):
                self.report.record(path, status, to)
        else:
            self.report.record(self.key_path(key), status, to)

    def rest_ignored(self, why: str) -> None:
        """Report every key of this section not decided yet as ignored with ``why``."""
        for key in self.data:
            value = self.data[key]
            paths = ([p for p, _ in leaf_paths(value, self.key_path(key) + ".")]
                     if isinstance(value, Mapping) and value else [self.key_path(key)])
            for path in paths:
                if not self.report.decided(path):
                    self.report.record(path, "ignored", why)
