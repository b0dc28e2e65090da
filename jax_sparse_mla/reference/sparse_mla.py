"""Exact sparse MLA over fp8_ds_mla records (implementation "xla")."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_mla.formats import LATENT_DIM, RECORD_BYTES, _unpack_records
from jax_sparse_mla.reference.attention import KeyTile, attend_tiles, ceil_div

# Keys gathered per tile across all rows (n_q * tile <= this): bounds the float32 key tile
# [n_q, tile, 576] to about 75 MB whatever n_q and the row lengths are.
MAX_TILE_KEYS = 32768
MAX_TILE = 256
MIN_TILE = 16


def tile_size(n_rows: int) -> int:
    """Keys per row per tile: a power of two in [16, 256], n_rows * tile <= 32768 where possible."""
    t = MAX_TILE
    while t > MIN_TILE and n_rows * t > MAX_TILE_KEYS:
        t //= 2
    return t


def no_keys(n_q: int, h: int) -> tuple[jax.Array, jax.Array]:
    """The answer when no row can have a key: out 0 [n_q, H, 512] bf16, lse -inf [n_q, H] f32."""
    return jnp.zeros((n_q, h, LATENT_DIM), jnp.bfloat16), jnp.full((n_q, h), -jnp.inf, jnp.float32)


def sparse_mla_xla(
    q: jax.Array, kv: jax.Array, idx: jax.Array, indptr: jax.Array, sm_scale: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Exact sparse MLA.

    Args:
      q: [n_q, H, 576] bf16.
      kv: [..., 656] uint8 records (read as rows).
      idx: [nnz] int32; indptr: [n_q + 1] int32 (CSR), each entry clipped to [0, nnz] (so the
        cost follows nnz whatever indptr holds). Entries outside [0, rows) are masked; rows with
        indptr[r+1] <= indptr[r] are empty.
      sm_scale: float32 scalar.
    Returns:
      out [n_q, H, 512] bf16 and lse [n_q, H] float32.
    """
    n_q, h, _ = q.shape
    records = kv.reshape(-1, RECORD_BYTES)
    rows, nnz = records.shape[0], idx.shape[0]
    if rows == 0 or nnz == 0 or n_q == 0:
        return no_keys(n_q, h)

    tile = tile_size(n_q)
    start = jnp.clip(indptr[:-1], 0, nnz)
    length = jnp.clip(indptr[1:], start, nnz) - start
    offsets = jnp.arange(tile, dtype=jnp.int32)

    def load_tile(t):
        j = t * tile + offsets  # [tile] position within the row
        in_row = j < length[:, None]  # [n_q, tile]
        ids = idx[jnp.minimum(start[:, None] + j, nnz - 1)]
        key_valid = in_row & (ids >= 0) & (ids < rows)
        latent, rope = _unpack_records(records[jnp.where(key_valid, ids, 0)])
        k = jnp.concatenate([latent, rope.astype(jnp.float32)], axis=-1)
        return KeyTile(k[:, :, None], latent[:, :, None], key_valid)

    num_tiles = ceil_div(jnp.max(length), tile)
    q4 = q.astype(jnp.float32)[:, None]  # [n_q, 1, H, 576]
    o, lse = attend_tiles(q4, num_tiles, load_tile, sm_scale)
    return o[:, 0].astype(jnp.bfloat16), lse[:, 0]
