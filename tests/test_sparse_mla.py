"""sparse_mla against the float64 oracle, every implementation (tests/impls.py) with its own
tolerance."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels.mosaic import sparse_mla as mosaic_sparse
from tests import cases as C
from tests import impls
from tests import oracle as O


def run(case, impl, jit=True):
    if jit:
        f = impls.with_scales(jsm.sparse_mla, impl, dict(sm_scale=case.sm_scale), return_lse=True)
    else:
        f = functools.partial(
            jsm.sparse_mla, sm_scale=case.sm_scale, return_lse=True, implementation=impl
        )
    out, lse = f(*case.args())
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert out.shape == (*case.q.shape[:2], 512) and lse.shape == case.q.shape[:2]
    return out, lse


def check(impl, case, out, lse, what="sparse_mla"):
    impls.check_sparse(impl, case, out, lse, what)


@impls.each_sparse
@pytest.mark.parametrize("h", [1, 12, 16, 40, 64, 96, 128])
def test_heads(impl, h):
    """Heads in one Mosaic CTA (up to 32; past 32 the 64-head CTAs, the lists being short:
    40 in one with 24 empty rows, 96 in two, the second half empty) and over several that walk
    the same keys."""
    case = C.sparse_case(10 + h, n_q=5 if h < 128 else 3, h=h)
    check(impl, case, *run(case, impl))


@impls.each_sparse
@pytest.mark.parametrize(
    "n_q, h, max_len",
    [(3, 40, 2600), (3, 128, 2600), (34, 128, 1300), (20, 40, 1300), (18, 96, 700)],
)
def test_long_lists_at_many_heads(impl, n_q, h, max_len):
    """Key lists of up to 40 tiles of 64 at 40 to 128 heads: several Mosaic CTAs per query
    row, each walking every tile through its ring of record stages many times over (n_q=3:
    the 32-row CTAs, the lists split; n_q=34: 68 CTAs of 64 heads, one split each; n_q=20 and
    18: CTAs of 64 heads, the lists split, rows past the heads in the last CTA unused)."""
    case = C.sparse_case(30 + h + n_q, n_q=n_q, h=h, n_rec=3000, min_len=100, max_len=max_len)
    check(impl, case, *run(case, impl))


@pytest.mark.parametrize("n_q,h", [(4, 2), (128, 16)])
def test_default_is_the_platform_choice(n_q, h):
    """implementation=None runs what it picks on this machine (impls.default): the same
    results, within that implementation's tolerance, jitted and eager."""
    case = C.sparse_case(1, n_q=n_q, h=h, n_rec=20)
    chosen = impls.default("sparse_mla")
    out, lse = run(case, None)
    out2, lse2 = run(case, chosen)
    np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
    check(chosen, case, out, lse)
    check(chosen, case, *run(case, None, jit=False), "eager")


@impls.each_sparse
@pytest.mark.parametrize("kv_lead", [(46,), (2, 23), (2, 23, 1)])
def test_kv_leading_shapes(impl, kv_lead):
    case = C.sparse_case(2, n_q=4, h=3, n_rec=40, n_nan=6, kv_lead=kv_lead)
    check(impl, case, *run(case, impl))


@impls.each_sparse
@pytest.mark.parametrize("sm_scale,q_scale", [(None, 1.0), (0.5, 1.0), (0.01, 4.0), (0.3, 8.0)])
def test_scales(impl, sm_scale, q_scale):
    # includes a very peaky softmax (scores of several hundred)
    case = C.sparse_case(3, n_q=6, h=4, sm_scale=sm_scale, q_scale=q_scale)
    check(impl, case, *run(case, impl))


@impls.each_sparse
def test_masking_and_empty_rows(impl):
    r = C.rng(4)
    n_rec = 15  # records 12..14 are NaN garbage that no entry references
    kv = C.make_records(r, n_rec, nan_rows=[12, 13, 14])
    big = 2**31 - 1
    rows = [
        [],  # empty
        [-1, -1],  # all -1
        [n_rec, n_rec + 1, big, -(2**31), -2],  # all out of range (not clamped)
        [11],  # the last valid record (a clamp of n_rec would hit the NaN record 14)
        [3],  # one key
        [3, 3, 3, 5],  # duplicates count once each
        [5, -1, n_rec, 3, 3, -5],  # mixed
        list(range(12)),
    ]
    idx = np.int32([e for row in rows for e in row])
    indptr = np.int32(np.cumsum([0] + [len(row) for row in rows]))
    q = C.bf16_normal(r, (len(rows), 4, 576))
    case = C.SparseCase(q, kv, idx, indptr)
    out, lse = run(case, impl)
    check(impl, case, out, lse)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    for row in (0, 1, 2):
        assert np.all(out[row] == 0) and np.all(np.isneginf(lse[row]))
    assert np.all(np.isfinite(lse[3:]))
    # duplicates: [3,3,3,5] == softmax with weight 3 on record 3
    assert not np.allclose(out[5], out[4])


@impls.each_sparse
def test_indptr_unusual(impl):
    # decreasing indptr -> empty row; positions past len(idx) are masked
    case = C.sparse_case(5, n_q=5, h=2, n_rec=30)
    nnz = len(case.idx)
    indptr = np.int32([0, 5, 3, 7, nnz, nnz + 9])
    case.indptr = indptr
    out, lse = run(case, impl)
    check(impl, case, out, lse)
    assert np.all(np.isneginf(np.asarray(lse)[1]))


@impls.each_sparse
def test_indptr_negative_start(impl):
    case = C.sparse_case(6, n_q=3, h=2, n_rec=30, min_len=4)
    case.indptr = np.int32([-3, 2, 2, len(case.idx)])
    check(impl, case, *run(case, impl))


@impls.each_sparse
def test_random_csr_structures(impl):
    for seed in range(3):
        case = C.sparse_case(100 + seed, n_q=24, h=2, n_rec=50, max_len=60, p_neg=0.2, p_oob=0.1)
        check(impl, case, *run(case, impl), f"seed {seed}")


@impls.each_sparse
def test_long_rows(impl):
    # a row of 1 key, a row of > 4096 keys, rows of 4095..4097 around a power-of-two tile
    case = C.sparse_case(
        7,
        n_q=6,
        h=2,
        n_rec=300,
        max_len=8,
        long_rows={0: 1, 1: 5000, 2: 4096, 3: 4097, 4: 129},
    )
    check(impl, case, *run(case, impl))


@impls.each_sparse
def test_all_nan_unreferenced_only(impl):
    # every record except the referenced ones is NaN; no row may see it
    r = C.rng(8)
    kv = C.nan_records(64)
    good = np.int32([3, 17, 40, 41])
    kv[good] = C.make_records(r, 4)
    idx = np.int32([3, 17, -1, 64, 40, 41, 3, -1])
    indptr = np.int32([0, 2, 4, 4, 8])
    case = C.SparseCase(C.bf16_normal(r, (4, 16, 576)), kv, idx, indptr)
    check(impl, case, *run(case, impl))


@impls.each_sparse
def test_referenced_nan_record_propagates(impl):
    # Corrupt data that a valid index reaches must surface as NaN in its row only, not be hidden
    # as an empty row (out 0, lse -inf).
    r = C.rng(9)
    kv = C.make_records(r, 8)
    kv[5] = C.nan_records(1)[0]
    idx = np.int32([1, 5, 2, 3])
    indptr = np.int32([0, 2, 4])
    case = C.SparseCase(C.bf16_normal(r, (2, 4, 576)), kv, idx, indptr)
    out, lse = run(case, impl)
    assert np.isnan(np.asarray(out[0], np.float32)).all() and np.isnan(np.asarray(lse[0])).all()
    clean = C.SparseCase(case.q[1:], kv, idx[2:], np.int32([0, 2]))
    check(impl, clean, out[1:], lse[1:], "the row without the NaN record")


@impls.each_sparse
def test_dense_to_csr(impl):
    r = C.rng(9)
    topk = r.integers(-1, 30, (7, 5)).astype(np.int32)
    idx, indptr = jsm.dense_to_csr(jnp.asarray(topk))
    assert idx.dtype == jnp.int32 and indptr.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), topk.reshape(-1))
    np.testing.assert_array_equal(np.asarray(indptr), np.arange(8) * 5)
    kv = C.make_records(r, 30)
    q = C.bf16_normal(r, (7, 2, 576))
    case = C.SparseCase(q, kv, np.asarray(idx), np.asarray(indptr))
    check(impl, case, *run(case, impl))


@impls.each_sparse
def test_return_lse_false(impl):
    case = C.sparse_case(11, n_q=3, h=2)
    out = jsm.sparse_mla(
        case.q,
        jnp.asarray(case.kv),
        jnp.asarray(case.idx),
        jnp.asarray(case.indptr),
        implementation=impl,
    )
    assert not isinstance(out, tuple) and out.shape == (3, 2, 512)
    check(impl, case, out, None)


@impls.each_sparse
@pytest.mark.parametrize("h", [3, 64])
def test_large_scales_and_extreme_records(impl, h):
    """Scale 2^7 records (|latent| up to 57344), zero records (scale 2^-13) and tiny ones
    (1e-6) in the same key lists, q of 1e-3; at 64 heads Mosaic's 64-head kernel, which
    multiplies each record's codes by its scales before the wgmmas."""
    r = C.rng(12)
    lat = C.random_latent(r, 16)
    lat[0] = 0.0
    lat[1] *= 57344 / np.max(np.abs(lat[1]))
    lat[2] *= 1e-6
    kv = O.pack_fp8_ds_mla(lat, C.random_rope(r, 16))
    idx = np.int32([0, 0, 1, 2, 2, 3, 0, 4, 5, 6, 1])
    indptr = np.int32([0, 2, 3, 5, 11])
    q = C.bf16_normal(r, (4, h, 576), 1e-3)
    assert mosaic_sparse.uses_wide(4, h, idx.size) == (h == 64)
    case = C.SparseCase(q, kv, idx, indptr, sm_scale=0.02)
    check(impl, case, *run(case, impl))


@impls.each_sparse
@pytest.mark.parametrize("h", [16, 64])
def test_chunk_scales_growing_and_shrinking_along_a_list(impl, h):
    """Records whose latent magnitudes (so chunk scales) run from 2^-24 up to 2^6 and back
    down along one key list of five tiles, beside ropes of magnitude 1: each tile's scales
    span several binades and the online softmax rescales across them (at 64 heads in Mosaic's
    64-head kernel); the small records after the large ones still count."""
    r = C.rng(15)
    n, n_q = 320, 17  # 17 rows: the 64-head kernel (``uses_wide``)
    binades = np.concatenate([np.linspace(-24, 6, n // 2), np.linspace(6, -24, n // 2)])
    lat = C.random_latent(r, n) * 2.0 ** np.round(binades)[:, None]
    kv = O.pack_fp8_ds_mla(lat, C.random_rope(r, n))
    idx = np.tile(np.arange(n, dtype=np.int32), n_q)
    indptr = np.arange(n_q + 1, dtype=np.int32) * n
    assert mosaic_sparse.uses_wide(n_q, h, idx.size) == (h == 64)
    case = C.SparseCase(C.bf16_normal(r, (n_q, h, 576)), kv, idx, indptr, sm_scale=0.05)
    check(impl, case, *run(case, impl))


def test_tolerance_catches_bf16_scores():
    """Meta-test: the comparison must reject an attention that rounds the scores / P to bf16 or
    rounds the output twice (plausible kernel shortcuts), with the same data as the tests."""
    case = C.sparse_case(13, n_q=6, h=4, n_rec=40, max_len=40, min_len=20, p_neg=0, p_oob=0)
    ref, ref_lse, st = O.sparse_mla(case.q, case.kv, case.idx, case.indptr, None, True)
    out, lse = run(case, "xla")
    O.check_attention(out, ref, st, lse, ref_lse)
    # scores with q.k rounded to bf16 (a bf16 score matmul)
    bad, bad_lse = O.sparse_mla(
        case.q, case.kv, case.idx, case.indptr, None, dot_transform=O.round_bf16
    )
    with pytest.raises(AssertionError):
        O.check_attention(O.round_bf16(bad), ref, st, lse, ref_lse)
    with pytest.raises(AssertionError):
        O.check_attention(out, ref, st, bad_lse, ref_lse)


@impls.each_sparse
def test_degenerate_shapes(impl):
    r = C.rng(14)
    q = C.bf16_normal(r, (3, 2, 576))
    kv = C.make_records(r, 5)
    # no entries at all; a cache with zero rows; zero query rows
    for kv_, idx, indptr in (
        (kv, np.zeros(0, np.int32), np.zeros(4, np.int32)),
        (kv[:0], np.int32([0, 1, -1]), np.int32([0, 1, 2, 3])),
    ):
        case = C.SparseCase(q, kv_, idx, indptr)
        out, lse = run(case, impl, jit=False)
        check(impl, case, out, lse)
        assert np.all(np.isneginf(np.asarray(lse)))
    out, lse = jsm.sparse_mla(
        q[:0],
        jnp.asarray(kv),
        jnp.zeros(0, jnp.int32),
        jnp.zeros(1, jnp.int32),
        return_lse=True,
        implementation=impl,
    )
    assert out.shape == (0, 2, 512) and lse.shape == (0, 2)
