"""The launch of the Mosaic GPU attention kernels: ``attention`` builds the inputs and output
types of one ``plgpu.kernel`` call and picks its body by the row format, ``_pipeline``'s
(16 or 32 rows per CTA, the rows as wgmma's N) or ``_wide``'s (64 heads as wgmma's M). It
sits above both, which share ``_pipeline``'s producer and helpers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla._platform import is_static_scalar
from jax_sparse_mla.formats import LATENT_DIM
from jax_sparse_mla.kernels.mosaic import _wide
from jax_sparse_mla.kernels.mosaic._pipeline import (
    DB,
    LOG2E,
    MAX_ROWS,
    RowFormat,
    _kernel,
    _mgpu,
    _scratch,
    masked_row,
    unpermute_fp4,
    unpermute_out,
)


def signed_q(q, score_scale):
    """q [G, heads, 576] bf16 times the sign of ``score_scale`` (+-1, 0 or NaN: exact), so that
    the latent formats' consumers take the running max of the scores as the wgmmas give them
    and multiply only by |scale| after it (``_pipeline.magnitude``): no multiply per score
    for the sign. A static positive scale leaves q as it is; a traced one costs one pass
    over q."""
    if is_static_scalar(score_scale) and score_scale > 0:
        return q
    return q * jnp.sign(jnp.asarray(score_scale, jnp.float32)).astype(q.dtype)


def attention(fmt: RowFormat, cache, idx, lists, q, score_scale, out_scale, *, finished=True):
    """Runs the kernel: ``cache`` [N, row_bytes] uint8 (``fmt.fp4``: [N, HB * slot_bytes / 4]
    uint32, one row of HB slots per token),
    ``idx`` [nnz] int32, ``lists`` the key lists: work entries [G, S, WORK] (``work_lists``)
    or (indptr [G + 1] int32, ``SplitRule``) for the kernel to split; ``q`` [G, heads, 576]
    bf16 rows as they are (``fmt.fp4``: [G, HB, FP4_SLICES, q_pieces * m, FP4_WORDS] from
    ``fp4_q``), scalar scales (the score scale in natural units; the latent formats' q goes
    to the kernel times its sign, ``signed_q``). ``finished``: the caller wants bf16 out, not
    partials to merge itself. Causal formats: row r is query position r // (heads / qlen)
    (``fmt.heads`` rows: qlen positions of the same heads).

    Returns o [G, S, HB * m, fmt.dims] f32 (natural dim order, each split normalized by its own
    sum and times ``out_scale``; ``finished`` latent formats with one split: [G, 1, heads,
    512] bf16, written by the kernel) and lse [G, S, HB * m] f32 (natural log; -inf without
    keys). A ``fmt.wide`` format runs ``_wide``'s kernel (``finished`` only; its split
    partials leave rows past ``fmt.heads`` unwritten), every other ``_pipeline``'s.
    """
    plgpu = _mgpu()[0]
    m = fmt.m
    kernel, scratch = (_wide.kernel, _wide.scratch) if fmt.wide else (_kernel, _scratch)
    if cache.shape[0] >= MAX_ROWS:
        raise NotImplementedError("the Mosaic GPU kernels read int32 record indices")
    rule = None
    if isinstance(lists, tuple):
        lists, rule = lists
    g = q.shape[0]
    hbs = q.shape[1] if fmt.fp4 else fmt.blocks
    splits = rule.splits if rule else lists.shape[1]
    if fmt.wide and not finished:
        raise NotImplementedError("the 64-head Mosaic kernel (_wide) writes finished latent rows")
    static = is_static_scalar(score_scale) and is_static_scalar(out_scale)
    xp = np if static else jnp  # static scales make an XLA constant, not a kernel
    scales = [xp.float32(score_scale) * xp.float32(LOG2E), xp.float32(out_scale)]
    scale = xp.repeat(xp.stack(scales), DB)
    q = q if fmt.fp4 else signed_q(q, score_scale)  # UltraQuant: the kernel takes the sign
    inputs = [cache, idx, masked_row(fmt), q, lists, scale]
    if fmt.causal:  # constants: each row's query position, and 0 .. 63
        positions = np.arange(hbs * m, dtype=np.int32) // (fmt.heads // fmt.qlen)
        rowpos = np.pad(positions.reshape(hbs, m), ((0, 0), (0, 64 - m)))
        inputs += [rowpos, np.arange(64, dtype=np.int32)]
    if finished and not fmt.fp4 and splits == 1:
        o_type = jax.ShapeDtypeStruct((g, fmt.heads, LATENT_DIM), jnp.bfloat16)
    elif fmt.wide:  # rows in the natural dim order
        o_type = jax.ShapeDtypeStruct((g, splits, hbs * m, LATENT_DIM), jnp.float32)
    else:
        o_type = jax.ShapeDtypeStruct((g, splits, hbs, fmt.dims, m), jnp.float32)
    o_t, lse2 = plgpu.kernel(
        functools.partial(kernel, fmt=fmt, rule=rule),
        out_type=(o_type, jax.ShapeDtypeStruct((g, splits, hbs, m), jnp.float32)),
        scratch_types=scratch(fmt, rule),
        grid=(g * hbs, splits),  # a group's row blocks side by side: their gathers share L2
        grid_names=("gh", "split"),
        num_threads=fmt.consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            unsafe_no_auto_barriers=True,  # the kernel places its own (see _kernel)
        ),
    )(*inputs)
    lse = lse2.reshape(g, splits, hbs * m)
    if o_t.dtype == jnp.bfloat16:
        return o_t[:, None], lse
    if fmt.wide:
        return o_t, lse
    o = o_t.swapaxes(-1, -2).reshape(g, splits, hbs * m, fmt.dims)
    return unpermute_fp4(o) if fmt.fp4 else unpermute_out(o), lse
