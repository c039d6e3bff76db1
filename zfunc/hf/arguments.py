"""`TrainingArguments`: Hugging Face's, with ``deepspeed=`` read by zfunc and zfunc's own fields.

transformers' ``TrainingArguments.__post_init__`` hands a ``deepspeed=``
config to its DeepSpeed integration (which imports ``deepspeed`` and makes
accelerate build a DeepSpeed engine). This subclass takes the config away
before that runs, keeps it in ``zfunc_config`` for `zfunc.deepspeed.from_config`,
and leaves ``deepspeed`` None: transformers never sees it, so DeepSpeed need
not be installed, and installed it changes nothing.

``fp16``/``bf16`` keep their values (they fill the config's ``"auto"``
precision and choose zfunc's `mixed_precision`), but accelerate is told
``mixed_precision="no"``: zfunc casts and scales the loss itself, so
accelerate must neither autocast the forward nor build its GradScaler.
Activation checkpointing (``activation_checkpointing`` / older
``gradient_checkpointing``) likewise becomes zfunc's `checkpoint` transform
and is switched off on the transformers side.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import transformers

Offload = Literal["none", "optimizer", "optimizer_nvme", "optimizer_and_params"]
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer_nvme", "optimizer_and_params")


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments`` plus zfunc's fields (all optional).

    ``deepspeed``: a DeepSpeed config (dict, JSON path, HJSON path) that zfunc
    reads (`zfunc.deepspeed.from_config`, ``"auto"`` filled from these
    arguments); after construction it is in ``zfunc_config`` and
    ``deepspeed`` is None. ``zfunc``: the same, under zfunc's own name.
    Without a config, ``zfunc_stage`` / ``zfunc_offload`` / ``zfunc_nvme_path``
    describe the ZeRO stage and offload directly. ``zfunc_gather_model``
    (default True): after ``train()`` the trainer's model holds the trained
    weights; False leaves the model's trainable tensors empty (for models too
    large to gather on one rank: save with ``trainer.save_model``, which
    streams one tensor at a time).
    """

    zfunc: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "A DeepSpeed config (dict or JSON/HJSON path) for zfunc to read"})
    zfunc_stage: int | None = dataclasses.field(
        default=None, metadata={"help": "ZeRO stage 0-3 (without a config)"})
    zfunc_offload: str = dataclasses.field(
        default="none", metadata={"help": f"One of {OFFLOADS} (without a config)"})
    zfunc_nvme_path: str | None = dataclasses.field(
        default=None, metadata={"help": "Directory for zfunc_offload='optimizer_nvme'"})
    zfunc_gather_model: bool = dataclasses.field(
        default=True, metadata={"help": "After train(), write the trained weights into trainer.model"})

    def __post_init__(self) -> None:
        given = [name for name, value in (("deepspeed", self.deepspeed), ("zfunc", self.zfunc)) if value]
        if len(given) > 1:
            raise ValueError("TrainingArguments: deepspeed= and zfunc= both give a config; pass one")
        config: Any = self.deepspeed or self.zfunc
        if config and (self.zfunc_stage is not None or self.zfunc_offload != "none" or self.zfunc_nvme_path):
            raise ValueError(f"TrainingArguments: {given[0]}= gives a DeepSpeed config and zfunc_stage / "
                             "zfunc_offload / zfunc_nvme_path describe one too; put the ZeRO settings in one place")
        if self.zfunc_stage is not None and self.zfunc_stage not in (0, 1, 2, 3):
            raise ValueError(f"TrainingArguments: zfunc_stage must be 0, 1, 2 or 3, got {self.zfunc_stage!r}")
        if self.zfunc_offload not in OFFLOADS:
            raise ValueError(f"TrainingArguments: zfunc_offload must be one of {OFFLOADS}, got {self.zfunc_offload!r}")
        if (self.zfunc_offload == "optimizer_nvme") != bool(self.zfunc_nvme_path):
            raise ValueError("TrainingArguments: zfunc_offload='optimizer_nvme' and zfunc_nvme_path= go together")
        if isinstance(config, os.PathLike):
            config = os.fspath(config)
        self.zfunc_config = config
        self.zfunc_recompute = bool(getattr(self, "activation_checkpointing", False)
                                    or getattr(self, "gradient_checkpointing", False))
        # transformers must not see the config (its integration imports deepspeed) nor checkpoint the model itself.
        self.deepspeed = None
        self.zfunc = None
        for name in ("activation_checkpointing", "gradient_checkpointing"):
            if getattr(self, name, False):
                setattr(self, name, False)
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes"):
            raise ValueError("ACCELERATE_USE_DEEPSPEED is set: accelerate would build a DeepSpeed engine around "
                             "the model zfunc trains. Unset it (zfunc.hf reads the DeepSpeed config itself)")
        super().__post_init__()
        # zfunc's mixed_precision casts and scales: accelerate must not autocast or build a GradScaler.
        self.mixed_precision = "no"
        if os.environ.get("ACCELERATE_MIXED_PRECISION") in ("fp16", "bf16"):
            os.environ["ACCELERATE_MIXED_PRECISION"] = "no"

    def zfunc_deepspeed_config(self) -> dict | str:
        """The DeepSpeed config zfunc builds from: ``zfunc_config`` if one was given, else one made from
        ``zfunc_stage`` / ``zfunc_offload`` with every batch, clipping and precision value ``"auto"``."""
        if self.zfunc_config:
            return self.zfunc_config
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "fp16": {"enabled": "auto"},
            "bf16": {"enabled": "auto"},
        }
        zero: dict[str, Any] = {"stage": self.zfunc_stage or 0}
        if self.zfunc_offload == "optimizer":
            zero["offload_optimizer"] = {"device": "cpu"}
        elif self.zfunc_offload == "optimizer_nvme":
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": self.zfunc_nvme_path}
        elif self.zfunc_offload == "optimizer_and_params":
            zero["offload_optimizer"] = {"device": "cpu"}
            zero["offload_param"] = {"device": "cpu"}
        if self.zfunc_stage is not None or self.zfunc_offload != "none":
            config["zero_optimization"] = zero
        return config
