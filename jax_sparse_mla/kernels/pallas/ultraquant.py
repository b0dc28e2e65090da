"""Pallas ``ultraquant_decode``: GQA decode over the 4-bit UltraQuant paged cache.

One program owns one request, one KV head (its G query heads, padded to 16 rows for the tensor
cores) and one contiguous partition of the request's tokens, walked in tiles of ``BLOCK_K``
tokens. Each slot is read once (as uint32 words split into their bytes: ``_common.as_words``,
no copy of the cache): the E2M1 codes become e4m3fn bytes by bit moves
(``e4m3(code') = value * 2^-6``, exact, subnormal 0.5 included), then bf16 (exact), times the
UE8M0 group scale (exact: a power of two); the 2^-6 is undone on the scores (before the max,
so sm_scale multiplies them only after it: any finite scale is served) and on the output.
K's low and high nibbles (stored elements 2i and 2i+1) are separate operands, so the rotated q
is split into its even and odd columns instead of interleaving codes. The rotated q
(``ultraquant_query``) holds e4m3 values, exact in bf16: one operand; with ``exact_q`` it is
float32 and enters as three bf16 pieces (hi + mid + lo = q exactly). Either way q·K is
float32-accurate. P is rounded to bf16 for P @ V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_sparse_mla.formats import (
    UQ_GROUP,
    UQ_GROUPS,
    UQ_HEAD_DIM,
    UQ_K_CODES,
    UQ_K_SCALES,
    UQ_V_CODES,
    UQ_V_SCALES,
)
from jax_sparse_mla.kernels.fp4_operands import FP4_BIAS, bf16_pieces, q_pieces
from jax_sparse_mla.kernels.pallas._common import (
    call,
    choose_splits,
    dot_nn,
    dot_nt,
    e4m3_to_bf16,
    gather_1d,
    gather_bytes,
    on_cuda_or_interpret,
    pow2_at_least,
    score_sign_and_scale,
    softmax_finish,
    softmax_init,
    softmax_update,
)
from jax_sparse_mla.kernels.pallas.merge import merge_partials_pallas
from jax_sparse_mla.reference.ultraquant import ultraquant_query

BLOCK_K = 64  # tokens per tile
HALF = UQ_HEAD_DIM // 2  # 128 code bytes: low nibbles are even elements, high nibbles odd
MIN_SPLIT_KEYS = 256
NUM_WARPS = 8
NUM_STAGES = 2


def _fp4_halves(codes, scale_bytes):
    """codes [K, 128] uint8, scale bytes [K, 8] -> (even, odd) [K, 128] bf16 = value * 2^-6."""
    k = codes.shape[0]
    scale = jax.lax.bitcast_convert_type(scale_bytes.astype(jnp.uint32) << 23, jnp.float32)
    per_col = jnp.broadcast_to(scale[:, :, None], (k, UQ_GROUPS, UQ_GROUP // 2))
    per_col = per_col.reshape(k, HALF).astype(jnp.bfloat16)

    def to_bf16(nibble):
        e4m3 = ((nibble & 7) << 2) | ((nibble & 8) << 4)
        return e4m3_to_bf16(e4m3) * per_col

    return to_bf16(codes & 0xF), to_bf16(codes >> 4)


def _kernel(
    bt_ref,
    seq_ref,
    cache_ref,
    scale_ref,
    q_ref,
    o_ref,
    lse_ref,
    *,
    block_size,
    num_blocks,
    kv_heads,
    num_parts,
):
    b, kh, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    max_blocks = bt_ref.shape[0] // seq_ref.shape[0]
    length = jnp.clip(seq_ref[b], 0, max_blocks * block_size)
    chunk = BLOCK_K * ((length + BLOCK_K * num_parts - 1) // (BLOCK_K * num_parts))
    lo = part * chunk
    hi = jnp.minimum(lo + chunk, length)
    q = [[q_ref[p, e] for e in range(2)] for p in range(q_ref.shape[0])]
    m_rows = q_ref.shape[2]
    key_iota = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_K,), 0)
    sign, scale = score_sign_and_scale(scale_ref[0])

    def tile(t, carry):
        m_run, l_run, acc_even, acc_odd = carry
        j = lo + t * BLOCK_K + key_iota
        in_seq = j < hi
        blk = gather_1d(bt_ref, b * max_blocks + j // block_size, in_seq)
        valid = in_seq & (blk >= 0) & (blk < num_blocks)
        slot = (blk * block_size + j % block_size) * kv_heads + kh
        k_even, k_odd = _fp4_halves(
            gather_bytes(cache_ref, slot, UQ_K_CODES, HALF, valid),
            gather_bytes(cache_ref, slot, UQ_K_SCALES, UQ_GROUPS, valid),
        )
        v_even, v_odd = _fp4_halves(
            gather_bytes(cache_ref, slot, UQ_V_CODES, HALF, valid),
            gather_bytes(cache_ref, slot, UQ_V_SCALES, UQ_GROUPS, valid),
        )
        s = dot_nt(q[0][0], k_even) + dot_nt(q[0][1], k_odd)
        for piece in q[1:]:
            s = s + dot_nt(piece[0], k_even) + dot_nt(piece[1], k_odd)
        s = jnp.where(valid[None, :], s * (sign * FP4_BIAS), -jnp.inf)  # the codes' 2^-6
        m_run, l_run, alpha, p = softmax_update(m_run, l_run, s, scale)
        p16 = p.astype(jnp.bfloat16)
        acc_even = acc_even * alpha[:, None] + dot_nn(p16, v_even)
        acc_odd = acc_odd * alpha[:, None] + dot_nn(p16, v_odd)
        return m_run, l_run, acc_even, acc_odd

    num_tiles = (jnp.maximum(hi - lo, 0) + BLOCK_K - 1) // BLOCK_K
    zeros = jnp.zeros((m_rows, HALF), jnp.float32)
    m_run, l_run, acc_even, acc_odd = jax.lax.fori_loop(
        0, num_tiles, tile, (*softmax_init(m_rows), zeros, zeros)
    )
    inv_l, lse = softmax_finish(m_run, l_run, scale)
    norm = (inv_l * FP4_BIAS)[:, None]
    o_ref[:, 0, :] = acc_even * norm
    o_ref[:, 1, :] = acc_odd * norm
    lse_ref[...] = lse


def _q_operand(q, kv_heads: int, rows: int, exact_q: bool):
    """q [B, Hq, 256] -> [B, Hk, pieces, 2, rows, 128] bf16: the bf16 pieces of the rotated
    q (``q_pieces``), even / odd columns."""
    b, hq, _ = q.shape
    g = hq // kv_heads
    pieces = q_pieces(exact_q)
    x = ultraquant_query(q, exact_q).reshape(b, kv_heads, g, UQ_HEAD_DIM)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    x = jnp.stack(bf16_pieces(x, pieces), axis=2)  # [B, Hk, pieces, rows, 256]
    return x.reshape(b, kv_heads, pieces, rows, HALF, 2).transpose(0, 1, 2, 5, 3, 4)


def ultraquant_partials_kernel(
    q, cache, block_tables, seq_lens, *, sm_scale, num_partitions, exact_q=False, interpret=False
):
    """Per-partition partials (partition p: tokens [p * c, min((p + 1) * c, seq_len)),
    ``c = 128 * ceil(seq_len / (128 * P))``), in float32.

    Args as ``ultraquant_decode_partials_f32``; ``num_partitions=None`` picks enough to fill the
    GPU. Returns o [B, P, Hq, 256] float32 (V's space, normalized per partition) and
    lse [B, P, Hq] float32.
    """
    o, lse, g = _partials(
        q, cache, block_tables, seq_lens, sm_scale, num_partitions, interpret, exact_q=exact_q
    )
    b, p, hk, rows = lse.shape
    o = o[:, :, :, :g].reshape(b, p, hk * g, 2, HALF).swapaxes(-1, -2)
    return o.reshape(b, p, hk * g, UQ_HEAD_DIM), lse[..., :g].reshape(b, p, hk * g)


def ultraquant_decode_kernel(
    q, cache, block_tables, seq_lens, *, sm_scale, num_partitions, exact_q=False, interpret=False
):
    """UltraQuant decode, partials merged on the GPU: [B, Hq, 256] bfloat16."""
    if q.shape[0] * q.shape[1] == 0 or cache.shape[0] * cache.shape[1] == 0:
        return jnp.zeros(q.shape, jnp.bfloat16)
    o, lse, g = _partials(
        q, cache, block_tables, seq_lens, sm_scale, num_partitions, interpret, exact_q=exact_q
    )
    b, p, hk, rows = lse.shape
    merged, _ = merge_partials_pallas(
        o.reshape(b, p, hk * rows, UQ_HEAD_DIM),
        lse.reshape(b, p, hk * rows),
        out_dtype=jnp.bfloat16,
        interpret=interpret,
    )
    merged = merged.reshape(b, hk, rows, 2, HALF)[:, :, :g].swapaxes(-1, -2)
    return merged.reshape(q.shape)


def _partials(
    q, cache, block_tables, seq_lens, sm_scale, num_partitions, interpret, words=None, exact_q=False
):
    """-> o [B, P, Hk, rows, 2, 128] f32 (even | odd halves), lse [B, P, Hk, rows], G.

    ``words``: the kernel reads the cache as uint32 words (``_common.call``; default: when
    compiled), never a copy of it; the answer is the same bits either way.
    """
    b, hq, _ = q.shape
    nb, bs, hk, slot_bytes = cache.shape
    g = hq // hk
    rows = pow2_at_least(g, 16)
    pieces = q_pieces(exact_q)
    if num_partitions is None:
        avg = block_tables.shape[1] * bs  # the capacity bounds every request
        num_partitions = choose_splits(b * hk, avg, MIN_SPLIT_KEYS)
    kernel = functools.partial(
        _kernel, block_size=bs, num_blocks=nb, kv_heads=hk, num_parts=num_partitions
    )
    scales = jnp.stack([jnp.float32(sm_scale)])
    flat = cache.reshape(nb * bs * hk, slot_bytes)  # a view; read as words (call: byte_args)
    o, lse = call(
        kernel,
        grid=(b, hk, num_partitions),
        in_specs=[pl.no_block_spec] * 4
        + [pl.BlockSpec((None, None, pieces, 2, rows, HALF), lambda i, h, s: (i, h, 0, 0, 0, 0))],
        out_specs=(
            pl.BlockSpec((None, None, None, rows, 2, HALF), lambda i, h, s: (i, s, h, 0, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, h, s: (i, s, h, 0)),
        ),
        out_shape=(
            jax.ShapeDtypeStruct((b, num_partitions, hk, rows, 2, HALF), jnp.float32),
            jax.ShapeDtypeStruct((b, num_partitions, hk, rows), jnp.float32),
        ),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        interpret=interpret,
        name="ultraquant_decode",
        byte_args=(2,),
        words=words,
    )(
        block_tables.reshape(-1),
        seq_lens,
        flat,
        scales,
        _q_operand(q, hk, rows, exact_q),
    )
    return o, lse, g


ultraquant_partials_pallas = on_cuda_or_interpret(ultraquant_partials_kernel)
ultraquant_decode_pallas = on_cuda_or_interpret(ultraquant_decode_kernel)
