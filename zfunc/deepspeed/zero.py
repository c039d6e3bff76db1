"""DeepSpeed's ``zero_optimization`` section -> `shard` and `offload` calls.

``stage`` 1-3 is ``shard(stage=...)``. Stage 0 on more than one rank is
DeepSpeed's plain data parallelism (gradients all-reduced, every rank
updating everything); zfunc's data parallelism is `shard`, and stage 1
computes the same update, so stage 0 maps to ``shard(stage=1)`` there (and to
no shard on one rank).

Offload maps to ``offload(step, optimizer="host"|"nvme", params="device"|
"host"|"nvme", nvme_dir=..., device_fraction=...)``: ``offload_optimizer``
gives ``optimizer`` (and, under stage 3, ``device_fraction = 1 - ratio``:
DeepSpeed's ``ratio`` is the share of the optimizer step done on the CPU),
``offload_param`` gives ``params`` (stage 3 only, as in DeepSpeed; alone it
means ``device_fraction = 1``: the optimizer stays on the device).

Everything else in the section tunes buckets, prefetching and overlap:
zfunc chooses those itself (one collective per block, the next block's
all-gather issued while the current one runs), so they are reported as
ignored. ZeRO++ (hpZ, quantized weights and gradients, LoCo) and MiCS change
what is communicated and are refused unless off.
"""

from __future__ import annotations

from typing import Any

from zfunc.deepspeed.report import DeepSpeedConfigError, Section
from zfunc.deepspeed.stack import TransformCall

_BUCKETS = "zfunc reduces and gathers one block (unit) per collective; it has no buckets to size"
_PERFORMANCE = {
    "contiguous_gradients": "zfunc's gradients already land in flat per-block buffers",
    "overlap_comm": "zfunc's shard always overlaps gradient reduction with backward",
    "reduce_scatter": "reduce-scatter vs all-reduce: the same averaged gradients; zfunc reduce-scatters",
    "allgather_partitions": "all-gather vs broadcasts of the updated parameters: the same parameters",
    "reduce_bucket_size": _BUCKETS,
    "allgather_bucket_size": _BUCKETS,
    "use_multi_rank_bucket_allreduce": _BUCKETS,
    "round_robin_gradients": "how ranks split gradient copies to the CPU; the same update",
    "grad_hooks": "when stage 1 reduces gradients; the same update",
    "sub_group_size": "tile size of DeepSpeed's stage-3 optimizer step; zfunc updates a block at a time",
    "stage3_max_live_parameters": "zfunc keeps at most the running and the prefetched block gathered",
    "stage3_max_reuse_distance": "zfunc keeps at most the running and the prefetched block gathered",
    "stage3_prefetch_bucket_size": "zfunc prefetches exactly the next block",
    "stage3_param_persistence_threshold": "zfunc partitions every parameter (small ones go with their block)",
    "stage3_model_persistence_threshold": "zfunc partitions every parameter (small ones go with their block)",
    "stage3_module_granularity_threshold": "zfunc gathers whole blocks (units), not single modules",
    "stage3_use_all_reduce_for_fetch_params": "how DeepSpeed gathers parameters; the same parameters",
    "memory_efficient_linear": "a memory optimization of DeepSpeed's stage-3 Linear; no effect on results",
    "override_module_apply": "how DeepSpeed's stage 3 hooks nn.Module.apply; zfunc needs no hooks",
    "ignore_unused_parameters": "zfunc never requires every parameter to receive a gradient",
    "legacy_stage1": "an older DeepSpeed implementation of the same stage 1",
    "log_trace_cache_warnings": "logging of DeepSpeed's stage-3 trace cache",
    "cpu_offload_use_pin_memory": "zfunc pins host buffers itself when a GPU is present",
}
_CHECKPOINT_KEYS = {
    "stage3_gather_16bit_weights_on_model_save": "zfunc saves sharded checkpoints (zf.io.save); write full "
                                                 "weights with `zfunc consolidate`",
    "stage3_gather_fp16_weights_on_model_save": "zfunc saves sharded checkpoints (zf.io.save); write full "
                                                "weights with `zfunc consolidate`",
    "elastic_checkpoint": "zfunc checkpoints load at any world size (zf.io)",
    "load_from_fp32_weights": "zfunc checkpoints always hold the fp32 master weights",
}
# key -> (the value that means "off", what the feature is)
_REFUSED_UNLESS_OFF = {
    "zero_hpz_partition_size": (1, "ZeRO++ hierarchical partitioning (hpZ): a secondary partition of the "
                                   "parameters within a node. zfunc partitions over the whole group; set it to 1"),
    "zero_quantized_weights": (False, "ZeRO++ quantized weight all-gathers; zfunc gathers exact weights. Set false"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized frozen weights; set false"),
    "zero_quantized_gradients": (False, "ZeRO++ quantized gradient reduction; zfunc reduces exact gradients "
                                        "(in communication_data_type). Set false"),
    "zeropp_loco_param": (None, "LoCo-ZeRO++ error feedback for quantized gradients; remove it"),
    "mics_shard_size": (-1, "MiCS: partitioning within subgroups of mics_shard_size ranks. zfunc partitions "
                            "over the whole group (pass shard(group=...) yourself for a subgroup); set it to -1"),
    "mics_hierarchical_params_gather": (False, "MiCS hierarchical all-gather; set false"),
    "pipeline_loading_checkpoint": (False, "loading checkpoints of DeepSpeed's pipeline parallelism; set false"),
}


def read_zero(root: Section, world_size: int) -> tuple[int, list[TransformCall]]:
    """Read and report ``zero_optimization``; returns ``(stage, [offload call?, shard call?])``."""
    if "zero_optimization" in root and isinstance(root.raw("zero_optimization"), bool):
        return _legacy(root, world_size)
    zero = root.section("zero_optimization")
    stage = zero.value("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise zero.error("stage", f"must be 0, 1, 2 or 3, got {stage!r}")
    calls: list[TransformCall] = []
    offload = _offload(zero, stage)
    if offload is not None:
        calls.append(offload)
    shard = _shard(stage, world_size, zero.key_path("stage") if "stage" in zero else "zero_optimization (absent)")
    zero.mapped("stage", str(shard) if shard is not None else "no shard: one rank, stage 0")
    if shard is not None:
        calls.append(shard)
    for key, why in _PERFORMANCE.items():
        zero.ignored(key, why)
    for key, why in _CHECKPOINT_KEYS.items():
        zero.ignored(key, why)
    for key, (off, what) in _REFUSED_UNLESS_OFF.items():
        if key in zero:
            value = zero.raw(key)
            if value != off:
                raise zero.error(key, f"{value!r}: {what}")
            zero.mapped(key, f"{value!r}: off")
    return stage, calls


def _shard(stage: int, world_size: int, source: str) -> TransformCall | None:
    if stage == 0 and world_size == 1:
        return None
    return TransformCall("shard", {"stage": max(stage, 1)}, {"stage": source})


def _legacy(root: Section, world_size: int) -> tuple[int, list[TransformCall]]:
    """``"zero_optimization": true|false``: DeepSpeed's old spelling of stage 1 | 0."""
    stage = 1 if root.raw("zero_optimization") else 0
    shard = _shard(stage, world_size, "zero_optimization")
    root.mapped("zero_optimization", f"{root.raw('zero_optimization')} (old spelling of stage {stage}): "
                                     + (str(shard) if shard else "no shard"))
    root.ignored("allgather_size", "the old spelling's all-gather bucket size; " + _BUCKETS)
    return stage, [shard] if shard else []


def _device(section: Section, default: str = "none") -> str:
    device = section.value("device", default)
    if device not in ("none", "cpu", "nvme"):
        raise section.error("device", f"must be 'cpu', 'nvme' or 'none', got {device!r}")
    return device


def _offload(zero: Section, stage: int) -> TransformCall | None:
    opt, par = zero.section("offload_optimizer"), zero.section("offload_param")
    for legacy, current in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if legacy in zero and current in zero:
            raise zero.error(legacy, f"is the old spelling of {current}, which the config also has; keep {current}")
    opt_device = _device(opt) if "offload_optimizer" in zero else ("cpu" if zero.raw("cpu_offload") else "none")
    par_device = _device(par) if "offload_param" in zero else ("cpu" if zero.raw("cpu_offload_param") else "none")
    if opt_device == "none" and par_device == "none":
        for section in (opt, par):
            section.rest_ignored("no offload: device is 'none'")
        zero.mapped("cpu_offload", "false: no offload")
        zero.mapped("cpu_offload_param", "false: no offload")
        return None
    if stage == 0:
        raise zero.error("offload_optimizer" if opt_device != "none" else "offload_param",
                         "offload needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads only under ZeRO and ignores "
                         "it at stage 0); set zero_optimization.stage or remove the offload section")
    if par_device != "none" and stage != 3:
        raise zero.error("offload_param", f"parameter offload needs stage 3 (DeepSpeed ignores it at stage "
                                          f"{stage}); set stage 3 or remove offload_param")
    if opt_device == "nvme" and stage != 3:
        raise opt.error("device", "NVMe optimizer offload needs stage 3 (as in DeepSpeed); use 'cpu' or stage 3")

    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    placement = {"cpu": "host", "nvme": "nvme"}
    if opt_device != "none":
        kwargs["optimizer"], sources["optimizer"] = placement[opt_device], _source(zero, opt, "cpu_offload")
        fraction = 1.0 - _ratio(opt, stage)
        if fraction:
            kwargs["device_fraction"], sources["device_fraction"] = fraction, opt.key_path("ratio")
    else:  # parameters only: the optimizer stays on the device
        kwargs["optimizer"], sources["optimizer"] = "host", _source(zero, par, "cpu_offload_param")
        kwargs["device_fraction"], sources["device_fraction"] = 1.0, sources["optimizer"]
    if par_device != "none":
        kwargs["params"], sources["params"] = placement[par_device], _source(zero, par, "cpu_offload_param")
    nvme_dirs = {section.key_path("nvme_path"): section.value("nvme_path", None)
                 for section, device in ((opt, opt_device), (par, par_device)) if device == "nvme"}
    if nvme_dirs:
        missing = [key for key, path in nvme_dirs.items() if not path]
        if missing:
            raise DeepSpeedConfigError(missing[0], "device 'nvme' needs the directory to write to: set nvme_path")
        if len(set(nvme_dirs.values())) > 1:
            raise DeepSpeedConfigError(next(iter(nvme_dirs)), f"optimizer and parameter NVMe paths differ "
                                                              f"({sorted(set(nvme_dirs.values()))}); zfunc's "
                                                              "offload takes one nvme_dir: use one path")
        kwargs["nvme_dir"] = str(next(iter(nvme_dirs.values())))
        sources["nvme_dir"] = " and ".join(nvme_dirs)
    call = TransformCall("offload", kwargs, sources)
    _report_offload(zero, opt, par, call, opt_device, par_device)
    return call


def _ratio(opt: Section, stage: int) -> float:
    ratio = opt.value("ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise opt.error("ratio", f"must be a number in [0, 1] (the share of the optimizer step on the CPU), "
                                 f"got {ratio!r}")
    if ratio < 1 and stage != 3:
        raise opt.error("ratio", f"{ratio}: partial offload needs stage 3 (as in DeepSpeed)")
    return float(ratio)


def _source(zero: Section, section: Section, legacy: str) -> str:
    return section.key_path("device") if "device" in section else zero.key_path(legacy)


def _report_offload(zero: Section, opt: Section, par: Section, call: TransformCall, opt_device: str,
                    par_device: str) -> None:
    def arg(keyword: str) -> str:
        return f"offload({keyword}={call.kwargs[keyword]!r})" if keyword in call.kwargs else ""

    opt.mapped("device", arg("optimizer") if opt_device != "none" else
               f"'none': the optimizer stays on the device, {arg('device_fraction')}")
    par.mapped("device", arg("params") if par_device != "none" else "'none': parameters stay on the device")
    zero.mapped("cpu_offload", f"{arg('optimizer')} (old spelling of offload_optimizer)")
    zero.mapped("cpu_offload_param", f"{arg('params')} (old spelling of offload_param)")
    opt.mapped("ratio", f"{arg('device_fraction') or 'offload(device_fraction=0.0)'}: 1 - ratio on the device")
    for section, device in ((opt, opt_device), (par, par_device)):
        if device == "nvme":
            section.mapped("nvme_path", arg("nvme_dir"))
        else:
            section.ignored("nvme_path", "used only with device 'nvme'")
        section.ignored("pin_memory", "zfunc pins host buffers itself when a GPU is present")
        for key in ("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline_read", "pipeline_write",
                    "pipeline"):
            section.ignored(key, "tunes DeepSpeed's NVMe/CPU swapping buffers; no effect on the result")
