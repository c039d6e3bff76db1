"""Hugging Face's ``Trainer``, trained by zfunc: one import away.

    from zfunc.hf import Trainer, TrainingArguments        # instead of transformers'
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=8,
                             learning_rate=3e-5, bf16=True, deepspeed="ds_config.json")   # dict, JSON or HJSON
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val, data_collator=collate)
    trainer.train(); trainer.evaluate(); trainer.predict(test); trainer.save_model("final")

The ``deepspeed=`` config is read by `zfunc.deepspeed.from_config` (its
``"auto"`` values filled from the arguments as transformers fills them) and
never reaches transformers' DeepSpeed integration. See docs/huggingface.md.
Needs ``transformers`` and ``accelerate`` (``pip install zfunc[hf]``).
"""

from zfunc.hf.arguments import TrainingArguments
from zfunc.hf.engine import Engine
from zfunc.hf.trainer import Trainer

__all__ = ["Engine", "Trainer", "TrainingArguments"]
