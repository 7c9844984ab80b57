"""pathspace_jax: path-space optimisation of ReLU networks in JAX.

See ``trace`` for finding the reduction graph of a forward function, and
``rescale`` / ``random_rescale`` / ``describe`` for working with it.
"""

from pathspace_jax import testing

# DDP-SGD (issue 5)
from pathspace_jax.alias import ddp_sgd
from pathspace_jax.ddp import DDPUnsupportedError, ddp_kappa
from pathspace_jax.graph import EdgeLeaf, NodeGroup, PathSpace
from pathspace_jax.rescale import describe, random_alphas, random_rescale, rescale
from pathspace_jax.trace import UnsupportedModelError, trace
from pathspace_jax.transforms import ScaleByDDPState, scale_by_ddp

__version__ = "0.1.0"

__all__ = [
    "DDPUnsupportedError",  # DDP-SGD (issue 5)
    "ScaleByDDPState",
    "ddp_kappa",
    "ddp_sgd",
    "scale_by_ddp",
    "EdgeLeaf",
    "NodeGroup",
    "PathSpace",
    "UnsupportedModelError",
    "describe",
    "random_alphas",
    "random_rescale",
    "rescale",
    "testing",
    "trace",
]
