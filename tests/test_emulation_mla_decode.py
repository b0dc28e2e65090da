"""The gfx950 mla_decode emulation (partials + combine) against the float64 oracle and "xla".

Error bound of the partials emulation (= the kernel's arithmetic) against exact attention, per
element (row, split, head, dim d), with the float64 softmax weights ``p_k`` of the split's
visible keys, values ``V_k``, output ``out`` and the shifted sum ``l = 2^8 sum_k exp(S_k - max S)``:

* q split: ``hi + lo / 32`` reproduces ``x = q 2^(127 - s)`` exactly when ``|x| >= 2^-7``: hi keeps
  4 of bf16's 8 significant bits, so ``x - hi`` is an integer multiple of x's last-bit weight
  ``2^k`` with ``|x - hi| <= 8 2^k`` (4 bits), and ``32 (x - hi)`` is an e4m3 value as long as
  ``2^(k+5) >= 2^-9`` (e4m3's subnormal step). Smaller elements keep an error ``<= 2^-15`` (half
  of 2^-9, over 32) in units of ``2^(s - 127)``; the row max scales into [128, 256), so that is
  ``<= 2^-22 max|q|``. Score error of key k: ``dq_k = sm_scale sum_d |dq_d| |K_kd|``.
* f32 scores in log2 units: the 576-term sum as in ``oracle.attn_atol`` (4 2^-24 score_abs),
  ``c = (sm_scale k_scale) log2 e`` (4 roundings with sm_scale's), and scaled after the max,
  ``(t_k - m) |c|``: the difference and the product round within ``2^-24 (|S_k| + score_abs)``
  each: ``dS_k = dq_k + (6 score_abs + 6 |S_k|) 2^-24``.
* exp2 (exact integer part, XLA's exp2 of the fraction: <= 1.4 ulp measured) of
  ``x_k = (t_k - m) |c| + 8`` rounded to f32 (``2^-24 |x_k|`` in log2 units):
  ``e_k = (4 + |x_k|) 2^-24``.
  A relative perturbation ``dS_k + e_k`` of each weight moves the output (l included) by at most
  ``sum_k p_k (dS_k + e_k) |V_kd - out_d|`` to first order (1% added for the second).
* P split (``p_split``, the dominant term): ``|hi + lo / 32 - P| <= 2^-8 P`` for ``P >= 2^-6``
  (hi within half an ulp, ``2^-4 P``; lo again within ``2^-4`` of the residual) and
  ``<= min(P, 2^-14)`` below (e4m3 subnormals); l sums the unsplit P, so in the output
  ``sum_k (2^-8 p_k + min(p_k, 2^-14 / l)) |V_kd|`` (``A_k <= 1`` rescales and ``l >= 2^8``).
  This is a worst case; P's rounding errors have random signs, so a split over many keys sees
  less, yet dropping P's lo part (16x this term) still breaks it (meta-test).
* f32 accumulation of O and l (random walk over n keys with a safety factor, as
  ``oracle.attn_atol``), one alpha rescale per 128-key block, ``O (v_scale / l)``:
  ``2^-24 max|V| (8 sqrt(n) + 16 + 8 (blocks + 2)) + 2^-22 |out|``.
* bf16 partial: ``2^-8 |out|`` (half an ulp of 8 significant bits) on top of ``(1 + 2^-8)``
  times the above.

LSE ``= (m |c| + (log2 l - 8)) ln 2`` (d lse / d s_k = p_k): ``1.01 sum_k p_k (dS_k + e_k)``,
l's sums ``2^-24 (4 sqrt(n) + 2 blocks + 4)``, then in log2 units the product ``m |c|``, XLA's
log2 (2 ulp), the difference and the sum, ``ln 2 2^-24 (|m c| + 2 |log2 l| + 2 + |log2 l - 8|
+ |m c + log2 l - 8|)``, and ``ln 2``'s f32 value and the product, ``2 2^-24 |lse|``.

Combine, per output element over the S partials with exact weights ``w_s = exp(lse_s - lse)``:
``w_s`` in f32 (``(lse_s - m) log2 e`` then exp2) is off by ``r_s = (6 + 2 |lse_s - m|) 2^-24``
relative, the sums by ``(S + 2) 2^-24``: ``|o - ref| <= 2^-8 |ref| + (1 + 2^-8)
(2 sum_s w_s r_s |o_s| + (S + 4) 2^-24 sum_s w_s |o_s|)``; lse within
``2^-22 (|lse| + 1) + max_s r_s``. Merging the emulated partials, each partial's own bound
and its lse bound (weights ``exp(+-dlse)``) add to that.

``test_kernel_layout`` (needs flydsl) runs one 128-key block through the kernel module's own
lane-address helpers with the assumed MFMA / ``ds_read_b64_tr_b8`` semantics (see there) and
checks that the kernel's data movement computes exactly the emulation's scores and PV.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.emulation import _arith as A
from jax_sparse_mla.emulation import bounds as B
from jax_sparse_mla.emulation import mla_decode as E
from jax_sparse_mla.kernels.gfx950 import configs
from jax_sparse_mla.reference.mla_decode import mla_decode_partials_f32
from tests import cases as C
from tests import oracle as O

EPS = 2.0**-24
DEFAULT_SM = O.KDIM**-0.5
LOG2E = np.log2(np.e)


def _sm(case) -> float:
    return DEFAULT_SM if case.sm_scale is None else case.sm_scale


@functools.cache
def _partials_fn(fn, qlen, num_splits):
    return jax.jit(functools.partial(fn, qlen=qlen, num_splits=num_splits))


def run_partials(case, num_splits, fresh=False):
    """The emulated partials (float64 views); ``fresh``: a new trace (e.g. after a monkeypatch)."""
    fn = E.mla_decode_partials_gfx950_emulation
    if fresh:
        f = jax.jit(functools.partial(fn, qlen=case.qlen, num_splits=num_splits))
    else:
        f = _partials_fn(fn, case.qlen, num_splits)
    o, lse = f(
        case.q,
        jnp.asarray(case.kv_codes),
        jnp.asarray(case.kv_indices),
        jnp.asarray(case.kv_indptr),
        k_scale=np.float32(case.k_scale),
        v_scale=np.float32(case.v_scale),
        sm_scale=np.float32(_sm(case)),
    )
    n, h = case.q.shape[:2]
    assert o.shape == (n, num_splits, h, 512) and lse.shape == (n, num_splits, h)
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    return O.to_f64(o), O.to_f64(lse)


# ---------------------------------------------------------------------------------------------
# float64 bound terms (module docstring), computed from the definitions, not the emulation
# ---------------------------------------------------------------------------------------------


def q_split_error(q_bits: np.ndarray) -> np.ndarray:
    """Bound on |q - (hi + lo / 32) 2^(s - 127)| per element of bf16 rows [..., 576] (bits)."""
    q = O.bf16_bits_to_f64(q_bits)
    e = (np.asarray(q_bits, np.int64) & 0x7FFF).max(axis=-1, keepdims=True) >> 7
    unit = np.ldexp(1.0, np.maximum(e - 7, 6) - 127)  # weight of x = 1
    return np.where(np.abs(q) / unit < 2.0**-7, 2.0**-15 * unit, 0.0)


def split_keys(case, num_splits):
    """Yields (query row, split, codes [n, 576] float64, blocks) for every visible key set (the
    key sets of ``bounds.decode_split_keys``; ``test_partials`` checks the reference built on
    them against the oracle's partials)."""
    codes = np.asarray(case.kv_codes, np.uint8)
    batch, n = len(case.kv_indptr) - 1, len(case.kv_indices)
    rows = configs.mla_decode_rows(case.qlen, case.q.shape[1], batch, n, configs.MI355X_CUS)
    block = configs.mla_decode_softmax_block(rows)
    keys = B.decode_split_keys(
        case.kv_indices, case.kv_indptr, len(codes), case.qlen, num_splits, block
    )
    for row, s, ids, blocks in keys:
        yield row, s, O.e4m3_decode(codes[ids]), blocks


def expected_partials(case, num_splits):
    """float64 partials and the emulation's bounds: ref, ref_lse, tol, lse_tol ([n, S, H, ...])."""
    q_bits = np.asarray(jnp.asarray(case.q).view(jnp.uint16))
    q = O.bf16_bits_to_f64(q_bits)
    dq = q_split_error(q_bits)
    n_rows, h, _ = q.shape
    sm, ks, vs = _sm(case), float(np.float32(case.k_scale)), float(np.float32(case.v_scale))
    shape = (n_rows, num_splits, h)
    ref, ref_lse = np.zeros((*shape, 512)), np.full(shape, -np.inf)
    tol, lse_tol = np.zeros((*shape, 512)), np.zeros(shape)
    for row, s, codes, blocks in split_keys(case, num_splits):
        n = codes.shape[0]
        if n == 0:
            continue
        k, v = codes * ks, codes[:, :512] * vs
        sc = sm * (q[row] @ k.T)  # [H, n]
        smax = sc.max(axis=-1, keepdims=True)
        w = np.exp(sc - smax)
        p = w / w.sum(axis=-1, keepdims=True)
        out = p @ v
        lse = (smax + np.log(w.sum(axis=-1, keepdims=True)))[:, 0]
        ref[row, s], ref_lse[row, s] = out, lse
        l_shift = 2.0**8 * w.sum(axis=-1, keepdims=True)
        vmax = np.abs(v).max()
        score_abs = abs(sm) * (np.abs(q[row]) @ np.abs(k).T).max(axis=-1, keepdims=True)  # [H, 1]
        d_s = abs(sm) * (dq[row] @ np.abs(k).T) + EPS * (6 * score_abs + 6 * np.abs(sc))
        e_k = (4 + np.abs((sc - smax) * LOG2E + 8)) * EPS
        pw = p * (d_s + e_k)
        score_term = 1.01 * (pw @ np.abs(v) + pw.sum(axis=-1, keepdims=True) * np.abs(out))
        p_term = (2.0**-8 * p + np.minimum(p, 2.0**-14 / l_shift)) @ np.abs(v)
        f32 = EPS * vmax * (8 * np.sqrt(n) + 16 + 8 * (blocks + 2)) + 2.0**-22 * np.abs(out)
        tol[row, s] = 2.0**-8 * np.abs(out) + (1 + 2.0**-8) * (score_term + p_term + f32)
        ma = smax[:, 0] * LOG2E  # m |c|, log2 units
        log2_l = np.log2(l_shift[:, 0])
        # roundings of (m |c| + (log2 l - 8)) ln 2: the product, log2, the difference, the sum
        lse_tol[row, s] = (
            1.01 * pw.sum(axis=-1)
            + np.log(2)
            * EPS
            * (np.abs(ma) + 2 * np.abs(log2_l) + 2 + np.abs(log2_l - 8) + np.abs(ma + log2_l - 8))
            + 2 * EPS * np.abs(lse)
            + EPS * (4 * np.sqrt(n) + 2 * blocks + 4)
        )
    return ref, ref_lse, tol, lse_tol


def check(out, lse, ref, ref_lse, tol, lse_tol, what=""):
    """Asserts |out - ref| <= tol and |lse - ref_lse| <= lse_tol; returns the worst ratio."""
    ratio = O.assert_within(out, ref, tol, what)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), f"{what}: -inf lse mismatch"
    assert not np.any(np.isnan(lse)) and not np.any(np.isposinf(lse)), f"{what}: bad lse"
    assert np.all(out[empty] == 0), f"{what}: partials without keys must be 0"
    fin = ~empty
    lerr = np.abs(lse[fin] - ref_lse[fin])
    lratio = float(np.max(lerr / lse_tol[fin], initial=0.0))
    assert lratio <= 1, f"{what}: lse out of bound (worst ratio {lratio:.3g})"
    return max(ratio, lratio)


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def test_q_split_exact_and_bounded():
    """hi + lo / 32 and the scale equal the float64 definition bit for bit (bf16 subnormals,
    rows of subnormals, sign bits included); the error obeys the docstring's bound."""
    r = C.rng(0)
    bits = r.integers(0, 1 << 16, (40, 576)).astype(np.uint16)
    bits = np.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits)  # no inf / NaN
    bits[:6] &= 0x807F  # subnormal rows
    bits[6:12] = (bits[6:12] & 0x807F) | (0x80 * r.integers(0, 3, (6, 576))).astype(np.uint16)
    bits[12] = 0  # all zero
    x_hat, scale = jax.jit(E.q_split)(jnp.asarray(bits).view(jnp.bfloat16))
    q = O.bf16_bits_to_f64(bits)
    e = (bits.astype(np.int64) & 0x7FFF).max(axis=-1) >> 7
    unit = np.ldexp(1.0, np.maximum(e - 7, 6) - 127)[:, None]
    x = q / unit
    hi = O.e4m3_decode(O.e4m3_encode(x))
    want = hi + O.e4m3_decode(O.e4m3_encode((x - hi) * 32)) / 32
    np.testing.assert_array_equal(np.asarray(x_hat, np.float64), want)
    np.testing.assert_array_equal(np.asarray(scale, np.float64), unit[:, 0])
    err = np.abs(want * unit - q)
    assert np.all(err <= q_split_error(bits))
    assert err.max() > 0  # the bound's small-element term is reached, not vacuous


def test_p_split_and_exp2():
    """p_split is e4m3(P) + e4m3((P - hi) 32) / 32 exactly, within the docstring's bound; exp2
    is exact at integers and elsewhere within what the bound's ``e_k = (4 + |x|) 2^-24`` leaves
    after the rounding of x (``ln 2 |x| 2^-24``): ``(4 + 0.3 |x|) 2^-24`` relative. The backend's
    exp2 of the fraction decides how much of it is used: <= 2 ulp on the CPU, more on the H200
    for results around 1e-33 and below. 0 below 2^-126 (and for -1e30)."""
    r = C.rng(1)
    p = np.concatenate([r.uniform(0, 256, 20000), 2.0 ** r.uniform(-30, 8, 20000), [0.0, 256]])
    p = p.astype(np.float32)
    got = np.asarray(jax.jit(E.p_split)(jnp.asarray(p)), np.float64)
    p64 = p.astype(np.float64)
    hi = O.e4m3_decode(O.e4m3_encode(p64))
    np.testing.assert_array_equal(got, hi + O.e4m3_decode(O.e4m3_encode((p64 - hi) * 32)) / 32)
    assert np.all(np.abs(got - p64) <= 2.0**-8 * p64 + np.minimum(p64, 2.0**-14))
    x = np.concatenate([r.uniform(-126, 8, 20000), np.arange(-126, 9)]).astype(np.float32)
    e2 = np.asarray(jax.jit(A.exp2)(jnp.asarray(x)), np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.all(np.abs(e2 - want) <= (4 + 0.3 * np.abs(x.astype(np.float64))) * EPS * want)
    np.testing.assert_array_equal(e2[-135:], want[-135:])
    small = jax.jit(A.exp2)(jnp.float32([-127.5, -1e30, -np.inf]))
    np.testing.assert_array_equal(np.asarray(small), [0.0, 0.0, 0.0])


# ---------------------------------------------------------------------------------------------
# Partials
# ---------------------------------------------------------------------------------------------

M128_N = configs.MLA_DECODE_M128_MIN_SPLIT_KEYS * configs.MI355X_CUS  # 2 requests: 128 rows

PARTIAL_CASES = {
    # name: (decode_case kwargs, num_splits, also against "xla")
    "q1_h16_s1": (dict(seed=1, seq_lens=(1, 37, 300), qlen=1, h=16), 1, False),
    "q2_h12_s3_masked": (dict(seed=2, seq_lens=(0, 2, 129, 300), qlen=2, h=12, p_masked=0.1),
                         3, True),
    "q4_h1_s16_empty": (dict(seed=3, seq_lens=(3, 130, 600), qlen=4, h=1), 16, False),
    "q1_h128_s2": (dict(seed=4, seq_lens=(130, 3), qlen=1, h=128), 2, False),
    # kv_indices long enough for the 128-row kernel (configs.mla_decode_rows): 64-key blocks
    "q1_h128_s2_m128": (dict(seed=4, seq_lens=(330, 3), qlen=1, h=128, n_indices=M128_N), 2,
                        False),
    "q4_h16_s5_short": (dict(seed=5, seq_lens=(0, 1, 3, 200, 2), qlen=4, h=16, p_masked=0.3), 5,
                        False),
    "q2_h4_s7_unit_scales": (dict(seed=6, seq_lens=(127, 128, 129, 600), qlen=2, h=4,
                                  k_scale=1.0, v_scale=1.0, sm_scale=0.11), 7, True),
    "q2_h8_s2_negative_scale": (dict(seed=7, seq_lens=(5, 300), qlen=2, h=8, sm_scale=-0.05), 2,
                                True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PARTIAL_CASES))
def test_partials(name):
    """Emulation vs the float64 oracle (bound of the module docstring; the oracle's partials and
    the local float64 reference agree) and, for two cases, vs the exact "xla" partials (their
    bounds add)."""
    kw, num_splits, with_xla = PARTIAL_CASES[name]
    case = C.decode_case(**kw, as_uint8=True)
    ref, ref_lse, tol, lse_tol = expected_partials(case, num_splits)
    oref, oref_lse, st = C.decode_oracle(case, num_splits=num_splits, stats=True)
    np.testing.assert_allclose(oref, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max(initial=1))
    np.testing.assert_allclose(oref_lse, ref_lse, rtol=1e-9, atol=1e-9)
    out, lse = run_partials(case, num_splits)
    check(out, lse, ref, ref_lse, tol, lse_tol, name)
    if "empty" in name:  # the case has splits without keys next to ones with
        assert np.any(np.isneginf(lse)) and np.any(np.isfinite(lse))
    if not with_xla:
        return
    xo, xl = mla_decode_partials_f32(
        case.q,
        jnp.asarray(case.kv_codes),
        jnp.asarray(case.kv_indices),
        jnp.asarray(case.kv_indptr),
        qlen=case.qlen,
        k_scale=jnp.float32(case.k_scale),
        v_scale=jnp.float32(case.v_scale),
        sm_scale=jnp.float32(_sm(case)),
        num_splits=num_splits,
    )
    # "xla" is within oracle.check_attention's f32 bound of the reference (the full row's stats
    # bound every split's), so the emulation is within the sum of both bounds of "xla".
    n_keys, vmax, sabs = (x[:, None] for x in O.stats_atol(st, case.q.shape[:2]))
    xtol = O.attn_atol(n_keys, vmax, sabs)[..., None]
    xltol = O.lse_atol(n_keys, sabs, np.where(np.isfinite(ref_lse), ref_lse, 0))
    check(out, lse, O.to_f64(xo), O.to_f64(xl), tol + xtol, lse_tol + xltol, f"{name} vs xla")


def test_partials_softmax_block_follows_the_kernel(monkeypatch):
    """Where the 128-row kernel serves the call (``configs.mla_decode_rows``) the emulation
    runs its 64-key softmax blocks: the same case emulated with 128-key blocks rounds
    differently (P's e4m3 split is taken against another running max); both are within the
    bound (``test_partials``'s ``q1_h128_s2_m128`` and this case's own check)."""
    case = C.decode_case(8, seq_lens=(250, 200), qlen=1, h=128, as_uint8=True, n_indices=M128_N)
    assert configs.mla_decode_rows(1, 128, 2, M128_N, configs.MI355X_CUS) == 128
    ref, ref_lse, tol, lse_tol = expected_partials(case, 1)
    out64, lse64 = run_partials(case, 1, fresh=True)
    check(out64, lse64, ref, ref_lse, tol, lse_tol, "64-key blocks")
    monkeypatch.setattr(configs, "mla_decode_softmax_block", lambda rows: 128)
    out128, lse128 = run_partials(case, 1, fresh=True)
    assert not (np.array_equal(out64, out128) and np.array_equal(lse64, lse128))


def test_partials_vmap():
    """vmap over a stack of queries matches the loop (XLA may fuse the batched program
    differently: a few ulp)."""
    case = C.decode_case(7, seq_lens=(40, 260), qlen=2, h=2, as_uint8=True)
    q2 = jnp.stack([case.q, -case.q])
    f = functools.partial(
        E.mla_decode_partials_gfx950_emulation,
        qlen=2,
        num_splits=2,
        k_scale=case.k_scale,
        v_scale=case.v_scale,
        sm_scale=DEFAULT_SM,
    )
    args = (jnp.asarray(case.kv_codes), jnp.asarray(case.kv_indices), jnp.asarray(case.kv_indptr))
    o2, l2 = jax.jit(jax.vmap(lambda q: f(q, *args)))(q2)
    for b in range(2):
        ob, lb = jax.jit(f)(q2[b], *args)
        np.testing.assert_allclose(O.to_f64(o2[b]), O.to_f64(ob), rtol=2.0**-7, atol=0)
        np.testing.assert_allclose(np.asarray(l2[b]), np.asarray(lb), rtol=2.0**-20, atol=0)


# ---------------------------------------------------------------------------------------------
# Meta-tests: the bound catches the variants the kernel must not be
# ---------------------------------------------------------------------------------------------


_Q_SPLIT = E.q_split


def _hi_only_q(q):
    """q split without its lo residual."""
    _, scale = _Q_SPLIT(q)
    return A.e4m3(q.astype(jnp.float32) / scale[..., None]), scale


def _hi_only_p(p):
    """P split without its lo part."""
    return A.e4m3(p)


@pytest.mark.parametrize(
    "attr, variant", [("q_split", _hi_only_q), ("p_split", _hi_only_p)], ids=["q_lo", "p_lo"]
)
def test_bound_catches_missing_lo(monkeypatch, attr, variant):
    """Dropping q's lo residual or P's lo part violates the bound; the real emulation passes.

    Short splits with a peaked softmax make P's split error visible (it averages out over many
    keys); q's shows anywhere.
    """
    case = C.decode_case(8, seq_lens=(5, 9, 16, 33), qlen=1, h=8, as_uint8=True)
    expected = expected_partials(case, 2)
    out, lse = run_partials(case, 2)
    assert check(out, lse, *expected) <= 1
    monkeypatch.setattr(E, attr, variant)
    out, lse = run_partials(case, 2, fresh=True)
    with pytest.raises(AssertionError, match="out of bound"):
        check(out, lse, *expected, what=attr)


# ---------------------------------------------------------------------------------------------
# Combine
# ---------------------------------------------------------------------------------------------


def merge_bound(o_parts, lse_parts, ref, ref_lse):
    """The combine's bound (module docstring) from float64 partials."""
    m = np.max(lse_parts, axis=1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    w = np.where(np.isneginf(lse_parts), 0.0, np.exp(lse_parts - m))
    w = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-300)
    gap = np.where(np.isneginf(lse_parts), 0.0, np.abs(lse_parts - m))
    r = (6 + 2 * gap) * EPS
    s = o_parts.shape[1]
    wo = w[..., None] * np.abs(o_parts)
    pre = 2 * np.sum(r[..., None] * wo, axis=1) + (s + 4) * EPS * np.sum(wo, axis=1)
    tol = 2.0**-8 * np.abs(ref) + (1 + 2.0**-8) * pre
    lse_tol = 2.0**-22 * (np.abs(np.where(np.isfinite(ref_lse), ref_lse, 0)) + 1) + r.max(axis=1)
    return tol, lse_tol


def run_merge(o_parts, lse_parts):
    o, lse = jax.jit(E.merge_attn_states_gfx950_emulation)(o_parts, lse_parts)
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert o.shape == o_parts.shape[:1] + o_parts.shape[2:] and lse.shape == lse_parts.shape[::2]
    return O.to_f64(o), O.to_f64(lse)


def test_merge_random_partials():
    """Random bf16 partials with -inf ones (whose o holds NaN / inf garbage), an all -inf row and
    single finite partials, lse over a wide range."""
    r = C.rng(9)
    n, s, h, d = 7, 6, 3, 512
    o = np.asarray(O.round_bf16(r.standard_normal((n, s, h, d)) * 3), np.float32)
    lse = (r.standard_normal((n, s, h)) * 20).astype(np.float32)
    empty = r.random((n, s, h)) < 0.3
    empty[0] = True
    empty[1, 1:] = True
    lse[empty] = -np.inf
    o_bad = np.where(empty[..., None], np.nan, o)
    o_bad[..., 0] = np.where(empty, np.inf, o_bad[..., 0])
    ref, ref_lse = O.merge_attn_states(np.where(empty[..., None], 0.0, o), lse)
    out, out_lse = run_merge(jnp.asarray(o_bad, jnp.bfloat16), jnp.asarray(lse))
    tol, lse_tol = merge_bound(
        O.to_f64(np.where(empty[..., None], 0.0, o)), O.to_f64(lse), ref, ref_lse
    )
    check(out, out_lse, ref, ref_lse, tol, lse_tol, "merge")
    np.testing.assert_array_equal(out[1], O.to_f64(o)[1, 0])  # one finite partial: unchanged
    np.testing.assert_array_equal(out_lse[1], lse[1, 0])


def test_merge_overflowed_partials():
    """Partials whose lse overflowed float32 (+inf: a huge sm_scale) weigh alike and the others
    0, as the exact merge (``reference.attention.merge_weights``) weighs them: the output is the
    mean of their o (exact here: two bf16 values, power-of-two count), its lse +inf."""
    r = C.rng(10)
    o = np.asarray(O.round_bf16(r.standard_normal((2, 4, 3, 512))), np.float32)
    lse = np.array([[np.inf, 5.0, np.inf, -np.inf], [1.0, np.inf, -np.inf, 2.0]], np.float32)
    lse = np.repeat(lse[..., None], 3, axis=-1)
    out, out_lse = run_merge(jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse))
    want = np.stack([(o[0, 0] + o[0, 2]) / 2, o[1, 1]])
    np.testing.assert_array_equal(out, O.to_f64(O.round_bf16(want)))
    np.testing.assert_array_equal(out_lse, np.inf)


def merged_bound(case, num_splits, o_p, lse_p):
    """The full decode's float64 reference and bound when it merges the partials ``o_p, lse_p``
    (float64 views) of ``num_splits`` splits: each partial's bound, its lse bound as a weight
    error (weights ``exp(+-dlse)``), plus the combine's bound.

    Returns ref [n, H, 512], ref_lse [n, H], tol, lse_tol.
    """
    _, ref_plse, tol_p, lse_tol_p = expected_partials(case, num_splits)
    ref, ref_lse = C.decode_oracle(case)
    tol_m, lse_tol_m = merge_bound(o_p, lse_p, ref, ref_lse)
    fin = np.isfinite(ref_plse)
    total = np.where(np.isfinite(ref_lse), ref_lse, 0.0)[:, None]
    w = np.where(fin, np.exp(np.where(fin, ref_plse, 0.0) - total), 0.0)
    dl = np.where(fin, lse_tol_p, 0.0)
    weight = np.sum(w[..., None] * (tol_p + 2 * np.expm1(2 * dl)[..., None] * np.abs(o_p)), 1)
    return ref, ref_lse, tol_m + (1 + 2.0**-8) * weight, lse_tol_m + dl.max(axis=1)


@pytest.mark.parametrize("name", ["q2_h12_s3_masked", "q4_h1_s16_empty"])
def test_partials_then_merge(name):
    """Merging the emulated partials gives full attention within ``merged_bound``."""
    kw, num_splits, _ = PARTIAL_CASES[name]
    case = C.decode_case(**kw, as_uint8=True)
    out_p, lse_p = run_partials(case, num_splits)
    out, out_lse = run_merge(jnp.asarray(out_p, jnp.bfloat16), jnp.asarray(lse_p, jnp.float32))
    check(out, out_lse, *merged_bound(case, num_splits, out_p, lse_p), name)


# ---------------------------------------------------------------------------------------------
# The kernel's data layout, lane by lane (needs flydsl: the kernel module's own address helpers)
# ---------------------------------------------------------------------------------------------

LANES = np.arange(64)


def _mfma(a, b, scale_a, scale_b):
    """16x16x128 e4m3 MFMA with E8M0 scales on lane data: a, b [64 lanes, 32 bytes] codes,
    scales [64] bytes -> [64 lanes, 4] f64. Lane 16G + i holds row / column i, bytes 0-15 at K
    ``16G + [0, 16)`` and bytes 16-31 at ``64 + 16G + [0, 16)``; scale group ``K // 32`` comes
    from lanes ``16 (K // 32) + i``; output lane 16G + j holds rows ``4G + [0, 4)`` of column j."""
    byte = np.arange(32)
    kpos = np.where(byte < 16, byte, 48 + byte)[None, :] + 16 * np.arange(4)[:, None]  # [G, b]
    mat_a, mat_b = np.zeros((16, 128)), np.zeros((128, 16))
    for g in range(4):
        lanes = 16 * g + np.arange(16)
        mat_a[:, kpos[g]] = O.e4m3_decode(a[lanes])
        mat_b[kpos[g], :] = O.e4m3_decode(b[lanes]).T
    grp = np.arange(128) // 32
    sa = np.ldexp(1.0, scale_a.reshape(4, 16).T[:, grp] - 127)  # [i, K]
    sb = np.ldexp(1.0, scale_b.reshape(4, 16)[grp, :] - 127)  # [K, j]
    d = (mat_a * sa) @ (mat_b * sb)
    return np.stack([d[4 * (LANES >> 4) + r, LANES & 15] for r in range(4)], axis=1)


def _tr8(lds, addrs):
    """ds_read_b64_tr_b8: within each 16-lane row, lane t byte k = lane 2k + t // 8's byte t % 8
    of the 8 bytes each lane addresses."""
    src = lds[np.asarray(addrs)[:, None] + np.arange(8)]
    t, k = np.arange(16)[:, None], np.arange(8)[None, :]
    return np.concatenate([src[16 * g + 2 * k + (t >> 3), t & 7] for g in range(4)])


def q_operands(r, codes):
    """16 random bf16 query rows split as the kernels split them: their e4m3 hi and lo codes
    [16, 576], each lane's E8M0 scale byte of the QK B operand (lane ``16 g + t``: row t's
    ``s`` for even g, ``s - 5`` for odd), and the exact scores [key, row] against ``codes``."""
    q = C.bf16_normal(r, (16, 576)) * C.to_bf16(2.0 ** r.integers(-3, 4, (16, 1)))
    x_hat, scale = (np.asarray(v, np.float64) for v in E.q_split(q))
    x = O.to_f64(q) / scale[:, None]
    hi = O.e4m3_encode(x)
    lo = O.e4m3_encode((x - O.e4m3_decode(hi)) * 32)
    s_byte = np.log2(scale).astype(int) + 127
    t, g = LANES & 15, LANES >> 4
    k_scale_b = np.where(g % 2 == 0, s_byte[t], s_byte[t] - 5)
    return hi, lo, k_scale_b, O.e4m3_decode(codes) @ (x_hat * scale[:, None]).T


def test_kernel_layout():
    """One 128-key block through the kernel's lane mappings (DMA into the swizzled slot, QK's
    A / B operands, P in LDS, tr8 V^T reads) with the MFMA / tr8 semantics above computes the
    emulation's ``S = K (hi + lo / 32) 2^(s - 127)`` and ``O = (hi + lo / 32)_P V`` exactly."""
    pytest.importorskip("flydsl")
    K = pytest.importorskip("jax_sparse_mla.kernels.gfx950.mla_decode")
    r = C.rng(10)
    codes = r.integers(0, 256, (128, 576)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN
    lds = np.zeros(K.SLOT_BYTES, np.uint8)
    src, off = K._dma_lanes(LANES)
    byte = np.arange(16)
    for w in range(8):
        for i, (s_i, o_i) in enumerate(zip(src, off, strict=True)):
            dst = w * 16 * 576 + 1024 * i + 16 * LANES
            lds[dst[:, None] + byte] = codes[16 * w + s_i[:, None] // 4, o_i[:, None] + byte]
    key, chunk = np.meshgrid(np.arange(128), np.arange(36), indexing="ij")
    at = 576 * key + 16 * K._swizzle(key, chunk)
    np.testing.assert_array_equal(lds[at[..., None] + np.arange(16)], codes.reshape(128, 36, 16))

    hi, lo, k_scale_b, want_s = q_operands(r, codes)
    t, g = LANES & 15, LANES >> 4
    for w in range(8):
        k_rd = K._k_offsets(w, t, g)
        acc = 0
        for s in range(9):
            a = np.concatenate([lds[k_rd[h][:, None] + 64 * s + byte] for h in range(2)], 1)
            dims = 64 * s + 32 * (g[:, None] & 1) + np.arange(32)
            b = np.where(g[:, None] < 2, hi[t[:, None], dims], lo[t[:, None], dims])
            acc = acc + _mfma(a, b, np.full(64, 127), k_scale_b)
        keys = 16 * w + 4 * g[:, None] + np.arange(4)
        np.testing.assert_allclose(acc, want_s[keys, t[:, None]], rtol=1e-12, atol=1e-300)

    p = r.uniform(0, 256, (16, 128))
    p_hi = O.e4m3_encode(p)
    p_lo = O.e4m3_encode((p - O.e4m3_decode(p_hi)) * 32)
    p_lds = np.zeros(2 * K.P_LO, np.uint8)
    for w in range(8):
        wr = K._p_write_offset(w, t, g)
        keys = 16 * w + 4 * g[:, None] + np.arange(4)
        p_lds[wr[:, None] + np.arange(4)] = p_hi[t[:, None], keys]
        p_lds[K.P_LO + wr[:, None] + np.arange(4)] = p_lo[t[:, None], keys]
    rd = K._p_read_offset(t, g)[:, None] + np.arange(32)
    want_o = (O.e4m3_decode(p_hi) + O.e4m3_decode(p_lo) / 32) @ O.e4m3_decode(codes[:, :512])
    for w in range(8):
        for jt in range(4):
            a = np.concatenate([_tr8(lds, K._v_offset(w, t, g, jt, r)) for r in range(4)], 1)
            acc = _mfma(a, p_lds[rd], np.full(64, 127), np.full(64, 127))
            acc += _mfma(a, p_lds[K.P_LO + rd], np.full(64, 127), np.full(64, 122))
            lat = 64 * w + 16 * jt + 4 * g[:, None] + np.arange(4)
            np.testing.assert_allclose(acc, want_o[t[:, None], lat], rtol=1e-12, atol=1e-300)


def causal_nan_case(qlen: int, dims: slice, last_only: bool = False):
    """A decode case whose boundary keys ``j > seq_len - qlen`` (hidden from position 0, seen by
    the last position) hold NaN codes in ``dims`` (latents: V and K; rope: K only); with
    ``last_only`` only key ``seq_len - 1``, seen by the last position alone."""
    case = C.decode_case(seed=40 + qlen, seq_lens=(5, 130, 300), qlen=qlen, h=4, as_uint8=True)
    codes = np.array(case.kv_codes, copy=True)
    indptr = np.asarray(case.kv_indptr)
    for r in range(len(indptr) - 1):
        seq = int(indptr[r + 1] - indptr[r])
        for j in range(seq - 1 if last_only else seq - qlen + 1, seq):
            codes[case.kv_indices[indptr[r] + j], dims] = 0x7F
    case.kv_codes, case.kv = codes, jnp.asarray(codes)
    return case


@pytest.mark.parametrize("last_only", [False, True], ids=["boundary", "last"])
@pytest.mark.parametrize("qlen", [2, 4])
@pytest.mark.parametrize("dims", [slice(3, 9), slice(540, 545)], ids=["latent", "rope"])
def test_causal_hidden_nan_key(qlen, dims, last_only):
    """Causal rule: a key hidden from a row contributes nothing to it, NaN codes included (the
    row's partial is within the bound of the float64 oracle, which never reads the key); a row
    that sees a NaN key gets NaN o and lse in that split's partial, not an empty partial."""
    case = causal_nan_case(qlen, dims, last_only)
    num_splits = 2
    ref, ref_lse, tol, lse_tol = expected_partials(case, num_splits)
    seen = np.isnan(ref_lse)
    assert seen.any() and not seen[0::qlen].any()  # rows r * qlen (position 0) see no NaN key
    if last_only:  # the middle positions hide the NaN key too
        assert not np.delete(seen, np.s_[qlen - 1 :: qlen], axis=0).any()
    out, lse = run_partials(case, num_splits)
    assert np.all(np.isnan(out[seen])) and np.all(np.isnan(lse[seen]))

    keep = functools.partial(outside, seen)
    check(
        keep(out),
        keep(lse),
        keep(ref),
        keep(ref_lse),
        keep(tol, 1.0),
        keep(lse_tol, 1.0),
        f"q{qlen} hidden NaN",
    )


def outside(seen, x, fill=0.0) -> np.ndarray:
    """``x`` ([n, S, H] or [n, S, H, 512]) with ``fill`` at the partials in ``seen``."""
    x = O.to_f64(x)
    return np.where(seen[..., None] if x.ndim == 4 else seen, fill, x)
