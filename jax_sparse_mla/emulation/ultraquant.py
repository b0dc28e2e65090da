"""jax emulation of the gfx950 ``ultraquant_decode`` kernels' arithmetic (partials + reduce).

Mirrors ``jax_sparse_mla/kernels/gfx950/ultraquant.py`` operation by operation, so it is the
tight oracle of those kernels and a numerics study of their design. float32 unless said
otherwise; ``e4m3`` is OCP e4m3fn, round to nearest even.

Query (``rotate_query``): f32 Walsh-Hadamard butterflies ``(a + b, a - b)`` over strides 1, 2,
4, ..., 128 in that order (the kernel's order: 5 in-lane stages, then 3 across lanes), times
1/16 (exact), clamped to [-448, 448], rounded to e4m3, in the natural rotated order K is stored
in (the kernel's byte permutation of q in LDS only undoes the MFMA's 8-bit operand layout; it
pairs the same dims). The clamp is the kernel's: ``v_cvt_pk_fp8_f32`` itself does
not saturate (an overflow gives NaN, as the CDNA ISA and AMD's fp8 libraries, which clamp with
v_med3 before it, say), so the kernel clamps first and a huge q saturates to +-448.

Partials (partition p of P owns the 128-token tile-groups p, p + P, ...; each is 8 tiles of 16
tokens; per request, KV head, query head):

* The scale (``score_scale``): ``sign = -1`` where ``sm_scale``'s sign bit is set, else 1;
  ``mag = max(|sm_scale|, 2^-126)``; ``c = f32(mag log2e)``, float32's max where it overflows.
* Scores ``s = f32(sum_i q8_i k_i) * sign`` (exact) with ``k = fp4 * 2^(e - 127)`` (exact)
  over the rotated dims; ``-inf`` for a token >= seq_len (clamped to [0, max_blocks * block_size])
  or in a block-table entry outside [0, num_blocks). Masked tokens' V are 0 (the kernel never
  loads them).
* Per tile, in order: ``M' = max(M, max_t s_t)``; ``alpha = exp2(f32(M - M') c)`` (1 while
  ``M = -inf``); ``p_t = exp2(f32(s_t - M') c)`` (0 while ``M' = -inf``): sm_scale meets the
  scores only after the max is subtracted, so any finite sm_scale gives finite weights; tile
  sum ``((p0+p1)+p2)+p3`` per 4 tokens, then ``(S0+S1)+(S2+S3)``;
  ``L' = f32(L alpha) + tile sum``; ``O' = f32(O alpha) + sum_t bf16(p_t) v_t``.
* ``o = bf16(O * f32(1 / L))`` (``L = 0``: divisor 1, o = 0), ``max_logit = f32(M mag)``
  (natural-log units; +-inf where it overflows), ``exp_sum = L``.

Reduce, per request and query head, partitions in order: ``M = max_p max_logit_p``;
``w_p = f32(exp2(d_p log2e)) * exp_sum_p`` with ``d_p = 0`` where ``max_logit_p = M`` (also
both -inf or both +inf: overflowed partitions weigh by their sums alone) and
``max_logit_p - M`` elsewhere; ``W = sum_p w_p``, ``acc = sum_p f32(w_p o_p)``;
``out = bf16(acc * f32(1 / W))``, 0 when ``W = 0``.

Not modeled: the MFMAs' accumulation order and internal precision (the QK dot over 256 dims,
the 16-token PV sum and its addition to ``O alpha`` run here in XLA's f32 order; the device may
round once), the hardware ``v_exp_f32`` rounding (here exp2 is exact at integers and within
about an ulp elsewhere), and f32 subnormals (XLA:CPU flushes them, the device keeps them: only
values below 2^-126, e.g. probabilities of keys 87 nats below the maximum, or fp4 K / V values
``0.5 * 2^-126``). The query is modeled bit for bit (same butterfly order, IEEE adds, RNE).

Kernel vs emulation, an MI355 test should allow per element (out = the reduced output)
``2^-7 |out_emu| + (1 + [P > 1]) 2^-7 A + 2^-15 (1 + S) max|V|`` with ``A = sum_k w_k |V_k|``
(``<= max|V|``) and ``S = |sm_scale| max_k sum_i |q8_i k_i|``: a probability, a partial o or the
output can land on the other side of a bf16 rounding (one bf16 ulp, ``<= 2^-7`` relative), and
the f32 sums can differ in order (worst case ``256 * 2^-24`` of the score's absolute sum,
moving the output by twice that times max|V|). Flips are rare (an f32-level difference over a
bf16 ulp, ~2^-14 per value), so typical distances are far below that bound. The
emulation-vs-float64-oracle bound is derived in ``tests/test_emulation_ultraquant.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla._vma import fori_loop, vary_like
from jax_sparse_mla.emulation._arith import exp2, narrow, rounded
from jax_sparse_mla.formats import UQ_HEAD_DIM, _unpack_slots
from jax_sparse_mla.reference.attention import ceil_div
from jax_sparse_mla.reference.ultraquant import round_e4m3

TILE = 16  # tokens per online-softmax step (one MFMA tile)
TILE_GROUP = 128  # tokens per partition work item
N_TILES = TILE_GROUP // TILE
LOG2E = np.float32(math.log2(math.e))  # the kernel's f32 constant
_F32 = np.finfo(np.float32)
_HIGHEST = jax.lax.Precision.HIGHEST


def rotate_query(q: jax.Array) -> jax.Array:
    """The kernel's query: f32 butterflies (strides 1 .. 128), / 16, clamp +-448, e4m3 (RNE),
    in natural rotated order (the order of the stored K).

    Args:
      q: [..., 256] float (bf16 in the op).
    Returns:
      [..., 256] float32 holding e4m3 values.
    """
    lead = q.shape[:-1]
    x = q.astype(jnp.float32)
    stride = 1
    while stride < UQ_HEAD_DIM:
        x = x.reshape(*lead, UQ_HEAD_DIM // (2 * stride), 2, stride)
        a, b = x[..., 0, :], x[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2)
        stride *= 2
    x = x.reshape(*lead, UQ_HEAD_DIM) * jnp.float32(1.0 / 16.0)
    return round_e4m3(x)


def score_scale(sm_scale) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's ``_score_scale``: (sign, mag, c) float32 of ``sm_scale`` (module
    docstring); NaN stays NaN."""
    scale = jnp.asarray(sm_scale, jnp.float32)
    sign = jnp.where(jnp.signbit(scale), jnp.float32(-1.0), jnp.float32(1.0))
    mag = jnp.where(jnp.abs(scale) < _F32.tiny, _F32.tiny, jnp.abs(scale))  # NaN stays NaN
    c = mag * LOG2E
    return sign, mag, jnp.where(c > _F32.max, _F32.max, c)


def _tile_sum(p: jax.Array) -> jax.Array:
    """Sum over the last axis (16 tokens) in the kernel's order."""
    s = p.reshape(*p.shape[:-1], 4, 4)
    quad = ((s[..., 0] + s[..., 1]) + s[..., 2]) + s[..., 3]
    return (quad[..., 0] + quad[..., 1]) + (quad[..., 2] + quad[..., 3])


def ultraquant_decode_gfx950_partials_emulation(
    q: jax.Array,
    cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale,
    num_partitions: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode kernel's partials.

    Args:
      q: [B, Hq, 256] bf16, not rotated; query head h reads KV head h // G.
      cache: [num_blocks, block_size, Hk, slot_bytes] uint8 UltraQuant slots.
      block_tables: [B, max_blocks] int32.
      seq_lens: [B] int32.
      sm_scale: softmax scale (rounded to float32).
      num_partitions: P (static; None means 1).
    Returns:
      o [B, P, Hq, 256] bf16, max_logits [B, P, Hq] f32, exp_sums [B, P, Hq] f32 (the kernel
      stores them as [B, Hk, P, G, ...]).
    """
    bsz, hq, _ = q.shape
    nb, bs, hk, _ = cache.shape
    g = hq // hk
    p_count = num_partitions or 1
    max_blocks = block_tables.shape[1]
    seq_len = jnp.clip(seq_lens, 0, max_blocks * bs)
    sign, mag, c = score_scale(sm_scale)
    part = jnp.tile(jnp.arange(p_count, dtype=jnp.int32), bsz)  # rows r = b * P + p
    req = jnp.repeat(jnp.arange(bsz, dtype=jnp.int32), p_count)
    row_len = seq_len[req][:, None]
    q8 = rotate_query(q).reshape(bsz, hk, g, UQ_HEAD_DIM)[req]  # [R, Hk, G, 256]
    offsets = jnp.arange(TILE, dtype=jnp.int32)
    neg_inf = jnp.float32(-jnp.inf)

    def step(t, carry):
        run_max, run_sum, acc = carry
        pos = (part + (t // N_TILES) * p_count) * TILE_GROUP + (t % N_TILES) * TILE
        pos = pos[:, None] + offsets  # [R, 16]
        block = block_tables[req[:, None], jnp.minimum(pos // bs, max_blocks - 1)]
        valid = (pos < row_len) & (block >= 0) & (block < nb)
        k, v = _unpack_slots(cache[jnp.where(valid, block, 0), pos % bs])  # [R, 16, Hk, 256]
        v = jnp.where(valid[..., None, None], v, 0.0)
        raw = jnp.einsum("rhgd,rthd->rhgt", q8, k, precision=_HIGHEST)
        s = jnp.where(valid[:, None, None, :], raw * sign, neg_inf)
        new_max = jnp.maximum(run_max, jnp.max(s, axis=-1))
        alpha = exp2(jnp.where(run_max > neg_inf, run_max - new_max, 0.0) * c)
        live = (new_max > neg_inf)[..., None]
        p = exp2(jnp.where(live, s - new_max[..., None], neg_inf) * c)
        run_sum = run_sum * alpha + _tile_sum(p)
        p16 = rounded(p, jnp.bfloat16)
        pv = jnp.einsum("rhgt,rthd->rhgd", p16, v, precision=_HIGHEST)
        return new_max, run_sum, acc * alpha[..., None] + pv

    rows = bsz * p_count
    init = (
        jnp.full((rows, hk, g), neg_inf),
        jnp.zeros((rows, hk, g), jnp.float32),
        jnp.zeros((rows, hk, g, UQ_HEAD_DIM), jnp.float32),
    )
    num_tiles = ceil_div(ceil_div(jnp.max(seq_len), TILE_GROUP), p_count) * N_TILES
    run_max, run_sum, acc = fori_loop(0, num_tiles, step, init)
    inv = jnp.float32(1.0) / jnp.where(run_sum > 0.0, run_sum, 1.0)
    o = narrow(acc * inv[..., None], jnp.bfloat16)
    return (
        o.reshape(bsz, p_count, hq, UQ_HEAD_DIM),
        (run_max * mag).reshape(bsz, p_count, hq),
        run_sum.reshape(bsz, p_count, hq),
    )


def ultraquant_reduce_gfx950_emulation(
    o: jax.Array, max_logits: jax.Array, exp_sums: jax.Array
) -> jax.Array:
    """The reduce kernel: merges [B, P, Hq, 256] bf16 partials into [B, Hq, 256] bf16."""
    top = jnp.max(max_logits, axis=1, keepdims=True)
    d = jnp.where(max_logits == top, 0.0, max_logits - top)
    w = exp2(d * LOG2E) * exp_sums  # [B, P, Hq]

    def add(carry, part):
        total, acc = carry
        w_p, o_p = part
        return (total + w_p, acc + w_p[..., None] * o_p.astype(jnp.float32)), None

    init = (jnp.zeros_like(w[:, 0]), jnp.zeros(o[:, 0].shape, jnp.float32))
    init = vary_like(init, w, o)  # jax.shard_map
    (total, acc), _ = jax.lax.scan(add, init, (jnp.moveaxis(w, 1, 0), jnp.moveaxis(o, 1, 0)))
    has = (total != 0.0)[..., None]
    inv = jnp.float32(1.0) / jnp.where(has, total[..., None], 1.0)
    return jnp.where(has, acc * inv, 0.0).astype(jnp.bfloat16)


def ultraquant_decode_gfx950_emulation(
    q: jax.Array,
    cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale,
    num_partitions: int | None,
) -> jax.Array:
    """The gfx950 decode + reduce kernels' arithmetic; [B, Hq, 256] bf16 (conventions of
    ``ultraquant_decode``; ``num_partitions`` None means 1)."""
    o, max_logits, exp_sums = ultraquant_decode_gfx950_partials_emulation(
        q, cache, block_tables, seq_lens, sm_scale=sm_scale, num_partitions=num_partitions
    )
    return ultraquant_reduce_gfx950_emulation(o, max_logits, exp_sums)
