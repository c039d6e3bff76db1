"""Refuse, saying what it is and how it likely got there, a value handed to a step where its state goes.

A transformed step, ``step.init``, ``step.gather`` and the checkpoint functions take a
`zfunc.TrainState`. The values people hand them instead are few and each has one
usual cause, so the error names it:

- a pair ``(state, x)``: `zfunc.io.restore` returns ``(state, client_state)``,
  `zfunc.io.load_pretrained` ``(state, report)`` and a step ``(state, metrics)``;
  the pair was assigned to one name (``state = zf.io.restore(...)``);
- a dict of tensors: the parameters from `zf.functional`, not yet made a state
  (``zf.TrainState.create(params, opt)``, then ``step.init``);
- another dict: a ``state_dict`` or a checkpoint loaded with ``torch.load``;
- an ``nn.Module``: the model itself, before `zf.functional`;
- None: a function that should have returned the state returned nothing.

This module sits below the interpreter and imports nothing of zfunc (`zfunc.state`
imports the interpreter), so a state is recognised by its fields, the ones every
transform reads: ``step``, ``params``, ``opt_state`` and ``extras``.
"""

from __future__ import annotations

from typing import Any

import torch

STATE_FIELDS = ("step", "params", "opt_state", "extras")

_MAKE_ONE = "state = step.init(zf.TrainState.create(params, opt))"


def is_state(value: Any) -> bool:
    """Whether ``value`` has the fields of a `zfunc.TrainState`."""
    return all(hasattr(value, field) for field in STATE_FIELDS)


def require_state(value: Any, what: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a training state, saying what it is and its likely cause.

    Args:
      value: what was passed where a `zfunc.TrainState` goes.
      what: the call that received it, for the message (e.g. ``"mixed_precision(...)"``).
    """
    if not is_state(value):
        raise TypeError(refusal(value, what))


def refusal(value: Any, what: str) -> str:
    """The message refusing ``value`` where ``what`` takes a state: what it got and the likely cause."""
    return f"{what} takes a zf.TrainState, but got {describe(value)}. {likely_cause(value)}"


def describe(value: Any) -> str:
    """A short description of ``value``: its type and, for containers, what they hold."""
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(_kind(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} of {len(value)} ({kinds})"
    if isinstance(value, dict):
        if value and all(isinstance(v, torch.Tensor) for v in value.values()):
            return f"a dict of {len(value)} tensors (keys {_keys(value)})"
        return f"a dict with keys {_keys(value)}"
    if isinstance(value, torch.nn.Module):
        return f"a torch.nn.Module ({type(value).__name__})"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def likely_cause(value: Any) -> str:
    """What usually produces ``value`` where a state was meant, and what to write instead."""
    if isinstance(value, (tuple, list)) and value and is_state(value[0]):
        second = value[1] if len(value) == 2 else None
        if type(second).__name__ == "LoadReport":
            return ("zfunc.io.load_pretrained returns (state, report): unpack it, "
                    "`state, report = zfunc.io.load_pretrained(dir, like=state)`.")
        if isinstance(second, dict) and "loss" in second:
            return ("A step returns (state, metrics): unpack it, `state, metrics = step(state, batch)`, and pass "
                    "the state on.")
        if len(value) == 2:
            return ("zf.io.restore returns (state, client_state): unpack it, `state, client_state = "
                    "zf.io.restore(dir, like=state)` (a step too returns a pair: `state, metrics = step(state, "
                    "batch)`).")
        return "Its first element is a state: pass that one."
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return (f"These look like parameters (zf.functional's params, or a state_dict): a step trains a state made "
                f"from them, `{_MAKE_ONE}`; to load saved weights into a state use zfunc.io.restore (a zfunc "
                "checkpoint) or zfunc.io.load_pretrained (Hugging Face safetensors).")
    if isinstance(value, dict):
        return (f"A step trains a state made with `{_MAKE_ONE}`; a checkpoint loaded with torch.load is not one: "
                "restore a zfunc checkpoint with `state, client_state = zf.io.restore(dir, like=state)`.")
    if isinstance(value, torch.nn.Module):
        return f"Make the model functional first, `apply_fn, params = zf.functional(model)`, then `{_MAKE_ONE}`."
    if value is None:
        return ("A function that should have returned the state returned nothing (a step must return "
                "(new_state, metrics)); make one with `" + _MAKE_ONE + "`.")
    return f"Make one with `{_MAKE_ONE}`, and pass the state each step returns to the next."


def _kind(value: Any) -> str:
    if is_state(value):
        return type(value).__name__
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


def _keys(mapping: dict) -> str:
    keys = [repr(k) for k in list(mapping)[:4]]
    return "[" + ", ".join(keys) + (", ..." if len(mapping) > 4 else "") + "]"
