"""The gfx950 sparse_mla emulation against the float64 oracle and against implementation "xla".

Error bound of the emulation (= the kernel's arithmetic) against exact attention, per output
element (row r, head h, dim d), with the float64 softmax weights ``p_k``, values ``V_k``,
output ``out`` and ``l = 2^8 sum_k exp(S_k - max S)`` (the kernel's shifted sum):

* q split: hi + lo / 32 reproduces a bf16 ``x = q 2^(127 - s_hi)`` exactly when
  ``|x| >= 2^-7``: hi keeps 4 of x's 8 significant bits, so ``x - hi`` is an integer multiple
  of x's last-bit weight ``2^k`` with ``|x - hi| <= 8 2^k``, and ``32 (x - hi)`` is an e4m3
  value as long as ``2^(k+5) >= 2^-9`` (e4m3's subnormal step). Smaller elements keep an error
  ``<= 2^-15`` (half of 2^-9, over 32), i.e. ``|dq| <= 2^-15 2^(s_hi - 127)``; with the
  block max in [128, 256) after scaling that is ``<= 2^-22 max|q_block|``. The generic
  e4m3 estimate, hi within 2^-4, the residual times 2^5 again within 2^-4, would allow
  ``2^-4 2^-5 2^-4`` of the binade; bf16's 8 bits make it exact. The score error of key k
  is ``dq_k = sm_scale sum_d |dq_d| |K_kd|``.
* f32 scores and log2 units: products / sums as in ``oracle.attn_atol`` (4 2^-24 score_abs),
  plus ``c = f32(f32(sm_scale) f32(log2 e))`` and ``s = S c`` (3 roundings) and ``s - m``:
  ``dS_k = dq_k + 12 2^-24 score_abs``.
* exp2: XLA:CPU's ``exp2(x)`` errs by ``<= (2 + 0.7 |x|) 2^-24`` relative (measured);
  ``e_k = (4 + |x_k|) 2^-24`` with ``x_k = (S_k - max S) log2 e + 8``.
  A relative perturbation ``dS_k + e_k`` of every P moves the output (l included) by
  ``sum_k p_k (dS_k + e_k) |V_kd - out_d|`` (first order; 1% added for the second).
* P' = f16(P sv): ``2^-11`` relative (half an ulp of 11 significant bits) above 2^-14,
  ``2^-25`` absolute below; in the output ``sum_k max(2^-11 p_k |V_kd|, 2^-25 |code_kd| / l)``.
* f32 accumulation of PV and l, one alpha rescale per 128-key tile:
  ``oracle.attn_atol + 8 2^-24 (tiles + 1) max|V|``.
* bf16 output: ``2^-8 |ref|`` (half an ulp of 8 bits) on top of ``(1 + 2^-8)`` times the above,
  and ``2^-22 |ref|`` for ``O (1 / l)``.

LSE: ``oracle.lse_atol + max_k dS_k + sum_k p_k e_k + 2^-20 + 2^-22 (|lse| + score_abs + 32)``
(the log2-unit sum ``m + log2 l - 8``, XLA's log2 and the final ``ln 2``).

``test_kernel_layout`` (needs flydsl) runs one 128-token tile through the kernel module's own
lane-address helpers with the assumed MFMA / ``ds_read_b64_tr_b8`` semantics and checks that its
data movement computes exactly the scores and PV that the record bytes define.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_mla.emulation import sparse_mla as E
from jax_sparse_mla.kernels.gfx950 import configs
from jax_sparse_mla.reference.sparse_mla import sparse_mla_xla
from tests import cases as C
from tests import oracle as O

EPS = 2.0**-24
DEFAULT_SM = O.KDIM**-0.5


@functools.cache
def _jitted(fn):
    return jax.jit(fn)


def _sm(case) -> float:
    return DEFAULT_SM if case.sm_scale is None else case.sm_scale


def run(case, fn=E.sparse_mla_gfx950_emulation, jit=True):
    args = (case.q, jnp.asarray(case.kv), jnp.asarray(case.idx), jnp.asarray(case.indptr))
    out, lse = (_jitted(fn) if jit else fn)(*args, np.float32(_sm(case)))
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert out.shape == (*case.q.shape[:2], 512) and lse.shape == case.q.shape[:2]
    return O.to_f64(out), O.to_f64(lse)


# ---------------------------------------------------------------------------------------------
# Local float64 helpers: the reference with the kernel's V clamp, and the bound's terms
# ---------------------------------------------------------------------------------------------


def q_split_error(q64: np.ndarray) -> np.ndarray:
    """Bound on |q - (hi + lo / 32) 2^(s_hi - 127)| per element of q [H, 576] (0 for the rope).

    Computed from the definition (block max exponent, s_hi = max(e - 7, 6)), not from the
    emulation's code.
    """
    lat = np.abs(q64[:, :512]).reshape(-1, 4, 128)
    amax = lat.max(axis=-1)
    _, e2 = np.frexp(amax)  # amax = m 2^e2, m in [0.5, 1)
    biased = np.where(amax >= 2.0**-126, e2 + 126, 0)
    s_hi = np.maximum(biased - 7, 6)
    unit = np.ldexp(1.0, s_hi - 127)[..., None]  # weight of x = 1
    x = lat / unit
    err = np.where((x > 0) & (x < 2.0**-7), 2.0**-15 * unit, 0.0).reshape(-1, 512)
    return np.concatenate([err, np.zeros((err.shape[0], 64))], axis=-1)


def row_keys(case, r: int):
    """Unmasked keys of row r: K [n, 576] (true record), V [n, 512] and codes [n, 512] with the
    kernel's V scale clamp (scales above 2^7 read as 2^7)."""
    recs = np.asarray(case.kv, np.uint8).reshape(-1, O.RECORD_BYTES)
    pos = O.csr_row_positions(case.indptr, r, len(case.idx))
    ent = np.asarray(case.idx, np.int64)[pos]
    ent = ent[(ent >= 0) & (ent < len(recs))]
    k, _ = O.record_kv(recs[ent])
    codes = O.e4m3_decode(recs[ent, :512]).astype(np.float64)
    scales = np.ascontiguousarray(recs[ent, 512:528]).view("<f4").astype(np.float64)
    v = codes * np.repeat(np.minimum(scales, 2.0**7), 128, axis=-1)
    return k, v, codes


def split_case(case, splits: int):
    """The case with each (row, split) of its keys as a row of its own (row r split s: row
    r S + s, q repeated), the splits as the kernel cuts them (``E.split_range``)."""
    idx, indptr = np.asarray(case.idx, np.int32), np.asarray(case.indptr, np.int64)
    pieces = [np.zeros(0, np.int32)]
    for r in range(case.q.shape[0]):
        b, e = np.clip(indptr[r : r + 2], 0, len(idx))
        for sp in range(splits):
            lo, hi = (int(x) for x in E.split_range(max(e - b, 0), sp, splits))
            pieces.append(idx[b + lo : b + hi])
    indptr = np.cumsum([0, *map(len, pieces[1:])]).astype(np.int32)
    q = jnp.repeat(case.q, splits, axis=0)
    return dataclasses.replace(case, q=q, idx=np.concatenate(pieces), indptr=indptr)


def expected(case, splits: int = 1):
    """float64 reference (kernel's V clamp) and the emulation's error bounds (module docstring;
    ``splits`` > 1: ``expected_split``).

    Returns ref [n_q, H, 512], ref_lse [n_q, H], tol [n_q, H, 512], lse_tol [n_q, H].
    """
    if splits > 1:
        return expected_split(case, splits)
    q = O.to_f64(case.q)
    n_q, h, _ = q.shape
    sm = _sm(case)
    ref, ref_lse = np.zeros((n_q, h, 512)), np.full((n_q, h), -np.inf)
    tol, lse_tol = np.zeros((n_q, h, 512)), np.zeros((n_q, h))
    for r in range(n_q):
        k, v, codes = row_keys(case, r)
        n = k.shape[0]
        if n == 0:
            continue
        s = sm * (q[r] @ k.T)  # [H, n]
        smax = s.max(axis=-1, keepdims=True)
        w = np.exp(s - smax)
        p = w / w.sum(axis=-1, keepdims=True)
        out = p @ v
        ref[r], ref_lse[r] = out, (smax + np.log(w.sum(axis=-1, keepdims=True)))[:, 0]
        l_shift = 2.0**8 * w.sum(axis=-1)  # [H]
        vmax = np.abs(v).max()
        score_abs = float(np.max(abs(sm) * (np.abs(q[r]) @ np.abs(k).T)))
        d_s = abs(sm) * (q_split_error(q[r]) @ np.abs(k).T) + 12 * EPS * score_abs  # [H, n]
        e_k = (4 + np.abs((s - smax) * np.log2(np.e) + 8)) * EPS
        f32 = O.attn_atol(n, vmax, score_abs) + 8 * EPS * (n // 128 + 2) * vmax
        for hh in range(h):
            f16 = np.maximum(
                2.0**-11 * p[hh][:, None] * np.abs(v), 2.0**-25 * np.abs(codes) / l_shift[hh]
            ).sum(axis=0)
            sc = (p[hh] * (d_s[hh] + e_k[hh])) @ np.abs(v - out[hh])
            pre = f16 + 1.01 * sc + f32
            tol[r, hh] = (2.0**-8 + 2.0**-22) * np.abs(out[hh]) + (1 + 2.0**-8) * pre
        lse_tol[r] = (
            O.lse_atol(n, score_abs, ref_lse[r])
            + d_s.max(axis=-1)
            + (p * e_k).sum(axis=-1)
            + 2.0**-20
            + 2.0**-22 * (np.abs(ref_lse[r]) + score_abs + 32)
        )
    return ref, ref_lse, tol, lse_tol


def expected_split(case, splits: int):
    """The bound of ``splits`` partials merged by the combine: each (row, split) partial lies
    within its own bound (``expected`` of ``split_case``) of the exact partial (o_s, lse_s), and
    the exact merge of exact partials, ``sum_s W_s o_s`` with ``W_s = exp(lse_s - lse)``, is the
    reference. LSEs off by at most ``D`` (per head, over the splits) move each normalized weight
    by a factor within ``exp(+-2D)``, so before the combine's rounding the output errs by
    ``exp(2D) sum_s W_s tol_s + (exp(2D) - 1 + c) sum_s W_s |o_s|``, c the combine's f32
    arithmetic (its exp2 ``(2 + 0.7 |x|) 2^-24`` on ``x = (lse_s - max lse) log2 e``, twice:
    weight and normalization, and S + 2 roundings of the sums); then one bf16 rounding
    (``2^-8``). LSE: log-sum-exp moves by at most D, plus ``2^-20 (|lse| + 1)`` of its f32 steps.
    """
    ref, ref_lse, _, _ = expected(case)
    n_q, h = ref_lse.shape
    p_ref, p_lse, p_tol, p_lse_tol = expected(split_case(case, splits))
    p_ref, p_tol = (x.reshape(n_q, splits, h, 512) for x in (p_ref, p_tol))
    p_lse, p_lse_tol = (x.reshape(n_q, splits, h) for x in (p_lse, p_lse_tol))
    live = np.isfinite(p_lse)
    lse0 = np.where(np.isfinite(ref_lse), ref_lse, 0.0)[:, None]
    w = np.where(live, np.exp(np.where(live, p_lse, 0.0) - lse0), 0.0)  # [n_q, S, H]
    d = np.max(np.where(live, p_lse_tol, 0.0), axis=1)  # [n_q, H]
    top = np.max(np.where(live, p_lse, -np.inf), axis=1, keepdims=True)
    x = np.where(live, (p_lse - np.where(np.isfinite(top), top, 0.0)) * np.log2(np.e), 0.0)
    comb = (2 * (4 + 0.7 * np.abs(x).max(axis=1)) + splits + 2) * EPS  # [n_q, H]
    grow = np.exp(2 * d)[..., None]
    pre = grow * np.einsum("rsh,rshd->rhd", w, p_tol) + (grow - 1 + comb[..., None]) * np.einsum(
        "rsh,rshd->rhd", w, np.abs(p_ref)
    )
    tol = 2.0**-8 * np.abs(ref) + (1 + 2.0**-8) * pre
    return ref, ref_lse, tol, d + 2.0**-20 * (np.abs(lse0[:, 0]) + 1)


def check(out, lse, ref, ref_lse, tol, lse_tol, what=""):
    """Asserts |out - ref| <= tol and |lse - ref_lse| <= lse_tol; returns the worst ratio."""
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    err = np.abs(out - ref)
    bad = np.argwhere(err > tol)
    ratio = float(np.max(err / np.maximum(tol, 1e-300)))
    assert bad.size == 0, (
        f"{what}: {len(bad)} outputs out of bound (worst ratio {ratio:.3g}); first "
        + str([(tuple(b), out[tuple(b)], ref[tuple(b)], tol[tuple(b)]) for b in bad[:3]])
    )
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), f"{what}: -inf lse mismatch"
    assert np.all(out[empty] == 0), f"{what}: rows without keys must be 0"
    fin = ~empty
    lerr = np.abs(lse[fin] - ref_lse[fin])
    lratio = float(np.max(lerr / lse_tol[fin])) if lerr.size else 0.0
    assert lratio <= 1, f"{what}: lse out of bound (worst ratio {lratio:.3g})"
    return max(ratio, lratio)


def check_case(case, what=""):
    """Emulation vs the float64 oracle and vs "xla" (no record scale above 2^7 in the case).

    Against "xla": both lie within their bounds of the same reference, so their difference is
    within the sum (triangle inequality); "xla"'s bound is ``oracle.check_attention``'s.
    Returns the worst error / bound ratio against the oracle.
    """
    ref, ref_lse, tol, lse_tol = expected(case)
    out, lse = run(case)
    ratio = check(out, lse, ref, ref_lse, tol, lse_tol, what)
    oref, oref_lse, st = O.sparse_mla(case.q, case.kv, case.idx, case.indptr, case.sm_scale, True)
    np.testing.assert_allclose(oref, ref, rtol=1e-9, atol=1e-9 * max(np.abs(ref).max(initial=0), 1))
    xo, xl = run(case, sparse_mla_xla)
    O.check_attention(xo, oref, st, xl, oref_lse, what=f"{what} (xla)")
    n_keys, vmax, sabs = O.stats_atol(st, ref.shape[:2])
    xtol = 2.0**-8 * np.abs(ref) + O.attn_atol(n_keys, vmax, sabs)[..., None]
    xltol = O.lse_atol(n_keys, sabs, np.where(np.isfinite(ref_lse), ref_lse, 0))
    check(out, lse, xo, xl, tol + xtol, lse_tol + xltol, f"{what} vs xla")
    return ratio


# ---------------------------------------------------------------------------------------------
# Tests. Every case but the H in {1, 12, 128} ones is padded to one shape (H = 16), so the
# emulation and "xla" compile once for all of them.
# ---------------------------------------------------------------------------------------------

N_Q, NNZ, ROWS = 8, 16384, 512


def padded(case, n_q=N_Q, nnz=NNZ, rows=ROWS):
    """The same case in a fixed shape: NaN records that no entry reaches, -1 entries past the
    old ones and empty rows appended; entries past the old records and indptr values past the
    old entries move by as much, so they stay out of range."""
    kv = np.asarray(case.kv, np.uint8).reshape(-1, O.RECORD_BYTES)
    idx = np.asarray(case.idx, np.int64)
    idx = np.where(idx >= len(kv), np.minimum(idx + rows - len(kv), 2**31 - 1), idx)
    indptr = np.asarray(case.indptr, np.int64)
    indptr = np.where(indptr > len(idx), indptr + nnz - len(idx), indptr)
    kv = np.concatenate([kv, C.nan_records(rows - len(kv))])
    idx = np.concatenate([idx, np.full(nnz - len(idx), -1)])
    extra = n_q - case.q.shape[0]
    indptr = np.concatenate([indptr, np.full(extra, indptr[-1])])
    q = jnp.concatenate([case.q, C.bf16_normal(C.rng(0), (extra, *case.q.shape[1:]))])
    return C.SparseCase(q, kv, idx.astype(np.int32), indptr.astype(np.int32), case.sm_scale)


@pytest.mark.parametrize("h", [1, 12, 16, 128])
def test_heads(h):
    """Random CSR rows with empty rows, -1 padding, out-of-range entries and duplicates."""
    case = C.sparse_case(10 + h, n_q=5 if h < 128 else 3, h=h, max_len=40, p_neg=0.15)
    if h == 16:
        case = padded(case)
    print(f"H={h}: worst ratio {check_case(case, f'H={h}'):.3g}")


def masking_case(h: int) -> C.SparseCase:
    """Empty rows, all-masked rows (-1; >= rows, 2^31 - 1, -2^31), duplicates, NaN records
    (0, 13, 14) behind masked entries only; rows 0-2 have no key."""
    r = C.rng(4)
    kv = C.make_records(r, 15, nan_rows=[0, 13, 14])
    rows = [
        [],
        [-1, -1],
        [15, 16, 2**31 - 1, -(2**31), -2],
        [12],
        [3, 3, 3, 5],
        [5, -1, 15, 3, 3, -5],
        list(range(1, 13)),
    ]
    idx = np.int32([e for row in rows for e in row])
    indptr = np.int32(np.cumsum([0] + [len(row) for row in rows]))
    return C.SparseCase(C.bf16_normal(r, (len(rows), h, 576)), kv, idx, indptr)


def unusual_indptr_case() -> C.SparseCase:
    """indptr decreasing (an empty row), negative at the start, past nnz (masked positions)."""
    case = C.sparse_case(5, n_q=5, h=16, n_rec=30, min_len=4)
    nnz = len(case.idx)
    case.indptr = np.int32([-3, 5, 3, 7, nnz, nnz + 9])
    return case


def test_masking_empty_rows_and_nan_records():
    """Empty rows, all-masked rows, out-of-range entries (never clamped onto a NaN record),
    duplicates, NaN garbage in record 0 behind masked keys, unusual indptr."""
    case = padded(masking_case(16))
    check_case(case, "masking")
    out, lse = run(case)
    assert np.all(out[:3] == 0) and np.all(np.isneginf(lse[:3]))
    check_case(padded(unusual_indptr_case()), "indptr")


def test_referenced_nan_record_propagates():
    """A NaN record that an unmasked key reaches makes its row NaN, and only its row."""
    r = C.rng(9)
    kv = C.make_records(r, 8)
    kv[5] = C.nan_records(1)[0]
    case = padded(
        C.SparseCase(
            C.bf16_normal(r, (2, 16, 576)), kv, np.int32([1, 5, 2, 3]), np.int32([0, 2, 4])
        )
    )
    out, lse = run(case)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all()
    assert np.isfinite(out[1:]).all() and np.isfinite(lse[1]).all()


def test_long_rows():
    """Rows of 1, 129, 4096, 4097 and 5000 keys (40 tiles of 128)."""
    case = C.sparse_case(
        7, n_q=6, h=16, n_rec=300, max_len=8, long_rows={0: 1, 1: 5000, 2: 4096, 3: 4097, 4: 129}
    )
    print(f"long rows: worst ratio {check_case(padded(case), 'long rows'):.3g}")


@pytest.mark.parametrize("sm_scale,q_scale", [(0.3, 8.0), (0.01, 4.0)])
def test_peaky_and_flat_softmax(sm_scale, q_scale):
    """Scores of several hundred (P far below 2^-14 for most keys) and nearly flat ones."""
    case = C.sparse_case(3, n_q=6, h=16, sm_scale=sm_scale, q_scale=q_scale, max_len=60)
    print(f"sm {sm_scale}: worst ratio {check_case(padded(case), f'sm {sm_scale}'):.3g}")


def extreme_records(scale_2_8=False):
    """Records with scale 2^7 (|latent| = 57344), zero records (scale 2^-13), tiny ones, and
    optionally one block with scale 2^8 (|latent| = 2 57344), over the kernel's precondition."""
    r = C.rng(12)
    lat = C.random_latent(r, 16)
    lat[0] = 0.0
    lat[1] *= 57344 / np.max(np.abs(lat[1]))
    lat[2] *= 1e-6
    if scale_2_8:
        lat[3, 128:256] *= 2 * 57344 / np.max(np.abs(lat[3, 128:256]))
    kv = O.pack_fp8_ds_mla(lat, C.random_rope(r, 16))
    idx = np.int32([0, 0, 1, 2, 2, 3, 0, 4, 5, 6, 1, 3, 7])
    indptr = np.int32([0, 2, 3, 5, 11, 13])
    q = C.bf16_normal(r, (5, 16, 576), 1e-3)
    return padded(C.SparseCase(q, kv, idx, indptr, sm_scale=0.02))


def test_scales_up_to_2_7():
    case = extreme_records()
    scales = np.ascontiguousarray(case.kv[:16, 512:528]).view("<f4")
    assert scales.max() == 2.0**7 and scales.min() == 2.0**-13
    print(f"scales: worst ratio {check_case(case, 'scales'):.3g}")


def test_scale_2_8_is_clamped():
    """A block scale of 2^8 reads V with 2^7 (K keeps 2^8): the emulation matches the clamped
    reference within the bound and is far from the exact one."""
    case = extreme_records(scale_2_8=True)
    assert np.ascontiguousarray(case.kv[3, 516:520]).view("<f4")[0] == 2.0**8
    out, lse = run(case)
    ref, ref_lse, tol, lse_tol = expected(case)  # clamped V
    check(out, lse, ref, ref_lse, tol, lse_tol, "clamped")
    exact, exact_lse = O.sparse_mla(case.q, case.kv, case.idx, case.indptr, case.sm_scale)
    np.testing.assert_allclose(exact_lse, ref_lse)  # K is not clamped
    with pytest.raises(AssertionError, match="out of bound"):
        check(out, lse, exact, exact_lse, tol, lse_tol, "unclamped")


def test_bound_catches_q_without_lo_residual(monkeypatch):
    """Meta-test: the bound rejects a kernel that drops the fp8 lo residual of q."""
    case = padded(C.sparse_case(13, n_q=6, h=16, max_len=40, min_len=20, p_neg=0, p_oob=0))
    expect = expected(case)
    check(*run(case), *expect, "true split")
    split = E.split_q

    def hi_only(q_latent):
        hi, lo, s_hi = split(q_latent)
        return hi, jnp.zeros_like(lo), s_hi

    monkeypatch.setattr(E, "split_q", hi_only)
    wrong = run(case, functools.partial(E.sparse_mla_gfx950_emulation))  # a fresh trace
    with pytest.raises(AssertionError, match="out of bound"):
        check(*wrong, *expect, "q without lo")


def test_exact_split_matches_xla():
    """With a q whose hi/lo split is exact (every latent element 0 or >= 2^-13 of its block's
    max), the emulation differs from "xla" only by f32 rounding, the f16 P' and the bf16
    output: its bound against the oracle has no q-split term here."""
    case = padded(C.sparse_case(21, n_q=6, h=16, max_len=60, min_len=1))
    q = O.to_f64(case.q)
    lat = q[..., :512].reshape(*q.shape[:2], 4, 128)
    amax = np.abs(lat).max(axis=-1, keepdims=True)
    lat = np.where(np.abs(lat) >= 2.0**-13 * amax, lat, 0.0).reshape(*q.shape[:2], 512)
    case.q = C.to_bf16(np.concatenate([lat, q[..., 512:]], axis=-1))
    hi, lo, s_hi = E.split_q(case.q[..., :512])
    rebuilt = O.to_f64(hi) * np.ldexp(1.0, s_hi - 127)[..., None]
    rebuilt += O.to_f64(lo) * np.ldexp(1.0, s_hi - 132)[..., None]
    np.testing.assert_array_equal(rebuilt.reshape(lat.shape), lat)
    assert not np.any([q_split_error(q_r) for q_r in O.to_f64(case.q)])
    print(f"exact split: worst ratio {check_case(case, 'exact split'):.3g}")


def test_vmap_and_jit():
    """Under vmap (a batch of two cases) the emulation equals the per-case results."""
    kw = dict(n_q=3, h=2, n_rec=20, min_len=6, max_len=6, p_empty=0)
    cases = [C.sparse_case(s, **kw) for s in (1, 2)]
    fn = jax.jit(jax.vmap(E.sparse_mla_gfx950_emulation, in_axes=(0, 0, 0, 0, None)))
    stack = [
        jnp.stack([jnp.asarray(getattr(c, f)) for c in cases]) for f in ("q", "kv", "idx", "indptr")
    ]
    out, lse = fn(*stack, np.float32(DEFAULT_SM))
    for b, c in enumerate(cases):
        o1, l1 = run(c)
        np.testing.assert_allclose(O.to_f64(out[b]), o1, rtol=2.0**-7, atol=1e-6)
        np.testing.assert_allclose(O.to_f64(lse[b]), l1, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The kernel's data layout, lane by lane (needs flydsl: the kernel module's own address helpers)
# ---------------------------------------------------------------------------------------------

LANES = np.arange(64)
KPOS_F8 = np.array([np.r_[16 * G : 16 * G + 16, 64 + 16 * G : 80 + 16 * G] for G in range(4)])
KPOS_16 = np.array([np.arange(8 * G, 8 * G + 8) for G in range(4)])


def _mfma(a, b, kpos, scale_a=None, scale_b=None):
    """16x16xK MFMA on lane data (the kernel's docstring): a, b [64 lanes, n] values of row /
    column ``lane & 15`` at K positions ``kpos[lane >> 4]``; optional E8M0 scales [64], that of
    K group ``K // 32`` from lane ``16 (K // 32) + i``. Returns [64, 4] f64: lane 16G + j holds
    rows ``4G + [0, 4)`` of column j."""
    k = kpos.max() + 1
    mat_a, mat_b = np.zeros((16, k)), np.zeros((k, 16))
    for grp in range(4):
        lanes = 16 * grp + np.arange(16)
        mat_a[:, kpos[grp]] = a[lanes]
        mat_b[kpos[grp], :] = b[lanes].T
    if scale_a is not None:
        kg = np.arange(k) // 32
        mat_a = mat_a * np.ldexp(1.0, scale_a.reshape(4, 16).T[:, kg] - 127)
        mat_b = mat_b * np.ldexp(1.0, scale_b.reshape(4, 16)[kg, :] - 127)
    d = mat_a @ mat_b
    return np.stack([d[4 * (LANES >> 4) + r, LANES & 15] for r in range(4)], axis=1)


def _tr8(lds, addrs):
    """ds_read_b64_tr_b8: within each 16-lane row, lane t byte k = lane 2k + t // 8's byte
    t % 8 of the 8 bytes each lane addresses."""
    src = lds[np.asarray(addrs)[:, None] + np.arange(8)]
    t, k = np.arange(16)[:, None], np.arange(8)[None, :]
    return np.concatenate([src[16 * grp + 2 * k + (t >> 3), t & 7] for grp in range(4)])


def _words(a):
    """Little-endian u32 words of byte rows [..., 4 n]."""
    return np.ascontiguousarray(a, np.uint8).view("<u4")


def test_kernel_layout():
    """One 128-token tile (H = 16) through the kernel module's own address helpers with the
    MFMA / tr8 semantics above: the latent DMA lands every record byte in its swizzled slot,
    QK's A / B operands, record E8M0 scales and rope compute exactly ``S = K q`` per (token,
    head), the mask words are the S rows' tokens', and PV (tr8 V^T, P and V scale words through
    LDS) computes exactly ``O = (P sv) V``."""
    pytest.importorskip("flydsl", reason="the kernel module (its address helpers) needs flydsl")
    from jax_sparse_mla.kernels.gfx950 import sparse_mla as K

    heads, tb, n_rec = 16, 128, 300  # the tile starts at row position tb
    lat0 = K.Config(num_heads=heads).lds_latent
    r = C.rng(31)
    codes = r.integers(0, 256, (n_rec, 512)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN
    scales = np.ldexp(1.0, r.integers(-4, 8, (n_rec, 4))).astype("<f4")
    rope = r.integers(-64, 64, (n_rec, 64)) / 8.0
    recs = np.concatenate(
        [codes, scales.view(np.uint8), O.f32_to_bf16_bits(rope).astype("<u2").view(np.uint8)], 1
    )
    assert recs.shape == (n_rec, K.RECORD_BYTES)
    idx = np.full(3 * 128, -1)
    idx[tb : tb + 128] = r.permutation(n_rec)[:128]
    tile = idx[tb : tb + 128]  # record of tile token k
    t, g = LANES & 15, LANES >> 4
    byte = np.arange(16)

    # latent DMA: wave w, instruction j, lane L writes 16 B at _dma_dst + 16 L
    lds = np.zeros(K.Config(num_heads=heads).lds_bytes, np.uint8)
    hits = np.zeros(lds.size, int)
    for w in range(4):
        held = [idx[K._dma_pos(tb, LANES, hh)] for hh in range(2)]
        for j in range(16):
            rec = held[j // 8][K._dma_src_lane(LANES, j % 8) // 4]
            dst = (K._dma_dst(lat0, w, j) + 16 * LANES)[:, None] + byte
            lds[dst] = recs[rec[:, None], K._dma_chunk(w, LANES, j % 4)[:, None] + byte]
            hits[dst] += 1
    assert np.all(hits[lat0:] == 1) and not hits[:lat0].any()
    tok, blk, c = np.meshgrid(np.arange(128), np.arange(4), np.arange(8), indexing="ij")
    at = lat0 + 16384 * blk + 128 * tok + 16 * (c ^ K._swizzle(tok))
    np.testing.assert_array_equal(lds[at[..., None] + byte], codes[tile].reshape(128, 4, 8, 16))

    # QK: S^T = K Q^T from the A reads, q's dim map, the records' E8M0 scales and the rope
    q_codes = r.integers(0, 256, (heads, 512)).astype(np.uint8)
    q_codes[(q_codes & 0x7F) == 0x7F] = 0x38
    q_e8 = r.integers(118, 136, (heads, 4))
    q_rope = r.integers(-64, 64, (heads, 64)) / 8.0
    k_val = O.e4m3_decode(codes[tile]) * np.repeat(scales[tile], 128, axis=1)
    q_val = O.e4m3_decode(q_codes) * np.repeat(np.ldexp(1.0, q_e8 - 127), 128, axis=1)
    want_s = k_val @ q_val.T + rope[tile] @ q_rope.T  # [token, head]
    lds32 = lds.view("<u4")
    for w in range(4):
        k_rd = K._k_rows(lat0, w, t, g)
        for s in range(2):
            rec = idx[K._qk_pos(tb, w, t, s)]
            word = _words(recs[rec[:, None], K._scale_byte(g)[:, None] + np.arange(4)])[:, 0]
            e8 = (word.astype(np.int64) >> 23) & 0xFF
            acc = 0
            for j in range(4):
                lo, hi = K._k_slice(0, k_rd, 4 * s + j)
                a = np.concatenate([lds[lo[:, None] + byte], lds[hi[:, None] + byte]], 1)
                dims = np.concatenate([K._q_dim(g, j, h)[:, None] + byte for h in range(2)], 1)
                b = q_codes[t[:, None], dims]
                acc = acc + _mfma(O.e4m3_decode(a), O.e4m3_decode(b), KPOS_F8, e8, q_e8[t, g])
            for i in range(2):
                kr = recs[rec[:, None], K._rope_byte(g, i)[:, None] + byte]
                kr = O.bf16_bits_to_f64(np.ascontiguousarray(kr).view("<u2"))
                qr = q_rope[t[:, None], K._q_rope_dim(g, i)[:, None] - 512 + np.arange(8)]
                acc = acc + _mfma(kr, qr, KPOS_16)
            rows = K._qk_pos(0, w, 4 * g[:, None] + np.arange(4), s)  # S^T rows of lane (t, g)
            np.testing.assert_allclose(acc, want_s[rows, t[:, None]], rtol=1e-12, atol=0)
            lds32[(K._ks_write(0, w, t, g) + 64 * s) // 4] = word  # this block's scale word

    # S rows -> mask words and P in LDS; PV: tr8 V^T, P' = f16(P sv)
    p = r.integers(0, 64, (heads, 128)) / 8.0
    for w in range(4):
        for s in range(2):
            rows = K._qk_pos(0, w, 4 * g[:, None] + np.arange(4), s)
            live = lds32[(K._mask_read(0, w, g) + 64 * s)[:, None] // 4 + np.arange(4)]
            want = recs[tile[rows][..., None], K._scale_byte(0) + np.arange(4)]
            np.testing.assert_array_equal(live, _words(want)[..., 0])
            p_at = (K._p_write(0, w, t, g, heads) + 16 * s)[:, None] // 4 + np.arange(4)
            lds32[p_at] = p[t[:, None], rows].astype("<f4").view("<u4")
    assert K._p_write(0, 3, 15, 3, heads) + 32 <= lat0
    want_o = np.concatenate(
        [
            (p * scales[tile, b]) @ O.e4m3_decode(codes[tile, 128 * b : 128 * b + 128])
            for b in range(4)
        ],
        axis=1,
    )  # [head, dim]
    for w in range(4):
        p_rd, sv_rd = K._p_read(0, K._p_rows(g, heads), t), K._sv_read(0, w, g)
        pp = []
        for kk in range(4):
            vals = []
            for s in range(2):
                p_at, sv_at = K._pv_at(p_rd, sv_rd, kk, s, heads)
                pv = lds32[p_at[:, None] // 4 + np.arange(4)].view("<f4")
                sv = lds32[sv_at[:, None] // 4 + np.arange(4)].view("<f4")
                vals.append(pv.astype(np.float64) * sv)
            pp.append(np.concatenate(vals, 1).astype(np.float16).astype(np.float64))
        v_rd = K._v_rows(lat0, w, t, g)
        for dc in range(8):
            acc = 0
            for kk in range(4):
                va = O.e4m3_decode(_tr8(lds, K._v_read(0, v_rd, dc, kk)))
                acc = acc + _mfma(va, pp[kk], KPOS_16)
            dims = 128 * w + 16 * dc + 4 * g[:, None] + np.arange(4)
            np.testing.assert_allclose(acc, want_o[t[:, None], dims], rtol=1e-12, atol=0)


def test_work_items_and_splits():
    """The kernels' block-id map (``_primitives.xcd_work_item`` / ``xcd_grid_x``, shared by
    the decode kernels) and sparse_mla's key splits, on Python ints: each (item, head group)
    once, the G head groups of an item on one XCD (block id mod 8) within one window of 8 G
    block ids; the splits tile a row in order, whole 64-key chunks but the last, on Python ints
    as on jnp arrays (the emulation's ``split_range``)."""
    K = pytest.importorskip("jax_sparse_mla.kernels.gfx950._primitives")
    for n_items, groups in ((1, 8), (13, 3), (64, 1)):
        grid = K.xcd_grid_x(n_items, groups)
        assert grid == 8 * groups * -(-n_items // 8)
        seen = {}
        for bid in range(grid):
            item, hg = K.xcd_work_item(bid, groups)
            seen.setdefault(item, []).append((hg, bid))
        assert sorted(seen) == list(range(grid // groups))
        for item, pairs in seen.items():
            assert sorted(hg for hg, _ in pairs) == list(range(groups))
            assert {bid % 8 for _, bid in pairs} == {item % 8}
            assert max(b for _, b in pairs) - min(b for _, b in pairs) < 8 * groups
    for length in (0, 1, 63, 64, 65, 300, 2100):
        for splits in (1, 2, 8, 33):
            ranges = [configs.sparse_mla_split_range(length, s, splits) for s in range(splits)]
            assert ranges == [
                tuple(map(int, E.split_range(length, s, splits))) for s in range(splits)
            ]
            assert ranges[0][0] == 0 and ranges[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            assert all((hi - lo) % 64 == 0 for lo, hi in ranges if hi < length)


@pytest.mark.parametrize("splits", [3, 9])
def test_splits_merged_by_the_combine(splits):
    """S key splits per row (empty ones for the short rows), their bf16 partials merged with the
    combine's arithmetic, against the float64 oracle within ``expected_split``."""
    case = C.sparse_case(
        7, n_q=6, h=16, n_rec=300, max_len=8, long_rows={0: 1, 1: 700, 2: 129, 3: 64}
    )
    fn = functools.partial(E.sparse_mla_gfx950_emulation, num_splits=splits)
    ref, ref_lse, tol, lse_tol = expected(case, splits)
    out, lse = run(case, fn)
    print(f"{splits} splits: worst ratio {check(out, lse, ref, ref_lse, tol, lse_tol):.3g}")
    one, _ = run(case)  # the partials' roundings change the result, within the bounds
    assert not np.array_equal(out, one)


@pytest.mark.parametrize("sm_scale", [0.0, -0.05, 1e37])
def test_any_finite_scale(sm_scale):
    """sm_scale 0 (every live key weighs alike), negative, and one whose scaled scores overflow
    float32 (|q·K| ~ 10): the scale multiplies the scores only after their running max is
    subtracted, so each stays finite."""
    case = C.sparse_case(5, n_q=6, h=16, sm_scale=sm_scale, max_len=60)
    if sm_scale == 1e37:  # one-hot weights: the oracle's argmax, not the bound's terms
        out, lse = run(case)
        assert np.isfinite(out).all() and not np.isnan(lse).any()
        C_ref = O.sparse_mla(case.q, case.kv, case.idx, case.indptr, sm_scale)[0]
        np.testing.assert_allclose(out, C_ref, rtol=2.0**-7, atol=2.0**-7 * np.abs(C_ref).max())
        return
    print(f"sm {sm_scale}: worst ratio {check_case(padded(case), f'sm {sm_scale}'):.3g}")
