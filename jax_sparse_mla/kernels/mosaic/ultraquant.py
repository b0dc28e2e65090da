"""Mosaic GPU (Hopper, sm_90a) ``ultraquant_decode`` over the 4-bit UltraQuant paged cache.

The pipeline of ``_pipeline`` (a producer warpgroup gathering cache rows; its consumers split by K
and by V, ``RowFormat.kv_split``: two warpgroups convert K and score, each every other tile with its
own softmax, whose running max lags the scores' by up to 8 in log2 units, two convert V and
multiply P @ V) over 272-byte slots: K's 128 bytes of E2M1 codes
(element 2i in the low nibble) and 8 UE8M0 group scales, then V's. One CTA owns the G query heads of
one KV head of one request (padded to 16 rows, or 32 past 16) and one split of its tokens. For token
j of the split, the producer reads the request's block-table entry j // block_size itself (no slot
list is built) and copies the KV head's slot of token slot ``entry * block_size + j % block_size``
(none for an entry outside [0, num_blocks): the token is masked) and its four scale words. Where
pages of 16 tokens or more tile the 64-key tiles (or are tiled by them) and the KV heads' row is
at least PITCH bytes, the slots come as TMA boxes, one per page (or per 64 keys of a larger page)
from the cache viewed as uint32 rows (``RowFormat.tile_rows``; ``tile_rows``): on the H200
``ultraquant_decode`` B=128 seq=32768 Hk=8 G=8 went from 6381.9 / 6381.5 to 5637.9 / 5687.8 us
(two runs each, alternating, 2026-12-04). Else its 128 lanes copy a tile's 64 slots in 16-byte
chunks, two lanes per slot (``RowFormat.lane_copies``): one ``cp.async.bulk`` per 272-byte slot
was slower.

A consumer reads a row's codes as uint32 words, 16 at a time (128 dims, four 32-dim scale
groups): nibble n of word w is dim 8w + n. Each nibble slice [64 keys, 16] becomes bf16 (value *
2^-6 from the code's bits in inline PTX, times the group's scale: exact), K slices are wgmma's A
operand straight from registers (K = 16) against the rotated q (``ultraquant_query``): its e4m3
values are exact in bf16, one wgmma column per query row; ``exact_q``'s float32 q enters as three
bf16 pieces (their sum is q exactly), three columns per row. Either way q.K is float32-accurate.
V slices go to SMEM for P @ V. The 2^-6 of K is undone on the scores before their running max
(sm_scale multiplies them only after it: ``_pipeline.score_factors``), V's is folded into the
output scale. A group's UE8M0 byte becomes its bf16 scale in PTX too (``_fp4_scales``: the
byte's bits shifted into the exponent).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_sparse_mla._platform import by_platform
from jax_sparse_mla.formats import (
    UQ_HEAD_DIM,
    UQ_K_SCALES,
    UQ_SLOT_CONTENT_BYTES,
    UQ_V_SCALES,
)
from jax_sparse_mla.kernels.fp4_operands import FP4_BIAS, bf16_pieces, q_pieces
from jax_sparse_mla.kernels.mosaic._launch import attention
from jax_sparse_mla.kernels.mosaic._pipeline import (
    RowFormat,
    T,
    as_f32,
    choose_splits,
    fail_off_cuda,
    fp4_q,
    merge_splits,
    per_element_vmap,
    rows_per_cta,
    work_lists,
)
from jax_sparse_mla.reference.ultraquant import ultraquant_query

# SMEM bytes per staged slot: 72 words, 8 mod 32, so that the 8-byte uint32 reads of four rows
# (a half warp) land on 32 distinct banks; at 272 (68 words) two rows would share 4 banks.
PITCH = 288
MAX_GROUP = 32  # query heads per KV head one CTA holds (wgmma's N)


def tile_rows(block_size: int, row_bytes: int) -> int:
    """``RowFormat.tile_rows`` for pages of ``block_size`` tokens in cache rows of
    ``row_bytes`` (all KV heads' slots): a page's keys of one tile as one TMA box where pages
    of at least 16 tokens tile T or T tiles a page and a box of PITCH bytes fits in a row;
    else 0 (the producer's lanes copy the slots)."""
    rows = min(block_size, T)
    tiles = block_size % T == 0 or T % block_size == 0
    return rows if tiles and rows >= 16 and row_bytes >= PITCH else 0


def row_format(group: int, block_size: int, row_bytes: int = 0, exact_q: bool = False) -> RowFormat:
    """The slot's RowFormat for ``group`` query heads per KV head (16 rows, or 32 past 16),
    pages of ``block_size`` tokens, cache rows of ``row_bytes`` (``tile_rows``) and q's bf16
    pieces (``q_pieces``: 3 with ``exact_q``, else 1)."""
    return RowFormat(
        row_bytes=UQ_SLOT_CONTENT_BYTES,
        pitch=PITCH,
        scale_words=(UQ_K_SCALES, UQ_K_SCALES + 4, UQ_V_SCALES, UQ_V_SCALES + 4),
        rope_word=0,
        rope_fp8=False,
        m=rows_per_cta(group),
        fp4=True,
        page_size=block_size,
        lane_copies=True,  # 272-byte slots: 16-byte lane copies beat one bulk copy per slot
        tile_rows=tile_rows(block_size, row_bytes),
        q_pieces=q_pieces(exact_q),
    )


def unsupported(q, cache) -> str | None:
    """Why the kernel cannot run these shapes, or None."""
    group = q.shape[1] // cache.shape[2]
    if group > MAX_GROUP:
        return f"at most {MAX_GROUP} query heads per KV head (got {group})"
    if cache.shape[-1] % 16:
        return f"slot_bytes a multiple of 16 for its bulk copies (got {cache.shape[-1]})"
    return None


def _decode(q, cache, block_tables, seq_lens, sm_scale, *, splits, exact_q):
    """-> [B, Hq, 256] bf16: the splits' o (V's space, each normalized by its own sum) and lse
    merged in float32."""
    b, hq, _ = q.shape
    nb, bs, hk, slot_bytes = cache.shape
    group = hq // hk
    fmt = row_format(group, bs, hk * slot_bytes, exact_q)
    m = fmt.m
    max_blocks = block_tables.shape[1]
    length = jnp.clip(seq_lens, 0, max_blocks * bs)
    entries = work_lists(jnp.arange(b, dtype=jnp.int32) * max_blocks, length, splits, T)
    x = ultraquant_query(q, exact_q).reshape(b, hk, group, UQ_HEAD_DIM)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, m - group), (0, 0))).reshape(b, hk * m, UQ_HEAD_DIM)
    pieces = jnp.stack(bf16_pieces(x, fmt.q_pieces), axis=1)  # [B, q_pieces, Hk * m, 256]
    o, lse = attention(
        fmt,
        _words(cache),  # one row of Hk slots per token
        block_tables.reshape(-1),
        entries,
        fp4_q(pieces, hk, m),
        sm_scale,  # the kernel undoes the codes' 2^-6 on the scores (``score_factors``)
        FP4_BIAS,
    )
    o = o.reshape(b, splits, hk, m, UQ_HEAD_DIM)[:, :, :, :group]
    lse = lse.reshape(b, splits, hk, m)[:, :, :, :group]
    out, _ = merge_splits(o.reshape(b, splits, hq, UQ_HEAD_DIM), lse.reshape(b, splits, hq))
    return out


def _words(cache):
    """[num_blocks, block_size, Hk, slot_bytes] uint8 -> [num_blocks * block_size, Hk *
    slot_bytes / 4] uint32: one row of Hk slots per token, 4 bytes a word (views: a reshape
    and a bitcast, no copy)."""
    nb, bs, hk, slot_bytes = cache.shape
    rows = cache.reshape(nb * bs, hk * slot_bytes // 4, 4)
    return jax.lax.bitcast_convert_type(rows, jnp.uint32)


def ultraquant_decode_mosaic(
    q, cache, block_tables, seq_lens, *, sm_scale, num_partitions, exact_q=False
):
    """``ultraquant_decode`` on the Mosaic GPU kernel (CUDA only): q [B, Hq, 256] bf16, cache
    [num_blocks, block_size, Hk, slot_bytes] uint8, block_tables [B, max_blocks] and seq_lens
    [B] int32, sm_scale a float or 0-d array, ``exact_q`` (static) as in ``ultraquant_decode``;
    ``num_partitions`` None fills the GPU
    (``choose_splits``); splits are cut at tile multiples and merged in float32. Under
    ``jax.vmap``: one call per batch element. Returns [B, Hq, 256] bf16.

    Raises NotImplementedError for more than 32 query heads per KV head or a slot_bytes that
    is not a multiple of 16."""
    why = unsupported(q, cache)
    if why is not None:
        raise NotImplementedError(f"ultraquant_decode: the Mosaic GPU kernel needs {why}")
    splits = num_partitions
    if splits is None:
        tiles = block_tables.shape[-1] * cache.shape[1] / T
        splits = choose_splits(q.shape[-3] * cache.shape[2], tiles)
    fn = per_element_vmap(functools.partial(_decode, splits=splits, exact_q=exact_q))
    return fn(q, cache, block_tables, seq_lens, as_f32(sm_scale))


def mosaic_or(fallback):
    """``ultraquant_decode_mosaic``, or ``fallback`` for the shapes it does not take
    (``unsupported``): the choice of ``implementation=None`` on Hopper."""

    def run(q, cache, *args, **options):
        fn = fallback if unsupported(q, cache) else ultraquant_decode_mosaic
        return fn(q, cache, *args, **options)

    return run


def _off_cuda(q, *args, **kw):
    return fail_off_cuda(jax.ShapeDtypeStruct(q.shape, jnp.bfloat16), q)


ultraquant_decode_mosaic_cuda = by_platform(default=_off_cuda, cuda=ultraquant_decode_mosaic)
"""``ultraquant_decode_mosaic`` where lowered for CUDA; elsewhere it fails when run."""
