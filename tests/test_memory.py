"""Each implementation's temporaries stop growing with the longest row / sequence.

Measured on XLA's compiled memory analysis (deterministic, no timing, nothing allocated), for a
short, a long and a very long row. The claims (``impls.MEMORY_FLAT_FROM``): "xla" and the gfx950
emulation walk the keys in fixed tiles, so their temporaries are the same for every length;
"pallas", "mosaic" and "flydsl" split long rows over more programs until the GPU is full (at
most ``TARGET_PROGRAMS`` Pallas programs, ``TARGET_CTAS`` Mosaic GPU CTAs, a split / one
partition per CU (group) for the MI355 kernels), then stay flat: their partials hold a row's share
of the GPU, not the row. Every size stays below 64 MB for one row / request.
"""

import jax
import jax.numpy as jnp
import pytest

import jax_sparse_mla as jsm
from tests import impls

_LIMIT = 64 * 2**20  # bytes of temporaries allowed for one row/request: tiles, not rows
LENGTHS = ("short", "long", "very long")


def _temp_bytes(fn, *shapes) -> int:
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def check_claim(impl, temp, sizes):
    """temp(n) for n in sizes (short, long, very long): flat from MEMORY_FLAT_FROM[impl] on,
    every one below _LIMIT."""
    got = dict(zip(LENGTHS, (temp(n) for n in sizes), strict=True))
    flat = LENGTHS[LENGTHS.index(impls.MEMORY_FLAT_FROM[impl]) :]
    # XLA:GPU's buffer assignment moves a few hundred bytes between shapes (256 B seen on the
    # H200); a buffer that follows the row would move by megabytes here
    assert max(got[k] for k in flat) - min(got[k] for k in flat) <= 2**16, (impl, got)
    assert max(got.values()) < _LIMIT, (impl, got)


@impls.each_sparse
@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_mla_temporaries(impl, heads):
    def temp(n_keys):
        return _temp_bytes(
            lambda *a: jsm.sparse_mla(*a, return_lse=True, implementation=impl),
            ((1, heads, 576), jnp.bfloat16),
            ((n_keys, 656), jnp.uint8),
            ((n_keys,), jnp.int32),
            ((2,), jnp.int32),
        )

    check_claim(impl, temp, (2_000, 200_000, 2_000_000))


@impls.each_decode
@pytest.mark.parametrize("num_splits", [4, None])
def test_mla_decode_temporaries(impl, num_splits):
    # The cache is passed as uint8 codes: XLA:CPU copies a float8_e4m3fn array before gathering
    # from it (documented in mla_decode), which is proportional to the cache, not to the tile.
    def temp(seq):
        return _temp_bytes(
            lambda *a: jsm.mla_decode(*a, qlen=2, num_splits=num_splits, implementation=impl),
            ((2 * 2, 16, 576), jnp.bfloat16),
            ((seq, 576), jnp.uint8),
            ((2 * seq,), jnp.int32),
            ((3,), jnp.int32),
        )

    check_claim(impl, temp, (2_000, 200_000, 2_000_000))


@impls.each_ultraquant
def test_ultraquant_temporaries(impl):
    def temp(blocks):
        return _temp_bytes(
            lambda *a: jsm.ultraquant_decode(*a, implementation=impl),
            ((2, 16, 256), jnp.bfloat16),
            ((blocks, 64, 2, 272), jnp.uint8),
            ((2, blocks), jnp.int32),
            ((2,), jnp.int32),
        )

    check_claim(impl, temp, (40, 4_000, 40_000))
