"""zfunc: DeepSpeed-class memory efficiency for PyTorch, as transforms of a pure step function.

    apply_fn, params = zf.functional(model)
    state = zf.TrainState.create(params, zf.optim.adamw(3e-4))
    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = shard(offload(train_step), stage=3)      # from zfunc.transforms
    state = step.init(state); state, metrics = step(state, batch)
"""

from zfunc import deepspeed, io, optim, tree
from zfunc._version import VERSION
from zfunc.autodiff import grad, value_and_grad
from zfunc.compile_step import compile_step
from zfunc.functional import FunctionalModel, ModelCall, functional
from zfunc.interpret import Transform, gather, init
from zfunc.plan import MemoryPlan, describe, plan
from zfunc.primitives import psum
from zfunc.state import TrainState
from zfunc.transforms.accumulate import accumulate
from zfunc.transforms.compile_blocks import compile_blocks

__version__ = VERSION

__all__ = [
    "FunctionalModel", "MemoryPlan", "ModelCall", "TrainState", "Transform", "accumulate", "compile_blocks", "compile_step", "deepspeed", "describe", "functional", "gather",
    "grad", "init", "io", "optim", "plan", "psum", "tree", "value_and_grad",
]
