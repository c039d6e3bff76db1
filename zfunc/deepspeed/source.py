"""Reading a DeepSpeed config: a dict, or a JSON / HJSON file as DeepSpeed reads it."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zfunc.deepspeed.report import DeepSpeedConfigError


def read_config(config: Mapping | str | os.PathLike) -> dict[str, Any]:
    """The config as a plain dict (a deep copy: the caller's dict is never changed).

    Args:
      config: a dict, or the path of a JSON file. DeepSpeed reads its config
        files with ``hjson`` (comments, unquoted keys, optional commas); a file
        that is not strict JSON is read the same way if the ``hjson`` package is
        installed, and refused with a message saying so if it is not.
    Returns:
      The config; duplicate keys in a file are an error, as in DeepSpeed.
    """
    if isinstance(config, Mapping):
        return _plain(copy.deepcopy(dict(config)), "config")
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeed config {str(path)!r} is not a file; pass a dict or the path "
                                    "of a JSON file")
        return parse_config_text(path.read_text(encoding="utf-8"), str(path))
    raise TypeError(f"config must be a dict or the path of a JSON/HJSON file, got {type(config).__name__}")


def parse_config_text(text: str, name: str = "config") -> dict[str, Any]:
    """Parse a config file's text: strict JSON, else HJSON (when the package is installed)."""
    try:
        data = json.loads(text, object_pairs_hook=_without_duplicates)
    except json.JSONDecodeError as err:
        try:
            import hjson  # noqa: PLC0415 (optional dependency)
        except ImportError:
            raise DeepSpeedConfigError("", (
                f"{name} is not strict JSON ({err.msg} at line {err.lineno}, column {err.colno}). DeepSpeed "
                "reads configs with hjson, which also accepts comments, unquoted keys and missing or trailing "
                "commas: install it (pip install hjson) to read this file as DeepSpeed does, or make the file "
                "strict JSON")) from None
        try:
            data = hjson.loads(text, object_pairs_hook=_without_duplicates)
        except hjson.HjsonDecodeError as hjson_err:
            raise DeepSpeedConfigError("", f"{name} is neither JSON nor HJSON: {hjson_err}") from None
    return _plain(data, name)


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DeepSpeedConfigError(key, "appears twice in the same dict of the config file "
                                            "(DeepSpeed refuses that too); keep one")
        out[key] = value
    return out


def _plain(data: Any, name: str) -> dict[str, Any]:
    """Ordered dicts (hjson's) as plain dicts, recursively; the top level must be a dict."""
    if not isinstance(data, Mapping):
        raise DeepSpeedConfigError("", f"{name} must hold a JSON object (a dict of options), "
                                       f"got {type(data).__name__}")

    def convert(value: Any) -> Any:
        if isinstance(value, Mapping):
            for key in value:
                if not isinstance(key, str):
                    raise DeepSpeedConfigError(str(key), f"config keys must be strings, got {key!r}")
            return {key: convert(v) for key, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    return convert(data)
