"""Every op under jax.jit and jax.vmap (results checked against the oracle / unbatched calls).

The ops run their exact implementation ("xla"): the oracle checks use its tolerances, and
implementation=None would pick the Pallas kernels on a Hopper GPU (their transforms are tested
in test_pallas_*.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm
from tests import cases as C
from tests import oracle as O

sparse_mla = functools.partial(jsm.sparse_mla, implementation="xla")
mla_decode = functools.partial(jsm.mla_decode, implementation="xla")
mla_decode_partials = functools.partial(jsm.mla_decode_partials, implementation="xla")
merge_attn_states = functools.partial(jsm.merge_attn_states, implementation="xla")
ultraquant_decode = functools.partial(jsm.ultraquant_decode, implementation="xla")


def _stack(xs):
    return jnp.stack([jnp.asarray(x) for x in xs])


def test_sparse_mla_vmap_batched_and_shared_kv():
    cs = [C.sparse_case(s, n_q=4, h=2, n_rec=20, n_nan=4, max_len=12) for s in range(3)]
    # pad every case's idx to the same length (extra entries sit past indptr[-1]: unreached)
    nnz = max(len(c.idx) for c in cs)
    idx = _stack([np.pad(c.idx, (0, nnz - len(c.idx)), constant_values=5) for c in cs])
    f = functools.partial(sparse_mla, return_lse=True)
    out, lse = jax.jit(jax.vmap(f))(
        _stack([c.q for c in cs]), _stack([c.kv for c in cs]), idx, _stack([c.indptr for c in cs])
    )
    for i, c in enumerate(cs):
        ref, ref_lse, st = O.sparse_mla(c.q, c.kv, c.idx, c.indptr, None, True)
        O.check_attention(out[i], ref, st, lse[i], ref_lse, what=f"vmap {i}")
    # kv shared (in_axes None), q / idx / indptr batched; a NaN-free kv, since the other cases'
    # valid entries may reach rows that are NaN garbage in cs[0].kv
    kv = C.make_records(C.rng(99), len(cs[0].kv))
    out = jax.vmap(sparse_mla, in_axes=(0, None, 0, 0))(
        _stack([c.q for c in cs]), jnp.asarray(kv), idx, _stack([c.indptr for c in cs])
    )
    for i, c in enumerate(cs):
        ref, _, st = O.sparse_mla(c.q, kv, c.idx, c.indptr, None, True)
        O.check_attention(out[i], ref, st, what=f"vmap shared kv {i}")


def test_sparse_mla_vmap_sm_scale_and_jit_traced_scale():
    c = C.sparse_case(5, n_q=3, h=2, n_rec=20)
    scales = jnp.float32([0.02, 0.1])
    out = jax.jit(
        jax.vmap(
            lambda s: sparse_mla(
                c.q, jnp.asarray(c.kv), jnp.asarray(c.idx), jnp.asarray(c.indptr), sm_scale=s
            )
        )
    )(scales)
    for i, s in enumerate([0.02, 0.1]):
        ref, _, st = O.sparse_mla(c.q, c.kv, c.idx, c.indptr, float(np.float32(s)), True)
        O.check_attention(out[i], ref, st)


def test_dense_to_csr_jit_vmap():
    topk = jnp.asarray(C.rng(0).integers(-1, 9, (3, 4, 5)).astype(np.int32))
    idx, indptr = jax.jit(jax.vmap(jsm.dense_to_csr))(topk)
    assert idx.shape == (3, 20) and indptr.shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(topk).reshape(3, 20))
    np.testing.assert_array_equal(np.asarray(indptr), np.tile(np.arange(5) * 5, (3, 1)))


def test_mla_decode_vmap():
    cs = [C.decode_case(s, seq_lens=(3, 150), qlen=2, h=2, n_nan=0) for s in range(2)]
    # same tokens count per case (n_nan=0, same seq_lens) so the caches stack
    f = functools.partial(
        mla_decode,
        qlen=2,
        num_splits=2,
        return_lse=True,
        k_scale=cs[0].k_scale,
        v_scale=cs[0].v_scale,
    )
    out, lse = jax.jit(jax.vmap(f))(
        _stack([c.q for c in cs]),
        _stack([c.kv for c in cs]),
        _stack([c.kv_indices for c in cs]),
        _stack([c.kv_indptr for c in cs]),
    )
    for i, c in enumerate(cs):
        ref, ref_lse, st = O.mla_decode(
            c.q, c.kv_codes, c.kv_indices, c.kv_indptr, 2, c.k_scale, c.v_scale, stats=True
        )
        O.check_attention(out[i], ref, st, lse[i], ref_lse, what=f"vmap {i}")


def test_mla_decode_vmap_scales_shared_kv():
    c = C.decode_case(3, seq_lens=(40, 9), qlen=1, h=2)
    ks = jnp.float32([0.01, 0.02])

    def f(q, k):
        idx, ptr = jnp.asarray(c.kv_indices), jnp.asarray(c.kv_indptr)
        return mla_decode(q, c.kv, idx, ptr, k_scale=k, v_scale=c.v_scale)

    out = jax.jit(jax.vmap(f))(_stack([c.q, c.q * 2]), ks)
    for i, (qm, k) in enumerate([(1, 0.01), (2, 0.02)]):
        q = O.to_f64(c.q) * qm
        ref, _, st = O.mla_decode(
            q, c.kv_codes, c.kv_indices, c.kv_indptr, 1, float(np.float32(k)), c.v_scale, stats=True
        )
        O.check_attention(out[i], ref, st)


def test_mla_decode_partials_and_merge_vmap():
    cs = [C.decode_case(s, seq_lens=(130, 300), qlen=1, h=2, n_nan=0) for s in range(2)]
    f = functools.partial(
        mla_decode_partials, num_splits=3, k_scale=cs[0].k_scale, v_scale=cs[0].v_scale
    )
    o_parts, lse_parts = jax.jit(jax.vmap(f))(
        _stack([c.q for c in cs]),
        _stack([c.kv for c in cs]),
        _stack([c.kv_indices for c in cs]),
        _stack([c.kv_indptr for c in cs]),
    )
    assert o_parts.shape == (2, 2, 3, 2, 512)
    for i, c in enumerate(cs):
        ref, ref_lse = O.mla_decode(
            c.q, c.kv_codes, c.kv_indices, c.kv_indptr, 1, c.k_scale, c.v_scale, num_splits=3
        )
        _, _, st = O.mla_decode(
            c.q, c.kv_codes, c.kv_indices, c.kv_indptr, 1, c.k_scale, c.v_scale, stats=True
        )
        O.check_attention(
            o_parts[i].reshape(6, 2, 512),
            ref.reshape(6, 2, 512),
            [x for x in st for _ in range(3)],
            lse_parts[i].reshape(6, 2),
            ref_lse.reshape(6, 2),
        )
    merged = jax.jit(jax.vmap(functools.partial(merge_attn_states, return_lse=True)))
    o, lse = merged(o_parts, lse_parts)
    for i in range(2):
        o1, lse1 = merge_attn_states(o_parts[i], lse_parts[i], return_lse=True)
        ref, ref_lse = O.merge_attn_states(o_parts[i], lse_parts[i])
        assert np.all(np.abs(O.to_f64(o[i]) - ref) <= 2.0**-8 * np.abs(ref) + 1e-6)
        np.testing.assert_allclose(np.asarray(lse[i]), ref_lse, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(lse1), ref_lse, rtol=1e-6)


def test_ultraquant_decode_vmap():
    c = C.uq_case(4, seq_lens=(10, 40), hk=1, g=8, bs=16)
    qs = _stack([c.q, c.q * 0.5, -c.q])
    f = functools.partial(ultraquant_decode, num_partitions=2)
    out = jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))(
        qs, jnp.asarray(c.cache), jnp.asarray(c.block_tables), jnp.asarray(c.seq_lens)
    )
    for i in range(3):
        ref, _, st = O.ultraquant_decode(qs[i], c.cache, c.block_tables, c.seq_lens, stats=True)
        O.check_attention(out[i], ref, st, heads_per_entry=8, what=f"vmap {i}")
    # batched seq_lens
    sl = jnp.asarray(np.int32([[10, 40], [0, 17], [7, 1]]))  # within the written tokens
    out = jax.jit(jax.vmap(ultraquant_decode, in_axes=(None, None, None, 0)))(
        c.q, jnp.asarray(c.cache), jnp.asarray(c.block_tables), sl
    )
    for i in range(3):
        ref, _, st = O.ultraquant_decode(
            c.q, c.cache, c.block_tables, np.asarray(sl[i]), stats=True
        )
        O.check_attention(out[i], ref, st, heads_per_entry=8, what=f"vmap seq_lens {i}")


def test_writers_jit_vmap():
    r = C.rng(6)
    lat = C.random_latent(r, 6).reshape(2, 3, 512)
    rope = C.random_rope(r, 6).reshape(2, 3, 64)
    rec = jax.jit(jax.vmap(jsm.pack_fp8_ds_mla))(jnp.asarray(lat), jnp.asarray(rope))
    want = O.pack_fp8_ds_mla(lat.reshape(6, 512), rope.reshape(6, 64)).reshape(2, 3, 656)
    np.testing.assert_array_equal(np.asarray(rec), want)
    l2, r2 = jax.jit(jax.vmap(jsm.unpack_fp8_ds_mla))(jnp.asarray(want))
    wl, wr = O.unpack_fp8_ds_mla(want)
    np.testing.assert_array_equal(np.asarray(l2), wl)
    np.testing.assert_array_equal(np.asarray(r2, np.float64), wr)

    # a batch of caches, each with its own slot mapping
    caches = r.integers(0, 256, (2, 5, 656), dtype=np.uint8)
    slots = np.int32([[4, -1, 0], [1, 2, 9]])
    got = jax.jit(jax.vmap(jsm.concat_and_cache_ds_mla))(
        jnp.asarray(caches), jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(slots)
    )
    want_c = caches.copy()
    recs = want.reshape(2, 3, 656)
    for b in range(2):
        for t in range(3):
            if 0 <= slots[b, t] < 5:
                want_c[b, slots[b, t]] = recs[b, t]
    np.testing.assert_array_equal(np.asarray(got), want_c)

    mc = r.integers(0, 256, (2, 5, 576), dtype=np.uint8)
    f = functools.partial(jsm.concat_and_cache_mla, scale=0.5)
    got = jax.jit(jax.vmap(f))(
        jnp.asarray(mc).view(jnp.float8_e4m3fn),
        jnp.asarray(lat),
        jnp.asarray(rope),
        jnp.asarray(slots),
    )
    want_m = mc.copy()
    codes = O.mla_cache_codes(lat.reshape(6, 512), rope.reshape(6, 64), 0.5).reshape(2, 3, 576)
    for b in range(2):
        for t in range(3):
            if 0 <= slots[b, t] < 5:
                want_m[b, slots[b, t]] = codes[b, t]
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want_m)


def test_ultraquant_store_jit_vmap():
    r = C.rng(7)
    caches = C.garbage_cache(r, 2 * 2, 4, 1).reshape(2, 2, 4, 1, 272)
    k = C.to_bf16(r.integers(-64, 65, (2, 3, 1, 256)) / 16.0)  # exact rotation in f32
    v = C.to_bf16(r.standard_normal((2, 3, 1, 256)))
    slots = np.int32([[0, 7, -1], [3, 8, 5]])
    got = jax.jit(jax.vmap(jsm.ultraquant_store))(jnp.asarray(caches), k, v, jnp.asarray(slots))
    for b in range(2):
        want = O.ultraquant_store(
            caches[b], np.asarray(k[b], np.float64), np.asarray(v[b], np.float64), slots[b]
        )
        np.testing.assert_array_equal(np.asarray(got[b]), want)


def test_jit_donated_cache():
    # writers work with a donated cache under jit (in-place update path)
    cache = jnp.zeros((4, 656), jnp.uint8)
    f = jax.jit(jsm.concat_and_cache_ds_mla, donate_argnums=0)
    lat = jnp.ones((1, 512), jnp.float32)
    rope = jnp.ones((1, 64), jnp.float32)
    out = f(cache, lat, rope, jnp.asarray(np.int32([2])))
    want = O.pack_fp8_ds_mla(np.ones((1, 512)), np.ones((1, 64)))
    np.testing.assert_array_equal(np.asarray(out)[2], want[0])
    assert np.all(np.asarray(out)[[0, 1, 3]] == 0)
