"""Pallas ``sparse_mla``: fp8_ds_mla records, one CSR key list per query row."""

from __future__ import annotations

import jax.numpy as jnp

from jax_sparse_mla.formats import RECORD_BYTES
from jax_sparse_mla.kernels.pallas._common import choose_splits, on_cuda_or_interpret
from jax_sparse_mla.kernels.pallas.merge import merge_partials_pallas
from jax_sparse_mla.kernels.pallas.mla_attention import BLOCK_K, block_m_for, mla_partials
from jax_sparse_mla.reference.sparse_mla import no_keys

MIN_SPLIT_KEYS = 128  # an internal split keeps at least this many keys of an average row


def sparse_mla_kernel(q, kv, idx, indptr, sm_scale, *, interpret: bool = False):
    """Sparse MLA (same contract as ``sparse_mla_xla``) with the Pallas kernel.

    Rows are split over the keys when there are too few rows to fill the GPU; the splits are
    merged in float32 by ``merge_partials_pallas``.

    Args:
      q: [n_q, H, 576] bf16; kv: [..., 656] uint8 records; idx [nnz] / indptr [n_q + 1] int32.
      sm_scale: float32 scalar.
      interpret: run in Pallas interpret mode.
    Returns:
      out [n_q, H, 512] bf16 and lse [n_q, H] float32.
    """
    n_q, h, _ = q.shape
    records = kv.reshape(-1, RECORD_BYTES)
    nnz = idx.shape[0]
    if n_q == 0 or h == 0 or nnz == 0 or records.shape[0] == 0:
        return no_keys(n_q, h)
    m_blocks = -(-h // block_m_for(h))
    splits = choose_splits(n_q * m_blocks, nnz / n_q, MIN_SPLIT_KEYS)
    scales = jnp.stack([jnp.float32(sm_scale), jnp.float32(1.0)])
    o, lse = mla_partials(
        q,
        records,
        idx,
        indptr,
        scales,
        fmt="ds_mla",
        qlen=1,
        heads=h,
        num_splits=splits,
        split_align=BLOCK_K,
        out_dtype=jnp.bfloat16 if splits == 1 else jnp.float32,
        interpret=interpret,
    )
    if splits == 1:
        o, lse = o[:, 0], lse[:, 0]
    else:
        o, lse = merge_partials_pallas(o, lse, out_dtype=jnp.bfloat16, interpret=interpret)
    return o[:, :h], lse[:, :h]


sparse_mla_pallas = on_cuda_or_interpret(sparse_mla_kernel)
