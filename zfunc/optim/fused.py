"""Reading and rebuilding Adam/AdamW states for fused in-place kernels.

`adam` and `adamw` are chains of pure transformations; a fused kernel (the
numba one on the host, torch's fused CUDA one on a GPU) does the same
arithmetic in one pass, in place. `FusedAdam` is the bridge: it reads from an
optimizer and its state everything such a kernel needs, and builds the state
that ``tx.update`` would have returned, so the fused path and the pure path
are interchangeable bit for bit in the state's structure.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zfunc.optim.transforms import decay_mask

FUSABLE = ("adam", "adamw")


class FusedAdam(NamedTuple):
    """One fused Adam/AdamW update, as a kernel sees it.

    ``step`` is the 1-based step of this update (bias corrections use it),
    ``lr`` the learning rate of this update (a float32 0-d tensor),
    ``mu``/``nu`` the moment dicts (updated in place by the kernel),
    ``weight_decay`` per parameter key (0 where the mask excludes it).
    """

    mode: str
    lr: torch.Tensor
    step: torch.Tensor
    b1: float
    b2: float
    eps: float
    weight_decay: dict[str, float]
    mu: dict[str, torch.Tensor]
    nu: dict[str, torch.Tensor]
    opt_state: Any
    name: str
    clip: float | None = None  # chain(clip_by_global_norm(clip), adam/adamw)

    @staticmethod
    def supports(tx) -> bool:
        """Whether `of` can view ``tx``: adam/adamw, optionally after clip_by_global_norm."""
        hp = getattr(tx, "hyperparams", None)
        if hp is not None and hp.get("name") == "chain" and len(hp["transforms"]) == 2:
            first, second = hp["transforms"]
            first_hp, second_hp = first.hyperparams or {}, second.hyperparams or {}
            return first_hp.get("name") == "clip_by_global_norm" and second_hp.get("name") in FUSABLE
        return hp is not None and hp.get("name") in FUSABLE

    @classmethod
    def of(cls, tx, opt_state, params: dict) -> "FusedAdam | None":
        """The fused view of ``(tx, opt_state)``, or None if ``tx`` is not adam/adamw,
        optionally after ``clip_by_global_norm`` (``chain(clip_by_global_norm(c), adamw(...))``)."""
        hp = getattr(tx, "hyperparams", None)
        if hp is not None and hp.get("name") == "chain" and len(hp["transforms"]) == 2:
            first, second = hp["transforms"]
            first_hp = first.hyperparams or {}
            if first_hp.get("name") == "clip_by_global_norm":
                inner = cls.of(second, opt_state[1], params)
                if inner is not None and inner.clip is None:
                    return inner._replace(opt_state=opt_state, clip=float(first_hp["max_norm"]))
            return None
        if hp is None or hp.get("name") not in FUSABLE:
            return None
        if hp["name"] == "adam":
            _, adam_state, lr_state = opt_state
        else:
            adam_state, lr_state = opt_state
        decays = decay_mask(hp.get("mask"), params) if hp["name"] == "adamw" else None
        wd = {k: (hp["weight_decay"] if decays is None or decays[k] else 0.0) for k in params}
        return cls(hp["mode"], hp["schedule"](lr_state.count), adam_state.count + 1, hp["b1"], hp["b2"],
                   hp["eps"], wd, adam_state.mu, adam_state.nu, opt_state, hp["name"])

    def grad_divisor(self, grads: dict) -> torch.Tensor | None:
        """What to divide the gradients by for the clip (None without one).

        ``clip_by_global_norm``: ``g ← g · min(1, c / (‖g‖ + 1e-6))`` with the
        norm over all shards (`zfunc.tree.global_norm`), i.e. a division by
        ``max(1, (‖g‖ + 1e-6) / c)``, which the fused kernels take as their
        gradient scale.
        """
        if self.clip is None:
            return None
        from zfunc.tree import global_norm  # noqa: PLC0415

        factor = (self.clip / (global_norm(grads) + 1e-6)).clamp(max=1.0)
        return 1.0 / factor

    def new_state(self):
        """The optimizer state after this update (moments as updated in place)."""
        state = self.opt_state[1] if self.clip is not None else self.opt_state
        if self.name == "adam":
            empty, adam_state, lr_state = state
        else:
            adam_state, lr_state = state
        adam_state = type(adam_state)(self.step, self.mu, self.nu)
        lr_state = type(lr_state)(lr_state.count + 1, self.lr)
        new = (empty, adam_state, lr_state) if self.name == "adam" else (adam_state, lr_state)
        return (self.opt_state[0], new) if self.clip is not None else new
