"""pathspace_jax: path-space optimisation of ReLU networks in JAX.

See ``trace`` for finding the reduction graph of a forward function, and
``rescale`` / ``random_rescale`` / ``describe`` for working with it.
"""

from pathspace_jax import testing
from pathspace_jax.graph import EdgeLeaf, NodeGroup, PathSpace
from pathspace_jax.rescale import describe, random_alphas, random_rescale, rescale
from pathspace_jax.trace import UnsupportedModelError, trace

__version__ = "0.1.0"

__all__ = [
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
