"""Step transforms: each takes a step and returns a step that computes the same thing differently.

Stack them as ``shard(offload(tensor_parallel(compute(step))))``, where compute is any mix of
`accumulate`, `checkpoint`, `compile_blocks` and `mixed_precision` (docs/parallelism.md: the mesh and the orders).
"""

from zfunc.transforms.accumulate import accumulate
from zfunc.transforms.checkpoint import checkpoint
from zfunc.transforms.compile_blocks import compile_blocks
from zfunc.transforms.mixed_precision import mixed_precision
from zfunc.transforms.mixed_precision_policy import Policy
from zfunc.transforms.offload import offload
from zfunc.transforms.pipeline import pipeline
from zfunc.transforms.shard import shard
from zfunc.transforms.tensor_parallel import tensor_parallel
from zfunc.transforms.tp_plans import FusedColwise, TPPlan, tp_plan

__all__ = ["FusedColwise", "Policy", "TPPlan", "accumulate", "checkpoint", "compile_blocks", "mixed_precision", "offload",
           "pipeline", "shard", "tensor_parallel", "tp_plan"]
