"""Mosaic GPU (Hopper, sm_90a) ``sparse_mla`` over fp8_ds_mla records.

The pipeline of ``_pipeline`` (a producer warpgroup gathering records, two wgmma consumers)
over 656-byte records: each record's four per-128-dim scales multiply its chunk's partial
scores and P, never K or V. One CTA owns 16 heads of one query row, 32 past 16 heads (more
heads take several CTAs, launched side by side so that their gathers of the same records meet
in L2), and one split of the row's key list. Heads are wgmma's N dimension, so 16 heads cost
16 columns (FlashMLA pads them to 64 rows), and a CTA converts each record once for all its
heads: at 128 heads, 32 rows per CTA (two record stages) took 470.4 against 634.8 us at n_q=128
and 3618.1 against 4815.3 at n_q=1024 on the H200 (``bench.py``, two runs of 2026-12-02). The
rope is 64 bf16 values: one operand block.

Past 32 heads, from 17 query rows on or where CTAs of 64 heads fill the GPU without
splitting the key lists (``plan``), ``_wide``'s kernel runs instead (its splits' f32
partials merged as the 32-row kernel's are): the heads are wgmma's M, the records are
converted times their scales into a bf16 K tile in SMEM, and 128 heads convert each record
twice, not four times. On the H200 it took n_q=128 H=128 from 426.9 to 240.2 us (171 to 304
TFLOP/s) and n_q=1024 from 3321.7 to 1849.4 us (2026-12-03, ``bench.py``).

The kernel takes q, indptr and (with one split) returns the output as they are: its consumers
stage q's rows into operand blocks themselves, thread 0 cuts the CTA's key list out of indptr,
and the output rows are written as bf16 from the accumulators, so that a call is the kernel
alone (the lse's slice aside where H is no multiple of the CTA's rows).
"""

from __future__ import annotations

import jax

from jax_sparse_mla._platform import by_platform
from jax_sparse_mla.formats import RECORD_BYTES, ROPE_OFFSET, SCALES_OFFSET
from jax_sparse_mla.kernels.mosaic._launch import attention
from jax_sparse_mla.kernels.mosaic._pipeline import (
    CHUNKS,
    WIDE_ROWS,
    RowFormat,
    SplitRule,
    T,
    choose_splits,
    fail_off_cuda,
    merge_splits,
    per_element_vmap,
    rows_per_cta,
)
from jax_sparse_mla.reference.sparse_mla import no_keys


def row_format(heads: int, wide: bool = False) -> RowFormat:
    """The records' RowFormat for ``heads`` query heads: 16 rows per CTA up to 16 heads, else
    32, or ``wide``: 64 heads as wgmma's M (``_wide``); q arrives as it is
    (``RowFormat.heads``)."""
    return RowFormat(
        row_bytes=RECORD_BYTES,
        pitch=RECORD_BYTES,  # 164 words: 4 mod 8, bank-conflict free as it is
        scale_words=tuple(SCALES_OFFSET + 4 * c for c in range(CHUNKS)),
        rope_word=ROPE_OFFSET // 2,
        rope_fp8=False,
        m=WIDE_ROWS if wide else rows_per_cta(heads),
        heads=heads,
    )


WIDE_MIN_ROWS = 17  # query rows from which the 64-head kernel runs with split lists too


def plan(n_q: int, heads: int, nnz: int) -> tuple[RowFormat, int]:
    """The RowFormat and the splits per key list (``choose_splits``) for ``n_q`` rows of
    ``heads`` heads and ``nnz`` keys in all. Past 32 heads ``_wide``'s 64-head kernel runs
    from ``WIDE_MIN_ROWS`` query rows on, or wherever its CTAs fill the GPU without splitting
    the key lists; with fewer rows and split lists the 32-row kernel was the faster one on the
    H200 (docs/h200.md, 2026-12-03: at 128 heads and 2048 keys a row, n_q = 1, 8, 16 took
    63.6, 53.2, 77.1 us on it against 81.5, 72.9, 83.0 on the 64-head kernel; n_q = 32 took
    112.9 against 89.7, and 76.1 against 55.3 at 64 heads; a second run: 116.0 against 95.6,
    and 76.0 against 73.1)."""
    tiles = nnz / T / n_q  # an average list's tiles
    if heads > 32:
        wide = row_format(heads, wide=True)
        splits = choose_splits(n_q * wide.blocks, tiles)
        if n_q >= WIDE_MIN_ROWS or splits == 1:
            return wide, splits
    fmt = row_format(heads)
    return fmt, choose_splits(n_q * fmt.blocks, tiles)


def uses_wide(n_q: int, heads: int, nnz: int) -> bool:
    """Whether ``plan`` picks ``_wide``'s 64-head kernel for these sizes."""
    return plan(n_q, heads, nnz)[0].wide


@per_element_vmap
def sparse_mla_mosaic(q, kv, idx, indptr, sm_scale):
    """Sparse MLA (the ``sparse_mla_xla`` contract) with the Mosaic GPU kernel (CUDA only).
    Under ``jax.vmap``: one call per batch element (``lax.map``).

    Args:
      q: [n_q, H, 576] bf16; kv: [..., 656] uint8 records; idx [nnz] / indptr [n_q + 1] int32.
      sm_scale: float32 scalar.
    Returns:
      out [n_q, H, 512] bf16 and lse [n_q, H] float32.
    """
    n_q, h, _ = q.shape
    records = kv.reshape(-1, RECORD_BYTES)
    nnz = idx.shape[0]
    if n_q == 0 or h == 0 or nnz == 0 or records.shape[0] == 0:
        return no_keys(n_q, h)
    fmt, splits = plan(n_q, h, nnz)
    lists = (indptr, SplitRule(nnz, splits, T))
    o, lse = attention(fmt, records, idx, lists, q, sm_scale, 1.0)
    return merge_splits(o[:, :, :h], lse[:, :, :h])


def _off_cuda(q, kv, idx, indptr, sm_scale):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), no_keys(*q.shape[:2]))
    return fail_off_cuda(shapes, q)


sparse_mla_mosaic_cuda = by_platform(default=_off_cuda, cuda=sparse_mla_mosaic)
"""``sparse_mla_mosaic`` where lowered for CUDA; elsewhere it fails when run, naming the remedy."""
