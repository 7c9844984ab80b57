"""pathspace_jax: path-space optimisation of ReLU networks in JAX.

* Structure: ``trace`` finds the reduction graph of a forward function (a `PathSpace`);
  ``describe``, ``rescale`` and ``random_rescale`` work with it.
* Path coordinates: ``to_coords``, ``from_coords``, ``coord_mask``, ``basis_paths``,
  ``canonicalize``, ``skeleton_init``.
* Path norms and κ: ``path_norm``, ``path_kappa`` (Path-SGD), ``ddp_kappa`` (DDP-SGD).
* optax transformations: ``in_path_space`` / ``g_sgd`` / ``g_adam`` (G-SGD), ``scale_by_path_sgd`` /
  ``path_sgd``, ``scale_by_ddp`` / ``ddp_sgd``; ``path_labels`` for ``optax.partition``;
  ``apply_gradients`` for a Flax ``TrainState`` whose optimizer needs the batch (DDP-SGD).
* ``pathspace_jax.testing``: chex assertions of rescaling invariance.
* Errors: ``PathSpaceError`` is the base of every error about a model, its params or its inputs.
"""

from pathspace_jax import testing
from pathspace_jax.alias import ddp_sgd, g_adam, g_sgd, path_sgd
from pathspace_jax.coords import (
    basis_paths,
    canonicalize,
    coord_mask,
    from_coords,
    skeleton_init,
    to_coords,
)
from pathspace_jax.ddp import ddp_kappa
from pathspace_jax.errors import (
    DDPNormalizationError,
    DDPUnsupportedError,
    PathKappaUnsupportedError,
    PathSpaceError,
    UnsupportedJaxprError,
    UnsupportedModelError,
)
from pathspace_jax.graph import EdgeLeaf, NodeGroup, PathSpace
from pathspace_jax.gsgd import coord_scales
from pathspace_jax.kappa import path_kappa, path_norm
from pathspace_jax.masking import path_labels
from pathspace_jax.normalize import ddp_normalize, ddp_normalized_weights
from pathspace_jax.rescale import describe, random_alphas, random_rescale, rescale
from pathspace_jax.trace import trace
from pathspace_jax.train_state import apply_gradients
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
    # errors (each model error below derives from PathSpaceError)
    "PathSpaceError",
    "UnsupportedJaxprError",
    # structure and rescaling
    "EdgeLeaf",
    "NodeGroup",
    "PathSpace",
    "UnsupportedModelError",
    "describe",
    "random_alphas",
    "random_rescale",
    "rescale",
    "trace",
    # path coordinates and G-SGD
    "InPathSpaceState",
    "basis_paths",
    "canonicalize",
    "coord_mask",
    "from_coords",
    "g_adam",
    "g_sgd",
    "in_path_space",
    "path_labels",
    "skeleton_init",
    "coord_scales",
    "to_coords",
    # Path-SGD
    "PathKappaUnsupportedError",
    "ScaleByPathSGDState",
    "path_kappa",
    "path_norm",
    "path_sgd",
    "scale_by_path_sgd",
    # DDP-SGD
    "DDPUnsupportedError",
    "ScaleByDDPState",
    "ddp_kappa",
    "ddp_sgd",
    "scale_by_ddp",
    # DDP-Normalization
    "DDPNormalizationError",
    "ddp_normalize",
    "ddp_normalized_weights",
    # Flax TrainState
    "apply_gradients",
    # invariance assertions
    "testing",
]
