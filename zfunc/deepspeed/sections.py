"""The other parts of a DeepSpeed config: batch sizes, precision, activation checkpointing, clipping,
logging, and the features zfunc does not have."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zfunc.deepspeed.report import DeepSpeedConfigError, Section
from zfunc.deepspeed.stack import TransformCall, show_value

# --------------------------------------------------------------------------
# Batch sizes


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """``train = micro × accumulation × world_size`` (DeepSpeed's rule)."""

    train: int
    micro: int
    accumulation: int


def read_batch(root: Section, world_size: int) -> BatchSizes:
    """DeepSpeed's rule: any two of train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps determine the third (train_batch_size alone: accumulation 1;
    the micro batch alone: accumulation 1); all three given must agree."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train, micro, accumulation = (_positive_int(root, name) for name in names)
    if train is None and micro is None:
        raise DeepSpeedConfigError("", "give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed needs "
                                       "one of them too)")
    if accumulation is None:
        if micro is None:
            accumulation = 1
            micro = _divide(root, train, world_size, "train_batch_size", f"the world size ({world_size})")
        elif train is None:
            accumulation = 1
        else:
            accumulation = _divide(root, train, micro * world_size, "train_batch_size",
                                   f"train_micro_batch_size_per_gpu × world size = {micro} × {world_size}")
    elif micro is None:
        micro = _divide(root, train, accumulation * world_size, "train_batch_size",
                        f"gradient_accumulation_steps × world size = {accumulation} × {world_size}")
    if train is None:
        train = micro * accumulation * world_size
    if train != micro * accumulation * world_size:
        raise DeepSpeedConfigError("train_batch_size", (
            f"{train} != train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size = "
            f"{micro} × {accumulation} × {world_size}; DeepSpeed requires them to agree (give two of them "
            "and it infers the third)"))
    sizes = BatchSizes(train, micro, accumulation)
    root.mapped("train_batch_size", f"train_batch_size = {train} = {micro} per micro-batch × {accumulation} "
                                    f"micro-batches × {world_size} ranks")
    root.mapped("train_micro_batch_size_per_gpu", f"micro_batch_size = {micro}")
    root.mapped("gradient_accumulation_steps", f"accumulate(micro_batches={accumulation})" if accumulation > 1
                else "1: no accumulate")
    return sizes


def _positive_int(root: Section, key: str) -> int | None:
    value = root.value(key, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise root.error(key, f"must be a positive whole number, got {value!r}")
    return int(value)


def _divide(root: Section, total: int, by: int, key: str, what: str) -> int:
    if total % by:
        raise root.error(key, f"{total} is not a multiple of {what}; DeepSpeed requires "
                              "train_batch_size = micro × accumulation × world size exactly")
    return total // by


# --------------------------------------------------------------------------
# Precision

_DTYPE_NAMES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
_DYNAMIC_KEYS = ("initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis", "consecutive_hysteresis")


def _flag(section: Section, key: str, default: bool) -> bool:
    value = section.value(key, default)
    if not isinstance(value, bool):
        raise section.error(key, f"must be true or false, got {value!r}")
    return value


def loss_scaler(fp16: Section, zero_stage: int, fused_adam: bool) -> tuple[dict[str, Any], str]:
    """The keyword arguments of `mixed_precision` that reproduce the fp16 loss scaler DeepSpeed builds,
    and its name.

    DeepSpeed has three: under ZeRO, ``DynamicLossScaler`` (with hysteresis;
    without any dynamic key in the config it starts at 2**32 with hysteresis
    1); at stage 0 with its FusedAdam, ``FP16_Optimizer``; at stage 0 with any
    other optimizer, ``FP16_UnfusedOptimizer`` (minimum scale 0.25 when no
    dynamic key is given). The two stage-0 wrappers have no hysteresis.
    """
    if fp16.value("loss_scale", 0):
        return {"loss_scale": fp16.value("loss_scale")}, "a static loss scale"
    given = any(key in fp16 for key in _DYNAMIC_KEYS)
    if zero_stage > 0:
        if not given:
            return ({"initial_scale_power": 32, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1.0},
                    "ZeRO's DynamicLossScaler with its own defaults (the config sets no loss-scale key)")
        kwargs = {"initial_scale_power": fp16.value("initial_scale_power", 16),
                  "loss_scale_window": fp16.value("loss_scale_window", 1000),
                  "hysteresis": fp16.value("hysteresis", 2), "min_loss_scale": fp16.value("min_loss_scale", 1),
                  "consecutive_hysteresis": fp16.value("consecutive_hysteresis", False)}
        return kwargs, "ZeRO's DynamicLossScaler"
    name = "FP16_Optimizer" if fused_adam else "FP16_UnfusedOptimizer"
    kwargs = {"initial_scale_power": fp16.value("initial_scale_power", 16), "hysteresis": 1,
              "loss_scale_window": fp16.value("loss_scale_window", 1000) if given else 1000,
              "min_loss_scale": fp16.value("min_loss_scale", 1) if given else (1 if fused_adam else 0.25)}
    return kwargs, f"DeepSpeed's stage-0 {name}"


def read_precision(root: Section, zero_stage: int, fused_adam: bool) -> TransformCall | None:
    """``fp16`` / ``bf16`` / ``communication_data_type`` (and ``amp``, ``data_types``) -> the
    ``mixed_precision`` call, or None for fp32. ``fused_adam``: whether DeepSpeed would
    build its FusedAdam (which picks its stage-0 fp16 wrapper, see `loss_scaler`)."""
    fp16 = root.section("fp16")
    if "bf16" in root and "bfloat16" in root:
        raise root.error("bfloat16", "is the old name of the bf16 section, which the config also has; keep bf16")
    bf16_key = "bfloat16" if "bfloat16" in root else "bf16"
    bf16 = root.section(bf16_key)
    fp16_on, bf16_on = _flag(fp16, "enabled", False), _flag(bf16, "enabled", False)
    if fp16_on and bf16_on:
        raise DeepSpeedConfigError("fp16.enabled", "fp16 and bf16 are both enabled; DeepSpeed refuses that too")
    amp = root.section("amp")
    if _flag(amp, "enabled", False):
        raise amp.error("enabled", "apex AMP: zfunc's mixed precision is the fp16 / bf16 sections; use one of "
                                   "them instead")
    amp.rest_ignored("apex AMP is disabled")
    compute = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    comm = root.value("communication_data_type", None)
    if comm is not None and comm not in _DTYPE_NAMES:
        raise root.error("communication_data_type", f"must be 'fp32', 'fp16' or 'bf16', got {comm!r}")
    reduce = comm or compute
    _grad_accum_dtype(root.section("data_types"), compute)

    policy = compute if reduce == compute else _policy(compute, reduce)
    kwargs: dict[str, Any] = {"policy": policy}
    sources = {"policy": "fp16.enabled" if fp16_on else f"{bf16_key}.enabled" if bf16_on
               else "communication_data_type"}
    if comm is not None and (fp16_on or bf16_on):
        sources["policy"] += " and communication_data_type"
    scaler = ""
    if fp16_on:
        scaling, scaler = loss_scaler(fp16, zero_stage, fused_adam)
        for key, value in scaling.items():
            kwargs[key] = value
            sources[key] = fp16.key_path(key) if key in fp16 else f"fp16.enabled ({scaler})"
    call = TransformCall("mixed_precision", kwargs, sources) if compute != "fp32" or reduce != "fp32" else None

    what = f"mixed_precision(policy={show_value(policy)})" if call is not None else "no mixed_precision: fp32"
    fp16.mapped("enabled", what + (f" with {scaler}" if scaler else "") if fp16_on
                else "false: " + ("see bf16" if bf16_on else "fp32 compute"))
    bf16.mapped("enabled", what if bf16_on else "false: " + ("see fp16" if fp16_on else "fp32 compute"))
    root.mapped("communication_data_type", f"gradients reduced in {reduce}: {what}")
    if fp16_on:
        _report_loss_scale(fp16, kwargs, zero_stage)
        fp16.mapped("auto_cast", "zfunc casts floating inputs to fp16 either way (with false DeepSpeed leaves "
                                 "that to you; inputs you cast already are unchanged)")
        if _flag(fp16, "fp16_master_weights_and_grads", False):
            raise fp16.error("fp16_master_weights_and_grads", "fp16 master weights: zfunc keeps an fp32 master; "
                                                              "set false")
        fp16.mapped("fp16_master_weights_and_grads", "false: fp32 master weights")
    else:
        fp16.rest_ignored("fp16 is disabled")
    bf16.ignored("immediate_grad_update", "when DeepSpeed's bf16 optimizer adds up gradients; the same sum")
    if not bf16_on:
        bf16.rest_ignored("bf16 is disabled")
    return call


def _report_loss_scale(fp16: Section, kwargs: dict[str, Any], zero_stage: int) -> None:
    for key in ("loss_scale", *_DYNAMIC_KEYS):
        if "loss_scale" in kwargs:
            if key == "loss_scale":
                fp16.mapped(key, f"mixed_precision(loss_scale={kwargs[key]!r}): static")
            else:
                fp16.ignored(key, "no effect with a static loss_scale (in DeepSpeed too)")
        elif key == "loss_scale":
            fp16.mapped(key, "0: dynamic loss scaling")
        elif key in ("hysteresis", "consecutive_hysteresis") and zero_stage == 0:
            fp16.ignored(key, "DeepSpeed's stage-0 fp16 optimizers have no hysteresis (only its ZeRO loss "
                              "scaler has): mixed_precision(hysteresis=1)")
        else:
            fp16.mapped(key, f"mixed_precision({key}={kwargs.get(key)!r})")


def _policy(compute: str, reduce: str):
    from zfunc.transforms.mixed_precision_policy import Policy  # noqa: PLC0415

    return Policy("fp32", compute, "fp32", reduce)


def _grad_accum_dtype(data_types: Section, compute: str) -> None:
    dtype = data_types.value("grad_accum_dtype", None)
    if dtype is None or dtype == compute:
        data_types.mapped("grad_accum_dtype", f"{compute}: accumulate adds micro-batch gradients in the compute "
                                              "dtype")
        return
    raise data_types.error("grad_accum_dtype", f"{dtype!r}: zfunc adds micro-batch gradients in the compute "
                                               f"dtype ({compute}); remove the key or set it to {compute!r}")


# --------------------------------------------------------------------------
# Activation checkpointing and clipping


def read_activation_checkpointing(root: Section, modules: Any) -> TransformCall | None:
    """The section's presence -> ``checkpoint(step, modules, policy)``: DeepSpeed's section configures
    ``deepspeed.checkpointing.checkpoint``, which a model calls around its layers; zfunc's `checkpoint`
    recomputes the blocks itself (``modules``: the model's repeated blocks by default)."""
    if "activation_checkpointing" not in root:
        return None
    section = root.section("activation_checkpointing")
    offload = _flag(section, "cpu_checkpointing", False)
    kwargs: dict[str, Any] = {"policy": "offload_inputs" if offload else "recompute"}
    sources = {"policy": section.key_path("cpu_checkpointing") if "cpu_checkpointing" in section
               else "activation_checkpointing"}
    if modules is not None:
        kwargs["modules"], sources["modules"] = modules, "checkpoint_modules= of from_config"
    call = TransformCall("checkpoint", kwargs, sources)
    if not section.keys():
        root.mapped("activation_checkpointing", str(call))
    section.mapped("cpu_checkpointing", f"{call}" + (": block inputs kept on the host" if offload else ""))
    section.ignored("partition_activations", "splits saved activations over model-parallel ranks; zfunc runs no "
                                             "model parallelism (where DeepSpeed's split does nothing either)")
    section.ignored("contiguous_memory_optimization", "copies saved activations into one buffer (fragmentation)")
    section.ignored("number_checkpoints", "sizes the buffer of contiguous_memory_optimization")
    section.ignored("synchronize_checkpoint_boundary", "a device synchronize at each checkpoint, for timing")
    section.ignored("profile", "logs the time of each checkpointed function")
    return call


def read_clipping(root: Section) -> float:
    clip = root.value("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
        raise root.error("gradient_clipping", f"must be a number >= 0 (0: no clipping), got {clip!r}")
    root.mapped("gradient_clipping", f"zf.optim.clip_by_global_norm({clip:g}) first in the optimizer chain"
                if clip > 0 else "0: no clipping")
    return float(clip)


# --------------------------------------------------------------------------
# Everything else at the top level

_LOGGING = {
    "steps_per_print": "DeepSpeed's progress printing; log zfunc's metrics yourself",
    "wall_clock_breakdown": "DeepSpeed's timers (logging)",
    "dump_state": "prints DeepSpeed's engine state (logging)",
    "memory_breakdown": "DeepSpeed's memory logging",
    "tensorboard": "logging (monitor): log zfunc's metrics with your own writer",
    "wandb": "logging (monitor): log zfunc's metrics with your own writer",
    "csv_monitor": "logging (monitor): log zfunc's metrics with your own writer",
    "comet": "logging (monitor): log zfunc's metrics with your own writer",
    "comms_logger": "logging of DeepSpeed's collectives",
    "flops_profiler": "DeepSpeed's FLOPs profiler (logging)",
    "timers": "DeepSpeed's throughput timers (logging)",
}
_NO_EFFECT = {
    "prescale_gradients": "where the 1/N of the gradient average is applied (before or after the sum); zfunc "
                          "averages with the backend's AVG reduction: the same mean up to rounding",
    "gradient_predivide_factor": "splits the 1/N of the gradient average around the sum; the same mean up to "
                                 "rounding",
    "disable_allgather": "how DeepSpeed's stage 1 gathers parameters; the same parameters",
    "zero_allow_untested_optimizer": "zfunc's shard runs any zf.optim optimizer",
    "zero_force_ds_cpu_optimizer": "which host optimizer DeepSpeed builds; zfunc's offload runs its own",
    "aio": "tunes DeepSpeed's NVMe I/O (libaio); no effect on the result",
    "compile": "DeepSpeed's torch.compile integration; compile zfunc's step yourself if you want",
    "graph_harvesting": "CUDA-graph capture inside DeepSpeed; no effect on the result",
    "checkpoint": "options of DeepSpeed's checkpoint files; zfunc saves with zf.io.save (sharded, atomic, "
                  "loadable at any world size)",
    "nebula": "DeepSpeed's Nebula checkpoint service; zfunc saves with zf.io.save",
    "autotuning": "read only by `deepspeed --autotuning`, not by training",
    "dataloader_drop_last": "applies to DeepSpeed's own data loader (engine.deepspeed_io); zfunc takes your "
                            "batches as they are",
    "seq_parallel_communication_data_type": "used by DeepSpeed-Ulysses sequence parallelism only",
}
# Sections of features zfunc does not have: fine when disabled, refused when enabled.
_FEATURES = {
    "elasticity": "elastic batch sizes chosen from the number of GPUs",
    "progressive_layer_drop": "progressive layer dropping",
    "curriculum_learning": "curriculum learning (legacy)",
    "data_efficiency": "DeepSpeed's data sampling and routing library",
    "eigenvalue": "eigenvalue computation for quantization schedules",
    "quantize_training": "quantization-aware training (MoQ)",
    "hybrid_engine": "the RLHF hybrid engine",
    "sparse_attention": "block-sparse attention kernels",
    "compression_training": "DeepSpeed compression (quantization, pruning, layer reduction)",
    "weight_quantization": "weight quantization",
    "pipeline": "pipeline parallelism",
    "tensor_parallel": "tensor (model) parallelism",
}


def read_other(root: Section) -> None:
    """Report (or refuse) the remaining known top-level keys."""
    for key, why in _LOGGING.items():
        root.ignored(key, why)
    for key, why in _NO_EFFECT.items():
        root.ignored(key, why)
    if _flag(root, "sparse_gradients", False):
        raise root.error("sparse_gradients", "sparse embedding gradients: zfunc's gradients are dense; set false")
    root.mapped("sparse_gradients", "false: dense gradients")
    for key, feature in _FEATURES.items():
        if key not in root:
            continue
        value = root.raw(key)
        enabled = value.get("enabled", True) if isinstance(value, dict) else bool(value)
        if key == "tensor_parallel" and isinstance(value, dict):
            enabled = value.get("autotp_size", 1) not in (0, 1)
        if enabled:
            raise root.error(key, f"{feature}: zfunc does not have it. Remove the section (or set "
                                  f"\"enabled\": false)")
        root.ignored(key, f"{feature}: disabled")
