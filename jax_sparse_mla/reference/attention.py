"""The tiled online-softmax attention loop shared by every exact implementation."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_sparse_mla._vma import fori_loop, sum_like

_HIGHEST = jax.lax.Precision.HIGHEST


class KeyTile(NamedTuple):
    """One tile of keys for every row, as produced by an op's tile loader.

    Attributes:
      k: [R, T, G, Dk] float32 keys (G key heads; G = 1 when all query heads share the keys).
      v: [R, T, G, Dv] float32 values.
      key_valid: [R, T] bool; an invalid key is ignored entirely (its k and v may be garbage).
      row_mask: optional bool mask broadcastable to [R, G, M, T] (e.g. causal), or None. A key
        it hides from a query contributes exactly nothing to that query's o and lse, whatever
        its k and v hold (never 0 x NaN); a query that sees a key with a non-finite v gets NaN.
    """

    k: jax.Array
    v: jax.Array
    key_valid: jax.Array
    row_mask: jax.Array | None = None


def attend_tiles(
    q: jax.Array,
    num_tiles: jax.Array | int,
    load_tile: Callable[[jax.Array], KeyTile],
    sm_scale: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """softmax(sm_scale * q·k) @ v over tiles of keys, with an f32 online softmax.

    Differentiable w.r.t. ``q`` and ``sm_scale`` under ``jax.jit`` (a custom VJP: the backward
    pass walks the same tiles again, flash-attention style, so it needs no stored tiles and no
    static tile count). ``load_tile``'s own inputs (codes, indices) are not differentiated; it
    must not close over float arrays (scales go into ``sm_scale`` or the caller's output).

    Args:
      q: [R, G, M, Dk] float32 queries (R rows, G key heads, M queries per key head).
      num_tiles: number of tiles (traced or static); tile ``t`` is ``load_tile(t)``.
      load_tile: int32 scalar -> KeyTile.
      sm_scale: float32 scalar; any finite value gives finite weights (it multiplies the
        scores after their running max is subtracted).
    Returns:
      o [R, G, M, Dv] float32 (normalized; 0 where no key is valid) and
      lse [R, G, M] float32 (natural log of the sum of exp(scores); -inf where no key is valid).
    """
    load, consts = _hoisted(load_tile)
    if any(isinstance(c, jax.core.Tracer) and jnp.issubdtype(c.dtype, jnp.inexact) for c in consts):
        raise NotImplementedError(
            "attend_tiles: load_tile closes over a differentiated float array; pass scales "
            "through sm_scale or apply them to the output"
        )
    n = jnp.asarray(num_tiles, jnp.int32)
    return _attend(load, q, jnp.asarray(sm_scale, jnp.float32), n, *consts)


def _hoisted(load_tile: Callable[[jax.Array], KeyTile]):
    """``load_tile`` as a pure function ``load(t, *consts)`` and every array it closes over.

    All of them are hoisted, integer index arrays included (``jax.closure_convert`` keeps those
    in the closure): the custom VJP's backward pass may run outside the trace that made them
    (``jax.grad`` of a ``shard_map``), so it must get them as arguments."""
    closed, shape = jax.make_jaxpr(load_tile, return_shape=True)(jnp.int32(0))
    tree = jax.tree.structure(shape)

    def load(t, *consts):
        return jax.tree.unflatten(tree, jax.core.eval_jaxpr(closed.jaxpr, consts, t))

    return load, closed.consts


def _scores(q, tile: KeyTile, sign):
    """One tile: scores t = ``sign`` * q·k [R, G, M, T] (-inf where a key is invalid or hidden;
    NaN where a visible key's v is not finite), and k, v with every value that meets a 0 weight
    made finite. The scaled scores are ``|sm_scale| * t``, formed only after the running max of
    t is subtracted, so any finite scale gives finite weights."""
    key_ok = tile.key_valid[:, :, None, None]
    k = jnp.where(key_ok, tile.k, 0.0)
    v = jnp.where(key_ok, tile.v, 0.0)
    s = jnp.einsum("rgmd,rtgd->rgmt", q, k, precision=_HIGHEST) * sign
    valid = tile.key_valid[:, None, None, :]
    if tile.row_mask is not None:
        valid = valid & tile.row_mask
    s = jnp.where(valid, s, -jnp.inf)
    if tile.row_mask is not None:  # P @ V on finite values; a visible non-finite v: NaN
        v_ok = jnp.isfinite(v)
        v = jnp.where(v_ok, v, 0.0)
        k = jnp.where(jnp.isfinite(k), k, 0.0)
        bad = jnp.moveaxis(~jnp.all(v_ok, axis=-1), 1, -1)[:, :, None]  # [R, G, 1, T]
        s = jnp.where(valid & bad, jnp.nan, s)
    return s, k, v


def _weights(t, m_ref, scale):
    """exp(scale * (t - m_ref)), 0 where t is -inf (also for a scale of 0)."""
    return jnp.where(t == -jnp.inf, 0.0, jnp.exp(scale * (t - m_ref)))


def _run(load, q, sm_scale, num_tiles, *consts):
    """(o, lse, m, total): the attention, the max m of the unscaled scores t (see ``_scores``)
    and the sum of exp(|sm_scale| (t - m)) per query (1 where no key is valid)."""
    r, g, m, _ = q.shape
    dv = jax.eval_shape(load, jnp.int32(0), *consts).v.shape[-1]
    neg_inf = jnp.float32(-jnp.inf)
    sign, scale = jnp.sign(sm_scale), jnp.abs(sm_scale)

    def step(t, carry):
        m_run, l_run, acc = carry
        s, _, v = _scores(q, load(t, *consts), sign)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=-1))
        m_ref = jnp.where(m_new == neg_inf, 0.0, m_new)  # no valid key yet: keep exp finite
        alpha = _weights(m_run, m_ref, scale)
        p = _weights(s, m_ref[..., None], scale)
        l_new = l_run * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("rgmt,rtgd->rgmd", p, v, precision=_HIGHEST)
        return m_new, l_new, acc * alpha[..., None] + pv

    init = (
        jnp.full((r, g, m), neg_inf),
        jnp.zeros((r, g, m), jnp.float32),
        jnp.zeros((r, g, m, dv), jnp.float32),
    )
    m_fin, l_fin, acc = fori_loop(0, num_tiles, step, init)
    # l >= 1 once a key is valid (its largest score contributes exp(0)), so l == 0 means no
    # valid key; NaN scores from a referenced corrupt record propagate as NaN.
    has_keys = l_fin != 0
    l_safe = jnp.where(has_keys, l_fin, 1.0)
    o = jnp.where(has_keys[..., None], acc / l_safe[..., None], 0.0)
    lse = jnp.where(has_keys, scale * m_fin + jnp.log(l_safe), neg_inf)
    return o, lse, m_fin, l_safe


def _forward(load, q, sm_scale, num_tiles, *consts):
    return _run(load, q, sm_scale, num_tiles, *consts)[:2]


_attend = jax.custom_vjp(_forward, nondiff_argnums=(0,))


def _attend_fwd(load, q, sm_scale, num_tiles, *consts):
    o, lse, m, total = _run(load, q, sm_scale, num_tiles, *consts)
    return (o, lse), (q, sm_scale, num_tiles, consts, o, m, total)


def _attend_bwd(load, res, cts):
    """dS = P (dO·v - dO·o + dlse), dq = sm_scale sum_k dS k, dsm_scale = sum(q · sum_k dS k)."""
    q, sm_scale, num_tiles, consts, o, m, total = res
    d_o, d_lse = cts
    m_ref = jnp.where(m == -jnp.inf, 0.0, m)[..., None]  # no key: every P is 0
    delta = (jnp.sum(d_o * o, axis=-1) - d_lse)[..., None]
    sign, scale = jnp.sign(sm_scale), jnp.abs(sm_scale)

    def step(t, dq):
        s, k, v = _scores(q, load(t, *consts), sign)
        p = _weights(s, m_ref, scale) / total[..., None]
        dp = jnp.einsum("rgmd,rtgd->rgmt", d_o, v, precision=_HIGHEST)
        return dq + jnp.einsum("rgmt,rtgd->rgmd", p * (dp - delta), k, precision=_HIGHEST)

    dq = fori_loop(0, num_tiles, step, jnp.zeros_like(q))
    d_scale = sum_like(jnp.sum(q * dq), sm_scale)
    return (sum_like(dq * sm_scale, q), d_scale, None, *(None for _ in consts))


_attend.defvjp(_attend_fwd, _attend_bwd)


def merge_partials(o_parts: jax.Array, lse_parts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Combines attention partials in float32.

    Args:
      o_parts: [..., S, H, D] partial outputs, each normalized by its own sum.
      lse_parts: [..., S, H] their log-sum-exps; a -inf partial has weight 0.
    Returns:
      o [..., H, D] float32 (0 where every partial is -inf) and lse [..., H] float32.
    """
    lse = lse_parts.astype(jnp.float32)
    neg_inf = jnp.float32(-jnp.inf)
    m = jnp.max(lse, axis=-2)
    w = merge_weights(lse, m[..., None, :])  # [..., S, H]
    m_ref = jnp.where(jnp.isinf(m), 0.0, m)
    total = jnp.sum(w, axis=-2)
    contrib = jnp.where((w != 0)[..., None], w[..., None] * o_parts.astype(jnp.float32), 0.0)
    has = total != 0  # 0 only when every partial is -inf; NaN propagates
    o = jnp.where(
        has[..., None], jnp.sum(contrib, axis=-3) / jnp.where(has, total, 1.0)[..., None], 0.0
    )
    lse_out = jnp.where(has, m_ref + jnp.log(jnp.where(has, total, 1.0)), neg_inf)
    return o, jnp.where(m == jnp.inf, m, lse_out)


def merge_weights(lse: jax.Array, m: jax.Array) -> jax.Array:
    """The merge's weights ``exp(lse - m)`` of partials with log-sum-exps ``lse`` and their
    maximum ``m`` (broadcast alike): 0 for a -inf partial; where m is +inf (a score scale so
    large that an lse overflows float32) the overflowed partials weigh 1 and the others 0."""
    m_ref = jnp.where(jnp.isinf(m), 0.0, m)
    return jnp.where(m == jnp.inf, (lse == jnp.inf).astype(jnp.float32), jnp.exp(lse - m_ref))


def ceil_div(a, b):
    """Integer ceil(a / b) for non-negative a (arrays or ints) and positive b."""
    return (a + b - 1) // b
