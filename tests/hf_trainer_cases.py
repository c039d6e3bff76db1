"""What the zfunc.hf tests run in each forked rank: a tiny GPT-2 trained by zfunc.hf.Trainer or by
transformers' own Trainer (DDP on gloo at 2 ranks), on the same generated data.

Each run starts from the same weights (seeded construction), sees the same batches (the Trainer's
sampler, seeded) and returns its final weights and log, so the tests compare element-wise.
"""

from __future__ import annotations

import os
from typing import Any

import torch

VOCAB, SEQ = 40, 8


def reset_accelerate() -> None:
    """A forked rank inherits the parent's accelerate singletons (a 1-process state): start afresh."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def tiny_gpt2(seed: int = 0, tie: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=12, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     tie_word_embeddings=tie)
    return GPT2LMHeadModel(cfg)


def dataset(n: int = 32, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, 3, (), generator=g))] = -100  # uneven token counts per example
        out.append({"input_ids": ids, "labels": labels})
    return out


def common_args(out_dir: str, **overrides: Any) -> dict:
    args = {"output_dir": out_dir, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
            "max_steps": 4, "learning_rate": 3e-3, "weight_decay": 0.1, "warmup_steps": 1,
            "lr_scheduler_type": "linear", "max_grad_norm": 0.5, "logging_steps": 1, "report_to": [],
            "use_cpu": True, "save_strategy": "no", "disable_tqdm": True, "seed": 0, "data_seed": 0,
            "dataloader_num_workers": 0}
    args.update(overrides)
    return args


class CountingCallback:
    """Counts the Trainer's callback events (built lazily: transformers is imported in the ranks)."""

    @staticmethod
    def make():
        from transformers import TrainerCallback

        class Counting(TrainerCallback):
            def __init__(self):
                self.counts: dict[str, int] = {}

            def _count(self, name):
                self.counts[name] = self.counts.get(name, 0) + 1

            def on_step_end(self, args, state, control, **kw):
                self._count("step_end")

            def on_pre_optimizer_step(self, args, state, control, **kw):
                self._count("pre_optimizer_step")

            def on_optimizer_step(self, args, state, control, **kw):
                self._count("optimizer_step")

            def on_log(self, args, state, control, logs=None, **kw):
                self._count("log")

        return Counting()


def train(kind: str, out_dir: str, *, n_data: int = 32, evaluate: bool = False, predict: bool = False,
          resume: Any = None, save_to: str | None = None, model_seed: int = 0, **overrides: Any) -> dict:
    """Train with ``kind`` "zfunc" (zfunc.hf) or "plain" (transformers); returns the final weights (fp32, by
    state_dict name), the log history and, if asked, evaluation metrics and prediction logits."""
    reset_accelerate()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = tiny_gpt2(model_seed)
    data = dataset(n_data)
    if kind == "zfunc":
        from zfunc.hf import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    args = TrainingArguments(**common_args(out_dir, **overrides))
    counting = CountingCallback.make()
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8], callbacks=[counting])
    trainer.train(resume_from_checkpoint=resume)
    result: dict[str, Any] = {
        "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "log": [dict(entry) for entry in trainer.state.log_history],
        "global_step": trainer.state.global_step,
        "callbacks": dict(counting.counts),
    }
    if evaluate:
        result["eval"] = trainer.evaluate()
    if predict:
        pred = trainer.predict(data[8:12])
        result["predictions"] = torch.as_tensor(pred.predictions[0] if isinstance(pred.predictions, tuple)
                                                else pred.predictions)
        result["pred_metrics"] = pred.metrics
    if save_to is not None:
        trainer.save_model(save_to)
    if kind == "zfunc":
        result["setup"] = str(trainer.engine)
    return result
