"""Every op under jax.jit, jax.vmap and buffer donation, on every implementation
(tests/impls.py): each batch element against the oracle with that implementation's tolerance.

Scales passed as traced values (a vmapped sm_scale / k_scale) run on every implementation but
"flydsl", whose kernels take the scales as compile-time attributes. Under jax.vmap the "flydsl"
custom calls run once per batch element (``vmap_method="sequential"``); test_gfx950.py checks
that those runs equal a loop of unbatched calls bit for bit.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests import cases as C
from tests import impls
from tests import oracle as O


def _stack(xs):
    return jnp.stack([jnp.asarray(x) for x in xs])


def _static_scales_only(impl):
    if impl == "flydsl":
        pytest.skip("the flydsl kernels take static scales (compile-time attributes)")


# ---------------------------------------------------------------------------------------------
# sparse_mla
# ---------------------------------------------------------------------------------------------


@impls.each_sparse
def test_sparse_mla_vmap_batched_and_shared_kv(impl):
    cs = [C.sparse_case(s, n_q=4, h=2, n_rec=20, n_nan=4, max_len=12) for s in range(3)]
    # pad every case's idx to the same length (extra entries sit past indptr[-1]: unreached)
    nnz = max(len(c.idx) for c in cs)
    idx = _stack([np.pad(c.idx, (0, nnz - len(c.idx)), constant_values=5) for c in cs])
    qs, indptrs = _stack([c.q for c in cs]), _stack([c.indptr for c in cs])
    f = functools.partial(jsm.sparse_mla, return_lse=True, implementation=impl)
    out, lse = jax.jit(jax.vmap(f))(qs, _stack([c.kv for c in cs]), idx, indptrs)
    for i, c in enumerate(cs):
        impls.check_sparse(impl, c, out[i], lse[i], f"vmap {i}")
    # kv shared (in_axes None), q / idx / indptr batched; a NaN-free kv, since the other cases'
    # valid entries may reach rows that are NaN garbage in cs[0].kv
    kv = C.make_records(C.rng(99), len(cs[0].kv))
    out = jax.vmap(functools.partial(f, return_lse=False), in_axes=(0, None, 0, 0))(
        qs, jnp.asarray(kv), idx, indptrs
    )
    for i, c in enumerate(cs):
        impls.check_sparse(impl, dataclasses.replace(c, kv=kv), out[i], what=f"shared kv {i}")


@impls.each_sparse
def test_sparse_mla_vmap_traced_sm_scale(impl):
    _static_scales_only(impl)
    c = C.sparse_case(5, n_q=3, h=2, n_rec=20)
    scales = jnp.float32([0.02, 0.1])
    f = functools.partial(jsm.sparse_mla, return_lse=True, implementation=impl)
    out, lse = jax.jit(jax.vmap(lambda s: f(*c.args(), sm_scale=s)))(scales)
    for i, s in enumerate(np.asarray(scales)):
        case = dataclasses.replace(c, sm_scale=float(s))
        impls.check_sparse(impl, case, out[i], lse[i], f"sm_scale {s}")


def test_dense_to_csr_jit_vmap():
    topk = jnp.asarray(C.rng(0).integers(-1, 9, (3, 4, 5)).astype(np.int32))
    idx, indptr = jax.jit(jax.vmap(jsm.dense_to_csr))(topk)
    assert idx.shape == (3, 20) and indptr.shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(topk).reshape(3, 20))
    np.testing.assert_array_equal(np.asarray(indptr), np.tile(np.arange(5) * 5, (3, 1)))


# ---------------------------------------------------------------------------------------------
# mla_decode, mla_decode_partials, merge_attn_states
# ---------------------------------------------------------------------------------------------


def _decode_batch(cs):
    """The cases' (q, kv, kv_indices, kv_indptr), each stacked on a new leading axis."""
    return [_stack(x) for x in zip(*(c.args() for c in cs), strict=True)]


@impls.each_decode
def test_mla_decode_vmap(impl):
    # same token count per case (n_nan=0, same seq_lens) so the caches stack
    cs = [C.decode_case(s, seq_lens=(3, 150), qlen=2, h=2, n_nan=0) for s in range(2)]
    f = functools.partial(
        jsm.mla_decode,
        qlen=2,
        num_splits=2,
        return_lse=True,
        k_scale=cs[0].k_scale,
        v_scale=cs[0].v_scale,
        implementation=impl,
    )
    out, lse = jax.jit(jax.vmap(f))(*_decode_batch(cs))
    for i, c in enumerate(cs):
        impls.check_decode(impl, c, out[i], lse[i], num_splits=2, what=f"vmap {i}")


@impls.each_decode
def test_mla_decode_vmap_traced_k_scale_shared_kv(impl):
    _static_scales_only(impl)
    c = C.decode_case(3, seq_lens=(40, 9), qlen=1, h=2)
    q, kv, idx, indptr = c.args()
    k_scales = jnp.float32([0.01, 0.02])
    f = functools.partial(jsm.mla_decode, v_scale=c.v_scale, return_lse=True, implementation=impl)
    out, lse = jax.jit(jax.vmap(lambda q, k: f(q, kv, idx, indptr, k_scale=k)))(
        _stack([q, q * 2]), k_scales
    )
    for i, k in enumerate(np.asarray(k_scales)):
        case = dataclasses.replace(c, q=q * (i + 1), k_scale=float(k))  # q * 2 is exact
        impls.check_decode(impl, case, out[i], lse[i], what=f"k_scale {k}")


@impls.each_of("mla_decode_partials", "merge_attn_states")
def test_mla_decode_partials_and_merge_vmap(impl):
    cs = [C.decode_case(s, seq_lens=(130, 300), qlen=1, h=2, n_nan=0) for s in range(2)]
    f = functools.partial(
        jsm.mla_decode_partials,
        num_splits=3,
        k_scale=cs[0].k_scale,
        v_scale=cs[0].v_scale,
        implementation=impl,
    )
    o_parts, lse_parts = jax.jit(jax.vmap(f))(*_decode_batch(cs))
    assert o_parts.shape == (2, 2, 3, 2, 512)
    for i, c in enumerate(cs):
        impls.check_partials(impl, c, 3, o_parts[i], lse_parts[i], f"vmap {i}")
    merge = functools.partial(jsm.merge_attn_states, return_lse=True, implementation=impl)
    o, lse = jax.jit(jax.vmap(merge))(o_parts, lse_parts)
    for i in range(2):
        ref, ref_lse = O.merge_attn_states(o_parts[i], lse_parts[i])
        tol, lse_tol = impls.merge_tolerance(impl, o_parts[i], lse_parts[i], ref, ref_lse)
        O.assert_within(o[i], ref, tol, f"merge vmap {i} [{impl}]")
        assert np.all(np.abs(np.asarray(lse[i]) - ref_lse) <= lse_tol), f"merge lse {i}"


# ---------------------------------------------------------------------------------------------
# ultraquant_decode, and the writers (no implementation choice)
# ---------------------------------------------------------------------------------------------


@impls.each_ultraquant
def test_ultraquant_decode_vmap(impl):
    c = C.uq_case(4, seq_lens=(10, 40), hk=1, g=8, bs=16)
    q, cache, tables, seq_lens = c.args()
    f = functools.partial(jsm.ultraquant_decode, num_partitions=2, implementation=impl)
    qs = [q, q * 0.5, -q]  # exact in bf16
    out = jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))(_stack(qs), cache, tables, seq_lens)
    for i, qi in enumerate(qs):
        impls.check_uq(impl, dataclasses.replace(c, q=qi), out[i], num_partitions=2)
    # batched seq_lens, within the written tokens
    lens = np.int32([[10, 40], [0, 17], [7, 1]])
    out = jax.jit(jax.vmap(f, in_axes=(None, None, None, 0)))(q, cache, tables, jnp.asarray(lens))
    for i, sl in enumerate(lens):
        case = dataclasses.replace(c, seq_lens=sl)
        impls.check_uq(impl, case, out[i], num_partitions=2, what=f"seq_lens {sl}")


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


@impls.each_ultraquant
def test_donated_cache_store_then_decode(impl):
    """A jitted step that writes tokens with ultraquant_store into a donated cache and decodes
    equals the same step without donation (cache and output: the same program but for the
    buffer aliasing), and its output is within the implementation's bound."""
    case = C.uq_case(4, seq_lens=(10, 40), hk=1, g=8, bs=16)  # test_ultraquant_decode_vmap's
    garbage = C.garbage_cache(C.rng(0), *case.cache.shape)

    def step(cache, k, v, slot_mapping, q, block_tables, seq_lens):
        cache = jsm.ultraquant_store(cache, k, v, slot_mapping)
        out = jsm.ultraquant_decode(
            q, cache, block_tables, seq_lens, num_partitions=2, implementation=impl
        )
        return cache, out

    q, _, tables, seq_lens = case.args()
    rest = (case.k, case.v, jnp.asarray(case.slot_mapping), q, tables, seq_lens)
    plain_cache, plain_out = jax.jit(step)(jnp.asarray(garbage), *rest)
    donated = jnp.asarray(garbage)
    cache, out = jax.jit(step, donate_argnums=0)(donated, *rest)
    assert donated.is_deleted(), "the cache was not donated"
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(plain_cache))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain_out, np.float32))
    impls.check_uq(impl, case, out, num_partitions=2)  # the case's cache has the same tokens
