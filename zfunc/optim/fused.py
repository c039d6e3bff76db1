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

    @classmethod
    def of(cls, tx, opt_state, params: dict) -> "FusedAdam | None":
        """The fused view of ``(tx, opt_state)``, or None if ``tx`` is not plain adam/adamw."""
        hp = getattr(tx, "hyperparams", None)
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

    def new_state(self):
        """The optimizer state after this update (moments as updated in place)."""
        if self.name == "adam":
            empty, adam_state, lr_state = self.opt_state
        else:
            adam_state, lr_state = self.opt_state
        adam_state = type(adam_state)(self.step, self.mu, self.nu)
        lr_state = type(lr_state)(lr_state.count + 1, self.lr)
        return (empty, adam_state, lr_state) if self.name == "adam" else (adam_state, lr_state)
