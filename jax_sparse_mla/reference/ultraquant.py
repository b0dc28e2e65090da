"""UltraQuant FP4 paged decode computed exactly (implementation "xla"), and the op's query."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_mla.emulation._arith import rounded
from jax_sparse_mla.formats import FP8_MAX, UQ_HEAD_DIM, _unpack_slots, ultraquant_rotate
from jax_sparse_mla.reference.attention import KeyTile, attend_tiles, ceil_div, merge_partials

PARTITION_TILE = 128  # key positions per tile-group; partition p owns groups p, p + P, ...


@jax.custom_jvp
def round_e4m3(x: jax.Array) -> jax.Array:
    """float32 -> the value of its nearest OCP e4m3fn code (round to nearest even, saturating
    at ±448; NaN stays NaN), as float32.

    Derivative: straight-through, 1 where ``|x| <= 448`` and 0 past it (where the value is
    the constant ±448): the cotangent of the rounded value passes to ``x`` unchanged. The
    rounding's own derivative is 0 almost everywhere, which would make q's gradient vanish.
    """
    return rounded(jnp.clip(x, -FP8_MAX, FP8_MAX), jnp.float8_e4m3fn)


@round_e4m3.defjvp
def _round_e4m3_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return round_e4m3(x), jnp.where(jnp.abs(x) <= FP8_MAX, t, jnp.zeros_like(t))


def ultraquant_query(q: jax.Array, exact_q: bool = False) -> jax.Array:
    """The query ``ultraquant_decode`` scores with: ``H q / 16`` (``ultraquant_rotate``), then
    rounded to e4m3 (``round_e4m3``) unless ``exact_q``.

    Args:
      q: [..., 256] float (bf16 in the op), not rotated.
      exact_q: keep the float32 rotated q.
    Returns:
      [..., 256] float32 in the rotated (stored K's) order.
    """
    x = ultraquant_rotate(q)
    return x if exact_q else round_e4m3(x)


def ultraquant_decode_partials_f32(
    q: jax.Array,
    cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: jax.Array,
    num_partitions: int,
    exact_q: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-partition partials of UltraQuant decode, in float32 (q as ``ultraquant_query``).

    Args:
      q: [B, Hq, 256] bf16 (not rotated), Hq = Hk * G; query head h reads KV head h // G.
      cache: [num_blocks, block_size, Hk, slot_bytes] uint8 UltraQuant slots.
      block_tables: [B, max_blocks] int32; an entry outside [0, num_blocks) masks its tokens.
      seq_lens: [B] int32, clamped to [0, max_blocks * block_size].
      sm_scale: float32 scalar.
      num_partitions: P; partition p owns the 128-token tile-groups p, p + P, p + 2P, ...
      exact_q: score with the float32 rotated q instead of its e4m3 rounding.
    Returns:
      o [B, P, Hq, 256] float32 (each normalized by its own sum), lse [B, P, Hq] float32.
    """
    bsz, hq, _ = q.shape
    nb, bs, hk, _ = cache.shape
    g = hq // hk
    p = num_partitions
    max_blocks = block_tables.shape[1]
    seq_len = jnp.clip(seq_lens, 0, max_blocks * bs)
    tile = PARTITION_TILE
    offsets = jnp.arange(tile, dtype=jnp.int32)
    part = jnp.tile(jnp.arange(p, dtype=jnp.int32), bsz)  # [R], R = B * P
    req = jnp.repeat(jnp.arange(bsz, dtype=jnp.int32), p)
    row_len = seq_len[req]

    def load_tile(t):
        pos = (part[:, None] + t * p) * tile + offsets  # [R, tile]
        in_seq = pos < row_len[:, None]
        blk_col = jnp.minimum(pos // bs, max_blocks - 1)
        blk = block_tables[req[:, None], blk_col]
        key_valid = in_seq & (blk >= 0) & (blk < nb)
        slots = cache[jnp.where(key_valid, blk, 0), pos % bs]  # [R, tile, Hk, slot_bytes]
        k, v = _unpack_slots(slots)
        return KeyTile(k, v, key_valid)

    num_tiles = ceil_div(ceil_div(jnp.max(seq_len), tile), p)
    q_rot = ultraquant_query(q, exact_q).reshape(bsz, 1, hk, g, UQ_HEAD_DIM)
    q_rot = jnp.broadcast_to(q_rot, (bsz, p, hk, g, UQ_HEAD_DIM)).reshape(bsz * p, hk, g, -1)
    o, lse = attend_tiles(q_rot, num_tiles, load_tile, sm_scale)
    return o.reshape(bsz, p, hq, UQ_HEAD_DIM), lse.reshape(bsz, p, hq)


def ultraquant_decode_xla(
    q: jax.Array,
    cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: jax.Array,
    num_partitions: int | None,
    exact_q: bool = False,
) -> jax.Array:
    """UltraQuant decode computed exactly: the float32 partials (``num_partitions`` None: 1)
    merged in float32; [B, Hq, 256] bf16."""
    o_parts, lse_parts = ultraquant_decode_partials_f32(
        q,
        cache,
        block_tables,
        seq_lens,
        sm_scale=sm_scale,
        num_partitions=num_partitions or 1,
        exact_q=exact_q,
    )
    out, _ = merge_partials(o_parts, lse_parts)
    return out.astype(jnp.bfloat16)
