"""Exact MLA decode over the fp8 latent cache, split over the KV (implementation "xla")."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_mla.formats import LATENT_DIM
from jax_sparse_mla.reference.attention import KeyTile, attend_tiles, ceil_div, merge_partials
from jax_sparse_mla.reference.sparse_mla import tile_size

SPLIT_ALIGN = 128  # splits cover whole blocks of this many key positions


def split_length(seq_len: jax.Array, num_splits: int) -> jax.Array:
    """Positions per split: ``128 * ceil(seq_len / (128 * num_splits))``.

    Split s of a request covers key positions [s * c, min((s + 1) * c, seq_len)).
    """
    return SPLIT_ALIGN * ceil_div(seq_len, SPLIT_ALIGN * num_splits)


def mla_decode_partials_f32(
    q: jax.Array,
    kv: jax.Array,
    kv_indices: jax.Array,
    kv_indptr: jax.Array,
    *,
    qlen: int,
    k_scale: jax.Array,
    v_scale: jax.Array,
    sm_scale: jax.Array,
    num_splits: int,
) -> tuple[jax.Array, jax.Array]:
    """Per-split partials of causal MLA decode, in float32.

    Args:
      q: [B * qlen, H, 576] bf16; row r * qlen + i is position i of request r.
      kv: [tokens, 576] uint8 e4m3fn codes.
      kv_indices: [n] int32; kv_indptr: [B + 1] int32, each entry clipped to [0, n] (the cost
        follows n whatever kv_indptr holds). Request r's keys in position order are
        kv[kv_indices[kv_indptr[r]:kv_indptr[r+1]]]; indices outside [0, tokens) are masked.
      qlen: queries per request; position i sees key positions j <= seq_len - qlen + i.
      k_scale, v_scale, sm_scale: float32 scalars.
      num_splits: S, splits per request (see ``split_length``).
    Returns:
      o [B * qlen, S, H, 512] float32 (each normalized by its own sum) and
      lse [B * qlen, S, H] float32 (-inf for a split with no visible key).
    """
    rows, h, _ = q.shape
    b = kv_indptr.shape[0] - 1
    s = num_splits
    tokens, n = kv.shape[0], kv_indices.shape[0]
    if tokens == 0 or n == 0 or b == 0:
        return (
            jnp.zeros((rows, s, h, LATENT_DIM), jnp.float32),
            jnp.full((rows, s, h), -jnp.inf, jnp.float32),
        )

    start = jnp.clip(kv_indptr[:-1], 0, n)
    seq_len = jnp.clip(kv_indptr[1:], start, n) - start  # [B]
    chunk = split_length(seq_len, s)
    split_ids = jnp.arange(s, dtype=jnp.int32)
    # Rows of the loop: (request, split) pairs, R = B * S.
    lo = (split_ids[None, :] * chunk[:, None]).reshape(-1)
    hi = jnp.minimum(lo + jnp.repeat(chunk, s), jnp.repeat(seq_len, s))
    row_start = jnp.repeat(start, s)
    # Causal bound of query position i: key positions j <= seq_len - qlen + i.
    bound = jnp.repeat(seq_len, s)[:, None] - qlen + jnp.arange(qlen, dtype=jnp.int32)  # [R, qlen]

    tile = tile_size(b * s)
    offsets = jnp.arange(tile, dtype=jnp.int32)

    def load_tile(t):
        j = lo[:, None] + t * tile + offsets  # [R, tile] key positions
        tok = kv_indices[jnp.minimum(row_start[:, None] + j, n - 1)]
        key_valid = (j < hi[:, None]) & (tok >= 0) & (tok < tokens)
        rows_u8 = kv[jnp.where(key_valid, tok, 0)]  # [R, tile, 576]: gather bytes, then convert
        codes = jax.lax.bitcast_convert_type(rows_u8, jnp.float8_e4m3fn).astype(jnp.float32)
        causal = j[:, None, :] <= bound[:, :, None]  # [R, qlen, tile]
        causal = jnp.broadcast_to(causal[:, :, None, :], (b * s, qlen, h, tile))
        row_mask = causal.reshape(b * s, 1, qlen * h, tile)
        return KeyTile(codes[:, :, None], codes[:, :, None, :LATENT_DIM], key_valid, row_mask)

    num_tiles = ceil_div(jnp.max(jnp.maximum(hi - lo, 0)), tile)
    qf = q.astype(jnp.float32).reshape(b, 1, 1, qlen * h, -1)
    qf = jnp.broadcast_to(qf, (b, s, 1, qlen * h, qf.shape[-1])).reshape(b * s, 1, qlen * h, -1)
    # k_scale joins the score scale and v_scale the output (the codes are the tiles' K and V)
    o, lse = attend_tiles(qf, num_tiles, load_tile, sm_scale * k_scale)
    o = o * v_scale
    o = o.reshape(b, s, qlen, h, LATENT_DIM).transpose(0, 2, 1, 3, 4).reshape(rows, s, h, -1)
    lse = lse.reshape(b, s, qlen, h).transpose(0, 2, 1, 3).reshape(rows, s, h)
    return o, lse


def merge_partials_bf16(o_parts: jax.Array, lse_parts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The exact combine: partials merged in float32, out rounded once to bf16."""
    o, lse = merge_partials(o_parts, lse_parts)
    return o.astype(jnp.bfloat16), lse
