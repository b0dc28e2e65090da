"""mla_decode, mla_decode_partials and merge_attn_states against the float64 oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests import cases as C
from tests import oracle as O


@functools.cache
def _decode_fn(qlen, num_splits, sm_scale):
    return jax.jit(
        functools.partial(
            jsm.mla_decode, qlen=qlen, num_splits=num_splits, sm_scale=sm_scale, return_lse=True
        )
    )


@functools.cache
def _partials_fn(qlen, num_splits, sm_scale):
    return jax.jit(
        functools.partial(
            jsm.mla_decode_partials, qlen=qlen, num_splits=num_splits, sm_scale=sm_scale
        )
    )


def _args(case):
    return (case.q, case.kv, jnp.asarray(case.kv_indices), jnp.asarray(case.kv_indptr))


def run(case, num_splits=None):
    # k_scale / v_scale passed as 0-d arrays: traced under jit
    out, lse = _decode_fn(case.qlen, num_splits, case.sm_scale)(
        *_args(case), k_scale=jnp.float32(case.k_scale), v_scale=jnp.float32(case.v_scale)
    )
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert out.shape == (*case.q.shape[:2], 512) and lse.shape == case.q.shape[:2]
    return out, lse


def oracle(case, num_splits=None):
    return O.mla_decode(
        case.q, case.kv_codes, case.kv_indices, case.kv_indptr, case.qlen, case.k_scale,
        case.v_scale, case.sm_scale, num_splits=num_splits, stats=True,
    )  # fmt: skip


def check(case, out, lse, what="mla_decode"):
    ref, ref_lse, st = oracle(case)
    return O.check_attention(out, ref, st, lse, ref_lse, what=what)


def check_partials(case, s, o_parts, lse_parts):
    ref, ref_lse, st = oracle(case, num_splits=s)
    n, h = case.q.shape[:2]
    assert o_parts.shape == (n, s, h, 512) and lse_parts.shape == (n, s, h)
    assert o_parts.dtype == jnp.bfloat16 and lse_parts.dtype == jnp.float32
    # the full row's stats bound every split's (more keys, larger max|V| and score_abs)
    st_s = [x for x in st for _ in range(s)]
    ref_n = O.to_f64(ref).reshape(n * s, h, 512)
    return O.check_attention(
        np.asarray(o_parts, np.float32).reshape(n * s, h, 512), ref_n, st_s,
        np.asarray(lse_parts).reshape(n * s, h), ref_lse.reshape(n * s, h), what="partials",
    )  # fmt: skip


@pytest.mark.parametrize("qlen", [1, 2, 4])
@pytest.mark.parametrize("as_uint8", [False, True])
def test_decode(qlen, as_uint8):
    case = C.decode_case(qlen, seq_lens=(1, 37, 300, 5), qlen=qlen, h=4, as_uint8=as_uint8)
    out, lse = run(case)
    check(case, out, lse)


@pytest.mark.parametrize("h", [1, 16, 128])
def test_decode_heads(h):
    case = C.decode_case(20 + h, seq_lens=(130, 3), qlen=2, h=h)
    out, lse = run(case)
    check(case, out, lse)


def test_decode_eager_default_scales():
    case = C.decode_case(3, seq_lens=(9, 40), qlen=1, h=2, k_scale=1.0, v_scale=1.0)
    out, lse = jsm.mla_decode(*_args(case), return_lse=True)
    check(case, out, lse)
    out2 = jsm.mla_decode(*_args(case), implementation="xla")
    np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))


def test_decode_masked_indices_and_short_sequences():
    # masked indices occupy positions; seq_len < qlen leaves early rows without keys; seq_len 0
    case = C.decode_case(4, seq_lens=(0, 1, 3, 200, 2), qlen=4, h=3, p_masked=0.3)
    out, lse = run(case)
    check(case, out, lse)
    lse = np.asarray(lse)
    assert np.all(np.isneginf(lse[0:4]))  # request 0: no keys
    assert np.all(np.isneginf(lse[4:7]))  # request 1: 1 key, positions 0..2 see j <= -3..-1


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 5, 7, 8, 16])
def test_num_splits_same_answer(num_splits):
    case = C.decode_case(5, seq_lens=(1, 127, 128, 129, 600, 1000), qlen=2, h=2, p_masked=0.05)
    out, lse = run(case, num_splits)
    check(case, out, lse, what=f"mla_decode num_splits={num_splits}")
    out1, lse1 = run(case, None)
    # same answer up to float32 noise: lse within the f32 budget, out within bf16 rounding
    ref, ref_lse, st = oracle(case)
    n_keys, vmax, sabs = O.stats_atol(st, ref_lse.shape)
    fin = np.isfinite(ref_lse)
    lse, lse1 = np.asarray(lse), np.asarray(lse1)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse1))
    assert np.all(np.abs(lse[fin] - lse1[fin]) <= 2 * O.lse_atol(n_keys, sabs, ref_lse)[fin])
    # each is within 2^-8 |ref| + atol of the oracle, so they differ by at most twice that
    o, o1 = O.to_f64(out), O.to_f64(out1)
    atol = 2 * O.attn_atol(n_keys, vmax, sabs)[..., None]
    assert np.all(np.abs(o - o1) <= 2.0**-7 * np.maximum(np.abs(o), np.abs(o1)) + atol)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16])
@pytest.mark.parametrize("qlen", [1, 3])
def test_partials(num_splits, qlen):
    case = C.decode_case(
        6 + qlen, seq_lens=(0, 2, 128, 129, 257, 700), qlen=qlen, h=2, p_masked=0.1
    )
    o_parts, lse_parts = _partials_fn(qlen, num_splits, None)(
        *_args(case), k_scale=case.k_scale, v_scale=case.v_scale
    )
    check_partials(case, num_splits, o_parts, lse_parts)
    # merging the partials gives the full answer
    o, lse = jsm.merge_attn_states(o_parts, lse_parts, return_lse=True)
    ref, ref_lse, st = oracle(case)
    # the partials were rounded to bf16 first: allow that rounding (2^-8 relative per partial)
    # on top of the output rounding
    n_keys, vmax, sabs = O.stats_atol(st, ref_lse.shape)
    err = np.abs(O.to_f64(o) - ref)
    tol = (
        2.0**-7 * np.abs(ref)
        + O.attn_atol(n_keys, vmax, sabs)[..., None]
        + 2.0**-9 * np.max(np.abs(O.to_f64(o_parts)), axis=1)
    )
    assert np.all(err <= tol)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(np.asarray(lse)), ~fin)
    lse = np.asarray(lse)
    assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= O.lse_atol(n_keys, sabs, ref_lse)[fin])


def test_partials_eager_default():
    case = C.decode_case(8, seq_lens=(3, 300), qlen=1, h=2)
    o_parts, lse_parts = jsm.mla_decode_partials(
        *_args(case), k_scale=case.k_scale, v_scale=case.v_scale, num_splits=3
    )
    check_partials(case, 3, o_parts, lse_parts)
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
    out, lse = run(case)
    O.check_attention(out, ref, st, lse, ref_lse)
    bad, bad_lse = O.mla_decode(
        case.q, case.kv_codes, case.kv_indices, case.kv_indptr, case.qlen, case.k_scale,
        case.v_scale, case.sm_scale, k_transform=O.round_bf16,
    )  # fmt: skip
    with pytest.raises(AssertionError):
        O.check_attention(O.round_bf16(bad), ref, st, bad_lse, ref_lse)
    with pytest.raises(AssertionError):
        O.check_attention(out, ref, st, bad_lse, ref_lse)


# ---------------------------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------------------------


def _random_partials(seed, n=6, s=5, h=3, d=32, p_inf=0.3, dtype=np.float32):
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
def test_merge(dtype, jit):
    o_parts, lse_parts, _ = _random_partials(10, dtype=dtype)
    f = functools.partial(jsm.merge_attn_states, return_lse=True)
    o, lse = (jax.jit(f) if jit else f)(o_parts, lse_parts)
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert o.shape == (6, 3, 32) and lse.shape == (6, 3)
    ref, ref_lse = O.merge_attn_states(o_parts, lse_parts)
    o64 = O.to_f64(o)
    # weights in f32: ~ a few 2^-24 relative on each term; bf16 output adds 2^-8 |ref|
    omax = np.max(np.abs(O.to_f64(o_parts)), axis=1)
    rel = 2.0**-8 if dtype == jnp.bfloat16 else 0.0
    assert np.all(np.abs(o64 - ref) <= rel * np.abs(ref) + 2.0**-20 * omax)
    assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    lse_np = np.asarray(lse)
    assert np.all(np.abs(lse_np[fin] - ref_lse[fin]) <= 2.0**-21 * (np.abs(ref_lse[fin]) + 1))
    assert np.all(o64[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))
    # a single finite partial comes back unchanged
    np.testing.assert_array_equal(o64[2], O.to_f64(o_parts)[2, 0])
    assert np.array_equal(np.asarray(lse)[2], np.asarray(lse_parts)[2, 0])


def test_merge_return_lse_false_and_large_lse():
    # lse of very different magnitudes (one partial dominates; exp would overflow unshifted)
    o_parts = jnp.asarray(np.float32([[[[1.0, 2.0]], [[3.0, 4.0]]]]))
    lse_parts = jnp.asarray(np.float32([[[1000.0], [900.0]]]))
    o = jsm.merge_attn_states(o_parts, lse_parts)
    assert not isinstance(o, tuple)
    np.testing.assert_allclose(np.asarray(o), [[[1.0, 2.0]]], rtol=1e-6)
    o, lse = jsm.merge_attn_states(o_parts, jnp.asarray(np.float32([[[3.0], [3.0]]])),
                                   return_lse=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(o), [[[2.0, 3.0]]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), [[3 + np.log(2)]], rtol=1e-6)


def test_merge_ignores_o_of_empty_partials():
    # a -inf partial has weight 0: whatever its o holds (here NaN / inf garbage) must not leak
    o_parts, lse_parts, inf = _random_partials(11)
    o_bad = np.where(inf[..., None], np.nan, np.asarray(o_parts))
    o_bad[..., 0] = np.where(inf, np.inf, o_bad[..., 0])
    o, lse = jsm.merge_attn_states(jnp.asarray(o_bad), lse_parts, return_lse=True)
    ref, ref_lse = O.merge_attn_states(o_parts, lse_parts)
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_allclose(np.asarray(o), ref, rtol=1e-5, atol=1e-6)


def test_merge_decode_context_parallel():
    # two "devices" each holding half of every request's keys (by index), merged
    case = C.decode_case(12, seq_lens=(50, 260), qlen=1, h=2)
    halves = []
    for part in range(2):
        idx = np.array(case.kv_indices, copy=True)
        keep = (np.arange(len(idx)) % 2) == part
        idx[~keep] = -1
        out, lse = jsm.mla_decode(
            case.q, case.kv, jnp.asarray(idx), jnp.asarray(case.kv_indptr), qlen=1,
            k_scale=case.k_scale, v_scale=case.v_scale, return_lse=True,
        )  # fmt: skip
        halves.append((np.asarray(out, np.float32), np.asarray(lse)))
    o_parts = jnp.asarray(np.stack([h[0] for h in halves], axis=1))
    lse_parts = jnp.asarray(np.stack([h[1] for h in halves], axis=1))
    o, lse = jsm.merge_attn_states(o_parts, lse_parts, return_lse=True)
    ref, ref_lse, st = oracle(case)
    n_keys, vmax, sabs = O.stats_atol(st, ref_lse.shape)
    assert np.all(np.abs(O.to_f64(o) - ref) <= 2.0**-7 * np.abs(ref) + 2.0**-9 * vmax[..., None])
    assert np.all(np.abs(np.asarray(lse) - ref_lse) <= O.lse_atol(n_keys, sabs, ref_lse) * 2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_non_monotone_indptr(num_splits):
    # without validate, request r reads kv_indices[indptr[r]:indptr[r+1]] (empty when reversed)
    case = C.decode_case(13, seq_lens=(20, 30, 10), qlen=2, h=2)
    case.kv_indptr = np.int32([0, 30, 25, 60])
    out, lse = run(case, num_splits)
    check(case, out, lse)
    assert np.all(np.isneginf(np.asarray(lse)[2:4]))
    o_parts, lse_parts = _partials_fn(2, num_splits, None)(
        *_args(case), k_scale=case.k_scale, v_scale=case.v_scale
    )
    check_partials(case, num_splits, o_parts, lse_parts)
