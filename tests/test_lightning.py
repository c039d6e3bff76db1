"""zfunc.lightning: Lightning's Trainer on zfunc strategies equals plain Lightning, element-wise.

Each test trains a tiny LightningModule (uneven widths, repeated blocks,
a frozen parameter) for a few steps on CPU. World size 1 runs in the test
process; world size 2 forks two gloo ranks (`zfunc.testing`) whose process
group Lightning finds already initialized, against ``strategy="ddp"``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

L = pytest.importorskip("lightning")
import torch.distributed as dist  # noqa: E402

import zfunc.lightning as zl  # noqa: E402
from zfunc.lightning import ZfuncPrecision, ZfuncStrategy  # noqa: E402
from zfunc.testing import run_distributed  # noqa: E402

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("no_process_group_left")]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Tiny(L.LightningModule):
    """5 -> 7 -> 2 blocks -> 3 classes; ``gain`` is frozen."""

    def __init__(self, optimizer: str = "adamw", scheduler: str | None = None, lr: float = 1e-2) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList([Block(7) for _ in range(2)])
        self.out = nn.Linear(7, 3)
        self.gain = nn.Parameter(torch.full((7,), 1.5), requires_grad=False)
        self.optimizer_kind, self.scheduler_kind, self.lr = optimizer, scheduler, lr

    def forward(self, x):
        x = self.inp(x) * self.gain
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)   # (a collective from inside zfunc's step)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        params = self.parameters()
        kind = self.optimizer_kind
        if kind == "adamw":
            opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.1)
        elif kind == "adamw_groups":   # no decay on biases: zfunc's adamw mask
            named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
            opt = torch.optim.AdamW([{"params": [p for n, p in named if not n.endswith("bias")]},
                                     {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
                                    lr=self.lr, weight_decay=0.1, betas=(0.8, 0.95))
        elif kind == "adam":
            opt = torch.optim.Adam(params, lr=self.lr, weight_decay=0.01, eps=1e-6)
        elif kind == "sgd":
            opt = torch.optim.SGD(params, lr=self.lr * 10, momentum=0.9, nesterov=True, weight_decay=0.01)
        elif kind == "deepspeed_cpu_adam":
            opt = DeepSpeedCPUAdam(params, lr=self.lr, weight_decay=0.1)
        elif kind == "rmsprop":
            opt = torch.optim.RMSprop(params, lr=self.lr)
        elif kind == "amsgrad":
            opt = torch.optim.Adam(params, lr=self.lr, amsgrad=True)
        elif kind == "two_rates":
            opt = torch.optim.SGD([{"params": self.inp.parameters(), "lr": 0.1},
                                   {"params": [p for n, p in self.named_parameters() if not n.startswith("inp")
                                               and p.requires_grad]}], lr=0.01)
        else:
            raise AssertionError(kind)
        scheduler = _scheduler(self.scheduler_kind, opt)
        return opt if scheduler is None else {"optimizer": opt, "lr_scheduler": scheduler}


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """Stands in for deepspeed.ops.adam.DeepSpeedCPUAdam (DeepSpeed is not installed here): its arguments,
    param-group keys and ``adam_w_mode`` attribute."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "bias_correction": bias_correction, "amsgrad": amsgrad})
        self.adam_w_mode = adamw_mode


DeepSpeedCPUAdam.__module__ = "deepspeed.ops.adam.cpu_adam"


def _scheduler(kind: str | None, opt):
    lr = torch.optim.lr_scheduler
    if kind is None:
        return None
    if kind == "warmup_cosine":   # warmup via SequentialLR, then a cosine
        return {"scheduler": lr.SequentialLR(opt, [lr.LinearLR(opt, 0.1, 1.0, total_iters=3),
                                                   lr.CosineAnnealingLR(opt, T_max=10)], milestones=[3]),
                "interval": "step"}
    if kind == "step_epoch":
        return lr.StepLR(opt, step_size=1, gamma=0.5)        # per epoch (Lightning's default interval)
    if kind == "lambda":
        return {"scheduler": lr.LambdaLR(opt, lambda i: 1.0 / (1 + i)), "interval": "step"}
    if kind == "one_cycle":
        return {"scheduler": lr.OneCycleLR(opt, max_lr=0.05, total_steps=40, cycle_momentum=False),
                "interval": "step"}
    if kind == "one_cycle_momentum":
        return {"scheduler": lr.OneCycleLR(opt, max_lr=0.05, total_steps=40), "interval": "step"}
    raise AssertionError(kind)


def loader(batches: int = 8, batch_size: int = 8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * batch_size, 5, generator=g)
    y = torch.randint(0, 3, (batches * batch_size,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def trainer(strategy, devices: int = 1, **kw):
    kw.setdefault("max_epochs", 1)
    kw.setdefault("enable_checkpointing", False)
    # One process: plain Lightning keeps the loader's order; a DDP-family strategy would shuffle it
    # (DistributedSampler), so both runs keep it. Two processes: both shuffle alike.
    kw.setdefault("use_distributed_sampler", devices > 1)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().float() for k, v in module.state_dict().items()}


def fit(strategy, *, module_kw=None, devices: int = 1, batches: int = 8, **kw):
    L.seed_everything(0, verbose=False)
    module = Tiny(**(module_kw or {}))
    t = trainer(strategy, devices=devices, **kw)
    t.fit(module, loader(batches), loader(2))
    return weights(module), t, module


def assert_close(got: dict, want: dict, atol: float = 2e-6) -> None:
    assert got.keys() == want.keys()
    for k, value in want.items():
        torch.testing.assert_close(got[k], value, rtol=1e-5, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


# -- equivalence at one process -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["zfunc_stage_1", "zfunc_stage_2", "zfunc_stage_3", "zfunc_stage_2_offload",
                                  "zfunc_stage_3_offload"])
def test_stages_equal_plain_lightning(name):
    want, _, _ = fit("auto")
    got, t, _ = fit(name)
    assert_close(got, want)
    assert t.global_step == 8
    start = weights(Tiny())
    assert any((got[k] - start[k]).abs().max() > 1e-3 for k in start), "training moved nothing"
    assert "deepspeed" not in name


class Tied(Tiny):
    """A second head sharing ``out``'s weight (one parameter under two names, as a GPT's embedding and head)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(7, 3)
        self.aux.weight = self.out.weight

    def forward(self, x):
        h = self.inp(x) * self.gain
        for block in self.blocks:
            h = block(h)
        return self.out(h) + 0.5 * self.aux(torch.relu(h))


@pytest.mark.parametrize("name", ["zfunc_stage_3", "zfunc_stage_2_offload"])
def test_tied_weights_equal_plain_lightning(name):
    results = []
    for strategy in ("auto", name):
        L.seed_everything(0, verbose=False)
        module = Tied()
        trainer(strategy).fit(module, loader(), loader(2))
        assert module.aux.weight is module.out.weight
        results.append(weights(module))
    assert_close(results[1], results[0])


def test_deepspeed_cpu_adam_is_adamw():
    want, _, _ = fit("auto", module_kw={"optimizer": "adamw"})
    got, t, _ = fit("zfunc_stage_2_offload", module_kw={"optimizer": "deepspeed_cpu_adam"})
    assert "deepspeed's DeepSpeedCPUAdam -> zf.optim.adamw" in t.strategy.report
    assert_close(got, want)


@pytest.mark.parametrize("module_kw", [dict(optimizer="adam"), dict(optimizer="sgd"),
                                       dict(optimizer="adamw_groups", scheduler="warmup_cosine"),
                                       dict(optimizer="adamw", scheduler="lambda"),
                                       dict(optimizer="adamw", scheduler="one_cycle")])
def test_optimizers_and_schedulers_equal_plain_lightning(module_kw):
    want, _, _ = fit("auto", module_kw=module_kw)
    got, _, _ = fit("zfunc_stage_2", module_kw=module_kw)
    assert_close(got, want)


def test_epoch_scheduler_accumulation_and_clipping_equal_plain_lightning():
    """3 micro-batches per update over 8 batches (a last window of 2 each epoch), clipping, StepLR per epoch."""
    kw = dict(module_kw=dict(optimizer="adamw", scheduler="step_epoch"), max_epochs=2, accumulate_grad_batches=3,
              gradient_clip_val=0.05)
    want, ref, _ = fit("auto", **kw)
    got, t, _ = fit(ZfuncStrategy(stage=3, offload_optimizer=True), **kw)
    assert t.global_step == ref.global_step == 6
    assert_close(got, want)


@pytest.mark.parametrize("strategy, stack", [
    (lambda: ZfuncStrategy(stage=3, activation_checkpointing=True), "policy='recompute'), stage=3)"),
    (lambda: ZfuncStrategy(stage=2, cpu_checkpointing=True), "policy='offload_inputs'"),
])
def test_activation_checkpointing_and_validation_inside_a_window(strategy, stack):
    """Validation every 2 batches runs while a window of 3 micro-batches is half fed (its step waiting)."""
    kw = dict(accumulate_grad_batches=3, val_check_interval=2, max_epochs=2)
    want, _, _ = fit("auto", **kw)
    got, t, _ = fit(strategy(), **kw)
    assert stack in t.strategy.report and t.global_step == 6
    assert_close(got, want)


@pytest.mark.parametrize("as_file", [False, True])
def test_deepspeed_config_and_report(as_file, tmp_path):
    cfg = {"zero_optimization": {"stage": 2, "overlap_comm": True}, "train_micro_batch_size_per_gpu": 8}
    if as_file:
        (tmp_path / "ds_config.json").write_text(json.dumps(cfg))
        cfg = str(tmp_path / "ds_config.json")
    want, _, _ = fit("auto")
    got, t, _ = fit(ZfuncStrategy(config=cfg))
    assert_close(got, want)
    report = t.strategy.report
    assert "shard(step, stage=2)" in report and "overlap_comm" in report and "torch.optim.AdamW -> " in report


# -- equivalence at two processes -----------------------------------------------------------------------


def _fit_on_rank(strategy: str, kw: dict):
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), NODE_RANK="0", WORLD_SIZE=str(dist.get_world_size()))
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    got, t, _ = fit(strategy, devices=2, **kw)
    return got, t.global_step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zfunc_stage_1", "zfunc_stage_2", "zfunc_stage_3", "zfunc_stage_3_offload"])
def test_two_processes_equal_ddp(name):
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    want = run_distributed(_fit_on_rank, 2, "ddp", kw, timeout=300)
    got = run_distributed(_fit_on_rank, 2, name, kw, timeout=300)
    for (w, w_steps), (g, g_steps) in zip(want, got):
        assert w_steps == g_steps == 2   # 4 batches per rank, 2 per update
        assert_close(g, w)
    assert_close(got[1][0], got[0][0], atol=0)   # every rank ends with the same weights


def _fit_and_resume_on_rank(directory: str):
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ.update(LOCAL_RANK=str(dist.get_rank()), NODE_RANK="0", WORLD_SIZE=str(dist.get_world_size()))
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    kw = dict(module_kw=dict(scheduler="warmup_cosine"), accumulate_grad_batches=2, devices=2)
    want, _, _ = fit("zfunc_stage_3", max_epochs=2, **kw)
    fit("zfunc_stage_3", max_epochs=1, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)], **kw)
    L.seed_everything(0, verbose=False)
    module = Tiny(**kw.pop("module_kw"))
    t = trainer("zfunc_stage_3", max_epochs=2, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)], **kw)
    t.fit(module, loader(), loader(2), ckpt_path="last")
    return want, weights(module), t.global_step


@pytest.mark.slow
def test_two_processes_resume_exactly(tmp_path):
    for want, got, steps in run_distributed(_fit_and_resume_on_rank, 2, str(tmp_path), timeout=300):
        assert steps == 4
        assert_close(got, want, atol=0)


# -- precision -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision, plugins", [("bf16-mixed", None), ("bf16-true", None), (None, "16-mixed"),
                                                ("32-true", None)])
def test_precisions_train(precision, plugins):
    kw = {"precision": precision} if precision else {"plugins": [ZfuncPrecision(plugins)]}
    got, t, module = fit("zfunc_stage_2", module_kw=dict(lr=3e-2), max_epochs=3, **kw)
    assert t.strategy.precision_plugin.precision == (precision or plugins)
    losses = t.callback_metrics
    assert torch.isfinite(losses["train_loss"]) and torch.isfinite(losses["val_loss"])
    start = weights(Tiny())
    assert any((got[k] - start[k]).abs().max() > 1e-3 for k in start)
    if precision == "bf16-mixed":
        assert "mixed_precision(" in t.strategy.report and module.inp.weight.dtype == torch.float32
    if precision == "bf16-true":
        assert module.inp.weight.dtype == torch.bfloat16


# -- checkpoints, resume, evaluation -----------------------------------------------------------------------


def test_resume_from_last_checkpoint_is_exact(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = dict(module_kw=dict(optimizer="adamw", scheduler="warmup_cosine"), accumulate_grad_batches=2)
    want, _, _ = fit("zfunc_stage_3", max_epochs=2, **kw)
    first, _, _ = fit("zfunc_stage_3", max_epochs=1, enable_checkpointing=True,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], **kw)
    last = tmp_path / "last.ckpt"
    assert last.is_dir() and (last / "latest").is_file()
    files = {p.suffix for p in last.rglob("*") if p.is_file()}
    assert files <= {".safetensors", ".json", ".sha256", ".lock", ""}, files   # nothing pickled
    L.seed_everything(0, verbose=False)
    module = Tiny(**kw.pop("module_kw"))
    t = trainer("zfunc_stage_3", max_epochs=2, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], **kw)
    t.fit(module, loader(), loader(2), ckpt_path="last")
    assert t.global_step == 8
    assert_close(weights(module), want, atol=0)
    assert any((first[k] - want[k]).abs().max() > 1e-4 for k in want)   # the second epoch did train


def test_test_validate_predict_on_trained_weights(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    _, t, module = fit("zfunc_stage_3", enable_checkpointing=True,
                       callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    x, y = loader(2).dataset.tensors
    with torch.no_grad():
        plain_loss = F.cross_entropy(module(x), y)
        plain_out = module(x)
    tested = t.test(module, loader(2), verbose=False)[0]["test_loss"]
    assert tested == pytest.approx(plain_loss.item(), abs=1e-6)
    predicted = torch.cat(t.predict(module, loader(2)))
    torch.testing.assert_close(predicted, plain_out, rtol=1e-5, atol=1e-6)
    # A fresh trainer and an untrained module: the checkpoint's weights are evaluated.
    L.seed_everything(5, verbose=False)
    fresh = Tiny()
    validated = trainer("zfunc_stage_2").validate(fresh, loader(2), ckpt_path=tmp_path / "last.ckpt",
                                                  verbose=False)[0]["val_loss"]
    assert validated == pytest.approx(plain_loss.item(), abs=1e-6)


def test_convert_to_one_fp32_file(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    got, t, module = fit("zfunc_stage_3_offload", enable_checkpointing=True,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    t.save_checkpoint(tmp_path / "after_fit.ckpt")   # after fit too, as with DeepSpeed
    out = tmp_path / "model.pt"
    zl.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "after_fit.ckpt", tmp_path / "after_fit.pt")
    zl.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt" / "last.ckpt", out)
    after_fit = torch.load(tmp_path / "after_fit.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(after_fit[k], got[k]) for k in after_fit)
    loaded = torch.load(out, weights_only=True)
    trainable = {k for k, p in module.named_parameters() if p.requires_grad}
    assert set(loaded["state_dict"]) == trainable and loaded["global_step"] == 8
    for k in trainable:
        assert torch.equal(loaded["state_dict"][k], got[k]), k
    fresh = Tiny()
    fresh.load_state_dict(loaded["state_dict"], strict=False)
    assert_close(weights(fresh), got, atol=0)


class MetaBuilt(Tiny):
    """Built in configure_model on the meta device: zfunc gives it values unit by unit (reset_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.blocks, self.out = None, None, None

    def configure_model(self):
        if self.inp is None:
            with torch.device("meta"):
                self.inp, self.out = nn.Linear(5, 7), nn.Linear(7, 3)
                self.blocks = nn.ModuleList([Block(7) for _ in range(2)])


def test_module_built_on_meta_in_configure_model():
    module = MetaBuilt()
    trainer("zfunc_stage_3").fit(module, loader(), loader(2))
    assert not any(p.is_meta for p in module.parameters())
    x, y = loader(2).dataset.tensors
    with torch.no_grad():
        loss = F.cross_entropy(module(x), y).item()
    assert math.isfinite(loss) and loss < math.log(3) + 0.5
    assert trainer("zfunc_stage_2").test(module, loader(2), verbose=False)[0]["test_loss"] == pytest.approx(loss, abs=1e-5)


# -- refused before training ----------------------------------------------------------------------------


class Manual(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class Skipper(Tiny):
    def training_step(self, batch, batch_idx):
        return None


class BetaEditor(Tiny):
    """Changes Adam's betas by hand after two updates: torch would follow, zfunc's fixed betas cannot."""

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 2:
            self.optimizers().param_groups[0]["betas"] = (0.5, 0.9)


def test_refused_during_training():
    for module, match in ((Skipper(), "skipping a step is not supported"), (BetaEditor(), "changed betas")):
        t = trainer("zfunc_stage_2")
        with pytest.raises(ValueError, match=match):
            t.fit(module, loader(), loader(2))


class Clipper(Tiny):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        pass


@pytest.mark.parametrize("case, match", [
    (dict(module_kw=dict(optimizer="rmsprop")), "RMSprop, which zfunc cannot map"),
    (dict(module_kw=dict(optimizer="amsgrad")), "amsgrad=True"),
    (dict(module_kw=dict(optimizer="two_rates")), "different learning rates"),
    (dict(module_kw=dict(optimizer="adamw", scheduler="one_cycle_momentum")), "cycle_momentum=False"),
    (dict(gradient_clip_val=1.0, gradient_clip_algorithm="value"), "global norm only"),
    (dict(module=Manual), "automatic optimization"),
    (dict(module=Clipper), "configure_gradient_clipping"),
    (dict(strategy=lambda: ZfuncStrategy(stage=3, offload_parameters=True, offload_params_device="nvme",
                                         nvme_path="/tmp")), "offload_param.device"),
    (dict(strategy=lambda: ZfuncStrategy(config={"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})),
     "zero_hpz_partition_size"),
])
def test_refused_before_training(case, match):
    module = case.pop("module", Tiny)(**case.pop("module_kw", {}))
    strategy = case.pop("strategy", lambda: "zfunc_stage_2")()
    before = weights(module)
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
        trainer(strategy, **case).fit(module, loader(), loader(2))
    assert_close(weights(module), before, atol=0)


def test_bad_arguments_refused():
    with pytest.raises(TypeError, match="unknown arguments.*stgae"):
        ZfuncStrategy(stgae=3)
    with pytest.raises(ValueError, match="load_full_weights"):
        ZfuncStrategy(load_full_weights=True)
    with pytest.raises(ValueError, match="16-mixed"):
        ZfuncPrecision("16-true")
    with pytest.raises(ValueError, match="precision"):
        trainer("zfunc_stage_2", precision="64-true")
