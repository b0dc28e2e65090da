"""Hypothesis property tests: random CSR structures, partial sets, and codec inputs, always
against the oracle. Shapes are fixed per test so each compiles once. The op properties run on
every implementation (tests/impls.py) with its tolerance; interpret-mode Pallas, slow on a CPU,
draws fewer examples."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jax_sparse_mla as jsm
from jax_sparse_mla import formats as F
from tests import cases as C
from tests import impls
from tests import oracle as O

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODEC_SETTINGS = settings(SETTINGS, max_examples=60)


def op_settings(impl: str) -> settings:
    """The examples an op property draws for ``impl``: 20, or 5 for interpret-mode Pallas."""
    return settings(SETTINGS, max_examples=5) if impls.interpreted(impl) else SETTINGS


# ---------------------------------------------------------------------------------------------
# sparse_mla over arbitrary CSR structures (including non-monotone indptr and pointers past
# len(idx), which are masked)
# ---------------------------------------------------------------------------------------------

N_Q, H, R, NNZ = 4, 2, 12, 24
_R = C.rng(123)
KV = C.make_records(_R, R)
Q = C.bf16_normal(_R, (N_Q, H, 576))


def _sparse(impl, case):
    fn = impls.jitted(jsm.sparse_mla, return_lse=True, implementation=impl)
    return fn(*case.args())


@impls.each_sparse
def test_sparse_mla_random_csr(impl):
    @op_settings(impl)
    @given(
        idx=st.lists(st.integers(-3, R + 3), min_size=NNZ, max_size=NNZ),
        indptr=st.lists(st.integers(-4, NNZ + 4), min_size=N_Q + 1, max_size=N_Q + 1),
        monotone=st.booleans(),
    )
    def prop(idx, indptr, monotone):
        indptr = sorted(indptr) if monotone else indptr
        case = C.SparseCase(Q, KV, np.int32(idx), np.int32(indptr))
        impls.check_sparse(impl, case, *_sparse(impl, case))

    prop()


@impls.each_sparse
def test_sparse_mla_dense_topk(impl):
    @op_settings(impl)
    @given(topk=hnp.arrays(np.int32, (N_Q, 6), elements=st.integers(-1, R - 1)))
    def prop(topk):
        idx, indptr = jsm.dense_to_csr(jnp.asarray(topk))
        np.testing.assert_array_equal(np.asarray(indptr), np.arange(N_Q + 1) * 6)
        case = C.SparseCase(Q, KV, np.asarray(idx), np.asarray(indptr))
        impls.check_sparse(impl, case, *_sparse(impl, case))

    prop()


# ---------------------------------------------------------------------------------------------
# mla_decode: random request boundaries / masked indices; answer independent of num_splits
# ---------------------------------------------------------------------------------------------

B, TOK, NIDX = 2, 300, 280
_DC = C.decode_case(321, seq_lens=(NIDX,), qlen=1, h=H, n_nan=TOK - NIDX)
DQ = {qlen: C.bf16_normal(_R, (B * qlen, H, 576)) for qlen in (1, 2)}


@impls.each_decode
def test_mla_decode_random_requests(impl):
    @op_settings(impl)
    @given(
        cuts=st.lists(st.integers(0, NIDX), min_size=B - 1, max_size=B - 1),
        end=st.integers(0, NIDX),
        masked=st.lists(st.integers(0, NIDX - 1), max_size=20),
        qlen=st.sampled_from([1, 2]),
        num_splits=st.sampled_from([None, 1, 2, 3]),
    )
    def prop(cuts, end, masked, qlen, num_splits):
        indptr = np.int32(sorted([0, *cuts, end])) if max(cuts) <= end else np.int32([0, end, end])
        indices = np.array(_DC.kv_indices, copy=True)
        indices[np.asarray(masked, np.int64)] = -1
        case = dataclasses.replace(_DC, q=DQ[qlen], kv_indices=indices, kv_indptr=indptr, qlen=qlen)
        fn = impls.decode_fn(jsm.mla_decode, impl, case, num_splits=num_splits, return_lse=True)
        impls.check_decode(impl, case, *fn(*case.args()), num_splits)

    prop()


# ---------------------------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------------------------


@impls.each_merge
def test_merge_random(impl):
    # "flydsl"'s combine kernel takes bf16 partials of 512 dims: the drawn ones, zero-padded
    dtype, dim = (jnp.bfloat16, 512) if impl == "flydsl" else (jnp.float32, 8)
    merge = impls.jitted(jsm.merge_attn_states, return_lse=True, implementation=impl)

    @op_settings(impl)
    @given(
        lse=hnp.arrays(
            np.float32,
            (3, 4, 2),
            elements=st.one_of(st.just(-np.inf), st.floats(-80, 80, width=32)),
        ),
        o=hnp.arrays(np.float32, (3, 4, 2, 8), elements=st.floats(-100, 100, width=32)),
    )
    def prop(lse, o):
        o = np.where(np.isneginf(lse)[..., None], 0, o)
        o = jnp.asarray(np.pad(o, [(0, 0)] * 3 + [(0, dim - 8)]), dtype)
        got, got_lse = merge(o, jnp.asarray(lse))
        ref, ref_lse = O.merge_attn_states(o, lse)
        tol, lse_tol = impls.merge_tolerance(impl, o, lse, ref, ref_lse)
        # + 2^-100: XLA:CPU flushes f32 subnormals (drawn o, weighted terms) to zero
        O.assert_within(got, ref, tol + 2.0**-100, f"merge [{impl}]")
        got_lse = np.asarray(got_lse)
        assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        assert np.all(np.abs(got_lse[fin] - ref_lse[fin]) <= lse_tol[fin])

    prop()


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
