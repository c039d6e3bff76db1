"""`Trainer`: transformers' Trainer with zfunc running every update, through the Trainer's own hooks.

The loop stays transformers' (data, epochs, callbacks, logging, evaluation
and checkpoint schedule, rotation, ``load_best_model_at_end``); only hooks
are overridden, with keyword arguments and ``**kwargs`` passed through so a
release that adds a parameter does not break them:

======================================  ========================================================================
hook                                    here
======================================  ========================================================================
``create_optimizer``                    a `WindowOptimizer`: its ``step()`` runs zfunc's step on the window
``create_scheduler``                    builds the zfunc `Engine` (config, stack, optimizer, state; every refusal
                                        before training) and returns a `StateSchedule` (the real rate, logged)
``training_step``                       collects the micro-batch (one zfunc update per accumulation window)
``_maybe_log_save_evaluate``            adds the window's loss to the Trainer's running loss, logs zfunc's
                                        gradient norm (the Trainer's own clipping sees no ``.grad``: a no-op)
``create_accelerator_and_postprocess``  accelerate prepares the model without DDP (zfunc's `shard` reduces)
``_move_model_to_device``               nothing: zfunc places the state (`zfunc.hf.engine`)
``prediction_step``                     the Trainer's, on a stand-in model running the current weights through
                                        the stack (stage 3 gathers block by block, as in training)
``save_model``                          `zfunc.io.export_hf`: safetensors, tied weights once, one tensor at a time
``_save_optimizer_and_scheduler``       `zfunc.io.save` into ``checkpoint-N/zfunc`` (sharded, no pickle)
``_load_optimizer_and_scheduler``       `zfunc.io.restore` from it: weights, optimizer, schedule count (exact)
``_load_from_checkpoint``               nothing: the weights come with zfunc's state
``_load_best_model``                    restores the best checkpoint's zfunc state
``train``                               then writes the trained weights into ``trainer.model``
                                        (``zfunc_gather_model=False``: not)
======================================  ========================================================================
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import transformers

import zfunc as zf
from zfunc.hf.arguments import TrainingArguments
from zfunc.hf.engine import BoundModel, Engine, MicroBatch, build_engine
from zfunc.hf.optim import StateSchedule, WindowOptimizer

logger = logging.getLogger(__name__)

ZFUNC_DIR = "zfunc"  # inside checkpoint-N: zfunc's sharded training state
TRAINING_ARGS_NAME = "training_args.bin"


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` whose updates are zfunc's (see the module docstring for each hook).

    Takes the same arguments; ``args`` must be `zfunc.hf.TrainingArguments`. ``optimizers=`` and
    ``optimizer_cls_and_kwargs=`` are refused: zfunc owns the optimizer (choose it with ``optim=`` or
    the DeepSpeed config's ``optimizer`` section). ``trainer.engine`` is the zfunc side once
    training started (``print(trainer.engine.setup)``: the stack and what each config key became).
    """

    def __init__(self, model=None, args=None, *positional: Any, **kwargs: Any) -> None:
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"zfunc.hf.Trainer takes zfunc.hf.TrainingArguments (a subclass of transformers'), got "
                            f"{type(args).__module__}.{type(args).__name__}; build it with "
                            "`from zfunc.hf import TrainingArguments`")
        optimizers = kwargs.get("optimizers", (None, None))
        if positional or any(x is not None for x in optimizers) or kwargs.get("optimizer_cls_and_kwargs"):
            if positional:
                raise TypeError("zfunc.hf.Trainer: pass the arguments after args= by keyword")
            raise ValueError("zfunc.hf.Trainer: optimizers= / optimizer_cls_and_kwargs= give a torch optimizer, but "
                             "zfunc runs the update itself. Choose the optimizer with TrainingArguments(optim=..., "
                             "learning_rate=..., lr_scheduler_type=...) or the DeepSpeed config's optimizer and "
                             "scheduler sections")
        self.engine: Engine | None = None
        self._window: list[MicroBatch] = []
        self._pending_loss: torch.Tensor | None = None  # the windows' losses not yet added to the Trainer's
        self._grad_norm: torch.Tensor | None = None
        super().__init__(model, args, **kwargs)

    # -- placement and wrapping ----------------------------------------------------------------
    def create_accelerator_and_postprocess(self, *args: Any, **kwargs: Any) -> None:
        super().create_accelerator_and_postprocess(*args, **kwargs)
        prepare_model = self.accelerator.prepare_model

        def prepare_without_ddp(model, device_placement=None, evaluation_mode=False, **kw):
            # Evaluation mode: accelerate neither wraps it in DDP nor moves it; zfunc reduces gradients.
            return prepare_model(model, device_placement=False, evaluation_mode=True, **kw)

        self.accelerator.prepare_model = prepare_without_ddp

    def _move_model_to_device(self, model, device, *args: Any, **kwargs: Any) -> None:
        return None  # zfunc places the state when it builds it (`zfunc.hf.engine._place_model`)

    def _wrap_model(self, model, training: bool = True, *args: Any, **kwargs: Any):
        return model  # no DataParallel / DDP: one process per device, zfunc's shard reduces

    # -- optimizer and schedule --------------------------------------------------------------------
    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = WindowOptimizer(self._run_window, self.args.learning_rate)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None, *args: Any, **kwargs: Any):
        if self.engine is None:
            self.engine = build_engine(self, num_training_steps)
            logger.info("zfunc: %s", self.engine)
        if self.lr_scheduler is None:
            self.lr_scheduler = StateSchedule(self.engine.learning_rate, self.optimizer)
        return self.lr_scheduler

    # -- the update ------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Collect one micro-batch; the update runs when the Trainer steps the optimizer (once per window).
        Returns 0: the window's loss reaches the Trainer's running loss at the next log/save/eval hook."""
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        window_size = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        self._window.append(MicroBatch(inputs, num_items_in_batch, window_size))
        return torch.zeros((), device=self.args.device)

    def _run_window(self) -> None:
        window, self._window = self._window, []
        if not window:
            raise RuntimeError("zfunc.hf: the optimizer was stepped with no micro-batch collected")
        metrics = self.engine.train_window(window)
        loss = metrics["loss"].to(self.args.device)
        self._pending_loss = loss if self._pending_loss is None else self._pending_loss + loss
        self._grad_norm = metrics["grad_norm"]

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args: Any, **kwargs: Any):
        if self._pending_loss is not None:
            tr_loss += self._pending_loss  # in place: the Trainer's accumulator (reset by it when it logs)
            self._pending_loss = None
        if self.engine is not None and self._grad_norm is not None:
            grad_norm = self._grad_norm
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # -- evaluation and prediction -------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, *args: Any, **kwargs: Any):
        if self.engine is not None:
            model = BoundModel(self.engine.forward, self.model)
        else:  # before training: the module itself, where the Trainer would have put it
            self.model.to(self.args.device)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, *args, **kwargs)

    # -- after training --------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any):
        out = super().train(*args, **kwargs)
        if self.engine is not None and self.args.zfunc_gather_model:
            self.engine.gather_into_model()
        return out

    # -- saving and loading ----------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False, *args: Any, **kwargs: Any):
        """Hugging Face's format (``from_pretrained`` loads it): config, safetensors weights (tied weights
        once), the tokenizer and the training arguments. Call it on every rank (the weights are gathered
        one tensor at a time; rank 0 writes)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call, *args, **kwargs)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        zf.io.export_hf(output_dir, self.engine.state, model=self.model, overwrite=True, progress=False)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))

    def _save_optimizer_and_scheduler(self, output_dir: str, *args: Any, **kwargs: Any) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir, *args, **kwargs)
        # Every rank writes its shards (no pickle); the schedule is the optimizer state's update count.
        zf.io.save(os.path.join(output_dir, ZFUNC_DIR), self.engine.state)

    def _load_optimizer_and_scheduler(self, checkpoint, *args: Any, **kwargs: Any) -> None:
        if checkpoint is None:
            return
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)
        self._restore(checkpoint)

    def _restore(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, ZFUNC_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{checkpoint} has no {ZFUNC_DIR}/ (zfunc's training state): it was not saved by zfunc.hf.Trainer, "
                "or with save_only_model=True. To start from its weights, load them into the model "
                "(from_pretrained) and train without resume_from_checkpoint")
        # RNG states are transformers' (rng_state*.pth, restored by the loop at the right moment).
        self.engine.state, _ = zf.io.restore(path, like=self.engine.state, rng=False)
        self.engine.model_has_weights = False

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None, *args: Any, **kwargs: Any) -> None:
        if self.engine is not None:
            return self._restore(resume_from_checkpoint)
        # Before training starts the state does not exist yet: `_load_optimizer_and_scheduler` restores
        # it (weights included) once `create_scheduler` has built it.
        return None

    def _load_best_model(self, *args: Any, **kwargs: Any) -> None:
        if self.engine is None:
            return super()._load_best_model(*args, **kwargs)
        logger.info("zfunc: loading the best model from %s (score %s)", self.state.best_model_checkpoint,
                    self.state.best_metric)
        self._restore(self.state.best_model_checkpoint)
