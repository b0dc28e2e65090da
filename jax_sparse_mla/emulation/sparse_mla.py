"""jax-native emulation of the gfx950 sparse_mla kernel's arithmetic (``gfx950_emulation``).

It reproduces, in jnp and for all (row, split) pieces at once (``lax.fori_loop`` over 128-token
tiles, so memory is O(n_q S x 128 x 512), never O(n_q x longest row x 512)), what
``jax_sparse_mla/kernels/gfx950/sparse_mla.py`` computes, and with S > 1 splits the combine
kernel's merge of its partials (``emulation.mla_decode.merge_attn_states_gfx950_emulation``):

* Rows: positions ``[b, e)`` with ``b, e = clamp(indptr[r], indptr[r + 1], 0, nnz)``, ``e >= b``;
  split s of S: ``split_range`` (chunks of ``64 ceil((e - b) / (64 S))``); 128-position tiles
  from the split's start; a key is masked (score -inf, never read) when its entry is outside
  ``[0, kv rows)``. (The kernel skips the tiles after the last unmasked entry: all-masked
  tiles, which change nothing: the max does not move, so alpha = 1 and P = 0.)
* Q per (row, head, 128-dim latent block): ``s_hi = max(e - 7, 6)`` with ``e`` the biased
  exponent of the block's ``max|q|``; ``x = q 2^(127 - s_hi)`` (built from the bf16 bits, exact;
  XLA:CPU flushes subnormal floats, so no subnormal is ever multiplied); ``hi = e4m3(x)``,
  ``lo = e4m3(32 (x - hi))`` (RNE e4m3fn codes); the lo block scale is ``s_hi - 5``.
* Scores: ``S = sum_j (hi_j·c_j 2^(s_hi - 127) + lo_j·c_j 2^(s_hi - 132)) 2^(E_j - 127)
  + q_rope·k_rope`` with ``c_j`` the record's e4m3 codes of block j and ``E_j`` the exponent bits
  of its f32 scale (f32 dots); ``t = S sign`` (``sign = -1`` for ``sm_scale < 0``, else 1),
  -inf when masked.
* Per tile, ``w(x) = exp2(((x - m_ref) |sm_scale|) f32(log2 e))`` (1 when ``x = m_ref``):
  ``m' = max(m, max t)`` (``m = -inf`` at first), ``m_ref = m'`` (0 while ``m' = -inf``),
  ``alpha = w(m)`` (0 for ``m = -inf``), ``P = w(t) 2^8`` (0 for ``t = -inf``),
  ``l' = l alpha + sum P``,
  ``P' = f16(P * sv)`` with ``sv`` the f32 block scale clamped to bits [1, 2^7] (0 when masked),
  ``O' = O alpha + P'·codes`` (f32; the codes are exact in f16).
* ``out = bf16(O * (1 / l))``, 0 when ``l == 0``; ``lse = ((m |sm_scale|) log2 e + log2 l - 8)
  ln 2``, -inf when ``l == 0`` (a NaN record that a valid key reaches gives NaN, as in the
  kernel). Any finite sm_scale gives finite weights.

Not modeled: the order and internal precision of the MFMA accumulations (QK scaled fp8 and bf16,
PV f16; emulated as f32 dots), the order of the partial sums of ``l`` (per lane, lane groups,
waves), the hardware ``v_exp_f32`` / ``v_log_f32`` (XLA's ``exp2`` / ``log2`` here; XLA:CPU's
``exp2(x)`` errs by up to about ``(2 + 0.7 |x|) 2^-24`` relative), and an E8M0 exponent of 0 (a
zero or subnormal record scale, which no writer produces: 2^-127 on the hardware, 0 here),
and the stale (finite) bytes a masked key leaves in the kernel's tile (times P' = 0: 0 here
too). Their effect before the
roundings is a relative error of about 2^-21 on scores and P. Two roundings amplify it: a P'
may land on the neighbouring f16 (one f16 ulp of that key, ``<= 2^-10 P'`` or ``2^-24`` below
2^-14), and the output on the neighbouring bf16. An MI355 test comparing the kernel with this
emulation should therefore allow, per output element,
``|out_k - out_e| <= 2^-7 |out_e| + 2^-10 max_k |V_k| + 2^-23 n_keys max|code| / 256 + 2^-18
score_abs max|V|`` (one bf16 ulp, every P' one f16 ulp off, f32-level score differences
``score_abs = |sm_scale| max_k sum |q||k|``), and
``|lse_k - lse_e| <= 2^-20 (|lse_e| + score_abs) + 2^-20``, per (row, split) over the split's
keys; with S > 1 the combine carries those bounds to the result (``emulation/bounds.py``,
``sparse_mla_bound``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla._vma import fori_loop
from jax_sparse_mla.emulation._arith import fp8_hi_lo, rounded
from jax_sparse_mla.emulation.mla_decode import merge_attn_states_gfx950_emulation
from jax_sparse_mla.formats import (
    LATENT_DIM,
    NUM_SCALES,
    RECORD_BYTES,
    ROPE_OFFSET,
    SCALE_BLOCK,
    SCALES_OFFSET,
    pow2,
)
from jax_sparse_mla.kernels.gfx950.configs import sparse_mla_split_range
from jax_sparse_mla.reference.sparse_mla import no_keys

TILE = 128  # keys per tile, as in the kernel
SPLITS_AT_ONCE = 8  # key splits emulated together (the rest in sequence)
P_SHIFT = 8.0  # P = 2^8 exp2(...) <= 2^8; the LSE takes the 8 off again
SCALE_CAP_BITS = 0x43000000  # f32 bits of 2^7: V scales are clamped to [bits 1, 2^7]
LO_SHIFT = 5  # lo = e4m3(32 (x - hi)), E8M0 scale s_hi - 5
MIN_HI_SCALE = 6  # so that the lo scale s_hi - 5 >= 1
LOG2E = np.float32(np.log2(np.e))
LN2 = np.float32(np.log(2.0))
_HIGHEST = jax.lax.Precision.HIGHEST


def split_q(q_latent: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's per-(head, 128-block) fp8 hi/lo split of the latent part of q.

    Args:
      q_latent: [..., 512] bf16.
    Returns:
      hi, lo: [..., 4, 128] f32 values of the e4m3 codes; s_hi: [..., 4] int32 E8M0 scale of
      hi (lo's is s_hi - 5), so ``q ~= hi 2^(s_hi - 127) + lo 2^(s_hi - 132)``.
    """
    bits = jax.lax.bitcast_convert_type(q_latent, jnp.uint16).astype(jnp.int32)
    bits = bits.reshape(*q_latent.shape[:-1], NUM_SCALES, SCALE_BLOCK)
    exponent = (bits >> 7) & 0xFF
    s_hi = jnp.maximum(jnp.max(exponent, axis=-1) - 7, MIN_HI_SCALE)
    # |q| = mant 2^(max(exponent, 1) - 134), so x = q 2^(127 - s_hi) = mant 2^k with k <= 0;
    # k < -126 means |x| < 2^-118, whose codes are 0.
    mant = jnp.where(exponent > 0, 128 + (bits & 0x7F), bits & 0x7F).astype(jnp.float32)
    k = jnp.maximum(exponent, 1) - 7 - s_hi[..., None]
    x = jnp.where(k >= -126, mant * pow2(jnp.maximum(k, -126)), 0.0)
    x = jnp.where((bits & 0x8000) != 0, -x, x)
    hi, lo = fp8_hi_lo(x)
    return hi, lo, s_hi


def _block_scale(e: jax.Array) -> jax.Array:
    """2^(e - 127) for an E8M0 byte e (0 for e = 0, whose 2^-127 is below f32's normal range)."""
    return jnp.where(e > 0, pow2(jnp.clip(e, 1, 255) - 127), 0.0)


def split_range(length, split, splits: int):
    """Positions ``[lo, hi)`` (from the row's first) of key split ``split`` of a row of
    ``length`` entries, as the kernel cuts them (``configs.sparse_mla_split_range``), on ints
    or jnp arrays."""
    return sparse_mla_split_range(length, split, splits, jnp.minimum)


def sparse_mla_gfx950_emulation(
    q: jax.Array,
    kv: jax.Array,
    idx: jax.Array,
    indptr: jax.Array,
    sm_scale: jax.Array,
    num_splits: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """The gfx950 sparse_mla kernels' arithmetic, in jnp (see the module docstring): with
    ``num_splits`` S > 1 the partials (``sparse_mla_partials_gfx950_emulation``) merged by the
    combine kernel's arithmetic; S = 1 the partial is the result.

    Args (as ``jax_sparse_mla.reference.sparse_mla.sparse_mla_xla``):
      q: [n_q, H, 576] bf16 (any H: the kernel's head groups do not change the arithmetic).
      kv: [..., 656] uint8 fp8_ds_mla records (read as rows).
      idx: [nnz] int32; indptr: [n_q + 1] int32 (CSR).
      sm_scale: float32 scalar.
      num_splits: static int, key splits per row (``ffi.calls.default_sparse_splits``).
    Returns:
      out [n_q, H, 512] bf16 and lse [n_q, H] float32.
    """
    o_parts, lse_parts = sparse_mla_partials_gfx950_emulation(
        q, kv, idx, indptr, sm_scale, num_splits
    )
    if num_splits == 1:
        return o_parts[:, 0], lse_parts[:, 0]
    return merge_attn_states_gfx950_emulation(o_parts, lse_parts)


def sparse_mla_partials_gfx950_emulation(
    q: jax.Array,
    kv: jax.Array,
    idx: jax.Array,
    indptr: jax.Array,
    sm_scale: jax.Array,
    num_splits: int,
) -> tuple[jax.Array, jax.Array]:
    """The kernel's per-split results: o_parts [n_q, S, H, 512] bf16 (normalized per split) and
    lse_parts [n_q, S, H] float32 (-inf and o 0 for a split without keys)."""
    n_q, h, _ = q.shape
    records = kv.reshape(-1, RECORD_BYTES)
    rows, nnz = records.shape[0], idx.shape[0]
    if rows == 0 or nnz == 0 or n_q == 0:
        out, lse = no_keys(n_q * num_splits, h)
        return out.reshape(n_q, num_splits, h, LATENT_DIM), lse.reshape(n_q, num_splits, h)

    row_start = jnp.clip(indptr[:-1], 0, nnz)
    row_length = jnp.clip(indptr[1:], row_start, nnz) - row_start
    lo, hi = split_range(row_length[None, :], jnp.arange(num_splits)[:, None], num_splits)

    def split(bounds):  # one split of every row: out [n_q, H, 512], lse [n_q, H]
        return _attend(q, records, idx, row_start + bounds[0], bounds[1] - bounds[0], sm_scale)

    # SPLITS_AT_ONCE splits of every row at a time: a row's temporaries do not grow with S
    out, lse = jax.lax.map(split, (lo, hi), batch_size=SPLITS_AT_ONCE)  # [S, n_q, ...]
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(lse, 0, 1)


def _attend(q, records, idx, start, length, sm_scale) -> tuple[jax.Array, jax.Array]:
    """Each query row's attention over its positions ``[start, start + length)`` of idx (a
    split of a row): out [n, H, 512] bf16, lse [n, H] float32."""
    n_q, h, _ = q.shape
    rows, nnz = records.shape[0], idx.shape[0]
    q_hi, q_lo, s_hi = split_q(q[..., :LATENT_DIM])  # [n_q, H, 4, 128], [n_q, H, 4]
    q_hi_scale = pow2(s_hi - 127)
    q_lo_scale = pow2(s_hi - 127 - LO_SHIFT)
    q_rope = q[..., LATENT_DIM:].astype(jnp.float32)
    sm_scale = jnp.asarray(sm_scale, jnp.float32)
    sign = jnp.where(sm_scale < 0, -1.0, 1.0).astype(jnp.float32)
    scale = jnp.abs(sm_scale)

    def weight(t, m_ref):
        """exp2(((t - m_ref) |sm_scale|) log2 e), 1 where t = m_ref (the hardware's exp2(0))."""
        return jnp.where(t == m_ref, 1.0, jnp.exp2(((t - m_ref) * scale) * LOG2E))

    offsets = jnp.arange(TILE, dtype=jnp.int32)

    def step(t, carry):
        m, l_sum, o = carry
        j = t * TILE + offsets
        in_row = j < length[:, None]  # [n_q, T]
        ids = idx[jnp.clip(start[:, None] + j, 0, nnz - 1)]
        valid = in_row & (ids >= 0) & (ids < rows)
        rec = records[jnp.where(valid, ids, 0)]  # [n_q, T, 656]
        codes = jax.lax.bitcast_convert_type(rec[..., :LATENT_DIM], jnp.float8_e4m3fn)
        codes = codes.astype(jnp.float32).reshape(n_q, TILE, NUM_SCALES, SCALE_BLOCK)
        codes = jnp.where(valid[..., None, None], codes, 0.0)  # a masked key is never read
        scale_bits = jax.lax.bitcast_convert_type(
            rec[..., SCALES_OFFSET:ROPE_OFFSET].reshape(n_q, TILE, NUM_SCALES, 4), jnp.int32
        )
        rope = jax.lax.bitcast_convert_type(
            rec[..., ROPE_OFFSET:].reshape(n_q, TILE, -1, 2), jnp.bfloat16
        ).astype(jnp.float32)

        dot_hi = jnp.einsum("rhjd,rtjd->rhtj", q_hi, codes, precision=_HIGHEST)
        dot_lo = jnp.einsum("rhjd,rtjd->rhtj", q_lo, codes, precision=_HIGHEST)
        k_scale = _block_scale((scale_bits >> 23) & 0xFF)[:, None]  # [n_q, 1, T, 4]
        blocks = (dot_hi * q_hi_scale[:, :, None] + dot_lo * q_lo_scale[:, :, None]) * k_scale
        scores = jnp.sum(blocks, axis=-1) + jnp.einsum(
            "rhd,rtd->rht", q_rope, rope, precision=_HIGHEST
        )
        s = jnp.where(valid[:, None, :], scores * sign, -jnp.inf)  # [n_q, H, T]

        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.where(m == -jnp.inf, 0.0, weight(m, m_ref))
        p = jnp.where(s == -jnp.inf, 0.0, weight(s, m_ref[..., None]) * 2.0**P_SHIFT)
        l_new = l_sum * alpha + jnp.sum(p, axis=-1)
        sv = jax.lax.bitcast_convert_type(jnp.clip(scale_bits, 1, SCALE_CAP_BITS), jnp.float32)
        sv = jnp.where(valid[..., None], sv, 0.0)[:, None]  # [n_q, 1, T, 4]
        p16 = rounded(p[..., None] * sv, jnp.float16)  # [n_q, H, T, 4]
        pv = jnp.einsum("rhtj,rtjd->rhjd", p16, codes, precision=_HIGHEST)
        return m_new, l_new, o * alpha[..., None, None] + pv

    init = (
        jnp.full((n_q, h), -jnp.inf, jnp.float32),
        jnp.zeros((n_q, h), jnp.float32),
        jnp.zeros((n_q, h, NUM_SCALES, SCALE_BLOCK), jnp.float32),
    )
    num_tiles = (jnp.max(length) + TILE - 1) // TILE
    m, l_sum, o = fori_loop(0, num_tiles, step, init)

    has_keys = l_sum != 0
    l_safe = jnp.where(has_keys, l_sum, 1.0)
    inv_l = jnp.where(has_keys, 1.0 / l_safe, 0.0)
    out = (o * inv_l[..., None, None]).reshape(n_q, h, LATENT_DIM).astype(jnp.bfloat16)
    m_log2 = jnp.where(has_keys, m * scale * LOG2E, 0.0)
    lse = jnp.where(has_keys, (m_log2 + jnp.log2(l_safe) - P_SHIFT) * LN2, -jnp.inf)
    return out, lse
