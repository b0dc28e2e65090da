"""Pallas merge of attention partials (split KV or context-parallel shards)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_sparse_mla.kernels.pallas._common import call, pow2_at_least
from jax_sparse_mla.reference.attention import merge_weights


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, num_parts: int):
    i, h = pl.program_id(0), pl.program_id(1)
    m = jax.lax.fori_loop(
        0, num_parts, lambda s, m: jnp.maximum(m, lse_ref[i, s, h]), jnp.float32(-jnp.inf)
    )
    m_ref = jnp.where(jnp.isinf(m), 0.0, m)

    def add(s, carry):
        total, acc = carry
        w = merge_weights(lse_ref[i, s, h], m)  # 0 for a -inf partial, whose o is ignored
        o = o_ref[i, s, h, :].astype(jnp.float32)
        return total + w, acc + jnp.where(w != 0, w * o, 0.0)

    d = o_ref.shape[-1]
    total, acc = jax.lax.fori_loop(
        0, num_parts, add, (jnp.float32(0), jnp.zeros((d,), jnp.float32))
    )
    has = total != 0
    out_ref[i, h, :] = jnp.where(has, acc / jnp.where(has, total, 1.0), 0.0).astype(out_ref.dtype)
    lse = jnp.where(has, m_ref + jnp.log(jnp.where(has, total, 1.0)), -jnp.inf)
    lse_out_ref[i, h] = jnp.where(m == jnp.inf, m, lse)


def merge_partials_pallas(o_parts, lse_parts, *, out_dtype=None, interpret: bool = False):
    """Combines partials in float32: weights ``exp(lse_s - max_s lse_s)``, a -inf partial
    weighs 0 (its o is ignored, even if NaN), all -inf gives o 0 and lse -inf.

    Args:
      o_parts: [n, S, H, D] float, each normalized by its own sum (D is padded to a power of
        two for the kernel).
      lse_parts: [n, S, H] float32.
      out_dtype: dtype of o (default o_parts' dtype).
      interpret: run in Pallas interpret mode.
    Returns:
      o [n, H, D] out_dtype and lse [n, H] float32.
    """
    n, s, h, d = o_parts.shape
    out_dtype = o_parts.dtype if out_dtype is None else out_dtype
    if n * h == 0:
        return jnp.zeros((n, h, d), out_dtype), jnp.full((n, h), -jnp.inf, jnp.float32)
    d_pad = pow2_at_least(d, 1)
    if d_pad != d:
        o_parts = jnp.pad(o_parts, ((0, 0), (0, 0), (0, 0), (0, d_pad - d)))
    o, lse = call(
        lambda *refs: _merge_kernel(*refs, num_parts=s),
        grid=(n, h),
        out_shape=(
            jax.ShapeDtypeStruct((n, h, d_pad), out_dtype),
            jax.ShapeDtypeStruct((n, h), jnp.float32),
        ),
        num_warps=2,
        num_stages=1,
        interpret=interpret,
        name="merge_attn_states",
    )(o_parts, lse_parts.astype(jnp.float32))
    return o[..., :d], lse
