"""The ``"auto"`` values of Hugging Face's DeepSpeed integration, filled the way it fills them.

transformers' Trainer writes ``"auto"`` in a DeepSpeed config wherever the
value should come from its ``TrainingArguments`` or from the model, and
replaces each one before DeepSpeed reads the config. `fill_auto` does the
same from a `TrainingArgs` (the same field names) and the model's hidden size:

=========================================================  ==============================================
key                                                        filled with
=========================================================  ==============================================
``train_micro_batch_size_per_gpu``                         ``per_device_train_batch_size``
``gradient_accumulation_steps``                            ``gradient_accumulation_steps``
``train_batch_size``                                       world size × the two above
``gradient_clipping``                                      ``max_grad_norm``
``optimizer.params.lr`` / ``betas`` / ``eps``              ``learning_rate`` / ``[adam_beta1, adam_beta2]``
                                                           / ``adam_epsilon``
``optimizer.params.weight_decay``                          ``weight_decay``
``scheduler.params.warmup_min_lr``                         0
``scheduler.params.warmup_max_lr``                         ``learning_rate``
``scheduler.params.total_num_steps``                       ``max_steps`` (the number of updates)
``scheduler.params.warmup_num_steps``                      ``warmup_steps`` (a float below 1: that share
                                                           of ``max_steps``), or ``warmup_ratio`` × max_steps
``fp16.enabled`` / ``bf16.enabled``                        ``fp16`` / ``bf16``
``amp.enabled``                                            false (Hugging Face enables apex AMP only for
                                                           ``fp16_backend="apex"``)
``zero_optimization.reduce_bucket_size``                   hidden size²
``zero_optimization.stage3_prefetch_bucket_size``          0.9 × hidden size²
``zero_optimization.stage3_param_persistence_threshold``   10 × hidden size
=========================================================  ==============================================

As in Hugging Face's integration, a key of the first group that is *not*
``"auto"`` must agree with the training argument when that argument is
given: disagreements are listed together in one error. An ``"auto"`` that
nothing fills stays ``"auto"``; the code that maps the key refuses it then,
naming the argument that would fill it (a key zfunc ignores needs no value).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from zfunc.deepspeed.report import AUTO, DeepSpeedConfigError, ReportBuilder


@dataclasses.dataclass(frozen=True)
class TrainingArgs:
    """Training arguments that fill ``"auto"`` values, named as Hugging Face's ``TrainingArguments``.

    ``None`` means unknown. ``warmup_steps``: a number of updates, or (a
    float below 1) a share of ``max_steps``; ``max_steps``: the number of
    optimizer updates of the whole run (Hugging Face's -1, "train by
    epochs", counts as unknown: give the number of updates).
    """

    learning_rate: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_epsilon: float | None = None
    weight_decay: float | None = None
    warmup_steps: float | None = None
    warmup_ratio: float | None = None
    max_steps: int | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    fp16: bool | None = None
    bf16: bool | None = None
    max_grad_norm: float | None = None

    @classmethod
    def resolve(cls, training_args: Any = None, overrides: Mapping[str, Any] | None = None) -> TrainingArgs:
        """Read the known fields of ``training_args`` (a ``TrainingArguments``, any object with those
        attributes, or a dict), then apply ``overrides`` (keyword arguments; unknown names raise)."""
        names = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        if isinstance(training_args, Mapping):
            values = {name: training_args[name] for name in names if name in training_args}
        elif training_args is not None:
            values = {name: getattr(training_args, name) for name in names if hasattr(training_args, name)}
        for name, value in (overrides or {}).items():
            if name not in names:
                raise TypeError(f"from_config() got an unexpected keyword argument {name!r}; the training "
                                f"arguments it takes are {', '.join(names)}")
            values[name] = value
        if values.get("max_steps") is not None and values["max_steps"] <= 0:
            values["max_steps"] = None   # Hugging Face's "train by epochs": the number of updates is unknown
        return cls(**values)


def hidden_size_of(model: Any, hidden_size: int | None) -> int | None:
    """``hidden_size`` if given, else the model's ``config.hidden_size`` (or the largest of
    ``config.hidden_sizes``), as Hugging Face reads it; None when unknown."""
    if hidden_size is not None:
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        return hidden_size
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (or None), got {type(model).__name__}")
    config = getattr(model, "config", None)
    if getattr(config, "hidden_size", None) is not None:
        return int(config.hidden_size)
    if getattr(config, "hidden_sizes", None):
        return int(max(config.hidden_sizes))
    return None


class _Unknown(Exception):
    """A value needs an argument nobody gave."""


@dataclasses.dataclass(frozen=True)
class _Fill:
    compute: Callable[[_Context], tuple[Any, str]]  # -> (value, where it came from)
    needs: str        # what to pass when it cannot be filled
    must_match: bool  # a non-"auto" value must agree with the training argument (Hugging Face's check)


@dataclasses.dataclass(frozen=True)
class _Context:
    args: TrainingArgs
    hidden_size: int | None
    world_size: int

    def arg(self, name: str) -> Any:
        value = getattr(self.args, name)
        if value is None:
            raise _Unknown(name)
        return value

    def hidden(self) -> int:
        if self.hidden_size is None:
            raise _Unknown("hidden_size")
        return self.hidden_size


def _from(name: str) -> Callable[[_Context], tuple[Any, str]]:
    return lambda ctx: (ctx.arg(name), f"{name} = {ctx.arg(name)!r}")


def _train_batch(ctx: _Context) -> tuple[int, str]:
    micro, accumulation = ctx.arg("per_device_train_batch_size"), ctx.arg("gradient_accumulation_steps")
    return (ctx.world_size * micro * accumulation,
            f"world size × per_device_train_batch_size × gradient_accumulation_steps = "
            f"{ctx.world_size} × {micro} × {accumulation}")


def _betas(ctx: _Context) -> tuple[list[float], str]:
    b1, b2 = ctx.arg("adam_beta1"), ctx.arg("adam_beta2")
    return [b1, b2], f"[adam_beta1, adam_beta2] = [{b1!r}, {b2!r}]"


def _warmup_steps(ctx: _Context) -> tuple[int, str]:
    """Hugging Face's ``get_warmup_steps`` (both its spellings: a ratio in ``warmup_steps`` < 1,
    or the older ``warmup_ratio``)."""
    steps, ratio = ctx.args.warmup_steps, ctx.args.warmup_ratio
    if steps is not None and steps >= 1:
        return int(steps), f"warmup_steps = {steps!r}"
    if steps is not None and 0 < steps < 1:
        total = ctx.arg("max_steps")
        return math.ceil(total * steps), f"ceil(max_steps × warmup_steps) = ceil({total} × {steps!r})"
    if ratio:
        total = ctx.arg("max_steps")
        return math.ceil(total * ratio), f"ceil(max_steps × warmup_ratio) = ceil({total} × {ratio!r})"
    if steps is not None:   # 0: no warmup
        return 0, "warmup_steps = 0"
    raise _Unknown("warmup_steps")


def _hidden_square(factor: float) -> Callable[[_Context], tuple[Any, str]]:
    def compute(ctx: _Context) -> tuple[Any, str]:
        h = ctx.hidden()
        value = h * h if factor == 1 else factor * h * h
        return value, f"{'' if factor == 1 else f'{factor} × '}hidden_size² = {value:g} (hidden_size {h})"
    return compute


_FILLS: dict[str, _Fill] = {
    "train_micro_batch_size_per_gpu": _Fill(_from("per_device_train_batch_size"),
                                            "per_device_train_batch_size", True),
    "gradient_accumulation_steps": _Fill(_from("gradient_accumulation_steps"), "gradient_accumulation_steps", True),
    "train_batch_size": _Fill(_train_batch, "per_device_train_batch_size and gradient_accumulation_steps", True),
    "gradient_clipping": _Fill(_from("max_grad_norm"), "max_grad_norm", True),
    "optimizer.params.lr": _Fill(_from("learning_rate"), "learning_rate", True),
    "optimizer.params.betas": _Fill(_betas, "adam_beta1 and adam_beta2", True),
    "optimizer.params.eps": _Fill(_from("adam_epsilon"), "adam_epsilon", True),
    "optimizer.params.weight_decay": _Fill(_from("weight_decay"), "weight_decay", True),
    "scheduler.params.warmup_min_lr": _Fill(lambda ctx: (0, "0 (as Hugging Face fills it)"), "", False),
    "scheduler.params.warmup_max_lr": _Fill(_from("learning_rate"), "learning_rate", True),
    "scheduler.params.total_num_steps": _Fill(_from("max_steps"), "max_steps (the number of optimizer updates)",
                                              True),
    "scheduler.params.warmup_num_steps": _Fill(_warmup_steps, "warmup_steps (and max_steps for a ratio)", True),
    "fp16.enabled": _Fill(lambda ctx: (bool(ctx.arg("fp16")), f"fp16 = {ctx.arg('fp16')!r}"), "fp16", True),
    "bf16.enabled": _Fill(lambda ctx: (bool(ctx.arg("bf16")), f"bf16 = {ctx.arg('bf16')!r}"), "bf16", True),
    "bfloat16.enabled": _Fill(lambda ctx: (bool(ctx.arg("bf16")), f"bf16 = {ctx.arg('bf16')!r}"), "bf16", True),
    "amp.enabled": _Fill(lambda ctx: (False, "false (apex AMP only for fp16_backend='apex')"), "", False),
    "zero_optimization.reduce_bucket_size": _Fill(_hidden_square(1), "model= or hidden_size=", False),
    "zero_optimization.stage3_prefetch_bucket_size": _Fill(_hidden_square(0.9), "model= or hidden_size=", False),
    "zero_optimization.stage3_param_persistence_threshold": _Fill(
        lambda ctx: (10 * ctx.hidden(), f"10 × hidden_size = {10 * ctx.hidden()}"), "model= or hidden_size=", False),
}


def fill_auto(config: dict, args: TrainingArgs, hidden_size: int | None, world_size: int,
              report: ReportBuilder) -> tuple[dict, dict[str, str]]:
    """Fill the ``"auto"`` values that ``args`` and ``hidden_size`` determine (in place).

    Returns ``(config, hints)``: ``hints`` says, for each ``"auto"`` left
    unfilled, what would fill it. Raises `DeepSpeedConfigError` listing every
    value that disagrees with a given training argument.
    """
    ctx = _Context(args, hidden_size, world_size)
    hints: dict[str, str] = {}
    mismatches: list[str] = []
    for path, fill in _FILLS.items():
        parent, key = _parent(config, path)
        if parent is None or key not in parent:
            continue
        written = parent[key]
        try:
            value, origin = fill.compute(ctx)
        except _Unknown as unknown:
            if written == AUTO:
                hints[path] = _hint(fill.needs, str(unknown))
            continue
        if written == AUTO:
            parent[key] = value
            report.note_auto(path, origin)
        elif fill.must_match and not _same(written, value):
            mismatches.append(f"{path} = {written!r} but {origin}")
    if mismatches:
        raise DeepSpeedConfigError("", "these config values disagree with the training arguments (Hugging Face "
                                       "refuses them too; write 'auto' to take the argument's value):\n  "
                                   + "\n  ".join(mismatches))
    return config, hints


def _hint(needs: str, missing: str) -> str:
    if missing == "hidden_size":
        return "pass model= (a model with config.hidden_size) or hidden_size= to from_config"
    return (f"pass {needs} to from_config, as keyword arguments or fields of training_args= "
            f"({missing} is missing)")


def _parent(config: dict, path: str) -> tuple[dict | None, str]:
    *parents, key = path.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            return None, key
    return node, key


def _same(written: Any, value: Any) -> bool:
    if isinstance(value, list):
        return isinstance(written, (list, tuple)) and list(written) == value
    if isinstance(value, bool) or isinstance(written, bool):
        return bool(written) == bool(value) and isinstance(written, bool) == isinstance(value, bool)
    return written == value
