"""Run time follows nnz: ``indptr`` / ``kv_indptr`` entries are clipped to [0, nnz] in every
implementation, so no entry changes the cost or drops a valid key (int32 overflow included)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests import cases as C
from tests import oracle as O
from tests.impls import available, common

BIG = [2**30, 2**31 - 1]


def _timed(fn, *args):
    t = time.perf_counter()
    res = jax.block_until_ready(fn(*args))
    return res, time.perf_counter() - t


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("impl", available("sparse_mla"))
@pytest.mark.parametrize("big", BIG)
def test_sparse_mla_indptr_clipped(impl, big):
    r = C.rng(11)
    kv = jnp.asarray(C.make_records(r, 10))
    q = C.bf16_normal(r, (3, 2, 576))
    idx = jnp.asarray(r.integers(0, 10, 9).astype(np.int32))
    fn = jax.jit(lambda *a: jsm.sparse_mla(*a, return_lse=True, implementation=impl))
    clipped = np.int32([0, 3, 4, 9])  # the last row holds positions 4 .. 8
    want, warm = _timed(fn, q, kv, idx, jnp.asarray(clipped))
    out, lse = O.sparse_mla(q, np.asarray(kv), np.asarray(idx), clipped)
    for indptr in ([-7, 3, 4, big], [0, 3, 4, big], [-(2**31), 3, big, big]):
        got, took = _timed(fn, q, kv, idx, jnp.asarray(np.int32(indptr)))
        assert took < max(10.0, 5 * warm), f"indptr {indptr}: {took:.1f} s vs {warm:.1f} s"
        ref = O.sparse_mla(q, np.asarray(kv), np.asarray(idx), np.int32(indptr))
        if indptr[2] == 4:  # clips to `clipped`: the same bits
            _same(got, want)
            np.testing.assert_array_equal(ref[1], lse)
        assert np.array_equal(np.isneginf(np.asarray(got[1])), np.isneginf(ref[1]))
    assert np.all(np.isfinite(np.asarray(want[1])))  # every row of `clipped` has keys


@pytest.mark.parametrize("impl", common("mla_decode", "mla_decode_partials"))
@pytest.mark.parametrize("big", BIG)
def test_mla_decode_indptr_clipped(impl, big):
    c = C.decode_case(12, seq_lens=(5, 7), h=2, qlen=2, n_nan=0)
    kw = dict(qlen=2, k_scale=c.k_scale, v_scale=c.v_scale, implementation=impl)
    fn = jax.jit(lambda *a: jsm.mla_decode(*a, return_lse=True, num_splits=2, **kw))
    idx = jnp.asarray(c.kv_indices)  # n = 12
    want, warm = _timed(fn, c.q, c.kv, idx, jnp.asarray(np.int32([0, 5, 12])))
    for indptr in ([0, 5, big], [-3, 5, big]):
        got, took = _timed(fn, c.q, c.kv, idx, jnp.asarray(np.int32(indptr)))
        assert took < max(10.0, 5 * warm), f"kv_indptr {indptr}: {took:.1f} s vs {warm:.1f} s"
        _same(got, want)  # both clip to [0, 5, 12]
        ref = O.mla_decode(
            c.q,
            c.kv_codes,
            c.kv_indices,
            np.int32(indptr),
            qlen=2,
            k_scale=c.k_scale,
            v_scale=c.v_scale,
        )
        assert np.all(np.isfinite(np.asarray(got[1])))
        assert np.all(np.isfinite(ref[1]))
    parts = jax.jit(lambda *a: jsm.mla_decode_partials(*a, num_splits=3, **kw))
    _same(
        parts(c.q, c.kv, idx, jnp.asarray(np.int32([0, 5, big]))),
        parts(c.q, c.kv, idx, jnp.asarray(np.int32([0, 5, 12]))),
    )


def test_oracle_clips_indptr():
    """The oracle's own reading: a row's positions are [clip(a), clip(b)) within [0, nnz]."""
    assert list(O.csr_row_positions(np.int64([-4, 2**31 - 1]), 0, 5)) == [0, 1, 2, 3, 4]
    assert list(O.csr_row_positions(np.int64([3, 1]), 0, 5)) == []
