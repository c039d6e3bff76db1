"""Step transforms: each takes a step and returns a step that computes the same thing differently.

Stack them as ``shard(offload(compute(step)))``, where compute is any mix of
`accumulate`, `checkpoint`, `compile_blocks` and `mixed_precision`.
"""

from zfunc.transforms.accumulate import accumulate
from zfunc.transforms.checkpoint import checkpoint
from zfunc.transforms.compile_blocks import compile_blocks
from zfunc.transforms.mixed_precision import Policy, mixed_precision
from zfunc.transforms.offload import offload
from zfunc.transforms.shard import shard

__all__ = ["Policy", "accumulate", "checkpoint", "compile_blocks", "mixed_precision", "offload", "shard"]
