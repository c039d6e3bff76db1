"""`Engine`: the zfunc side of a Hugging Face run — the stack, the state, the training and evaluation steps.

Built once per run from the trainer's arguments (`build_engine`):

1. the DeepSpeed config (``deepspeed=`` / ``zfunc=``, or one made from
   ``zfunc_stage`` / ``zfunc_offload``) goes through
   `zfunc.deepspeed.from_config`, its ``"auto"`` values filled from the
   arguments as transformers fills them (``max_steps``: the number of updates
   the Trainer computed); every key is mapped or refused before training;
2. the stack is the config's transforms without ``accumulate``: the Trainer
   hands micro-batches one at a time (a data collator may pad each to its own
   length), so the step takes the window's list and differentiates each
   micro-batch in turn, summing the gradients, as the Trainer's backward
   passes sum into ``.grad``;
3. the optimizer is the config's (its schedule, or transformers'
   ``lr_scheduler_type`` when the config has no scheduler) or, without an
   optimizer section, transformers' AdamW (`zfunc.hf.optim`).

The loss of a micro-batch is the Trainer's own ``compute_loss`` (so a
subclass's override, ``compute_loss_func`` and label smoothing apply), run on
a stand-in module that calls the model on zfunc's parameters, then
normalized as the Trainer's ``training_step`` normalizes it: divided by the
window's micro-batch count unless the loss was already normalized by
``num_items_in_batch``. Gradients are averaged over ranks by `shard`, as DDP
averages them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import zfunc as zf
from zfunc.deepspeed import DeepSpeedConfigError, DeepSpeedSetup, TransformCall, from_config, read_config
from zfunc.deepspeed.auto import TrainingArgs
from zfunc.deepspeed.stack import ORDER, build_stack
from zfunc.hf.optim import hf_schedule, optimizer_from_args, with_schedule
from zfunc.optim.transforms import global_norm
from zfunc.tree import tree_map


class BoundModel(nn.Module):
    """A module whose forward is ``run(*args, **kwargs)``: what the Trainer's ``compute_loss`` and
    ``prediction_step`` call as "the model" while zfunc holds the parameters. Named like the real
    model (label smoothing picks its shift by the model's class name)."""

    def __init__(self, run, model: nn.Module) -> None:
        super().__init__()
        self._run = run
        object.__setattr__(self, "_wrapped_name", model._get_name())  # not registered: no submodule
        object.__setattr__(self, "config", getattr(model, "config", None))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    def _get_name(self) -> str:
        return self._wrapped_name


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of an accumulation window, with what the Trainer's loss normalization needs."""

    inputs: dict
    num_items_in_batch: Any          # the Trainer's token count over the window (or None)
    window_size: int                 # micro-batches in this window (the last one of an epoch may be short)


class Engine:
    """The transformed training and evaluation steps of one run and the state they share.

    ``state`` is the current `TrainState` (each step consumes it and stores the new one);
    ``setup`` the `DeepSpeedSetup` (``print(engine.setup)`` shows the stack and the report)."""

    def __init__(self, trainer, setup: DeepSpeedSetup, calls: tuple[TransformCall, ...],
                 optimizer: zf.optim.GradientTransformation, optimizer_source: str = "") -> None:
        self.trainer = trainer
        self.optimizer_source = optimizer_source
        self.setup = setup
        self.calls = calls
        model = trainer.model
        self.apply_fn, params = zf.functional(model)
        self.step = build_stack(calls, self.train_step)
        self.forward_step = build_stack(calls, self.eval_step)
        self.state = zf.init(self.step, zf.TrainState.create(params, optimizer))
        del params
        # The state holds the trainable weights now (sharded, cast, offloaded): the module's own copy
        # would be one more full fp32 model per rank. `gather_into_model` gives it values back.
        self.apply_fn.release_module_params()
        self.model_has_weights = False

    def __str__(self) -> str:
        k = self.trainer.args.gradient_accumulation_steps
        window = f" (one update per window of {k} micro-batches)" if k > 1 else ""
        lines = str(self.setup).splitlines()[1:]
        if self.optimizer_source:
            lines = [f"optimizer:  {self.optimizer_source}" if line.startswith("optimizer:") else line
                     for line in lines]
        return "\n".join([f"stack:      {self.step!r}{window}", *lines])

    # -- the steps ---------------------------------------------------------------------------
    def _loss(self, params, micro: MicroBatch):
        trainer = self.trainer
        bound = BoundModel(lambda *a, **kw: self.apply_fn(params, *a, **kw), trainer.model)
        n = micro.num_items_in_batch
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(bound, dict(micro.inputs), num_items_in_batch=n)
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled is None:  # transformers' rule: the loss is already normalized over the window
            scaled = (trainer.model_accepts_loss_kwargs and n is not None) or trainer.compute_loss_func is not None
        return loss if scaled else loss / micro.window_size

    def train_step(self, state, window: list[MicroBatch]):
        loss_and_grad = zf.value_and_grad(self._loss)
        total_loss = grads = None
        for micro in window:  # in order, summed as backward passes sum into .grad
            loss, g = loss_and_grad(state.params, micro)
            grads = g if grads is None else tree_map(torch.add, grads, g)
            total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
        norm = global_norm(grads)  # over every rank's shards: the norm the Trainer logs (before clipping)
        scaler = state.extras.get("mixed_precision")
        if getattr(scaler, "loss_scale", None) is not None:  # fp16: the gradients carry the loss scale
            norm = norm / scaler.loss_scale
        return state.apply_gradients(grads), {"loss": total_loss, "grad_norm": norm}

    def eval_step(self, state, call):
        args, kwargs = call
        return state, {"outputs": self.apply_fn(state.params, *args, **kwargs)}

    def train_window(self, window: list[MicroBatch]) -> dict:
        """One update on the window's micro-batches; returns the step's metrics."""
        self.state, metrics = self.step(self.state, window)
        return metrics

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model on the current weights (no update), through the stack: stage 3 gathers block by
        block as in training. Every rank must call it as often as the others (its collectives)."""
        _, metrics = self.forward_step(self.state, (args, kwargs))
        return metrics["outputs"]

    def learning_rate(self) -> float:
        """The rate of the last update (a host read)."""
        return float(zf.optim.learning_rate(self.state.opt_state))

    # -- weights -----------------------------------------------------------------------------
    def full_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 trainable weights on every rank (a collective)."""
        return zf.gather(self.step, self.state)

    @torch.no_grad()
    def gather_into_model(self) -> None:
        """Write the trained weights into the module's parameters (tied names share one tensor)."""
        full = self.full_params()
        model = self.trainer.model
        for name, key in self.apply_fn.aliases.items():
            p = model.get_parameter(name)
            p.data = full[key].to(p.dtype)
        self.model_has_weights = True


def training_args_for_auto(args, num_training_steps: int) -> TrainingArgs:
    """The values that fill ``"auto"``, as transformers fills them (``max_steps``: the number of updates)."""
    return TrainingArgs.resolve(args, {"max_steps": num_training_steps})


def build_engine(trainer, num_training_steps: int) -> Engine:
    """Read the config, build the stack, optimizer and state; every refusal comes before training."""
    args = trainer.args
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"zfunc.hf runs one process per GPU (torchrun); this process sees {args.n_gpu} GPUs and "
                         "transformers would use DataParallel. Launch with torchrun --nproc-per-node")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    setup = from_config(completed_config(args.zfunc_deepspeed_config()), trainer.model,
                        training_args=training_args_for_auto(args, num_training_steps), world_size=world)
    _check_batch(setup, args)
    calls = tuple(c for c in setup.transforms if c.name != "accumulate")
    if args.zfunc_recompute and getattr(getattr(trainer.model, "config", None), "use_cache", False):
        # A key/value cache cannot be recomputed (its update would replay); transformers turns it off too
        # when it checkpoints activations.
        trainer.model.config.use_cache = False
    if args.zfunc_recompute and not any(c.name == "checkpoint" for c in calls):
        calls = tuple(sorted((*calls, TransformCall("checkpoint", {}, {})), key=lambda c: ORDER.index(c.name)))
    if world > 1 and not any(c.name == "shard" for c in calls):
        # Several ranks without a ZeRO section: DDP's update is stage 1's (one replicated update).
        calls = (*calls, TransformCall("shard", {"stage": 1}, {"stage": "(several ranks, no zero_optimization)"}))
    _place_model(trainer.model, args.device, sharded=any(c.name == "shard" for c in calls))
    decay = trainer.get_decay_parameter_names(trainer.model)
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if setup.optimizer is None:
        schedule = hf_schedule(args, num_training_steps)
        optimizer = optimizer_from_args(args, schedule, decay, setup.gradient_clipping)
        source = (f"zf.optim.adamw from the arguments (optim={getattr(args.optim, 'value', args.optim)!r}), "
                  f"lr_scheduler_type={kind!r}" + (f", clipped to {setup.gradient_clipping:g}"
                                                    if setup.gradient_clipping > 0 else ""))
    elif setup.schedule is None:
        optimizer = with_schedule(setup.optimizer, hf_schedule(args, num_training_steps))
        source = f"the config's, with the arguments' lr_scheduler_type={kind!r}"
    else:
        optimizer, source = setup.optimizer, ""
    return Engine(trainer, setup, calls, optimizer, source)


def completed_config(config) -> dict:
    """The config with what transformers and accelerate add when it leaves it out: the micro-batch size
    and accumulation steps (from the arguments: ``"auto"``), and the precision the arguments ask for when
    the config has neither an ``fp16`` nor a ``bf16`` section."""
    config = read_config(config)
    if "train_micro_batch_size_per_gpu" not in config and "train_batch_size" not in config:
        config["train_micro_batch_size_per_gpu"] = "auto"
    if "gradient_accumulation_steps" not in config and "train_batch_size" not in config:
        config["gradient_accumulation_steps"] = "auto"
    if not any(k in config for k in ("fp16", "bf16", "bfloat16")):
        config["fp16"], config["bf16"] = {"enabled": "auto"}, {"enabled": "auto"}
    return config


def _place_model(model: nn.Module, device: torch.device, sharded: bool) -> None:
    """The module where it computes. Under `shard` the state is placed by shard (on its group's
    device) and only frozen parameters and buffers, which the model reads from itself, move here;
    otherwise the whole module moves (the plain state is the module's tensors)."""
    if not sharded:
        model.to(device)
        return
    with torch.no_grad():
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.device != device:
                    module._buffers[name] = b.to(device)
            for p in module._parameters.values():
                if p is not None and not p.requires_grad and p.device != device:
                    p.data = p.data.to(device)


def _check_batch(setup: DeepSpeedSetup, args) -> None:
    wrong = []
    if setup.micro_batch_size != args.per_device_train_batch_size:
        wrong.append(f"train_micro_batch_size_per_gpu is {setup.micro_batch_size} but per_device_train_batch_size "
                     f"is {args.per_device_train_batch_size}")
    if setup.micro_batches != args.gradient_accumulation_steps:
        wrong.append(f"gradient_accumulation_steps is {setup.micro_batches} in the config but "
                     f"{args.gradient_accumulation_steps} in the arguments")
    if wrong:
        raise DeepSpeedConfigError("", "; ".join(wrong) + ". The Trainer feeds the arguments' batches: make the "
                                   "config agree (or write 'auto')")
