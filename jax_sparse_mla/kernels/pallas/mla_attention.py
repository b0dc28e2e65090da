"""The MLA attention kernel shared by ``sparse_mla`` and ``mla_decode``.

One program owns one group of query rows (a ``sparse_mla`` row, or the ``qlen`` positions of a
decode request, times the heads), one block of ``block_m`` of those rows and one split of the
group's key list ``idx[indptr[g]:indptr[g+1]]``. It walks the split in tiles of ``BLOCK_K``
keys: gathers the records (each record read once per program, as uint32 words split into their
bytes: ``_common.as_words``, no copy of the cache), converts the fp8 codes to bf16 (exact),
computes the scores on the tensor cores in bf16 x bf16 -> f32 (exact products), keeps
an f32 online softmax, and accumulates P @ V with P rounded to bf16 (the only rounding besides
f32 accumulation; per-key scales are folded into the scores and into P, never into K or V).
With causal masking (qlen > 1) a key hidden from a row adds exactly nothing to it, whatever its
bytes hold; a NaN code a row sees makes that row NaN (through its scores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_sparse_mla.formats import LATENT_DIM, ROPE_OFFSET, SCALES_OFFSET
from jax_sparse_mla.kernels.pallas._common import (
    call,
    dot_nn,
    dot_nt,
    e4m3_to_bf16,
    gather_1d,
    gather_bytes,
    gather_words,
    pow2_at_least,
    score_sign_and_scale,
    softmax_finish,
    softmax_init,
    softmax_update,
    word_column,
    word_halves,
)

BLOCK_K = 64  # keys per tile
CHUNK = 128  # latent dims per tensor-core operand (one fp8_ds_mla scale block)
NUM_CHUNKS = LATENT_DIM // CHUNK  # 4
ROPE = 64
MAX_BLOCK_M = 64
NUM_WARPS = 8
NUM_STAGES = 2


def _latent_chunks(kv_ref, ids, valid):
    """The 512 latent e4m3fn codes of each record / row: 4 chunks [K, 128] bf16 (exact)."""
    return [
        e4m3_to_bf16(gather_bytes(kv_ref, ids, CHUNK * c, CHUNK, valid)) for c in range(NUM_CHUNKS)
    ]


def _load_ds_mla(kv_ref, ids, valid):
    """fp8_ds_mla records -> (4 latent chunks [K, 128] bf16 codes, 4 scales [K] f32, rope)."""
    scale_words = gather_words(kv_ref, ids, SCALES_OFFSET, NUM_CHUNKS, valid)
    scales = [
        jax.lax.bitcast_convert_type(word_column(scale_words, c), jnp.float32)
        for c in range(NUM_CHUNKS)
    ]
    rope = word_halves(gather_words(kv_ref, ids, ROPE_OFFSET, ROPE // 2, valid))
    rope = jax.lax.bitcast_convert_type(rope.astype(jnp.uint16), jnp.bfloat16)
    return _latent_chunks(kv_ref, ids, valid), scales, rope


def _load_fp8(kv_ref, ids, valid):
    """fp8 latent cache rows -> (4 latent chunks [K, 128] bf16 codes, None, rope codes bf16)."""
    rope = e4m3_to_bf16(gather_bytes(kv_ref, ids, LATENT_DIM, ROPE, valid))
    return _latent_chunks(kv_ref, ids, valid), None, rope


_LOADERS = {"ds_mla": _load_ds_mla, "fp8": _load_fp8}


def _kernel(
    indptr_ref,
    idx_ref,
    kv_ref,
    scale_ref,
    q_ref,
    o_ref,
    lse_ref,
    *,
    fmt,
    rows,
    qlen,
    heads,
    block_m,
    num_splits,
    split_align,
):
    g, split, mb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nnz = idx_ref.shape[0]
    start = jnp.clip(indptr_ref[g], 0, nnz)  # indptr entries clipped to [0, nnz]
    length = jnp.clip(indptr_ref[g + 1], start, nnz) - start
    chunk = split_align * ((length + split_align * num_splits - 1) // (split_align * num_splits))
    lo = split * chunk
    hi = jnp.minimum(lo + chunk, length)
    q_lat = [q_ref[:, pl.ds(CHUNK * c, CHUNK)] for c in range(NUM_CHUNKS)]
    q_rope = q_ref[:, pl.ds(LATENT_DIM, ROPE)]
    (sign, scale), v_scale = score_sign_and_scale(scale_ref[0]), scale_ref[1]
    key_iota = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_K,), 0)
    if qlen > 1:  # causal: query position i sees key positions j <= length - qlen + i
        row = mb * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
        bound = length - qlen + row // heads

    def tile(t, carry):
        m_run, l_run, accs = carry
        j = lo + t * BLOCK_K + key_iota
        in_list = j < hi
        ids = gather_1d(idx_ref, start + j, in_list)
        valid = in_list & (ids >= 0) & (ids < rows)
        chunks, scales, rope = _LOADERS[fmt](kv_ref, ids, valid)
        s = dot_nt(q_rope, rope)
        for c in range(NUM_CHUNKS):
            d = dot_nt(q_lat[c], chunks[c])
            s = s + (d if scales is None else d * scales[c][None, :])
        mask = valid[None, :]
        if qlen > 1:
            mask = mask & (j[None, :] <= bound[:, None])
        s = jnp.where(mask, s * sign, -jnp.inf)
        m_run, l_run, alpha, p = softmax_update(m_run, l_run, s, scale)
        if qlen > 1:  # a hidden NaN code (P = 0) adds 0, not 0 x NaN; a visible one has
            chunks = [jnp.where(jnp.isnan(c), 0, c) for c in chunks]  # made its row's s NaN
        accs = tuple(
            acc * alpha[:, None]
            + dot_nn(
                (p if scales is None else p * scales[c][None, :]).astype(jnp.bfloat16), chunks[c]
            )
            for c, acc in enumerate(accs)
        )
        return m_run, l_run, accs

    num_tiles = (jnp.maximum(hi - lo, 0) + BLOCK_K - 1) // BLOCK_K
    zeros = jnp.zeros((block_m, CHUNK), jnp.float32)
    init = (*softmax_init(block_m), (zeros,) * NUM_CHUNKS)
    m_run, l_run, accs = jax.lax.fori_loop(0, num_tiles, tile, init)
    inv_l, lse = softmax_finish(m_run, l_run, scale)
    for c, acc in enumerate(accs):
        o_ref[:, pl.ds(CHUNK * c, CHUNK)] = (acc * (inv_l * v_scale)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = lse


def block_m_for(m: int) -> int:
    """Query rows per program: a power of two in [16, 64] covering m where possible."""
    return min(MAX_BLOCK_M, pow2_at_least(m, 16))


def mla_partials(
    q,
    kv,
    idx,
    indptr,
    scales,
    *,
    fmt: str,
    qlen: int,
    heads: int,
    num_splits: int,
    split_align: int,
    out_dtype,
    interpret: bool,
    words: bool | None = None,
):
    """Per-split MLA attention over CSR key lists.

    Group g (of G) has query rows q[g] (row ``i * heads + h`` is position i, head h) and the
    keys ``kv[idx[indptr[g] + j]]`` for j < length_g (indptr entries clipped to [0, len(idx)]);
    split s of S covers key positions [s * c, min((s + 1) * c, length_g)) with
    ``c = split_align * ceil(length_g / (split_align * S))``. Entries outside [0, len(kv)) are
    masked; with qlen > 1 position i sees key positions j <= length_g - qlen + i.

    Args:
      q: [G, M, 576] bfloat16, M = qlen * heads.
      kv: [rows, 656] uint8 fp8_ds_mla records (fmt "ds_mla") or [rows, 576] e4m3fn codes
        (fmt "fp8", float8_e4m3fn or uint8; K = code * k_scale, V = code[:512] * v_scale).
      idx: [nnz] int32; indptr: [G + 1] int32.
      scales: [2] float32: (scale of q·K as stored (sm_scale, times k_scale for "fp8"),
        scale of the output (1, or v_scale for "fp8")).
      split_align: multiple of BLOCK_K.
      out_dtype: dtype of the partial outputs.
      words: the kernel reads ``kv`` as uint32 words (``_common.call``; default: when
        compiled), never a copy of it; the answer is the same bits either way.
    Returns:
      o [G, S, M_pad, 512] out_dtype (normalized per split; 0 where a split has no key) and
      lse [G, S, M_pad] float32 (-inf there); M_pad >= M, rows past M are padding.
    """
    g, m, _ = q.shape
    rows = kv.shape[0]
    block_m = block_m_for(m)
    m_pad = -(-m // block_m) * block_m
    if m_pad != m:
        q = jnp.pad(q, ((0, 0), (0, m_pad - m), (0, 0)))
    kernel = functools.partial(
        _kernel,
        fmt=fmt,
        rows=rows,
        qlen=qlen,
        heads=heads,
        block_m=block_m,
        num_splits=num_splits,
        split_align=split_align,
    )
    return call(
        kernel,
        grid=(g, num_splits, m_pad // block_m),
        in_specs=[
            pl.no_block_spec,
            pl.no_block_spec,
            pl.no_block_spec,
            pl.no_block_spec,
            pl.BlockSpec((None, block_m, q.shape[2]), lambda i, s, b: (i, b, 0)),
        ],
        out_specs=(
            pl.BlockSpec((None, None, block_m, LATENT_DIM), lambda i, s, b: (i, s, b, 0)),
            pl.BlockSpec((None, None, block_m), lambda i, s, b: (i, s, b)),
        ),
        out_shape=(
            jax.ShapeDtypeStruct((g, num_splits, m_pad, LATENT_DIM), out_dtype),
            jax.ShapeDtypeStruct((g, num_splits, m_pad), jnp.float32),
        ),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        interpret=interpret,
        name=f"mla_{fmt}",
        byte_args=(2,),
        words=words,
    )(indptr, idx, kv, scales, q)
