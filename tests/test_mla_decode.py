"""mla_decode, mla_decode_partials and merge_attn_states against the float64 oracle, every
implementation (tests/impls.py) with its own tolerance."""

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
from tests.pallas_checks import P_ROUNDING


def run(case, impl, num_splits=None):
    out, lse = impls.decode_fn(jsm.mla_decode, impl, case, num_splits=num_splits, return_lse=True)(
        *case.args()
    )
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert out.shape == (*case.q.shape[:2], 512) and lse.shape == case.q.shape[:2]
    return out, lse


def partials(case, impl, num_splits):
    return impls.decode_partials(impl, case, num_splits)


def oracle(case, num_splits=None):
    return C.decode_oracle(case, num_splits=num_splits, stats=True)


@impls.each_decode
@pytest.mark.parametrize("qlen", [1, 2, 4])
@pytest.mark.parametrize("as_uint8", [False, True])
def test_decode(impl, qlen, as_uint8):
    case = C.decode_case(qlen, seq_lens=(1, 37, 300, 5), qlen=qlen, h=4, as_uint8=as_uint8)
    impls.check_decode(impl, case, *run(case, impl))


@impls.each_decode
@pytest.mark.parametrize("qlen,h", [(2, 1), (2, 16), (2, 128), (1, 48), (1, 128)])
def test_decode_heads(impl, qlen, h):
    """A request's rows in one Mosaic CTA or in several that walk the same keys, causal
    (qlen 2) or not (qlen 1: 48 heads take two CTAs, 128 four)."""
    case = C.decode_case(20 + h, seq_lens=(130, 3), qlen=qlen, h=h)
    impls.check_decode(impl, case, *run(case, impl))


@impls.each_decode
@pytest.mark.parametrize("binades", [24, -40])
def test_decode_q_far_outside_float16s_range(impl, binades):
    """q times 2^24 (up to about 10^8, past float16's 65504) or 2^-40 (float16 subnormals and
    below), with sm_scale taking the factor back so that the softmax is the usual one: the
    Mosaic kernel's float16 operands stage q times a power of two (``q_rows_ptx``), which must
    keep both within the bounds of bf16 q."""
    case = C.decode_case(9, seq_lens=(70, 200), qlen=2, h=16)
    case = dataclasses.replace(case, q=case.q * 2.0**binades, sm_scale=2.0**-binades / np.sqrt(576))
    impls.check_decode(impl, case, *run(case, impl))


@impls.each_decode
def test_decode_heads_2_to_the_80_apart(impl):
    """One request's heads at 2^40 and 2^-40 times the others: each row of q gets its own scale
    in the Mosaic kernel's float16 staging (``q_max_ptx``), so no head's magnitude (a one-hot
    softmax at 2^40, a flat one at 2^-40) moves another's result."""
    case = C.decode_case(10, seq_lens=(90, 33), qlen=1, h=16)
    factor = np.ones(16, np.float32)
    factor[[0, 9]], factor[[3, 12]] = 2.0**40, 2.0**-40
    case = dataclasses.replace(case, q=case.q * jnp.asarray(factor, jnp.bfloat16)[None, :, None])
    impls.check_decode(impl, case, *run(case, impl))


def test_default_is_the_platform_choice():
    """implementation=None (eager, default scales) runs what it picks on this machine."""
    case = C.decode_case(3, seq_lens=(9, 40), qlen=1, h=2, k_scale=1.0, v_scale=1.0)
    chosen = impls.default("mla_decode")
    out, lse = jsm.mla_decode(*case.args(), return_lse=True)
    impls.check_decode(chosen, case, out, lse)
    out2 = jsm.mla_decode(*case.args(), implementation=chosen)
    np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))


@impls.each_decode
def test_decode_masked_indices_and_short_sequences(impl):
    # masked indices occupy positions; seq_len < qlen leaves early rows without keys; seq_len 0
    case = C.decode_case(4, seq_lens=(0, 1, 3, 200, 2), qlen=4, h=3, p_masked=0.3)
    out, lse = run(case, impl)
    impls.check_decode(impl, case, out, lse)
    lse = np.asarray(lse)
    assert np.all(np.isneginf(lse[0:4]))  # request 0: no keys
    assert np.all(np.isneginf(lse[4:7]))  # request 1: 1 key, positions 0..2 see j <= -3..-1


@pytest.mark.parametrize(
    "impl, num_splits",
    [
        (i, s)
        for i in impls.available("mla_decode")
        # None: the implementation's own choice of splits
        for s in ((None, 1, 2, 3, 4, 5, 7, 8, 16) if i == "xla" else (None, 1, 3, 16))
    ],
)
def test_num_splits_same_answer(impl, num_splits):
    case = C.decode_case(5, seq_lens=(1, 127, 128, 129, 600, 1000), qlen=2, h=2, p_masked=0.05)
    out, lse = run(case, impl, num_splits)
    impls.check_decode(impl, case, out, lse, num_splits, what=f"num_splits={num_splits}")


@pytest.mark.parametrize(
    "impl, num_splits",
    [
        (i, s)
        for i in impls.common("mla_decode_partials", "merge_attn_states")
        for s in ((1, 2, 3, 16) if i == "xla" else (1, 3, 16))
    ],
)
@pytest.mark.parametrize("qlen", [1, 3])
def test_partials(impl, num_splits, qlen):
    case = C.decode_case(
        6 + qlen, seq_lens=(0, 2, 128, 129, 257, 700), qlen=qlen, h=2, p_masked=0.1
    )
    if qlen == 3 and impl == "flydsl":
        pytest.skip("the flydsl kernels serve qlen 1 / 2 / 4")
    o_parts, lse_parts = partials(case, impl, num_splits)
    impls.check_partials(impl, case, num_splits, o_parts, lse_parts)
    if impl in impls.GFX950:
        return  # merging them: test_decode (the bound of merged gfx950 partials)
    # merging the partials gives the full answer
    merge = impls.jitted(jsm.merge_attn_states, return_lse=True, implementation=impl)
    o, lse = merge(o_parts, lse_parts)
    ref, ref_lse, st = oracle(case)
    # the partials were rounded to bf16 first: allow that rounding (2^-8 relative per partial)
    # on top of the output rounding
    n_keys, vmax, sabs = O.stats_atol(st, ref_lse.shape)
    err = np.abs(O.to_f64(o) - ref)
    tol = (
        2.0**-7 * np.abs(ref)
        + O.attn_atol(n_keys, vmax, sabs)[..., None]
        + 2.0**-9 * np.max(np.abs(O.to_f64(o_parts)), axis=1)
        + (P_ROUNDING * vmax[..., None] if impl in impls.BF16_P else 0.0)
    )
    assert np.all(err <= tol)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(np.asarray(lse)), ~fin)
    lse = np.asarray(lse)
    assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= O.lse_atol(n_keys, sabs, ref_lse)[fin])


@impls.each_partials
def test_partials_eager(impl):
    case = C.decode_case(8, seq_lens=(3, 300), qlen=1, h=2)
    o_parts, lse_parts = jsm.mla_decode_partials(
        *case.args(),
        k_scale=case.k_scale,
        v_scale=case.v_scale,
        num_splits=3,
        implementation=impl,
    )
    impls.check_partials(impl, case, 3, o_parts, lse_parts)
    lse_parts = np.asarray(lse_parts)
    # request 0 (3 keys): c = 128, splits 1 and 2 are empty
    assert np.all(np.isneginf(lse_parts[0, 1:])) and np.all(np.asarray(o_parts)[0, 1:] == 0)
    # request 1 (300 keys): c = 128 -> splits [0,128), [128,256), [256,300) all non-empty
    assert np.all(np.isfinite(lse_parts[1]))


def test_tolerance_catches_bf16_k():
    """Meta-test: with a non-power-of-two k_scale, K = code * k_scale is not exact in bf16; an
    implementation that rounds K (or the score) to bf16 must fail the comparison."""
    case = C.decode_case(9, seq_lens=(60, 200, 90), qlen=1, h=8)
    ref, ref_lse, st = oracle(case)
    out, lse = run(case, "xla")
    O.check_attention(out, ref, st, lse, ref_lse)
    bad, bad_lse = C.decode_oracle(case, k_transform=O.round_bf16)
    with pytest.raises(AssertionError):
        O.check_attention(O.round_bf16(bad), ref, st, bad_lse, ref_lse)
    with pytest.raises(AssertionError):
        O.check_attention(out, ref, st, bad_lse, ref_lse)


# ---------------------------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------------------------


def _random_partials(seed, n=6, s=5, h=3, d=512, p_inf=0.3, dtype=np.float32):
    r = C.rng(seed)
    o = r.standard_normal((n, s, h, d)).astype(np.float32)
    lse = (r.standard_normal((n, s, h)) * 5).astype(np.float32)
    inf = r.random((n, s, h)) < p_inf
    inf[0] = True  # an all -inf row
    inf[1, :, 0] = True
    inf[2, 1:] = True  # a single finite partial
    lse[inf] = -np.inf
    o = np.where(inf[..., None], 0.0, o).astype(np.float32)
    if dtype == jnp.bfloat16:
        o = np.asarray(O.round_bf16(o), np.float32)
    return jnp.asarray(o, dtype), jnp.asarray(lse), inf


@impls.each_merge
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
def test_merge(impl, dtype, jit):
    if impl == "flydsl" and dtype == jnp.float32:
        pytest.skip("the flydsl combine kernel takes bf16 partials")
    o_parts, lse_parts, _ = _random_partials(10, dtype=dtype)
    f = functools.partial(jsm.merge_attn_states, return_lse=True, implementation=impl)
    o, lse = (jax.jit(f) if jit else f)(o_parts, lse_parts)
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert o.shape == (6, 3, 512) and lse.shape == (6, 3)
    ref, ref_lse = O.merge_attn_states(o_parts, lse_parts)
    tol, lse_tol = impls.merge_tolerance(impl, o_parts, lse_parts, ref, ref_lse)
    o64, lse_np = O.to_f64(o), np.asarray(lse)
    O.assert_within(o64, ref, tol, f"merge [{impl}]")
    assert np.array_equal(np.isneginf(lse_np), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.all(np.abs(lse_np[fin] - ref_lse[fin]) <= lse_tol[fin])
    assert np.all(o64[0] == 0) and np.all(np.isneginf(lse_np[0]))
    # a single finite partial comes back unchanged (the gfx950 combine writes bf16)
    if dtype == jnp.bfloat16 or impl not in impls.GFX950:
        np.testing.assert_array_equal(o64[2], O.to_f64(o_parts)[2, 0])
        assert np.array_equal(lse_np[2], np.asarray(lse_parts)[2, 0])


def test_merge_return_lse_false_and_large_lse():
    # lse of very different magnitudes (one partial dominates; exp would overflow unshifted)
    o_parts = jnp.asarray(np.float32([[[[1.0, 2.0]], [[3.0, 4.0]]]]))
    lse_parts = jnp.asarray(np.float32([[[1000.0], [900.0]]]))
    o = jsm.merge_attn_states(o_parts, lse_parts)
    assert not isinstance(o, tuple)
    np.testing.assert_allclose(np.asarray(o), [[[1.0, 2.0]]], rtol=1e-6)
    o, lse = jsm.merge_attn_states(
        o_parts, jnp.asarray(np.float32([[[3.0], [3.0]]])), return_lse=True
    )
    np.testing.assert_allclose(np.asarray(o), [[[2.0, 3.0]]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), [[3 + np.log(2)]], rtol=1e-6)


@impls.each_merge
def test_merge_ignores_o_of_empty_partials(impl):
    # a -inf partial has weight 0: whatever its o holds (here NaN / inf garbage) must not leak
    # (bf16 partials for "flydsl", whose combine kernel takes those)
    dtype = jnp.bfloat16 if impl == "flydsl" else jnp.float32
    o_parts, lse_parts, inf = _random_partials(11, dtype=dtype)
    o_bad = np.where(inf[..., None], np.nan, np.asarray(o_parts))
    o_bad[..., 0] = np.where(inf, np.inf, o_bad[..., 0])
    o, lse = jsm.merge_attn_states(
        jnp.asarray(o_bad, dtype), lse_parts, return_lse=True, implementation=impl
    )
    ref, ref_lse = O.merge_attn_states(o_parts, lse_parts)
    tol, _ = impls.merge_tolerance(impl, o_parts, lse_parts, ref, ref_lse)
    O.assert_within(o, ref, tol, f"merge [{impl}]")


@impls.each_of("mla_decode", "merge_attn_states")
def test_merge_decode_context_parallel(impl):
    # two "devices" each holding half of every request's keys (by index), merged
    case = C.decode_case(12, seq_lens=(50, 260), qlen=1, h=2)
    halves = []
    for part in range(2):
        idx = np.array(case.kv_indices, copy=True)
        keep = (np.arange(len(idx)) % 2) == part
        idx[~keep] = -1
        out, lse = impls.decode_fn(jsm.mla_decode, impl, case, return_lse=True)(
            case.q, case.kv, jnp.asarray(idx), jnp.asarray(case.kv_indptr)
        )
        halves.append((out, lse))
    o_parts, lse_parts = (jnp.stack(x, axis=1) for x in zip(*halves, strict=True))
    o, lse = jsm.merge_attn_states(o_parts, lse_parts, return_lse=True, implementation=impl)
    ref, ref_lse, st = oracle(case)
    n_keys, vmax, sabs = O.stats_atol(st, ref_lse.shape)
    # each half within 2^-8 of its value (bf16), the merge's bf16 output 2^-8 more; P rounded
    # to bf16 ("pallas", "mosaic") or split into fp8 hi + lo (gfx950: within 2^-8 P) adds
    # 2^-8 max|V|
    p_term = 2.0**-9 + (0.0 if impl == "xla" else 2.0**-8)
    assert np.all(np.abs(O.to_f64(o) - ref) <= 2.0**-7 * np.abs(ref) + p_term * vmax[..., None])
    assert np.all(np.abs(np.asarray(lse) - ref_lse) <= O.lse_atol(n_keys, sabs, ref_lse) * 2)


@impls.each_of("mla_decode", "mla_decode_partials")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_non_monotone_indptr(impl, num_splits):
    # without validate, request r reads kv_indices[indptr[r]:indptr[r+1]] (empty when reversed)
    case = C.decode_case(13, seq_lens=(20, 30, 10), qlen=2, h=2)
    case.kv_indptr = np.int32([0, 30, 25, 60])
    out, lse = run(case, impl, num_splits)
    impls.check_decode(impl, case, out, lse, num_splits)
    assert np.all(np.isneginf(np.asarray(lse)[2:4]))
    o_parts, lse_parts = partials(case, impl, num_splits)
    impls.check_partials(impl, case, num_splits, o_parts, lse_parts)
