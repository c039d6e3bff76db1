"""`ZfuncStrategy`'s arguments -> a DeepSpeed config -> `zfunc.deepspeed.from_config`.

The strategy takes `DeepSpeedStrategy`'s argument names and builds the same
DeepSpeed config Lightning builds from them (or takes the user's ``config=``,
a dict or a JSON/HJSON path), fills in what the Trainer decides
(``accumulate_grad_batches``, ``gradient_clip_val``, ``precision``) as
Lightning does, and hands it to `from_config`, whose report says what every
key became. Arguments that are not config keys are reported here (`STRATEGY_ONLY`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

from zfunc.deepspeed import DeepSpeedConfigError, read_config

# DeepSpeedStrategy's defaults, for the arguments that become config keys.
DEFAULTS: dict[str, Any] = dict(
    zero_optimization=True, stage=2, offload_optimizer=False, offload_parameters=False, offload_params_device="cpu",
    nvme_path="/local_nvme", params_buffer_count=5, params_buffer_size=100_000_000, max_in_cpu=1_000_000_000,
    offload_optimizer_device="cpu", optimizer_buffer_count=4, block_size=1048576, queue_depth=8,
    single_submit=False, overlap_events=True, thread_count=1, pin_memory=False, sub_group_size=1_000_000_000_000,
    contiguous_gradients=True, overlap_comm=True, allgather_partitions=True, reduce_scatter=True,
    allgather_bucket_size=200_000_000, reduce_bucket_size=200_000_000, zero_allow_untested_optimizer=True,
    logging_batch_size_per_gpu="auto", partition_activations=False, cpu_checkpointing=False,
    contiguous_memory_optimization=False, synchronize_checkpoint_boundary=False,
    loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1,
)

# Arguments of DeepSpeedStrategy that are not DeepSpeed config keys: what each does under zfunc.
STRATEGY_ONLY: dict[str, str] = {
    "remote_device": "ignored: the module is built where configure_model builds it; zfunc's state is laid out by "
                     "step.init (build on torch.device('meta') in configure_model to never hold it whole)",
    "logging_level": "ignored: DeepSpeed's logger",
    "exclude_frozen_parameters": "zfunc's checkpoints always hold the trainable parameters only",
    "process_group_backend": "mapped: the process group Lightning creates",
    "timeout": "mapped: the process group's timeout (zfunc's own waits: $ZFUNC_TIMEOUT_S)",
}


def deepspeed_config(config: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config the strategy's arguments describe, as `DeepSpeedStrategy` builds it.

    ``config`` (a dict or a path) wins over the arguments, as in Lightning; a
    path goes through `zfunc.deepspeed.read_config` (JSON, or HJSON).
    """
    if config is None and os.environ.get("PL_DEEPSPEED_CONFIG_PATH"):
        config = os.environ["PL_DEEPSPEED_CONFIG_PATH"]
    if config is not None:
        return copy.deepcopy(read_config(config))
    a = {**DEFAULTS, **args}
    cfg: dict[str, Any] = {}
    if a["partition_activations"] or a["cpu_checkpointing"] or a["contiguous_memory_optimization"]:
        # (Lightning always writes the section; DeepSpeed's checkpointing only acts where the model calls it,
        # while zfunc's checkpoint transform recomputes the blocks by itself: written only when asked for.)
        cfg["activation_checkpointing"] = {
            "partition_activations": a["partition_activations"], "cpu_checkpointing": a["cpu_checkpointing"],
            "contiguous_memory_optimization": a["contiguous_memory_optimization"],
            "synchronize_checkpoint_boundary": a["synchronize_checkpoint_boundary"]}
    nvme = "nvme" in (a["offload_optimizer_device"], a["offload_params_device"])
    if nvme:
        cfg["aio"] = {k: a[k] for k in ("block_size", "queue_depth", "single_submit", "overlap_events",
                                          "thread_count")}
    if a["zero_optimization"]:
        zero = {k: a[k] for k in ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions",
                                  "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")}
        if a["offload_optimizer"]:
            zero["offload_optimizer"] = {"device": a["offload_optimizer_device"], "nvme_path": a["nvme_path"],
                                         "buffer_count": a["optimizer_buffer_count"], "pin_memory": a["pin_memory"]}
        if a["offload_parameters"]:
            zero["offload_param"] = {"device": a["offload_params_device"], "nvme_path": a["nvme_path"],
                                     "buffer_count": a["params_buffer_count"], "buffer_size": a["params_buffer_size"],
                                     "max_in_cpu": a["max_in_cpu"], "pin_memory": a["pin_memory"]}
        cfg = {"zero_allow_untested_optimizer": a["zero_allow_untested_optimizer"], "zero_optimization": zero, **cfg}
    if a["logging_batch_size_per_gpu"] != "auto":
        cfg = {"train_micro_batch_size_per_gpu": a["logging_batch_size_per_gpu"], **cfg}
    return cfg


def fill_from_trainer(cfg: dict[str, Any], *, accumulate_grad_batches: int, gradient_clip_val: float | None,
                      micro_batch_size: int, precision: str, loss_scale_args: dict[str, Any]) -> dict[str, Any]:
    """What Lightning's DeepSpeedStrategy writes into the config from the Trainer (``_format_config``)."""
    cfg = copy.deepcopy(cfg)
    if "gradient_accumulation_steps" in cfg:
        raise DeepSpeedConfigError("gradient_accumulation_steps", "do not set it in the config: Lightning's "
                                   "Trainer(accumulate_grad_batches=...) sets it (as for DeepSpeedStrategy)")
    cfg["gradient_accumulation_steps"] = accumulate_grad_batches
    cfg.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)
    if "gradient_clipping" not in cfg:
        cfg["gradient_clipping"] = float(gradient_clip_val or 0.0)
    if precision == "16-mixed" and "fp16" not in cfg:
        cfg["fp16"] = {"enabled": True, **loss_scale_args}
    elif precision == "bf16-mixed" and "bf16" not in cfg:
        cfg["bf16"] = {"enabled": True}
    elif precision in ("32-true", "bf16-true"):
        for section in ("fp16", "bf16"):
            if isinstance(cfg.get(section), dict) and cfg[section].get("enabled") is True:
                raise DeepSpeedConfigError(f"{section}.enabled", f"the config enables {section} but the Trainer's "
                                           f"precision is {precision!r}; pass the matching Trainer(precision=...)")
    return cfg
