"""Arithmetic shared by the gfx950 emulations: fenced roundings, the fp8 hi/lo split, exp2.

On GPU, XLA's excess-precision simplification removes a ``f32 -> narrow -> f32`` convert pair
(seen on the H200: a bf16 round trip vanished), which would silently undo the very roundings an
emulation models. An optimization barrier between the two converts keeps the narrow value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_mla.formats import pow2

LO_FACTOR = 32.0  # lo = e4m3((x - hi) * 32): the largest power of two keeping |lo| <= 448


def narrow(x: jax.Array, dtype) -> jax.Array:
    """``x`` converted to ``dtype`` (round to nearest even), kept narrow for later consumers."""
    return jax.lax.optimization_barrier(x.astype(dtype))


def rounded(x: jax.Array, dtype) -> jax.Array:
    """``x`` rounded to ``dtype`` and widened back to float32."""
    return narrow(x, dtype).astype(jnp.float32)


def e4m3(x: jax.Array) -> jax.Array:
    """float32 -> the value of its nearest e4m3fn code (RNE) as float32; |x| <= 448."""
    return rounded(x, jnp.float8_e4m3fn)


def fp8_hi_lo(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kernels' fp8 split of float32 ``x`` (|x| <= 256): ``hi = e4m3(x)`` and
    ``lo = e4m3((x - hi) * 32)``, so ``x ~= hi + lo / 32``."""
    hi = e4m3(x)
    return hi, e4m3((x - hi) * LO_FACTOR)


def exp2(x: jax.Array) -> jax.Array:
    """``2**x`` for float32 ``x < 128``: exact at integers (exponent bits, XLA:CPU's exp2 is
    not), 0 below 2^-126."""
    whole = jnp.floor(x)
    n = jnp.clip(whole, -127.0, 128.0).astype(jnp.int32)
    y = jnp.exp2(x - whole) * pow2(jnp.maximum(n, -126))
    return jnp.where(whole < -126.0, 0.0, y)
