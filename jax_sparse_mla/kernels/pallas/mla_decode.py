"""Pallas ``mla_decode``: causal split-KV MLA decode over the fp8 latent cache."""

from __future__ import annotations

import jax.numpy as jnp

from jax_sparse_mla.formats import LATENT_DIM
from jax_sparse_mla.kernels.pallas._common import choose_splits, on_cuda_or_interpret
from jax_sparse_mla.kernels.pallas.merge import merge_partials_pallas
from jax_sparse_mla.kernels.pallas.mla_attention import block_m_for, mla_partials
from jax_sparse_mla.reference.mla_decode import SPLIT_ALIGN

MIN_SPLIT_KEYS = 256  # a chosen split keeps at least this many keys of an average request


def _partials(
    q, kv, kv_indices, kv_indptr, qlen, k_scale, v_scale, sm_scale, num_splits, interpret
):
    """-> o [B, S, M_pad, 512] f32, lse [B, S, M_pad] (M = qlen * H, row i * H + h)."""
    rows, h, d = q.shape
    b = kv_indptr.shape[0] - 1
    scales = jnp.stack([jnp.float32(sm_scale) * k_scale, jnp.float32(v_scale)])
    return mla_partials(
        q.reshape(b, qlen * h, d),
        kv,
        kv_indices,
        kv_indptr,
        scales,
        fmt="fp8",
        qlen=qlen,
        heads=h,
        num_splits=num_splits,
        split_align=SPLIT_ALIGN,
        out_dtype=jnp.float32,
        interpret=interpret,
    )


def _empty(q, kv, kv_indices, kv_indptr) -> bool:
    return q.shape[0] * q.shape[1] == 0 or kv.shape[0] == 0 or kv_indices.shape[0] == 0


def mla_decode_partials_kernel(
    q, kv, kv_indices, kv_indptr, *, qlen, k_scale, v_scale, sm_scale, num_splits, interpret=False
):
    """Same contract as ``mla_decode_partials_f32`` (o [B*qlen, S, H, 512] f32, lse)."""
    rows, h, _ = q.shape
    b = kv_indptr.shape[0] - 1
    if _empty(q, kv, kv_indices, kv_indptr):
        return (
            jnp.zeros((rows, num_splits, h, LATENT_DIM), jnp.float32),
            jnp.full((rows, num_splits, h), -jnp.inf, jnp.float32),
        )
    o, lse = _partials(
        q, kv, kv_indices, kv_indptr, qlen, k_scale, v_scale, sm_scale, num_splits, interpret
    )
    o = o[:, :, : qlen * h].reshape(b, num_splits, qlen, h, LATENT_DIM).transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, : qlen * h].reshape(b, num_splits, qlen, h).transpose(0, 2, 1, 3)
    return o.reshape(rows, num_splits, h, LATENT_DIM), lse.reshape(rows, num_splits, h)


def mla_decode_kernel(
    q, kv, kv_indices, kv_indptr, *, qlen, k_scale, v_scale, sm_scale, num_splits, interpret=False
):
    """Causal MLA decode, partials merged on the GPU.

    ``kv`` [tokens, 576] holds e4m3fn codes as float8_e4m3fn or uint8; compiled, the kernel
    reads either in place (``_common.as_words``), never a converted copy. ``num_splits=None``
    picks enough splits to fill the GPU (at least 256 keys each for an average request).
    Returns out [B*qlen, H, 512] bf16 and lse [B*qlen, H] f32.
    """
    rows, h, _ = q.shape
    b = kv_indptr.shape[0] - 1
    if _empty(q, kv, kv_indices, kv_indptr):
        return jnp.zeros((rows, h, LATENT_DIM), jnp.bfloat16), jnp.full((rows, h), -jnp.inf)
    if num_splits is None:
        m_blocks = -(-qlen * h // block_m_for(qlen * h))
        num_splits = choose_splits(b * m_blocks, kv_indices.shape[0] / b, MIN_SPLIT_KEYS)
    o, lse = _partials(
        q, kv, kv_indices, kv_indptr, qlen, k_scale, v_scale, sm_scale, num_splits, interpret
    )
    o, lse = merge_partials_pallas(o, lse, out_dtype=jnp.bfloat16, interpret=interpret)
    o = o[:, : qlen * h].reshape(rows, h, LATENT_DIM)
    return o, lse[:, : qlen * h].reshape(rows, h)


mla_decode_partials_pallas = on_cuda_or_interpret(mla_decode_partials_kernel)
mla_decode_pallas = on_cuda_or_interpret(mla_decode_kernel)
merge_attn_states_pallas = on_cuda_or_interpret(merge_partials_pallas)
