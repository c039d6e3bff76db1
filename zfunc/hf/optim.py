"""The optimizer and schedule of a Hugging Face run, as zfunc's; and the stand-ins the Trainer loop holds.

zfunc owns both: the update runs inside zfunc's step (``zf.optim``, fused,
sharded, offloaded), and the rate of update ``c`` is the rate transformers'
scheduler would give it. transformers' schedulers (``lr_scheduler_type`` with
warmup and ``lr_scheduler_kwargs``) are ``LambdaLR``s: update ``c`` runs at
``lr · λ(c)``; `hf_schedule` tabulates exactly that (`TableSchedule`). A
DeepSpeed config's ``scheduler`` section keeps its own schedule
(`zfunc.deepspeed.from_config`).

The Trainer loop still calls ``optimizer.step()`` once per accumulation
window and asks ``lr_scheduler.get_last_lr()`` for logging:
`WindowOptimizer` (a ``torch.optim.Optimizer`` over one empty tensor) runs
zfunc's step when stepped, and `StateSchedule` reads the rate of the last
update from zfunc's optimizer state (so an fp16 overflow skip, which does not
advance zfunc's count, is logged right).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import torch

from zfunc import optim
from zfunc.deepspeed import DeepSpeedConfigError
from zfunc.optim.base import GradientTransformation

# transformers' names of torch's AdamW (and the fused/foreach kernels of it): all compute torch.optim.AdamW.
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_hf",
               "adamw_apex_fused")


class TableSchedule:
    """``count -> rates[min(count, len - 1)]``: a precomputed schedule as zfunc's ``Schedule`` (float32 0-d).

    Kept per device once moved there, so a step reads it without a host transfer."""

    def __init__(self, rates: list[float]) -> None:
        if not rates:
            raise ValueError("TableSchedule needs at least one rate")
        self.rates = torch.tensor(rates, dtype=torch.float64).to(torch.float32)
        self._on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        table = self._on.get(count.device)
        if table is None:
            table = self._on[count.device] = self.rates.to(count.device)
        return table[count.clamp(0, len(self.rates) - 1)]

    def rate(self, count: int) -> float:
        return float(self.rates[min(max(count, 0), len(self.rates) - 1)])


def hf_schedule(args, num_training_steps: int) -> TableSchedule:
    """The rate of each update under ``args.lr_scheduler_type`` (with ``get_warmup_steps`` and
    ``lr_scheduler_kwargs``), exactly as transformers' ``get_scheduler`` gives it: ``lr · λ(c)`` for
    updates ``c = 0 .. num_training_steps``."""
    from transformers import get_scheduler

    kind = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if kind in ("reduce_lr_on_plateau", "greedy"):
        raise ValueError(f"lr_scheduler_type={kind!r} changes the rate from evaluation metrics, which zfunc's "
                         "step cannot see; pick a schedule of the step count (linear, cosine, constant_with_warmup, "
                         "...) or give the DeepSpeed config a scheduler section")
    probe = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([probe], lr=args.learning_rate)
    sched = get_scheduler(kind, optimizer=opt, num_warmup_steps=args.get_warmup_steps(num_training_steps),
                          num_training_steps=num_training_steps,
                          scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    lambdas = getattr(sched, "lr_lambdas", None)
    if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR) or not lambdas:
        raise ValueError(f"lr_scheduler_type={kind!r} built a {type(sched).__name__}, not a LambdaLR: zfunc cannot "
                         "tabulate it; pick another schedule or give the DeepSpeed config a scheduler section")
    base = sched.base_lrs[0]
    return TableSchedule([base * lambdas[0](c) for c in range(num_training_steps + 1)])


def optimizer_from_args(args, schedule: Callable, decay_names: Collection[str], clip: float) -> GradientTransformation:
    """transformers' default optimizer for ``args.optim`` as zfunc's: AdamW with ``adam_beta1/2``,
    ``adam_epsilon`` and ``weight_decay`` on the parameters transformers decays (not biases or norms),
    clipped to ``clip`` first. Other ``optim`` values are refused, naming them."""
    name = str(getattr(args.optim, "value", args.optim))
    if name not in ADAMW_NAMES:
        raise DeepSpeedConfigError("", f"TrainingArguments(optim={name!r}): zfunc maps torch's AdamW "
                                       f"({', '.join(ADAMW_NAMES[:2])}, ...) only. Use optim='adamw_torch', or give "
                                       "the DeepSpeed config an optimizer section (Adam, AdamW, Lamb, SGD)")
    if getattr(args, "optim_args", None):
        raise DeepSpeedConfigError("", f"TrainingArguments(optim_args={args.optim_args!r}): zfunc's AdamW takes no "
                                       "extra arguments; remove optim_args")
    decay = frozenset(decay_names)
    tx = optim.adamw(schedule, b1=args.adam_beta1, b2=args.adam_beta2, eps=args.adam_epsilon,
                     weight_decay=args.weight_decay, mask=lambda n: n in decay)
    return optim.chain(optim.clip_by_global_norm(clip), tx) if clip > 0 else tx


def with_schedule(tx: GradientTransformation, schedule: Callable) -> GradientTransformation:
    """``tx`` (a config's optimizer: AdamW or Adam, maybe after clipping) with its rate replaced by
    ``schedule``: a DeepSpeed config with an optimizer but no scheduler section runs transformers'
    ``lr_scheduler_type``, as transformers' DeepSpeed integration does."""
    hp = tx.hyperparams
    if hp["name"] == "chain":
        parts = hp["transforms"]
        clip = [p for p in parts if p.hyperparams["name"] == "clip_by_global_norm"]
        rest = [p for p in parts if p.hyperparams["name"] != "clip_by_global_norm"]
        if len(rest) == 1 and len(clip) == 1:
            return optim.chain(optim.clip_by_global_norm(clip[0].hyperparams["max_norm"]),
                               with_schedule(rest[0], schedule))
    elif hp["name"] in ("adamw", "adam"):
        make = optim.adamw if hp["name"] == "adamw" else optim.adam
        extra = {"mask": hp["mask"]} if hp["name"] == "adamw" else {}
        return make(schedule, b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=hp["weight_decay"], **extra)
    raise DeepSpeedConfigError("optimizer", f"{hp['name']}: with no scheduler section zfunc runs transformers' "
                                            "lr_scheduler_type, and cannot put that schedule into this optimizer; "
                                            "add a scheduler section to the config")


class WindowOptimizer(torch.optim.Optimizer):
    """What the Trainer holds as ``trainer.optimizer``: ``step()`` runs zfunc's update on the
    accumulation window the trainer collected (``run``); it has no parameters of its own (one empty
    tensor, since torch's Optimizer needs a group). ``param_groups[0]["lr"]`` is the rate of the last
    update."""

    def __init__(self, run: Callable[[], None], lr: float) -> None:
        super().__init__([torch.zeros(0)], {"lr": lr})
        self._run = run

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("zfunc.hf's optimizer takes no closure: the update runs inside zfunc's step")
        self._run()

    def zero_grad(self, set_to_none: bool = True) -> None:  # zfunc's gradients live inside its step
        return None


class StateSchedule:
    """What the Trainer holds as ``trainer.lr_scheduler``: ``get_last_lr()`` is the rate of the last
    update, read from zfunc's optimizer state (``rate()``); ``step()`` does nothing (zfunc's schedule
    follows its own update count, which checkpoints restore)."""

    def __init__(self, rate: Callable[[], float], optimizer: torch.optim.Optimizer) -> None:
        self._rate = rate
        self.optimizer = optimizer

    def get_last_lr(self) -> list[float]:
        lr = self._rate()
        if not math.isfinite(lr):
            raise FloatingPointError(f"zfunc's learning rate is {lr}")
        self.optimizer.param_groups[0]["lr"] = lr
        return [lr]

    def step(self, *args, **kwargs) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None
