"""Roundings that XLA must keep.

On GPU, XLA's excess-precision simplification removes a ``f32 -> narrow -> f32`` convert pair
(seen on the H200: a bf16 round trip vanished), which would silently undo the very roundings an
emulation models. An optimization barrier between the two converts keeps the narrow value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def narrow(x: jax.Array, dtype) -> jax.Array:
    """``x`` converted to ``dtype`` (round to nearest even), kept narrow for later consumers."""
    return jax.lax.optimization_barrier(x.astype(dtype))


def rounded(x: jax.Array, dtype) -> jax.Array:
    """``x`` rounded to ``dtype`` and widened back to float32."""
    return narrow(x, dtype).astype(jnp.float32)
