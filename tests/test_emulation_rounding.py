"""The emulations' roundings: correct, and fenced so that XLA cannot fold them away."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.emulation._arith import rounded


@pytest.mark.parametrize(
    "dtype, x, expected",
    [
        (jnp.bfloat16, 1 + 2**-8, 1.0),  # a tie goes to the even neighbour
        (jnp.bfloat16, 1 + 3 * 2**-9, 1 + 2**-7),
        (jnp.float16, 1 + 2**-11, 1.0),
        (jnp.float16, 3 * 2**-25, 2**-23),  # subnormal f16, a tie to even (2 x 2^-24)
        (jnp.float8_e4m3fn, 0.1, 0.1015625),
        (jnp.float8_e4m3fn, 17.0, 16.0),  # tie between 16 and 18 goes to 16
        (jnp.float8_e4m3fn, 440.0, 448.0),
    ],
)
def test_rounded_values(dtype, x, expected):
    got = jax.jit(lambda v: rounded(v, dtype))(jnp.float32(x))
    assert got.dtype == jnp.float32 and float(got) == expected


def test_round_trip_is_fenced():
    """The narrow value passes an optimization barrier, which XLA's simplifier cannot see
    through (on the H200 an unfenced bf16 round trip was seen to vanish)."""
    jaxpr = jax.make_jaxpr(lambda v: v - rounded(v, jnp.bfloat16))(np.float32(1.0))
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.index("convert_element_type") < names.index("optimization_barrier")
    assert float(jax.jit(lambda v: v - rounded(v, jnp.bfloat16))(jnp.float32(1 + 2**-10))) > 0
