"""The errors pathspace_jax raises about a model it cannot handle: one base class, `PathSpaceError`.

``except pj.PathSpaceError`` catches every one of them. Each also derives from the builtin exception that it
was before the base existed (``ValueError``, or ``NotImplementedError`` for a jaxpr layout), so older
``except ValueError`` clauses keep working. Invalid arguments (a learning rate below 0, an unknown option) are
plain ``ValueError`` / ``TypeError``, as in optax.
"""

from __future__ import annotations

import os
import sys


class PathSpaceError(Exception):
    """Base class of pathspace_jax's errors about a model, its params or its inputs."""


class UnsupportedModelError(PathSpaceError, ValueError):
    """Raised by ``trace(..., strict=True)`` when part of the model is not homogeneous."""


class UnsupportedJaxprError(PathSpaceError, NotImplementedError):
    """A jaxpr equation in a layout this version of pathspace_jax does not know (a newer or older JAX)."""


class PathKappaUnsupportedError(PathSpaceError, ValueError):
    """Raised when a model is outside what path norms / Path-SGD's κ are computed for (see `pathspace_jax.kappa`)."""


class DDPUnsupportedError(PathSpaceError, ValueError):
    """Raised when a model is outside what DDP-SGD's κ is defined for here (see `pathspace_jax.ddp`)."""


class DDPNormalizationError(PathSpaceError, ValueError):
    """Raised when a model or batch is outside what DDP-Normalization is defined for here."""


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` that names the first caller outside pathspace_jax (the user's line)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package:
        frame, level = frame.f_back, level + 1
    return level
