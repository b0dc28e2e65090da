"""Inputs as users pass them: numpy arrays inside and outside ``jax.jit``, and zero-size
inputs (0 tokens, rows, requests, heads, blocks), for every implementation on this machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests import cases as C
from tests import oracle as O
from tests.impls import available, common


def _np(x):
    """A numpy copy of a jax array (bf16 stays ml_dtypes bfloat16)."""
    return np.asarray(x)


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------------------------------
# numpy arrays give the same result as jax arrays, eagerly and under jit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", available("sparse_mla"))
@pytest.mark.parametrize("jit", [False, True])
def test_sparse_mla_numpy(impl, jit):
    c = C.sparse_case(1, n_q=2, h=2, n_rec=6, n_nan=0, min_len=3, max_len=5, p_empty=0.0)
    fn = jax.jit(jsm.sparse_mla, static_argnames=("implementation",)) if jit else jsm.sparse_mla
    want = jsm.sparse_mla(
        c.q, jnp.asarray(c.kv), jnp.asarray(c.idx), jnp.asarray(c.indptr), implementation=impl
    )
    got = fn(_np(c.q), _np(c.kv), _np(c.idx), _np(c.indptr), implementation=impl)
    _bits_equal(got, want)


@pytest.mark.parametrize("impl", common("mla_decode", "mla_decode_partials", "merge_attn_states"))
@pytest.mark.parametrize("jit", [False, True])
def test_mla_decode_numpy(impl, jit):
    c = C.decode_case(2, seq_lens=(3, 9), h=2, qlen=2, n_nan=0)
    kw = dict(qlen=2, k_scale=c.k_scale, v_scale=c.v_scale, implementation=impl)
    want = jsm.mla_decode(c.q, c.kv, jnp.asarray(c.kv_indices), jnp.asarray(c.kv_indptr), **kw)
    fn = jsm.mla_decode
    if jit:
        fn = jax.jit(fn, static_argnames=("qlen", "implementation", "k_scale", "v_scale"))
    got = fn(_np(c.q), _np(c.kv), _np(c.kv_indices), _np(c.kv_indptr), **kw)
    _bits_equal(got, want)
    parts = jsm.mla_decode_partials(
        _np(c.q), _np(c.kv), c.kv_indices, c.kv_indptr, num_splits=2, **kw
    )
    o, lse = jsm.merge_attn_states(
        _np(parts[0]), _np(parts[1]), return_lse=True, implementation=impl
    )
    assert o.shape == (4, 2, 512) and lse.shape == (4, 2)


@pytest.mark.parametrize("impl", available("ultraquant_decode"))
@pytest.mark.parametrize("jit", [False, True])
def test_ultraquant_numpy(impl, jit):
    c = C.uq_case(3, seq_lens=(5, 20), hk=1, g=2)
    kw = dict(implementation=impl)
    want = jsm.ultraquant_decode(
        c.q, jnp.asarray(c.cache), jnp.asarray(c.block_tables), jnp.asarray(c.seq_lens), **kw
    )
    fn = (
        jax.jit(jsm.ultraquant_decode, static_argnames=("implementation",))
        if jit
        else (jsm.ultraquant_decode)
    )
    got = fn(_np(c.q), c.cache, c.block_tables, c.seq_lens, **kw)
    _bits_equal(got, want)


@pytest.mark.parametrize("jit", [False, True])
def test_writers_numpy(jit):
    r = C.rng(4)
    lat = C.random_latent(r, 3)
    rope = C.random_rope(r, 3)
    slots = np.int32([2, -1, 0])
    wrap = jax.jit if jit else (lambda f: f)
    rec = wrap(jsm.pack_fp8_ds_mla)(lat, rope)
    _bits_equal(rec, O.pack_fp8_ds_mla(lat, rope))
    cache = np.zeros((2, 2, 656), np.uint8)
    got = wrap(jsm.concat_and_cache_ds_mla)(cache, lat, rope, slots)
    want = np.zeros((4, 656), np.uint8)
    want[[2, 0]] = O.pack_fp8_ds_mla(lat[[0, 2]], rope[[0, 2]])
    _bits_equal(got, want.reshape(2, 2, 656))
    got = wrap(jsm.concat_and_cache_mla)(np.zeros((3, 576), np.uint8), lat, rope, slots)
    want = np.zeros((3, 576), np.uint8)
    want[[2, 0]] = O.mla_cache_codes(lat[[0, 2]], rope[[0, 2]])
    _bits_equal(got, want)
    k = np.asarray(C.uq_kv(r, 3, 1)[0]).astype(np.float32)
    uq = np.zeros((2, 2, 1, 272), np.uint8)
    _bits_equal(wrap(jsm.ultraquant_store)(uq, k, k, slots), O.ultraquant_store(uq, k, k, slots))
    latent, rope_back = jsm.unpack_fp8_ds_mla(np.asarray(rec))
    assert latent.shape == (3, 512) and rope_back.shape == (3, 64)


# ---------------------------------------------------------------------------------------------
# zero-size inputs: the empty or no-key result, never a crash
# ---------------------------------------------------------------------------------------------

SPARSE_EMPTY = {  # n_q, H, kv rows, nnz
    "0 rows": (0, 2, 4, 3),
    "0 heads": (2, 0, 4, 3),
    "0 records": (2, 2, 0, 3),
    "0 entries": (2, 2, 4, 0),
}


@pytest.mark.parametrize("impl", available("sparse_mla"))
@pytest.mark.parametrize("case", SPARSE_EMPTY)
def test_sparse_mla_empty(impl, case):
    n_q, h, rows, nnz = SPARSE_EMPTY[case]
    r = C.rng(5)
    q = C.bf16_normal(r, (n_q, h, 576))
    kv = C.make_records(r, rows) if rows else np.zeros((0, 656), np.uint8)
    idx = np.zeros(nnz, np.int32)
    indptr = np.minimum(np.arange(n_q + 1), nnz).astype(np.int32)
    jitted = jax.jit(jsm.sparse_mla, static_argnames=("implementation", "return_lse"))
    for fn in (jsm.sparse_mla, jitted):
        out, lse = fn(q, kv, idx, indptr, return_lse=True, implementation=impl)
        assert out.shape == (n_q, h, 512) and out.dtype == jnp.bfloat16
        assert lse.shape == (n_q, h)
        assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isneginf(lse))


DECODE_EMPTY = {  # B, qlen, H, tokens, n
    "0 requests": (0, 1, 2, 4, 0),
    "0 requests qlen 2": (0, 2, 2, 4, 3),
    "0 heads": (2, 2, 0, 4, 3),
    "0 tokens": (2, 1, 2, 0, 3),
    "0 indices": (2, 2, 2, 4, 0),
}


@pytest.mark.parametrize("impl", common("mla_decode", "mla_decode_partials", "merge_attn_states"))
@pytest.mark.parametrize("case", DECODE_EMPTY)
def test_mla_decode_empty(impl, case):
    b, qlen, h, tokens, n = DECODE_EMPTY[case]
    r = C.rng(6)
    q = C.bf16_normal(r, (b * qlen, h, 576))
    kv = r.integers(0, 0x7E, (tokens, 576)).astype(np.uint8)
    idx = np.zeros(n, np.int32)
    indptr = np.minimum(np.arange(b + 1), n).astype(np.int32)
    kw = dict(qlen=qlen, implementation=impl)
    out, lse = jsm.mla_decode(q, kv, idx, indptr, return_lse=True, **kw)
    assert out.shape == (b * qlen, h, 512) and lse.shape == (b * qlen, h)
    assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isneginf(lse))
    o, lp = jsm.mla_decode_partials(q, kv, idx, indptr, num_splits=3, **kw)
    assert o.shape == (b * qlen, 3, h, 512) and lp.shape == (b * qlen, 3, h)
    assert np.all(np.asarray(o, np.float32) == 0) and np.all(np.isneginf(lp))
    m, ml = jsm.merge_attn_states(o, lp, return_lse=True, implementation=impl)
    assert m.shape == (b * qlen, h, 512) and ml.shape == (b * qlen, h)
    assert np.all(np.asarray(m, np.float32) == 0) and np.all(np.isneginf(ml))


UQ_EMPTY = {  # B, Hq, Hk, num_blocks, block_size
    "0 requests": (0, 2, 1, 3, 16),
    "0 query heads": (2, 0, 1, 3, 16),
    "0 heads": (2, 0, 0, 3, 16),
    "0 blocks": (2, 2, 1, 0, 16),
    "0 slots per block": (2, 2, 1, 3, 0),
}


@pytest.mark.parametrize("impl", available("ultraquant_decode"))
@pytest.mark.parametrize("case", UQ_EMPTY)
def test_ultraquant_empty(impl, case):
    b, hq, hk, nb, bs = UQ_EMPTY[case]
    r = C.rng(7)
    q = C.bf16_normal(r, (b, hq, 256))
    cache = C.garbage_cache(r, nb, bs, hk)
    bt = np.zeros((b, 2), np.int32)
    seq = np.full((b,), 20, np.int32)
    for fn in (
        jsm.ultraquant_decode,
        jax.jit(jsm.ultraquant_decode, static_argnames=("implementation",)),
    ):
        out = fn(q, cache, bt, seq, implementation=impl)
        assert out.shape == (b, hq, 256) and out.dtype == jnp.bfloat16
        assert np.all(np.asarray(out, np.float32) == 0)


@pytest.mark.parametrize("jit", [False, True])
def test_writers_zero_tokens(jit):
    wrap = jax.jit if jit else (lambda f: f)
    lat, rope = np.zeros((0, 512), np.float32), np.zeros((0, 64), np.float32)
    slots = np.zeros((0,), np.int32)
    assert wrap(jsm.pack_fp8_ds_mla)(lat, rope).shape == (0, 656)
    cache = C.make_records(C.rng(8), 4).reshape(2, 2, 656)
    _bits_equal(wrap(jsm.concat_and_cache_ds_mla)(cache, lat, rope, slots), cache)
    codes = np.arange(3 * 576, dtype=np.uint32).astype(np.uint8).reshape(3, 576)
    _bits_equal(wrap(jsm.concat_and_cache_mla)(codes, lat, rope, slots), codes)
    uq = C.garbage_cache(C.rng(9), 2, 16, 1)
    kv = np.zeros((0, 1, 256), np.float32)
    _bits_equal(wrap(jsm.ultraquant_store)(uq, kv, kv, slots), uq)
    # and an empty cache
    empty = np.zeros((0, 656), np.uint8)
    one = np.ones((1, 512), np.float32), np.ones((1, 64), np.float32)
    assert wrap(jsm.concat_and_cache_ds_mla)(empty, *one, np.int32([0])).shape == (0, 656)
    latent, rope_back = jsm.unpack_fp8_ds_mla(np.zeros((0, 656), np.uint8))
    assert latent.shape == (0, 512) and rope_back.shape == (0, 64)
