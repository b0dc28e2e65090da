"""jax emulation of the gfx950 ``mla_decode`` kernels' arithmetic (split-KV partials + combine).

Mirrors ``jax_sparse_mla/kernels/gfx950/mla_decode.py`` operation by operation, so it is the tight
oracle of those kernels and a numerics study of their design. All values are float32 unless said
otherwise; ``e4m3`` is OCP e4m3fn with round-to-nearest-even; ``exp2``/``log2`` are exact up to
a few ulp here and the hardware ``v_exp_f32`` / ``v_log_f32`` on the device.

Partials (per request, split, query row; ``c = (sm_scale * k_scale) * f32(log2 e)``,
``sg = -1`` if ``c < 0`` else 1, ``a = c sg = |c|``):

* q split, per query row over its 576 dims (``q_split``): ``e`` = exponent bits of ``max|q|``,
  ``s = max(e - 7, 6)`` (E8M0, so ``max|q| 2^(127-s)`` is in [128, 256) unless clamped),
  ``x = q 2^(127-s)`` (exact, bf16 subnormals included), ``hi = e4m3(x)``,
  ``lo = e4m3((x - hi) 32)``. The kernel feeds ``hi`` (scale ``s``) and ``lo`` (scale ``s - 5``)
  to a scaled fp8 MFMA, so the query it uses is ``(hi + lo / 32) 2^(s-127)``; this equals q for
  every element with ``|x| >= 2^-7`` (e.g. within 2^14 of the row max) and is off by at most
  ``2^-15 2^(s-127)`` otherwise.
* Scores: ``S = (sum_d code_d (hi_d + lo_d / 32)) 2^(s-127)`` (the raw fp8 K codes, f32
  accumulation), ``t = S sg`` (exact); a key is masked (``t = -inf``, ``P = 0``) when its
  position is outside the split, its index position outside ``[0, len(kv_indices))``, its
  index outside ``[0, tokens)`` or it is causally hidden (``j > seq_len - qlen + i``).
* Online softmax over blocks of ``K`` keys of the split (block ``b`` = positions
  ``lo + K b + [0, K)``; ``K = 128``, or 64 where the 128-row kernel serves the call on an
  MI355X's 256 CUs: ``configs.mla_decode_rows``, from qlen, H, B and len(kv_indices)), scaled
  after the max:
  ``m' = max(m, max_block t)`` (``m`` starts at -inf), ``alpha = exp2((m - m') a)`` (0 while
  ``m = -inf``),
  ``P = exp2((t - m') a + 8)`` (so ``P <= 2^8``), ``l' = l alpha + sum P`` (the f32 P),
  ``O' = O alpha + sum_k Pq_k code_k`` with
  ``Pq = hi + lo / 32``, ``hi = e4m3(P)``, ``lo = e4m3((P - hi) 32)`` (``p_split``) and the raw
  fp8 V codes (masked keys contribute 0).
* ``o = bf16(O (v_scale / l))``, ``lse = (m a + (log2 l - 8)) ln 2``; ``o = 0``,
  ``lse = -inf`` when ``l == 0`` (no visible key). Any finite sm_scale gives finite weights
  (while ``c`` is finite: ``|sm_scale k_scale| log2 e < 2^128``); an lse past float32's range
  is +-inf.
* Causal rule (the kernel's way): the NaN V codes of the boundary keys ``j > seq_len - qlen``
  (hidden from some position, seen by another) are zeroed before ``P V`` (after the scores), so
  a hidden key contributes exactly nothing, even a NaN. A row that sees a NaN code has a NaN
  score (V is part of K), so a NaN ``l``: that counts as a visible key (``l != 0``) and makes
  o and the LSE NaN.

Combine (per output row and head, over the S partials in order):
``m = max_s lse_s``; all -inf: ``o = 0``, ``lse = -inf``. Else ``w_s = exp2((lse_s - m) log2 e)``
(``m = +inf``: ``w_s = [lse_s = +inf]``),
``acc = sum_s (w_s > 0 ? w_s o_s : 0)`` and ``W = sum_s w_s`` (both left to right),
``o = bf16(acc / W)``, ``lse = m + log2(W) ln 2``.

What is not modeled: the MFMA's accumulation order and internal precision (the scores' and O's
f32 sums here run in XLA's order), the per-lane / per-wave order of the kernel's l partial sums,
f32 subnormals in the softmax (XLA:CPU flushes them, the device keeps them: they only touch P
below 2^-126, which is 0 after the split) and the hardware exp2 / log2 rounding (1 ulp vs
XLA's ~1.4). Kernel vs emulation, an MI355 test should therefore allow, per element of a
partial with softmax weights ``p_k`` and values ``V_k``:

* ``2^-7 |o_emu|``: the f32 values differ by a few ulp, so the bf16 roundings may differ by one
  ulp;
* ``2^-7 sum_k p_k |V_k|`` over the keys whose P lands on the other side of an e4m3 rounding
  boundary of ``p_split`` (a key's P differs by ~2^-20 relative, so each key flips with
  probability ~2^-12; summed over all keys this is twice the P term of the emulation-vs-oracle
  bound in ``tests/test_emulation_mla_decode.py``);
* ``2^-24 (16 score_abs + 8 sqrt(n) + 8 blocks + 32) max|V|`` for the f32 sums and exp2;

and ``2^-22 (|lse| + 8) + 8 2^-24 score_abs`` on the LSE. A practical test asserts the full
bound (all keys) for every element and ``2^-7 |o_emu| + 2^-16 max|V|`` for 99% of them. The
combine's emulation differs from the kernel only by exp2 / log2 rounding and the bf16 rounding
of its output: ``2^-7 |o| + 2^-20 max_s |o_s|`` and ``2^-22 (|lse| + 1)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_sparse_mla._vma import fori_loop, vary_like
from jax_sparse_mla.emulation._arith import LO_FACTOR, exp2, fp8_hi_lo, narrow
from jax_sparse_mla.formats import LATENT_DIM, pow2
from jax_sparse_mla.kernels.gfx950 import configs

BLOCK = configs.MLA_DECODE_BLOCK  # a split is whole blocks of 128 keys
P_SHIFT = 8.0  # P = exp2((t - m) |c| + 8) <= 2^8
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
Q_SCALE_MIN = 6  # smallest hi E8M0 exponent byte (the lo one, s - 5, stays >= 1)


def q_split(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kernel's fp8 hi + lo split of each query row (last axis).

    Args:
      q: [..., 576] bf16.
    Returns:
      ``x_hat = hi + lo / 32`` [..., 576] float32 (exact sum) and ``scale = 2^(s - 127)`` [...]
      float32, so the query the kernel multiplies is ``x_hat * scale``.
    """
    bits = jax.lax.bitcast_convert_type(q, jnp.uint16).astype(jnp.int32)
    s = jnp.maximum((jnp.max(bits & 0x7FFF, axis=-1) >> 7) - 7, Q_SCALE_MIN)[..., None]
    x = q.astype(jnp.float32) * pow2(127 - s)
    # A bf16 subnormal is (bits & 0x7F) 2^-133: scale its integer mantissa (XLA:CPU would flush
    # the float product); below 2^-119 both hi and lo are 0 anyway.
    sub = (bits & 0x7F).astype(jnp.float32) * jnp.where(s <= 120, pow2(jnp.minimum(-6 - s, 0)), 0.0)
    x = jnp.where((bits & 0x7F80) == 0, jnp.where(bits & 0x8000, -sub, sub), x)
    hi, lo = fp8_hi_lo(x)
    return hi + lo / LO_FACTOR, pow2(s[..., 0] - 127)


def p_split(p: jax.Array) -> jax.Array:
    """The kernel's fp8 hi + lo split of P (``0 <= P <= 2^8``): ``hi + lo / 32`` in float32."""
    hi, lo = fp8_hi_lo(p)
    return hi + lo / LO_FACTOR


def softmax_block(qlen: int, heads: int, batch: int, n_indices: int) -> int:
    """Keys per online-softmax block of the partials kernel that serves the call on an
    MI355X's 256 CUs (``configs.mla_decode_rows``): 64 for the 128-row kernel, else 128."""
    rows = configs.mla_decode_rows(qlen, heads, batch, n_indices, configs.MI355X_CUS)
    return configs.mla_decode_softmax_block(rows)


def split_bounds(kv_indptr: jax.Array, n: int, num_splits: int):
    """Per request: start of its positions in kv_indices, seq_len, and the split length c
    (``kv_indptr`` entries clipped to [0, n], n = len(kv_indices))."""
    start = jnp.clip(kv_indptr[:-1], 0, n)
    seq_len = jnp.clip(kv_indptr[1:], start, n) - start
    chunk = BLOCK * ((seq_len + BLOCK * num_splits - 1) // (BLOCK * num_splits))
    return start, seq_len, chunk


def mla_decode_partials_gfx950_emulation(
    q: jax.Array,
    kv: jax.Array,
    kv_indices: jax.Array,
    kv_indptr: jax.Array,
    *,
    qlen: int,
    k_scale,
    v_scale,
    sm_scale,
    num_splits: int,
) -> tuple[jax.Array, jax.Array]:
    """The gfx950 partials kernel's arithmetic (see the module docstring).

    Args:
      q: [B * qlen, H, 576] bf16; row r * qlen + i is position i of request r.
      kv: [tokens, 576] uint8 e4m3fn codes.
      kv_indices: [n] int32; kv_indptr: [B + 1] int32 (CSR, as ``mla_decode``).
      qlen, num_splits: static ints.
      k_scale, v_scale, sm_scale: float32 scalars.
    Returns:
      o_parts [B * qlen, S, H, 512] bf16 and lse_parts [B * qlen, S, H] float32, with the
      conventions of ``reference.mla_decode.mla_decode_partials_f32``.
    """
    rows, h, dim = q.shape
    b = kv_indptr.shape[0] - 1
    s_count = num_splits
    tokens, n = kv.shape[0], kv_indices.shape[0]
    m_rows = qlen * h
    if tokens == 0 or n == 0 or b == 0:
        return (
            jnp.zeros((rows, s_count, h, LATENT_DIM), jnp.bfloat16),
            jnp.full((rows, s_count, h), -jnp.inf, jnp.float32),
        )
    f32 = jnp.float32
    c = (jnp.asarray(sm_scale, f32) * jnp.asarray(k_scale, f32)) * f32(LOG2E)
    sg = jnp.where(c < 0, f32(-1.0), f32(1.0))
    a = c * sg
    x_hat, q_scale = q_split(q.reshape(b, m_rows, dim))  # [B, M, 576], [B, M]
    start, seq_len, chunk = split_bounds(kv_indptr, n, s_count)
    lo = jnp.arange(s_count, dtype=jnp.int32)[None, :] * chunk[:, None]  # [B, S]
    hi = jnp.minimum(lo + chunk[:, None], seq_len[:, None])
    block = softmax_block(qlen, h, b, n)  # keys per online-softmax block
    num_blocks = (jnp.max(jnp.maximum(hi - lo, 0)) + block - 1) // block
    # Causal bound of row m = (i, head): position i = m // h sees j <= seq_len - qlen + i.
    pos_i = jnp.arange(m_rows, dtype=jnp.int32) // h
    bound = seq_len[:, None] - qlen + pos_i[None, :]  # [B, M]
    offsets = jnp.arange(block, dtype=jnp.int32)

    def step(blk, carry):
        m_run, l_run, o_run = carry
        j = lo[:, :, None] + blk * block + offsets  # [B, S, T] key positions
        pos = start[:, None, None] + j
        tok = kv_indices[jnp.clip(pos, 0, n - 1)]
        valid = (j < hi[:, :, None]) & (pos >= 0) & (pos < n) & (tok >= 0) & (tok < tokens)
        codes = kv[jnp.where(valid, tok, 0)]  # [B, S, T, 576] uint8
        codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(f32)
        codes = jnp.where(valid[..., None], codes, 0.0)
        dots = jnp.einsum("bmd,bstd->bsmt", x_hat, codes, precision=jax.lax.Precision.HIGHEST)
        t = (dots * q_scale[:, None, :, None]) * sg
        visible = valid[:, :, None, :] & (j[:, :, None, :] <= bound[:, None, :, None])
        t = jnp.where(visible, t, -jnp.inf)
        m_new = jnp.maximum(m_run, jnp.max(t, axis=-1))
        alpha = jnp.where(m_run == -jnp.inf, 0.0, exp2((m_run - m_new) * a))
        p = jnp.where(visible, exp2((t - m_new[..., None]) * a + f32(P_SHIFT)), 0.0)
        l_new = l_run * alpha + jnp.sum(p, axis=-1)
        v = codes[..., :LATENT_DIM]
        boundary = (j > (seq_len - qlen)[:, None, None])[..., None]
        v = jnp.where(boundary & jnp.isnan(v), 0.0, v)
        pv = jnp.einsum("bsmt,bstd->bsmd", p_split(p), v, precision=jax.lax.Precision.HIGHEST)
        return m_new, l_new, o_run * alpha[..., None] + pv

    init = (
        jnp.full((b, s_count, m_rows), -jnp.inf, f32),
        jnp.zeros((b, s_count, m_rows), f32),
        jnp.zeros((b, s_count, m_rows, LATENT_DIM), f32),
    )
    m_fin, l_fin, o_fin = fori_loop(0, num_blocks, step, init)
    has = l_fin != 0  # NaN included (causal rule)
    l_safe = jnp.where(has, l_fin, 1.0)
    o = jnp.where(has[..., None], o_fin * (jnp.asarray(v_scale, f32) / l_safe)[..., None], 0.0)
    lse = jnp.where(has, (m_fin * a + (jnp.log2(l_safe) - f32(P_SHIFT))) * f32(LN2), -jnp.inf)
    # [B, S, (qlen, H)] -> [B * qlen, S, H]
    o = o.reshape(b, s_count, qlen, h, LATENT_DIM).transpose(0, 2, 1, 3, 4)
    lse = lse.reshape(b, s_count, qlen, h).transpose(0, 2, 1, 3)
    return (
        narrow(o.reshape(rows, s_count, h, LATENT_DIM), jnp.bfloat16),
        lse.reshape(rows, s_count, h),
    )


def merge_attn_states_gfx950_emulation(
    o_parts: jax.Array, lse_parts: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The gfx950 combine kernel's arithmetic.

    Args:
      o_parts: [n, S, H, D] partial outputs (bf16 from the partials kernel).
      lse_parts: [n, S, H] float32 natural-log LSEs; a -inf partial has weight 0 (its o is
        ignored even if NaN).
    Returns:
      o [n, H, D] bf16 (0 where every partial is -inf) and lse [n, H] float32.
    """
    f32 = jnp.float32
    lse = lse_parts.astype(f32)
    m = jnp.max(lse, axis=1)  # [n, H]
    empty = m == -jnp.inf
    m_ref = jnp.where(empty, 0.0, m)

    def add(carry, part):
        acc, total = carry
        o_s, lse_s = part
        w = exp2((lse_s - m_ref) * f32(LOG2E))
        w = jnp.where(m == jnp.inf, (lse_s == jnp.inf).astype(f32), w)
        contrib = jnp.where((w > 0)[..., None], w[..., None] * o_s.astype(f32), 0.0)
        return (acc + contrib, total + w), None

    init = (jnp.zeros(o_parts.shape[:1] + o_parts.shape[2:], f32), jnp.zeros_like(m_ref))
    init = vary_like(init, o_parts, lse_parts)  # jax.shard_map
    (acc, total), _ = jax.lax.scan(
        add, init, (jnp.moveaxis(o_parts, 1, 0), jnp.moveaxis(lse, 1, 0))
    )
    total_safe = jnp.where(empty, 1.0, total)
    o = jnp.where(empty[..., None], 0.0, acc / total_safe[..., None])
    lse_out = jnp.where(empty, -jnp.inf, m_ref + jnp.log2(total_safe) * f32(LN2))
    return o.astype(jnp.bfloat16), lse_out
