"""Hypothesis property tests: random CSR structures, partial sets, and codec inputs, always
against the oracle. Shapes are fixed per test so each compiles once. The ops run the exact "xla"
path (the checks use its tolerance; the suites of test_sparse_mla / test_mla_decode run every
implementation)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jax_sparse_mla as jsm
from jax_sparse_mla import formats as F
from tests import cases as C
from tests import oracle as O

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODEC_SETTINGS = settings(SETTINGS, max_examples=60)

# ---------------------------------------------------------------------------------------------
# sparse_mla over arbitrary CSR structures (including non-monotone indptr and pointers past
# len(idx), which are masked)
# ---------------------------------------------------------------------------------------------

N_Q, H, R, NNZ = 4, 2, 12, 24
_R = C.rng(123)
KV = C.make_records(_R, R)
Q = C.bf16_normal(_R, (N_Q, H, 576))
_sparse = jax.jit(functools.partial(jsm.sparse_mla, return_lse=True, implementation="xla"))


@SETTINGS
@given(
    idx=st.lists(st.integers(-3, R + 3), min_size=NNZ, max_size=NNZ),
    indptr=st.lists(st.integers(-4, NNZ + 4), min_size=N_Q + 1, max_size=N_Q + 1),
    monotone=st.booleans(),
)
def test_sparse_mla_random_csr(idx, indptr, monotone):
    idx = np.int32(idx)
    indptr = np.int32(sorted(indptr) if monotone else indptr)
    out, lse = _sparse(Q, jnp.asarray(KV), jnp.asarray(idx), jnp.asarray(indptr))
    ref, ref_lse, stats = O.sparse_mla(Q, KV, idx, indptr, None, True)
    O.check_attention(out, ref, stats, lse, ref_lse)


@SETTINGS
@given(
    topk=hnp.arrays(np.int32, (N_Q, 6), elements=st.integers(-1, R - 1)),
)
def test_sparse_mla_dense_topk(topk):
    idx, indptr = jsm.dense_to_csr(jnp.asarray(topk))
    out, lse = _sparse(Q, jnp.asarray(KV), idx, indptr)
    ref, ref_lse, stats = O.sparse_mla(Q, KV, topk.reshape(-1), np.arange(N_Q + 1) * 6, None, True)
    O.check_attention(out, ref, stats, lse, ref_lse)


# ---------------------------------------------------------------------------------------------
# mla_decode: random request boundaries / masked indices; answer independent of num_splits
# ---------------------------------------------------------------------------------------------

B, TOK, NIDX = 2, 300, 280
_DC = C.decode_case(321, seq_lens=(NIDX,), qlen=1, h=H, n_nan=TOK - NIDX)
DQ = {qlen: C.bf16_normal(_R, (B * qlen, H, 576)) for qlen in (1, 2)}


@functools.cache
def _decode(qlen, num_splits):
    return jax.jit(
        functools.partial(
            jsm.mla_decode,
            qlen=qlen,
            num_splits=num_splits,
            return_lse=True,
            k_scale=_DC.k_scale,
            v_scale=_DC.v_scale,
            implementation="xla",
        )
    )


@SETTINGS
@given(
    cuts=st.lists(st.integers(0, NIDX), min_size=B - 1, max_size=B - 1),
    end=st.integers(0, NIDX),
    masked=st.lists(st.integers(0, NIDX - 1), max_size=20),
    qlen=st.sampled_from([1, 2]),
    num_splits=st.sampled_from([None, 1, 2, 3]),
)
def test_mla_decode_random_requests(cuts, end, masked, qlen, num_splits):
    indptr = np.int32(sorted([0, *cuts, end])) if max(cuts) <= end else np.int32([0, end, end])
    indices = np.array(_DC.kv_indices, copy=True)
    indices[np.asarray(masked, np.int64)] = -1
    q = DQ[qlen]
    out, lse = _decode(qlen, num_splits)(q, _DC.kv, jnp.asarray(indices), jnp.asarray(indptr))
    ref, ref_lse, stats = O.mla_decode(
        q, _DC.kv_codes, indices, indptr, qlen, _DC.k_scale, _DC.v_scale, stats=True
    )
    O.check_attention(out, ref, stats, lse, ref_lse)


# ---------------------------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------------------------

_merge = jax.jit(functools.partial(jsm.merge_attn_states, return_lse=True, implementation="xla"))


@SETTINGS
@given(
    lse=hnp.arrays(
        np.float32,
        (3, 4, 2),
        elements=st.one_of(st.just(-np.inf), st.floats(-80, 80, width=32)),
    ),
    o=hnp.arrays(np.float32, (3, 4, 2, 8), elements=st.floats(-100, 100, width=32)),
)
def test_merge_random(lse, o):
    o = np.where(np.isneginf(lse)[..., None], 0, o).astype(np.float32)
    got, got_lse = _merge(jnp.asarray(o), jnp.asarray(lse))
    ref, ref_lse = O.merge_attn_states(o, lse)
    omax = np.max(np.abs(o), axis=1)
    assert np.all(np.abs(np.asarray(got, np.float64) - ref) <= 2.0**-20 * omax + 1e-30)
    got_lse = np.asarray(got_lse)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.all(np.abs(got_lse[fin] - ref_lse[fin]) <= 2.0**-21 * (np.abs(ref_lse[fin]) + 1))


# ---------------------------------------------------------------------------------------------
# codecs on arbitrary float32 inputs
# ---------------------------------------------------------------------------------------------

_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_pack = jax.jit(jsm.pack_fp8_ds_mla)
_uq_quantize = jax.jit(F.ultraquant_quantize)


@CODEC_SETTINGS
@given(
    lat=hnp.arrays(np.float32, (2, 512), elements=_f32),
    rope=hnp.arrays(np.float32, (2, 64), elements=_f32),
    exp=st.integers(-30, 30),
)
def test_pack_arbitrary_floats(lat, rope, exp):
    with np.errstate(over="ignore"):
        lat = (lat * np.float32(2.0**exp)).astype(np.float32)  # hypothesis' values, rescaled
    lat = np.where(np.isfinite(lat), lat, 0).astype(np.float32)
    got = np.asarray(_pack(jnp.asarray(lat), jnp.asarray(rope)))
    want = O.pack_fp8_ds_mla(lat, rope)
    # FTZ: XLA on CPU may flush float32 subnormal *inputs*; they quantize to +-0 either way, so
    # compare everything except the sign of a zero code coming from a subnormal input
    sub = (np.abs(lat) < np.float32(2.0**-126)) & (lat != 0)
    codes_g, codes_w = got[:, :512], want[:, :512]
    zero_code = (codes_w & 0x7F) == 0
    mask = sub & zero_code
    np.testing.assert_array_equal(np.where(mask, 0, codes_g), np.where(mask, 0, codes_w))
    np.testing.assert_array_equal(got[:, 512:528], want[:, 512:528])
    np.testing.assert_array_equal(got[:, 528:], want[:, 528:])


@CODEC_SETTINGS
@given(
    x=hnp.arrays(np.float32, (2, 256), elements=_f32),
    exp=st.integers(-140, 100),
)
def test_ultraquant_quantize_arbitrary_floats(x, exp):
    with np.errstate(over="ignore"):
        x = (x.astype(np.float64) * 2.0**exp).astype(np.float32)
    x = np.where(np.isfinite(x), x, 0).astype(np.float32)
    codes, scales = _uq_quantize(jnp.asarray(x))
    w_codes, w_scales = O.uq_quantize(x)
    np.testing.assert_array_equal(np.asarray(scales), w_scales)
    np.testing.assert_array_equal(np.asarray(codes), w_codes)
