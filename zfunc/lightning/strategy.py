"""`ZfuncStrategy`: Lightning's ``Trainer(strategy=...)`` training through a zfunc step.

The strategy owns the whole step. The LightningModule is functionalized once
(`zf.functional`); a zfunc step (``shard(offload(checkpoint(mixed_precision(
accumulate(train_step)))))``, as the DeepSpeed-style arguments or config ask)
differentiates the loss the user's ``training_step`` returns, with the step's
parameters swapped into the module for the call: the module's ``forward`` is
redirected to ``training_step`` for that one call, as Lightning itself
redirects it through DDP and DeepSpeed wrappers, so ``self(x)``, ``self.log``
and everything else inside ``training_step`` run as usual. The precision
plugin's ``backward`` does nothing and ``optimizer_step`` runs the closure,
whose last micro-batch completes the zfunc update (`zfunc.lightning.window`).

Validation, test and predict steps run the same way (the forward only, under
the same transforms: stage 3 gathers block by block), on the current state
during ``fit`` and on a state built from the module (or restored from
``ckpt_path``) otherwise. After ``fit`` the trained weights are written back
into the module's parameters (``gather_on_fit_end=False`` skips that for a
model too big to hold whole on each rank; the weights are then in the
checkpoints, see `convert_zero_checkpoint_to_fp32_state_dict`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import zfunc as zf
from zfunc import io as zio
from zfunc import optim
from zfunc.deepspeed import DeepSpeedSetup, from_config
from zfunc.deepspeed.stack import build_stack
from zfunc.lightning.checkpoint import checkpoint_of, client_state_of
from zfunc.lightning.config import DEFAULTS, STRATEGY_ONLY, deepspeed_config, fill_from_trainer
from zfunc.lightning.optimizers import LiveRate, map_optimizer, refuse_momentum_cycling
from zfunc.lightning.precision import ZfuncPrecision, precision_name
from zfunc.lightning.window import Window
from zfunc.transforms import accumulate

_MISSING = object()


class ZfuncStrategy(DDPStrategy):
    """Train a LightningModule with zfunc's ZeRO stages, offload and mixed precision.

    Takes `DeepSpeedStrategy`'s arguments (``stage``, ``offload_optimizer``,
    ``offload_parameters``, ``offload_params_device``, ``offload_optimizer_device``,
    ``nvme_path``, ``cpu_checkpointing``, the fp16 loss-scale knobs, bucket
    and buffer sizes, ``config=`` a DeepSpeed config dict or JSON path, ...)
    with their meaning; ``report`` (printed at setup) says what each became
    (`zfunc.deepspeed.from_config`'s report plus the strategy-only arguments).
    Arguments zfunc cannot honour are refused with the reason.

    zfunc's own arguments:
      activation_checkpointing: recompute the model's repeated blocks in
        backward (`zfunc.transforms.checkpoint`); ``cpu_checkpointing=True``
        keeps the block inputs on the host instead.
      gather_on_fit_end: write the trained weights back into the module's
        parameters when ``fit`` ends (default True).
    """

    strategy_name = "zfunc"

    def __init__(self, accelerator: Any = None, *, config: Any = None, parallel_devices: Any = None,
                 cluster_environment: Any = None, precision_plugin: Any = None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 remote_device: str | None = None, load_full_weights: bool = False,
                 exclude_frozen_parameters: bool = False, logging_level: int = logging.WARNING,
                 activation_checkpointing: bool = False, gather_on_fit_end: bool = True,
                 **deepspeed_args: Any) -> None:
        unknown = sorted(set(deepspeed_args) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"ZfuncStrategy got unknown arguments {unknown}; it takes DeepSpeedStrategy's "
                            f"arguments ({', '.join(sorted(DEFAULTS))}, config, ...) and zfunc's own "
                            "(activation_checkpointing, gather_on_fit_end)")
        if load_full_weights:
            raise ValueError("ZfuncStrategy(load_full_weights=True) is not supported: zfunc checkpoints are "
                             "directories that every world size and stage restores; to start from a single weights "
                             "file, load it into the module (model.load_state_dict(...)) before trainer.fit")
        if remote_device not in (None, "cpu", "nvme"):
            raise ValueError(f"remote_device must be None, 'cpu' or 'nvme', got {remote_device!r}")
        if not isinstance(activation_checkpointing, bool) or not isinstance(gather_on_fit_end, bool):
            raise TypeError("activation_checkpointing and gather_on_fit_end must be True or False")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.config = deepspeed_config(config, deepspeed_args)
        self._loss_scale_args = {k: deepspeed_args.get(k, DEFAULTS[k]) for k in
                                 ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                  "min_loss_scale")}
        self._strategy_args = {"remote_device": remote_device, "logging_level": logging_level,
                               "exclude_frozen_parameters": exclude_frozen_parameters,
                               "process_group_backend": process_group_backend, "timeout": timeout}
        self.activation_checkpointing = activation_checkpointing
        self.gather_on_fit_end = gather_on_fit_end
        self.setup_result: DeepSpeedSetup | None = None
        self.report = ""
        self._reset_run()

    def _reset_run(self) -> None:
        self._apply_fn: Any = None
        self._calls: tuple = ()
        self._steps: dict[int, Callable] = {}
        self._eval_step: Callable | None = None
        self._state: Any = None
        self._rate: LiveRate | None = None
        self._window: Window | None = None
        self._loss_factor = 1.0

    # -- precision -----------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> ZfuncPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZfuncPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # Lightning picks a plugin by the precision name (autocast, a GradScaler); under zfunc the step owns
        # precision, so keep only the name.
        self._precision_plugin = None if plugin is None else ZfuncPrecision(precision_name(plugin))

    # -- processes -----------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        if self.num_nodes * self.num_processes <= 1 and not torch_dist.is_initialized():
            reset_seed()   # one process: no process group to create (zfunc's shard runs a world of 1 without one)
            self.set_world_ranks()
            return
        super().setup_distributed()

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model   # no DDP wrapper: shard reduces the gradients

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True   # the checkpoint is restored into the state setup builds

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise ValueError("ZfuncStrategy needs automatic optimization: zfunc's step computes the gradients and "
                             "applies the update, so manual_backward/optimizer.step() in training_step cannot run "
                             "under it. Set self.automatic_optimization = True (return the loss from training_step)")
        self._reset_run()
        self._apply_fn, params = zf.functional(module)
        if fitting:
            tx = self._setup_training(trainer, module, params)
        else:   # evaluation only: the same layout, a stand-in optimizer (restore fills what both hold)
            self.setup_result = self._from_config(trainer, micro_batch_size=1)
            tx = optim.sgd(0.0)
        self._calls = tuple(call for call in self.setup_result.transforms if call.name != "accumulate")
        self._eval_step = build_stack(self._calls, self._eval_fn)
        self._state = zf.init(self._step(1), zf.TrainState.create(params, tx))
        self.barrier()

    def _setup_training(self, trainer: Any, module: LightningModule, params: dict) -> optim.GradientTransformation:
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE and trainer.gradient_clip_val:
            raise ValueError("ZfuncStrategy clips by the global norm only (zf.optim.clip_by_global_norm): use "
                             "Trainer(gradient_clip_algorithm='norm') or leave it out")
        if is_overridden("configure_gradient_clipping", module, LightningModule):
            raise ValueError(f"{type(module).__name__} overrides configure_gradient_clipping, which clips the "
                             "gradients torch holds in .grad; under ZfuncStrategy zfunc holds them. Use "
                             "Trainer(gradient_clip_val=...) (the global norm) instead")
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        self.optimizers, self.lr_scheduler_configs = optimizers, schedulers
        self.setup_result = self._from_config(trainer, micro_batch_size=_micro_batch_size(trainer))
        torch_optimizers = [o for o in optimizers if not isinstance(o, _MockOptimizer)]
        if len(torch_optimizers) > 1:
            raise ValueError(f"configure_optimizers returned {len(torch_optimizers)} optimizers; ZfuncStrategy "
                             "trains with one (as DeepSpeedStrategy)")
        if self.setup_result.optimizer is not None:
            tx, line = self.setup_result.optimizer, "the config's optimizer section (configure_optimizers' ignored)"
        elif not torch_optimizers:
            raise ValueError("configure_optimizers returned no optimizer and the DeepSpeed config has no optimizer "
                             "section: return torch.optim.Adam, AdamW or SGD from configure_optimizers")
        else:
            names = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
            tx, self._rate, line = map_optimizer(torch_optimizers[0], names, set(params))
            refuse_momentum_cycling([config.scheduler for config in schedulers])
            clip = self.setup_result.gradient_clipping
            if clip > 0:
                tx = optim.chain(optim.clip_by_global_norm(clip), tx)
                line += f", after zf.optim.clip_by_global_norm({clip})"
        self.report = self._report(line)
        rank_zero_info(self.report)
        return tx

    def _from_config(self, trainer: Any, micro_batch_size: int) -> DeepSpeedSetup:
        cfg = fill_from_trainer(self.config, accumulate_grad_batches=trainer.accumulate_grad_batches,
                                gradient_clip_val=trainer.gradient_clip_val, micro_batch_size=micro_batch_size,
                                precision=self.precision_plugin.precision, loss_scale_args=self._loss_scale_args)
        if self.activation_checkpointing and "activation_checkpointing" not in cfg:
            # (The section's presence turns zfunc's checkpoint transform on: recompute the repeated blocks.)
            cfg["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False}
        return from_config(cfg, self.lightning_module, world_size=max(self.world_size, 1))

    def _report(self, optimizer_line: str) -> str:
        lines = [f"ZfuncStrategy: precision {self.precision_plugin.precision!r}, optimizer: {optimizer_line}",
                 str(self.setup_result)]
        lines += [f"  {name:<56} {value!r:<14} {STRATEGY_ONLY[name]}" for name, value in self._strategy_args.items()
                  if value is not None]
        return "\n".join(lines)

    def _step(self, micro_batches: int) -> Callable:
        """The zfunc step of a window of ``micro_batches`` micro-batches (built once per size)."""
        if micro_batches not in self._steps:
            inner = accumulate(self._train_step, micro_batches) if micro_batches > 1 else self._train_step
            self._steps[micro_batches] = build_stack(self._calls, inner)
        return self._steps[micro_batches]

    # -- the step --------------------------------------------------------------------------------------
    def _run_module(self, params: dict, method: str, args: tuple, kwargs: dict) -> Any:
        """``module.<method>(*args, **kwargs)`` with ``params`` swapped in: the module's ``forward`` is
        redirected to ``method`` for this one call of ``apply_fn`` (and restored as it starts, so that
        ``self(x)`` inside it runs the real forward)."""
        module = self.lightning_module
        own = module.__dict__.get("forward", _MISSING)

        def restore() -> None:
            if own is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own

        def redirected(*a: Any, **kw: Any) -> Any:
            restore()
            return getattr(module, method)(*a, **kw)

        module.forward = redirected
        try:
            return self._apply_fn(params, *args, **kwargs)
        finally:
            restore()

    def _loss_fn(self, params: dict, window_ids: torch.Tensor) -> torch.Tensor:
        args, kwargs = self._window.next_micro_batch()
        out = self._run_module(params, "training_step", args, kwargs)
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"training_step returned {type(out).__name__}; under ZfuncStrategy it must return the "
                             "loss (a tensor, or a dict with 'loss'): skipping a step is not supported (as with "
                             "DeepSpeedStrategy)")
        self._window.output(out)
        # Lightning divides each micro-batch's loss by accumulate_grad_batches; `accumulate` averages over
        # the window, which differs only in a shorter last window of an epoch.
        return loss * self._loss_factor if self._loss_factor != 1.0 else loss

    def _train_step(self, state: Any, window_ids: torch.Tensor) -> tuple[Any, dict]:
        loss, grads = zf.value_and_grad(self._loss_fn)(state.params, window_ids)
        state = state.apply_gradients(grads)
        self._window.updated()
        return state, {"loss": loss}

    def _eval_fn(self, state: Any, call: tuple) -> tuple[Any, Any]:
        method, args, kwargs = call
        return state, {"output": self._run_module(state.params, method, args, kwargs)}

    # -- Lightning's hooks -------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._window is None:
            self._window = self._open_window()
            self._window.start()
        return self._window.feed((args, kwargs))

    def _open_window(self) -> Window:
        """The window of micro-batches Lightning will feed before its next optimizer step (Lightning's rule:
        every accumulate_grad_batches batches of an epoch, and at the epoch's last batch)."""
        trainer = self.lightning_module.trainer
        k = trainer.accumulate_grad_batches
        batch = trainer.fit_loop.epoch_loop.batch_idx
        left = trainer.num_training_batches - batch
        m = int(min(k - batch % k, left)) if left != float("inf") else k - batch % k
        self._loss_factor = m / k
        step, state = self._step(m), self._state
        ids = torch.arange(m, device=self.root_device)
        return Window(lambda window: step(state, ids), m, self.root_device)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._rate is not None:
            self._rate.read()   # the scheduler's rate for this update; refuses changed hyperparameters
        result = closure()     # its training_step feeds the window's last micro-batch: the update runs
        window, self._window = self._window, None
        if window is None:
            raise RuntimeError("ZfuncStrategy: optimizer_step without a training_step before it")
        if not window.complete:
            window.cancel()
            raise RuntimeError(
                f"Lightning stepped after {window.fed} of the {window.micro_batches} micro-batches zfunc expected in "
                "this accumulation window (a data loader without a length whose epoch ended early?): give the train "
                "loader a length, or use accumulate_grad_batches=1")
        self._state, _ = window.result()
        # The update happened: what torch's schedulers check before they step (else they warn that the
        # scheduler stepped before the optimizer).
        optimizer._opt_called = True
        self.precision_plugin._after_closure(model or self.lightning_module, optimizer)
        return result

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("predict_step", args, kwargs)

    def _evaluate(self, method: str, args: tuple, kwargs: dict) -> Any:
        # Not in inference mode (Lightning's default for validate/test/predict): zfunc's transforms check the
        # version counters of the tensors they hand the model, which inference tensors do not have.
        with torch.inference_mode(False), torch.no_grad():
            _, metrics = self._eval_step(self._state, (method, args, kwargs))
        return metrics["output"]

    def on_train_end(self) -> None:
        if self.gather_on_fit_end and self._state is not None:
            self.write_weights_into_module()

    def write_weights_into_module(self) -> None:
        """Copy the trained weights (full, on every rank) into the LightningModule's own parameters (new
        parameters where the module was built on the meta device, tied weights tied again)."""
        full = zf.gather(self._step(1), self._state)
        module = self.lightning_module
        made: dict[str, nn.Parameter] = {}
        with torch.no_grad():
            for name, key in self._apply_fn.aliases.items():
                param = module.get_parameter(name)
                if not param.is_meta:
                    param.copy_(full[key])
                    continue
                if key not in made:
                    made[key] = nn.Parameter(full[key].to(self.root_device), requires_grad=param.requires_grad)
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, made[key])

    def model_to_device(self) -> None:
        if any(t.is_meta for t in self.lightning_module.parameters()):
            return   # built on the meta device (configure_model): step.init gives it values unit by unit
        super().model_to_device()

    def on_exception(self, exception: BaseException) -> None:
        self._close_window()
        super().on_exception(exception)

    def _close_window(self) -> None:
        if self._window is not None:
            self._window.cancel()
            self._window = None

    def teardown(self) -> None:
        # The state is kept (until the next setup) so that trainer.save_checkpoint works after fit, as with
        # DeepSpeed's engine.
        self._close_window()
        super().teardown()

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        """Write ``filepath`` as a `zfunc.io` checkpoint directory (every rank calls it)."""
        if storage_options is not None:
            raise TypeError("ZfuncStrategy saves zfunc checkpoints directly; storage_options is not supported")
        filepath = self.broadcast(os.fspath(filepath))
        zio.save(filepath, self._state, client_state=client_state_of(checkpoint), keep=1)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the state from a checkpoint directory this strategy saved; returns Lightning's entries."""
        path = self.broadcast(os.fspath(checkpoint_path))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        self._state, client = zio.restore(path, like=self._state, strict=fitting)
        return checkpoint_of(client, path)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: `load_checkpoint` restored the weights into the state."""

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = os.fspath(filepath)
            if os.path.isdir(path) and os.path.lexists(os.path.join(path, "latest")):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                super().remove_checkpoint(filepath)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, kwargs in REGISTERED:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)


def _micro_batch_size(trainer: Any) -> int:
    """The train loader's batch size (for the report, as DeepSpeedStrategy's "auto"), else 1."""
    source = trainer.fit_loop._data_source
    try:
        loader = source.dataloader() if source.is_defined() else None
    except Exception:  # noqa: BLE001 (only for the report: the loop raises on a broken loader itself)
        loader = None
    size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else 1


_NVME_PATH = os.environ.get("ZFUNC_NVME_PATH", "/local_nvme")

# DeepSpeed's strategy names with zfunc_ for deepspeed_ (Lightning treats any name containing "deepspeed" as
# DeepSpeed's). zfunc keeps stage-3 parameters in host memory, not on NVMe: _3_offload_nvme puts the optimizer
# state on NVMe and the parameters on the host.
REGISTERED: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("zfunc", "zfunc ZeRO stage 2", {}),
    ("zfunc_stage_1", "zfunc ZeRO stage 1", {"stage": 1}),
    ("zfunc_stage_2", "zfunc ZeRO stage 2", {"stage": 2}),
    ("zfunc_stage_2_offload", "zfunc ZeRO stage 2, optimizer on the host", {"stage": 2, "offload_optimizer": True}),
    ("zfunc_stage_3", "zfunc ZeRO stage 3", {"stage": 3}),
    ("zfunc_stage_3_offload", "zfunc ZeRO stage 3, optimizer and parameters on the host",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    ("zfunc_stage_3_offload_nvme", "zfunc ZeRO stage 3, optimizer on NVMe ($ZFUNC_NVME_PATH), parameters on the host",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True, "offload_optimizer_device": "nvme",
      "nvme_path": _NVME_PATH}),
)
