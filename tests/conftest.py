"""Tests run in float64 where they ask for it: x64 is enabled for the whole suite."""

import jax

jax.config.update("jax_enable_x64", True)
