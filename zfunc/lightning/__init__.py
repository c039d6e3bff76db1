"""Lightning's ``Trainer(strategy=...)`` on zfunc: one import registers the strategies.

    import lightning as L
    import zfunc.lightning                                  # registers zfunc_stage_1 ... zfunc_stage_3_offload_nvme
    trainer = L.Trainer(strategy="zfunc_stage_3_offload", precision="bf16-mixed",
                        accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer.fit(model); trainer.test(model); trainer.predict(model, loader)
    trainer.fit(model, ckpt_path="last")                    # exact resume from a ModelCheckpoint
    zfunc.lightning.convert_zero_checkpoint_to_fp32_state_dict("ckpts/last.ckpt", "model.pt")

`ZfuncStrategy` takes DeepSpeedStrategy's arguments (or ``config=`` a
DeepSpeed config); `ZfuncPrecision` is the precision plugin it runs with.
Files: `strategy` (the strategy), `window` (an accumulation window as one
zfunc step), `optimizers` (torch optimizers and schedulers -> zf.optim),
`precision`, `config` (arguments -> DeepSpeed config), `checkpoint`
(Lightning's checkpoint dict in a zfunc checkpoint; the fp32 converter).
See docs/lightning.md.
"""

from lightning.pytorch.strategies import StrategyRegistry

from zfunc.lightning.checkpoint import convert_zero_checkpoint_to_fp32_state_dict
from zfunc.lightning.optimizers import OptimizerMappingError
from zfunc.lightning.precision import ZfuncPrecision
from zfunc.lightning.strategy import REGISTERED, ZfuncStrategy

ZfuncStrategy.register_strategies(StrategyRegistry)

__all__ = ["REGISTERED", "OptimizerMappingError", "ZfuncPrecision", "ZfuncStrategy",
           "convert_zero_checkpoint_to_fp32_state_dict"]
