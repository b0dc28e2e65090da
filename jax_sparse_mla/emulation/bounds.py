"""Kernel vs emulation: the bounds that each emulation module's docstring states for a gfx950
kernel compared with its emulation on the same inputs, computed in float64 NumPy.

Each ``*_bound`` takes the op's inputs and the emulation's outputs and returns the per-element
tolerances (same shapes as the outputs); ``compare`` applies them. The bounds are the
docstrings' "an MI355 test should allow" formulas, with these stand-ins where the docstring's
term needs the exact softmax weights:

* ultraquant ``A = sum_k w_k |V_k|`` is the emulation's own output on the cache with V's sign
  bits cleared (``abs_v_cache``), times ``1 + 2^-6`` for its roundings (K is stored apart from
  V there, so the weights do not change);
* ultraquant ``S = |sm_scale| max_k sum_i |q8_i k_i| <= |sm_scale| |q8| max_k |k|`` (Cauchy-Schwarz,
  with ``|q8| <= (1 + 2^-4) |q| + 2^-6``: the rotation is orthonormal and e4m3 rounds by at most
  2^-4 relative, or 2^-10 absolute for each of the 256 subnormals); the term it enters is
  2^-15 of max|V|, so the looser S costs nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_sparse_mla.emulation.mla_decode import softmax_block
from jax_sparse_mla.emulation.sparse_mla import split_range
from jax_sparse_mla.formats import (
    LATENT_DIM,
    NUM_SCALES,
    RECORD_BYTES,
    ROPE_OFFSET,
    SCALE_BLOCK,
    SCALES_OFFSET,
    UQ_SLOT_CONTENT_BYTES,
    UQ_V_CODES,
    UQ_V_SCALES,
    ultraquant_unpack,
)

EPS = 2.0**-24


def f64(x) -> np.ndarray:
    """Any jax / NumPy array (bf16, f32, e4m3, ...) as float64."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _e4m3(codes) -> np.ndarray:
    return f64(jnp.asarray(np.ascontiguousarray(codes, np.uint8)).view(jnp.float8_e4m3fn))


def compare(name: str, got, want, tol) -> tuple[float, str | None]:
    """(worst |got - want| / tol, None) or (that ratio, what is out of bound). An element with
    tol 0 must be equal; a non-finite ``got`` where ``want`` is finite is out of bound."""
    got, want, tol = f64(got), f64(want), np.asarray(tol, np.float64)
    if got.shape != want.shape:
        return float("nan"), f"{name}: shape {got.shape}, the emulation's {want.shape}"
    same = (got == want) | (np.isnan(got) & np.isnan(want))  # e.g. -inf lse without keys
    with np.errstate(invalid="ignore"):
        err = np.where(same, 0.0, np.abs(got - want))
    err = np.where(np.isnan(err), np.inf, err)
    ratio = np.where(err == 0, 0.0, err / np.maximum(tol, 1e-300))
    worst = float(ratio.max(initial=0.0))
    if worst <= 1:
        return worst, None
    at = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    return worst, (
        f"{name}{list(map(int, at))} = {got[at]:.6g}, the emulation's {want[at]:.6g} (bound "
        f"{tol[at]:.3g}; {int(np.sum(ratio > 1))} elements out of bound)"
    )


# ---------------------------------------------------------------------------------------------
# sparse_mla (emulation/sparse_mla.py)
# ---------------------------------------------------------------------------------------------


def sparse_mla_bound(q, kv, idx, indptr, sm_scale, out_e, lse_e, parts=None):
    """The kernel's result against the emulation's, per (row, split) of its keys:
    ``|out_k - out_e| <= 2^-7 |out_e| + 2^-10 max_k |V_k| + 2^-23 n_keys max|code| / 256
    + 2^-18 score_abs max|V|`` and ``|lse_k - lse_e| <= 2^-20 (|lse_e| + score_abs) + 2^-20``,
    ``score_abs = sm_scale max_k sum |q||k|`` over the split's unmasked keys (per head).
    ``parts`` (S > 1): the emulation's partials (o_parts [n_q, S, H, 512], lse_parts [n_q, S, H]),
    whose bounds the combine carries to the result (``_combined``).
    q [n_q, H, 576], kv [rows, 656] uint8 records -> (tol [n_q, H, 512], lse_tol [n_q, H])."""
    q = f64(q)
    kv = np.asarray(kv, np.uint8).reshape(-1, RECORD_BYTES)
    idx, indptr = np.asarray(idx, np.int64), np.asarray(indptr, np.int64)
    o_e, l_e = (out_e[:, None], lse_e[:, None]) if parts is None else parts
    o_e, l_e = f64(o_e), f64(l_e)
    splits = o_e.shape[1]
    tol, lse_tol = 2.0**-7 * np.abs(o_e), np.zeros(l_e.shape)
    for r in range(q.shape[0]):
        b, e = np.clip(indptr[r : r + 2], 0, len(idx))
        length = max(e - b, 0)
        for s in range(splits):
            lo, hi = (int(x) for x in split_range(length, s, splits))
            ids = idx[b + lo : b + hi]
            ids = ids[(ids >= 0) & (ids < len(kv))]
            if len(ids):
                atol, lse_tol[r, s] = _keys_bound(q[r], kv[ids], sm_scale, l_e[r, s])
                tol[r, s] += atol[:, None]
    if parts is None:
        return tol[:, 0], lse_tol[:, 0]
    return _combined(o_e, l_e, tol, lse_tol, f64(out_e), f64(lse_e))


def _keys_bound(q_row, rec, sm_scale, lse_e):
    """The absolute terms of ``sparse_mla_bound`` for one (row, split): q_row [H, 576], rec
    [n, 656] its unmasked keys' records -> (atol [H], lse_tol [H])."""
    codes = _e4m3(rec[:, :LATENT_DIM])
    scales = rec[:, SCALES_OFFSET:ROPE_OFFSET].copy().view(np.float32).astype(np.float64)
    v = codes * np.repeat(scales.reshape(-1, NUM_SCALES), SCALE_BLOCK, axis=1)
    rope = f64(jnp.asarray(rec[:, ROPE_OFFSET:].copy().view(np.uint16)).view(jnp.bfloat16))
    k = np.concatenate([v, rope], axis=1)
    vmax, cmax = np.abs(v).max(), np.abs(codes).max()
    score_abs = np.abs(sm_scale) * (np.abs(q_row) @ np.abs(k).T).max(axis=-1)  # [H]
    atol = 2.0**-10 * vmax + 2.0**-23 * len(rec) * cmax / 256 + 2.0**-18 * score_abs * vmax
    return atol, 2.0**-20 * (np.abs(lse_e) + score_abs) + 2.0**-20


def _combined(o_parts, lse_parts, tol, lse_tol, out_e, lse_e):
    """The combine of partials each within (tol, lse_tol) of the emulation's: a partial's LSE
    off by at most ``D = max lse_tol`` moves the normalized weights by a factor within
    ``exp(+-2D)``, so ``|out_k - out_e| <= exp(2D) max_s tol_s + (exp(2D) - 1) max_s |o_s|``
    plus the combine's own ``merge_bound``; ``|lse_k - lse_e| <= D`` plus the combine's. Maxima
    over the splits with keys (finite LSE; the others have weight 0 in both)."""
    live = np.isfinite(lse_parts)  # [n_q, S, H]
    d = np.max(np.where(live, lse_tol, 0.0), axis=1)[..., None]  # [n_q, H, 1]
    grow = np.exp(2 * d)
    o_max = np.max(np.where(live[..., None], np.abs(np.nan_to_num(o_parts)), 0.0), axis=1)
    t_max = np.max(np.where(live[..., None], tol, 0.0), axis=1)
    m_tol, m_lse_tol = merge_bound(o_parts, lse_parts, out_e, lse_e)
    return m_tol + grow * t_max + (grow - 1) * o_max, m_lse_tol + d[..., 0]


# ---------------------------------------------------------------------------------------------
# mla_decode (emulation/mla_decode.py)
# ---------------------------------------------------------------------------------------------


def decode_split_keys(
    kv_indices, kv_indptr, tokens: int, qlen: int, num_splits: int, block: int = 128
):
    """Yields (query row, split, token ids, online-softmax blocks of ``block`` keys in the
    split) of every split's keys that the row sees (``mla_decode_partials``' splits of whole
    128s, causal rule and masking)."""
    idx, indptr = np.asarray(kv_indices, np.int64), np.asarray(kv_indptr, np.int64)
    for r in range(len(indptr) - 1):
        start = int(indptr[r])
        seq = max(int(indptr[r + 1]) - start, 0)
        pos = start + np.arange(seq)
        ok = (pos >= 0) & (pos < len(idx))
        ids = np.where(ok, idx[np.clip(pos, 0, max(len(idx) - 1, 0))] if len(idx) else 0, -1)
        ok &= (ids >= 0) & (ids < tokens)
        chunk = 128 * -(-seq // (128 * num_splits))
        for s in range(num_splits):
            j = np.arange(s * chunk, min((s + 1) * chunk, seq))
            for i in range(qlen):
                seen = j[ok[j] & (j <= seq - qlen + i)]
                yield r * qlen + i, s, ids[seen], -(-len(j) // block)


def mla_decode_partials_bound(
    q, kv, kv_indices, kv_indptr, *, qlen, k_scale, v_scale, sm_scale, o_e, lse_e
):
    """Per partial element, with the float64 softmax weights ``p_k`` and values ``V_k`` of the
    split's visible keys: ``2^-7 |o_emu| + 2^-7 sum_k p_k |V_k| + 2^-24 (16 score_abs
    + 8 sqrt(n) + 8 blocks + 32) max|V|``; LSE ``2^-22 (|lse| + 8) + 8 2^-24 score_abs``.
    kv [tokens, 576] uint8 e4m3 codes -> (tol [B*qlen, S, H, 512], lse_tol [B*qlen, S, H])."""
    q, o_e, lse_e = f64(q), f64(o_e), f64(lse_e)
    kv = np.asarray(kv, np.uint8)
    tol = 2.0**-7 * np.abs(o_e)
    lse_tol = np.zeros(lse_e.shape)
    block = softmax_block(qlen, o_e.shape[2], len(kv_indptr) - 1, len(kv_indices))
    splits = decode_split_keys(kv_indices, kv_indptr, len(kv), qlen, o_e.shape[1], block)
    for row, s, ids, blocks in splits:
        if len(ids) == 0:
            continue
        codes = _e4m3(kv[ids])
        k, v = codes * k_scale, codes[:, :LATENT_DIM] * v_scale
        scores = sm_scale * (q[row] @ k.T)  # [H, n]
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        vmax = np.abs(v).max()
        score_abs = abs(sm_scale) * (np.abs(q[row]) @ np.abs(k).T).max(axis=-1)  # [H]
        f32 = EPS * (16 * score_abs + 8 * np.sqrt(len(ids)) + 8 * blocks + 32) * vmax
        tol[row, s] += 2.0**-7 * (p @ np.abs(v)) + f32[:, None]
        lse_tol[row, s] = 2.0**-22 * (np.abs(lse_e[row, s]) + 8) + 8 * EPS * score_abs
    return tol, lse_tol


def merge_bound(o_parts, lse_parts, out_e, lse_e):
    """The combine: ``2^-7 |o| + 2^-20 max_s |o_s|`` over the partials that may have weight
    (lse > -inf) and ``2^-22 (|lse| + 1)`` -> (tol [n, H, D], lse_tol [n, H])."""
    o_parts, lse_parts, out_e, lse_e = map(f64, (o_parts, lse_parts, out_e, lse_e))
    live = (lse_parts > -np.inf)[..., None]
    o_max = np.max(np.where(live, np.abs(np.nan_to_num(o_parts)), 0.0), axis=1)
    lse_tol = 2.0**-22 * (np.abs(np.where(np.isfinite(lse_e), lse_e, 0.0)) + 1)
    return 2.0**-7 * np.abs(out_e) + 2.0**-20 * o_max, lse_tol


# ---------------------------------------------------------------------------------------------
# ultraquant_decode (emulation/ultraquant.py)
# ---------------------------------------------------------------------------------------------


def abs_v_cache(cache) -> np.ndarray:
    """The cache with every V code's sign bit cleared (E2M1: bit 3 of each nibble)."""
    c = np.array(cache, np.uint8, copy=True)
    c[..., UQ_V_CODES:UQ_V_SCALES] &= 0x77
    return c


def ultraquant_bound(q, cache, block_tables, seq_lens, *, sm_scale, num_partitions, out_e, a_e):
    """``2^-7 |out_emu| + (1 + [P > 1]) 2^-7 A + 2^-15 (1 + S) max|V|`` per element, ``a_e``
    the emulation's output on ``abs_v_cache(cache)`` (module docstring) -> tol [B, Hq, 256]."""
    q, out_e, a_e = f64(q), f64(out_e), f64(a_e)
    cache = np.asarray(cache, np.uint8)
    nb, bs, hk, _ = cache.shape
    g = q.shape[1] // hk
    bt = np.asarray(block_tables, np.int64)
    seq = np.clip(np.asarray(seq_lens, np.int64), 0, bt.shape[1] * bs)
    q8_norm = (1 + 2.0**-4) * np.linalg.norm(q, axis=-1) + 2.0**-6  # [B, Hq]
    atol = np.zeros(q.shape[:2])
    for b in range(q.shape[0]):
        j = np.arange(seq[b])
        blk = bt[b, j // bs]
        ok = (blk >= 0) & (blk < nb)
        if not ok.any():
            continue
        k, v = map(f64, ultraquant_unpack(cache[blk[ok], j[ok] % bs, :, :UQ_SLOT_CONTENT_BYTES]))
        k_norm = np.linalg.norm(k, axis=-1).max(axis=0)  # [Hk]
        vmax = np.abs(v).max(axis=(0, 2))  # [Hk]
        s = abs(sm_scale) * q8_norm[b] * np.repeat(k_norm, g)
        atol[b] = 2.0**-15 * (1 + s) * np.repeat(vmax, g)
    p_terms = (2 if num_partitions > 1 else 1) * 2.0**-7 * (1 + 2.0**-6) * np.abs(a_e)
    return 2.0**-7 * np.abs(out_e) + p_terms + atol[..., None]
