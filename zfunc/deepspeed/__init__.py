"""From a DeepSpeed config to zfunc in one line.

    setup = zfunc.deepspeed.from_config("ds_config.json", model, training_args=args)
    print(setup.report)                       # every key: mapped to what, or ignored and why
    step = setup.wrap(train_step)             # shard(offload(checkpoint(mixed_precision(accumulate(...)))))
    state = step.init(zf.TrainState.create(params, setup.optimizer))
    for batch in loader:                      # setup.micro_batch_size × setup.micro_batches examples per rank
        state, metrics = step(state, batch)

`from_config` reads the config as DeepSpeed does (JSON, or HJSON with the
``hjson`` package), fills Hugging Face's ``"auto"`` values from training
arguments and the model (`auto`), applies DeepSpeed's batch-size rule, and
maps each section:

===========================================  ==========================================================
DeepSpeed                                    zfunc
===========================================  ==========================================================
``train_batch_size`` / ``..._per_gpu`` /      ``micro_batch_size``, ``accumulate(micro_batches=k)``,
``gradient_accumulation_steps``              ``train_batch_size``
``optimizer`` (Adam, AdamW, Lamb, SGD)       ``setup.optimizer`` (`optimizer`)
``scheduler`` (Warmup*, OneCycle, LRRT)      its schedule, exactly DeepSpeed's rate per update (`scheduler`)
``gradient_clipping``                        ``zf.optim.clip_by_global_norm`` first in the chain
``fp16`` / ``bf16`` / ``communication_``      ``mixed_precision(step, policy, loss-scale knobs)``
``data_type``
``zero_optimization.stage``                  ``shard(stage=...)`` (`zero`)
``offload_optimizer`` / ``offload_param``    ``offload(optimizer=..., params=..., nvme_dir=...,
                                             device_fraction=...)``
``activation_checkpointing``                 ``checkpoint(policy="recompute" | "offload_inputs")``
logging, buckets, prefetch sizes, ...        ignored, with the reason in the report
ZeRO++, MiCS, 1-bit optimizers, pipeline,    refused (`DeepSpeedConfigError` naming the key)
compression, ... (when enabled)
===========================================  ==========================================================

The result's ``transforms`` are data (`TransformCall`: name, keyword
arguments, the DeepSpeed key behind each), so what a config maps to can be
checked without building anything; ``wrap`` builds them.
"""

from zfunc.deepspeed.auto import TrainingArgs
from zfunc.deepspeed.convert import DeepSpeedSetup, from_config
from zfunc.deepspeed.optimizer import deepspeed_lamb
from zfunc.deepspeed.report import DeepSpeedConfigError, Report, ReportEntry
from zfunc.deepspeed.scheduler import deepspeed_timing
from zfunc.deepspeed.source import read_config
from zfunc.deepspeed.stack import TransformCall

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedSetup",
    "Report",
    "ReportEntry",
    "TrainingArgs",
    "TransformCall",
    "deepspeed_lamb",
    "deepspeed_timing",
    "from_config",
    "read_config",
]
