"""Step transforms: each takes a step and returns a step that computes the same thing differently.

Stack them as ``shard(offload(compute(step)))``, where compute is any mix of
`accumulate`, `checkpoint` and `mixed_precision`.
"""

from zfunc.transforms.accumulate import accumulate
from zfunc.transforms.checkpoint import checkpoint
from zfunc.transforms.mixed_precision import Policy, mixed_precision
from zfunc.transforms.offload import offload
from zfunc.transforms.pipeline import pipeline
from zfunc.transforms.shard import shard

__all__ = ["Policy", "accumulate", "checkpoint", "mixed_precision", "offload", "pipeline", "shard"]
