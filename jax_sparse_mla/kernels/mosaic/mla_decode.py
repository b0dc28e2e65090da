"""Mosaic GPU (Hopper, sm_90a) ``mla_decode`` over the fp8 latent cache.

The pipeline of ``_pipeline`` (a producer warpgroup gathering cache rows, two wgmma consumers)
over 576-byte rows: 512 latent e4m3 codes, then 64 rope e4m3 codes, with one ``k_scale`` and
one ``v_scale`` per call (the score scale and the output scale). One CTA owns 16 query rows of
one request (row r = i * H + h: position i of ``qlen``, head h), or 32 where the request has
more than 16 (then every key is read and converted once for up to 32 rows, not twice for 16),
and one split of the request's key positions. The rope is two 32-dim operand blocks (the even
and the odd codes of its 32 uint16 words). Rows are staged in SMEM at a pitch of 592 bytes: at
576 (144 words, 0 mod 8) the 16-byte slices of 8 rows at one column would share 4 banks.

With ``qlen`` > 1 the rows are causal: row r sees key positions j <= length - qlen + i.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_sparse_mla._platform import by_platform
from jax_sparse_mla.formats import KV_DIM, LATENT_DIM
from jax_sparse_mla.kernels.mosaic._launch import attention
from jax_sparse_mla.kernels.mosaic._pipeline import (
    RowFormat,
    SplitRule,
    T,
    as_f32,
    choose_splits,
    fail_off_cuda,
    merge_splits,
    per_element_vmap,
    rows_per_cta,
)
from jax_sparse_mla.reference.mla_decode import SPLIT_ALIGN

PITCH = 592  # SMEM bytes per staged row: 148 words, 4 mod 8 (bank-conflict free)


def row_format(qlen: int, heads: int) -> RowFormat:
    """The cache's RowFormat for requests of ``qlen`` positions of ``heads`` heads: 16 rows per
    CTA where qlen * heads <= 16, else 32; q arrives as it is (``RowFormat.heads``: a request's
    qlen * heads rows, row r = i * heads + h)."""
    return RowFormat(
        row_bytes=KV_DIM,
        pitch=PITCH,
        scale_words=(),
        rope_word=LATENT_DIM // 2,
        rope_fp8=True,
        qlen=qlen,
        m=rows_per_cta(qlen * heads),
        heads=qlen * heads,
    )


def _partials(
    q, codes, kv_indices, kv_indptr, k_scale, v_scale, sm_scale, *, qlen, splits, align, finished
):
    """-> o [B * qlen, S, H, 512] f32 and lse [B * qlen, S, H] f32 (natural log), each split
    normalized by its own sum; splits cut at multiples of ``align``. ``finished`` with one
    split: o is the bf16 output (``attention``)."""
    rows, h, _ = q.shape
    b = kv_indptr.shape[0] - 1
    fmt = row_format(qlen, h)
    lists = (kv_indptr, SplitRule(kv_indices.shape[0], splits, align))
    q_rows = q.reshape(b, qlen * h, KV_DIM)
    o, lse = attention(
        fmt, codes, kv_indices, lists, q_rows, sm_scale * k_scale, v_scale, finished=finished
    )
    o = o[:, :, : qlen * h].reshape(b, splits, qlen, h, LATENT_DIM).transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, : qlen * h].reshape(b, splits, qlen, h).transpose(0, 2, 1, 3)
    return o.reshape(rows, splits, h, LATENT_DIM), lse.reshape(rows, splits, h)


def _run(q, codes, kv_indices, kv_indptr, *, k_scale, v_scale, sm_scale, **static):
    """``_partials`` with one kernel call per batch element under ``jax.vmap``."""
    fn = per_element_vmap(functools.partial(_partials, **static))
    scales = (as_f32(x) for x in (k_scale, v_scale, sm_scale))
    return fn(q, codes, kv_indices, kv_indptr, *scales)


def mla_decode_partials_mosaic(q, codes, kv_indices, kv_indptr, *, qlen, num_splits, **scales):
    """``mla_decode_partials`` (its split contract: whole 128-position blocks) on the Mosaic GPU
    kernel. q [B * qlen, H, 576] bf16; codes [tokens, 576] uint8; kv_indices [n] and kv_indptr
    [B + 1] int32; ``scales``: k_scale, v_scale, sm_scale (float or 0-d array). Returns
    o_parts [B * qlen, S, H, 512] f32 and lse_parts [B * qlen, S, H] f32."""
    args = (q, codes, kv_indices, kv_indptr)
    return _run(*args, qlen=qlen, splits=num_splits, align=SPLIT_ALIGN, finished=False, **scales)


def mla_decode_mosaic(q, codes, kv_indices, kv_indptr, *, qlen, num_splits=None, **scales):
    """``mla_decode`` on the Mosaic GPU kernel; arguments as ``mla_decode_partials_mosaic``.
    ``num_splits=None`` fills the GPU (``choose_splits``); splits are cut at tile multiples and
    merged in float32. Returns out [B * qlen, H, 512] bf16 and lse [B * qlen, H] f32."""
    b, h = kv_indptr.shape[0] - 1, q.shape[1]
    if num_splits is None:
        hbs = row_format(qlen, h).blocks
        num_splits = choose_splits(b * hbs, kv_indices.shape[0] / T / b)
    args = (q, codes, kv_indices, kv_indptr)
    return merge_splits(
        *_run(*args, qlen=qlen, splits=num_splits, align=T, finished=True, **scales)
    )


def _off_cuda(splits: bool):
    def fail(q, *args, num_splits=None, **kw):
        lead = (q.shape[0], num_splits, q.shape[1]) if splits else q.shape[:2]
        shapes = (
            jax.ShapeDtypeStruct((*lead, LATENT_DIM), jnp.float32 if splits else q.dtype),
            jax.ShapeDtypeStruct(lead, jnp.float32),
        )
        return fail_off_cuda(shapes, q)

    return fail


mla_decode_partials_mosaic_cuda = by_platform(
    default=_off_cuda(splits=True), cuda=mla_decode_partials_mosaic
)
mla_decode_mosaic_cuda = by_platform(default=_off_cuda(splits=False), cuda=mla_decode_mosaic)
