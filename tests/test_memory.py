"""The exact implementations' temporaries do not grow with the longest row / sequence.

Measured on XLA's compiled memory analysis (deterministic, no timing, nothing allocated):
the temporary-buffer size must be the same for 2,000 and 200,000 keys and stay small.
"""

import jax
import jax.numpy as jnp
import pytest

import jax_sparse_mla as jsm

_LIMIT = 64 * 2**20  # bytes of temporaries allowed for one row/request: tiles, not rows


def _temp_bytes(fn, *shapes) -> int:
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_mla_temporaries_independent_of_row_length(heads):
    def temp(n_keys):
        return _temp_bytes(
            lambda *a: jsm.sparse_mla(*a, return_lse=True),
            ((1, heads, 576), jnp.bfloat16),
            ((n_keys, 656), jnp.uint8),
            ((n_keys,), jnp.int32),
            ((2,), jnp.int32),
        )

    short, long = temp(2_000), temp(200_000)
    assert long == short
    assert long < _LIMIT


def test_mla_decode_temporaries_independent_of_sequence_length():
    # The cache is passed as uint8 codes: XLA:CPU copies a float8_e4m3fn array before gathering
    # from it (documented in mla_decode), which is proportional to the cache, not to the tile.
    def temp(seq):
        return _temp_bytes(
            lambda *a: jsm.mla_decode(*a, qlen=2, num_splits=4),
            ((2 * 2, 16, 576), jnp.bfloat16),
            ((seq, 576), jnp.uint8),
            ((2 * seq,), jnp.int32),
            ((3,), jnp.int32),
        )

    assert temp(200_000) == temp(2_000) < _LIMIT


def test_ultraquant_temporaries_independent_of_sequence_length():
    def temp(blocks):
        return _temp_bytes(
            jsm.ultraquant_decode,
            ((2, 16, 256), jnp.bfloat16),
            ((blocks, 64, 2, 272), jnp.uint8),
            ((2, blocks), jnp.int32),
            ((2,), jnp.int32),
        )

    assert temp(4_000) == temp(40) < _LIMIT
