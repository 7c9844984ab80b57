"""pathspace_jax: path-space optimisation of ReLU networks in JAX.

See ``trace`` for finding the reduction graph of a forward function, and
``rescale`` / ``random_rescale`` / ``describe`` for working with it.
"""

from pathspace_jax import testing

# DDP-SGD (issue 5)
from pathspace_jax.alias import ddp_sgd, g_adam, g_sgd, path_sgd
from pathspace_jax.coords import basis_paths, canonicalize, coord_mask, from_coords, skeleton_init, to_coords
from pathspace_jax.ddp import DDPUnsupportedError, ddp_kappa
from pathspace_jax.graph import EdgeLeaf, NodeGroup, PathSpace
from pathspace_jax.kappa import PathKappaUnsupportedError, path_kappa, path_norm  # Path-SGD (issue 2)
from pathspace_jax.rescale import describe, random_alphas, random_rescale, rescale
from pathspace_jax.trace import UnsupportedModelError, trace
from pathspace_jax.transforms import (
    InPathSpaceState,
    ScaleByDDPState,
    ScaleByPathSGDState,
    in_path_space,
    scale_by_ddp,
    scale_by_path_sgd,
)

__version__ = "0.1.0"

__all__ = [
    "PathKappaUnsupportedError",  # Path-SGD (issue 2)
    "ScaleByPathSGDState",
    "path_kappa",
    "path_norm",
    "path_sgd",
    "scale_by_path_sgd",
    "DDPUnsupportedError",  # DDP-SGD (issue 5)
    "ScaleByDDPState",
    "ddp_kappa",
    "ddp_sgd",
    "scale_by_ddp",
    "InPathSpaceState",  # G-SGD (issue 4)
    "basis_paths",
    "canonicalize",
    "coord_mask",
    "from_coords",
    "g_adam",
    "g_sgd",
    "in_path_space",
    "skeleton_init",
    "to_coords",
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
