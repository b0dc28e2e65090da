"""``mla_decode``: MLA decode over the fp8 latent cache, split over the KV, and the merge."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla._checks import (
    DataCheck,
    as_jax,
    check_array,
    check_positive_int,
    check_scalar,
    csr_check,
    range_check,
    run_data_checks,
)
from jax_sparse_mla._dispatch import resolve_implementation, with_exact_gradient
from jax_sparse_mla._platform import by_platform, gfx950_or, hopper_or
from jax_sparse_mla.emulation.mla_decode import (
    merge_attn_states_gfx950_emulation,
    mla_decode_partials_gfx950_emulation,
)
from jax_sparse_mla.ffi.calls import (
    merge_attn_states_flydsl,
    merge_configurations,
    merge_unsupported,
    mla_decode_configurations,
    mla_decode_flydsl,
    mla_decode_partials_configurations,
    mla_decode_partials_flydsl,
    mla_decode_unsupported,
)
from jax_sparse_mla.formats import KV_DIM, LATENT_DIM
from jax_sparse_mla.kernels.mosaic.mla_decode import (
    mla_decode_mosaic,
    mla_decode_mosaic_cuda,
    mla_decode_partials_mosaic,
    mla_decode_partials_mosaic_cuda,
)
from jax_sparse_mla.kernels.pallas.merge import merge_partials_pallas
from jax_sparse_mla.kernels.pallas.mla_decode import (
    merge_attn_states_pallas,
    mla_decode_kernel,
    mla_decode_pallas,
    mla_decode_partials_kernel,
    mla_decode_partials_pallas,
)
from jax_sparse_mla.reference.attention import merge_partials
from jax_sparse_mla.reference.mla_decode import merge_partials_bf16, mla_decode_partials_f32

DEFAULT_SM_SCALE = KV_DIM**-0.5


class DecodeImplementation(NamedTuple):
    """One implementation of split-KV decode.

    partials(q, kv_codes, kv_indices, kv_indptr, *, qlen, k_scale, v_scale, sm_scale, num_splits)
      -> (o_parts [B*qlen, S, H, 512] float, lse_parts [B*qlen, S, H] f32);
    combine(o_parts, lse_parts) -> (out in o_parts' dtype, combined in f32, lse f32);
    decode(same arguments as partials, num_splits None = the implementation's choice)
      -> (out [B*qlen, H, 512] bf16, lse [B*qlen, H] f32).
    """

    partials: Callable
    combine: Callable
    decode: Callable


def _merge_xla(o_parts, lse_parts):
    o, lse = merge_partials(o_parts, lse_parts)
    return o.astype(o_parts.dtype), lse


def _merge_emulation(o_parts, lse_parts):
    o, lse = merge_attn_states_gfx950_emulation(o_parts, lse_parts)  # bf16, as the kernel writes
    return o.astype(o_parts.dtype), lse


def _partials_then_combine(partials: Callable, combine: Callable) -> Callable:
    """decode = the partials (num_splits None: 1) merged by ``combine`` (-> bf16, lse)."""

    def decode(*args, num_splits, **kw):
        return combine(*partials(*args, num_splits=num_splits or 1, **kw))

    return decode


_XLA = DecodeImplementation(
    mla_decode_partials_f32,
    _merge_xla,
    _partials_then_combine(mla_decode_partials_f32, merge_partials_bf16),
)


def _gfx950_emulation_decode(*args, num_splits, **kw):
    """The gfx950 structure (``ffi.calls.mla_decode_flydsl``): the partials (num_splits None:
    1), then the combine, which one split skips (its partial is the output)."""
    o_parts, lse_parts = mla_decode_partials_gfx950_emulation(
        *args, num_splits=num_splits or 1, **kw
    )
    if o_parts.shape[1] == 1:
        return o_parts[:, 0], lse_parts[:, 0]
    return merge_attn_states_gfx950_emulation(o_parts, lse_parts)


_GFX950_EMULATION = DecodeImplementation(
    mla_decode_partials_gfx950_emulation, _merge_emulation, _gfx950_emulation_decode
)
_PALLAS = DecodeImplementation(
    mla_decode_partials_pallas, merge_attn_states_pallas, mla_decode_pallas
)


_COMPILED = DecodeImplementation(
    mla_decode_partials_kernel, merge_partials_pallas, mla_decode_kernel
)
# The Mosaic GPU kernel's partials, merged in float32 by XLA (no merge kernel of its own).
_MOSAIC = DecodeImplementation(mla_decode_partials_mosaic_cuda, _merge_xla, mla_decode_mosaic_cuda)
_MOSAIC_COMPILED = DecodeImplementation(mla_decode_partials_mosaic, _merge_xla, mla_decode_mosaic)
_FLYDSL = DecodeImplementation(
    mla_decode_partials_flydsl, merge_attn_states_flydsl, mla_decode_flydsl
)
_FLYDSL_UNSUPPORTED = DecodeImplementation(
    mla_decode_unsupported, merge_unsupported, mla_decode_unsupported
)
_FLYDSL_CONFIGURATIONS = DecodeImplementation(
    mla_decode_partials_configurations, merge_configurations, mla_decode_configurations
)


def _f32_parts(partials: Callable) -> Callable:
    """``partials`` with o_parts in float32 (exact), the type every platform's branch returns."""

    def run(*args, **kw):
        o_parts, lse_parts = partials(*args, **kw)
        return o_parts.astype(jnp.float32), lse_parts

    return run


def _auto(field: str):
    """implementation=None: the FlyDSL kernels on gfx950 (ROCm); on Hopper GPUs the Mosaic GPU
    kernels (the merge: Pallas), on later NVIDIA GPUs the compiled Pallas kernels; "xla"
    everywhere else. On the H200 (README, "NVIDIA H200") the Mosaic decode is 1.3x to 2.8x
    faster than Pallas from 32 requests up, at 12 to 128 rows (qlen * H) per request."""
    xla = getattr(_XLA, field)
    flydsl = getattr(_FLYDSL, field)
    if field == "partials":
        flydsl = _f32_parts(flydsl)
    mosaic = None if field == "combine" else getattr(_MOSAIC_COMPILED, field)
    return by_platform(
        default=xla,
        cuda=hopper_or(getattr(_COMPILED, field), xla, mosaic),
        rocm=gfx950_or(
            flydsl,
            xla,
            getattr(_FLYDSL_UNSUPPORTED, field),
            getattr(_FLYDSL_CONFIGURATIONS, field),
        ),
    )


def _exact_gradient(impl: DecodeImplementation) -> DecodeImplementation:
    """``impl`` with the gradients of the "xla" implementation (every field)."""
    return DecodeImplementation(
        *(with_exact_gradient(f, x) for f, x in zip(impl, _XLA, strict=True))
    )


_IMPLEMENTATIONS = {
    "xla": _XLA,
    "gfx950_emulation": _exact_gradient(_GFX950_EMULATION),
    "pallas": _exact_gradient(_PALLAS),
    "mosaic": _exact_gradient(_MOSAIC),
    "flydsl": _exact_gradient(_FLYDSL),
    None: _exact_gradient(DecodeImplementation(*(_auto(f) for f in DecodeImplementation._fields))),
}
_KV_DTYPES = (jnp.float8_e4m3fn, jnp.uint8)


def mla_decode(
    q: jax.Array,
    kv: jax.Array,
    kv_indices: jax.Array,
    kv_indptr: jax.Array,
    *,
    qlen: int = 1,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    num_splits: int | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    validate: bool = False,
):
    """Causal MLA decode of ``qlen`` query positions per request against an fp8 latent cache.

    Request r's keys, in position order, are ``kv[kv_indices[kv_indptr[r]:kv_indptr[r+1]]]``;
    K = code * k_scale (576 dims), V = code[:, :512] * v_scale. Position i of request r sees
    key positions ``j <= seq_len_r - qlen + i``. Indices outside [0, tokens) are masked; a row
    with no visible key gives out 0 and lse -inf. Every argument may be a jax or a numpy array;
    zero-size inputs (0 requests, heads, indices or tokens) give the empty or no-key result.
    Differentiable w.r.t. ``q`` and traced ``k_scale`` / ``v_scale`` / ``sm_scale`` with every
    implementation (the gradient is always the exact "xla" path's), as are the partials and
    ``merge_attn_states``.

    Args:
      q: [B * qlen, H, 576] bfloat16; row r * qlen + i is position i of request r.
      kv: [tokens, 576] float8_e4m3fn, or uint8 holding e4m3fn codes. On XLA:CPU a float8
        array is copied once per call before the gathers (XLA widens float8 there); a uint8
        cache (e.g. the one ``concat_and_cache_mla`` writes when given uint8) avoids the copy.
      kv_indices: [n] int32; kv_indptr: [B + 1] int32, each entry clipped to [0, n] before
        anything else (seq_len_r and the causal bounds come from the clipped entries): no value
        changes the cost (it follows n) or drops a valid key.
      qlen: query positions per request (static).
      k_scale, v_scale: per-tensor dequantization scales (float or 0-d array).
      sm_scale: softmax scale; default 576 ** -0.5 (1 / sqrt(head dim)). DeepSeek-V3.2 must
        pass its own: ``192 ** -0.5 * mscale ** 2`` (192 = the q/k head dim before absorption,
        128 nope + 64 rope; YaRN ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``, with the
        config's rope_scaling factor 40 and mscale_all_dim 1: ``≈ 0.1352``).
      num_splits: KV splits per request (static; default 1 for "xla", enough to fill the GPU
        for "pallas" and "mosaic"). Splits are combined in float32, so the answer does not
        depend on it.
      return_lse: also return the natural-log LSE.
      implementation: None (the FlyDSL kernels on gfx950 ROCm GPUs; on Hopper GPUs the Mosaic
        GPU kernel, on later NVIDIA GPUs the Pallas one; "xla" elsewhere), "xla", "mosaic"
        (the Mosaic GPU kernel: CUDA Hopper only, no interpret mode), "pallas" (compiled on
        CUDA, Pallas interpret mode elsewhere), "flydsl" or "gfx950_emulation" (the gfx950
        kernels' own arithmetic in jnp, every platform).
      validate: run ``validate_mla_decode``'s data checks (ValueError on concrete inputs or
        inside ``checked``; otherwise under ``jax.jit`` a ``jax.errors.JaxRuntimeError`` with
        the same message).
    Returns:
      out [B * qlen, H, 512] bfloat16, and with ``return_lse`` also lse [B * qlen, H] float32.
    """
    op = "mla_decode"
    check_positive_int(op, "num_splits", num_splits, allow_none=True)
    args, kw = _prepare(
        op, q, kv, kv_indices, kv_indptr, qlen, k_scale, v_scale, sm_scale, validate
    )
    impl = resolve_implementation(op, implementation, _IMPLEMENTATIONS)
    if _empty(*args):
        out, lse = _no_keys(q.shape[0], q.shape[1])
    else:
        out, lse = impl.decode(*args, **kw, num_splits=num_splits)
    return (out, lse) if return_lse else out


def mla_decode_partials(
    q: jax.Array,
    kv: jax.Array,
    kv_indices: jax.Array,
    kv_indptr: jax.Array,
    *,
    qlen: int = 1,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    num_splits: int = 1,
    implementation: str | None = None,
    validate: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The split-KV partials of ``mla_decode``, for ``merge_attn_states``.

    Each request's key positions are cut into ``num_splits`` splits of
    ``c = 128 * ceil(seq_len / (128 * num_splits))`` positions (whole 128-key blocks): split s
    covers [s * c, min((s + 1) * c, seq_len)). Each partial is normalized by its own sum; a split
    with no visible key has o 0 and lse -inf. Arguments as ``mla_decode``.

    Returns:
      o_parts [B * qlen, num_splits, H, 512] bfloat16 and lse_parts [B * qlen, num_splits, H]
      float32.
    """
    op = "mla_decode_partials"
    check_positive_int(op, "num_splits", num_splits)
    args, kw = _prepare(
        op, q, kv, kv_indices, kv_indptr, qlen, k_scale, v_scale, sm_scale, validate
    )
    impl = resolve_implementation(op, implementation, _IMPLEMENTATIONS)
    if _empty(*args):
        return _no_keys(q.shape[0], q.shape[1], num_splits)
    o_parts, lse_parts = impl.partials(*args, **kw, num_splits=num_splits)
    return o_parts.astype(jnp.bfloat16), lse_parts


def _empty(q, codes, kv_indices, kv_indptr) -> bool:
    """True when no query row can see a key (nothing to compute or launch)."""
    return q.size == 0 or codes.size == 0 or kv_indices.size == 0


def _no_keys(rows: int, heads: int, *splits: int) -> tuple[jax.Array, jax.Array]:
    """o 0 [rows, *splits, H, 512] bf16 and lse -inf [rows, *splits, H] f32."""
    return (
        jnp.zeros((rows, *splits, heads, LATENT_DIM), jnp.bfloat16),
        jnp.full((rows, *splits, heads), -jnp.inf, jnp.float32),
    )


def _prepare(op, q, kv, kv_indices, kv_indptr, qlen, k_scale, v_scale, sm_scale, validate):
    """Checks the shared arguments; returns the implementations' positional and keyword ones."""
    _check_static(op, q, kv, kv_indices, kv_indptr, qlen)
    kw = {
        "qlen": qlen,
        "k_scale": check_scalar(op, "k_scale", k_scale),
        "v_scale": check_scalar(op, "v_scale", v_scale),
        "sm_scale": check_scalar(
            op, "sm_scale", DEFAULT_SM_SCALE if sm_scale is None else sm_scale
        ),
    }
    q, kv, kv_indices, kv_indptr = as_jax(q, kv, kv_indices, kv_indptr)
    if validate:
        checks = _data_checks(kv_indices, kv_indptr, kv.shape[0])
        kv_indptr = run_data_checks(checks, kv_indptr)
    codes = kv if kv.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(kv, jnp.uint8)
    return (q, codes, kv_indices, kv_indptr), kw


def _check_static(op, q, kv, kv_indices, kv_indptr, qlen) -> None:
    check_positive_int(op, "qlen", qlen)
    check_array(op, "q", q, dtypes=[jnp.bfloat16], ndim=3, last_dims=(KV_DIM,))
    if hasattr(kv, "dtype") and kv.dtype == jnp.float8_e4m3fnuz:
        raise TypeError(f"{op}: kv must be OCP float8_e4m3fn (or uint8 codes), not FNUZ")
    check_array(op, "kv", kv, dtypes=_KV_DTYPES, ndim=2, last_dims=(KV_DIM,))
    check_array(op, "kv_indices", kv_indices, dtypes=[jnp.int32], ndim=1)
    check_array(op, "kv_indptr", kv_indptr, dtypes=[jnp.int32], ndim=1)
    if kv_indptr.shape[0] < 1:
        raise ValueError(f"{op}: kv_indptr must have shape [B + 1] with B >= 0, got [0]")
    b = kv_indptr.shape[0] - 1
    if q.shape[0] != b * qlen:
        raise ValueError(
            f"{op}: q and kv_indptr disagree: kv_indptr has {b + 1} entries (B = {b} requests), "
            f"so q needs B * qlen = {b} * {qlen} = {b * qlen} rows, got {q.shape[0]}; "
            f"kv_indptr must have q rows / qlen + 1 = {q.shape[0] / qlen:g} + 1 entries"
        )


def validate_mla_decode(q, kv, kv_indices, kv_indptr, *, qlen: int = 1) -> None:
    """Checks ``mla_decode``'s arguments, static and data-dependent; raises on the first problem.

    Data checks (computed where the data lives; only their findings reach the host):
    ``kv_indptr`` starts >= 0, never decreases and ends at ``len(kv_indices)``; every entry of
    ``kv_indices`` is in [0, tokens): an index outside it is flagged although ``mla_decode``
    masks it, at every position of ``kv_indices``. Raises ValueError.
    """
    _check_static("validate_mla_decode", q, kv, kv_indices, kv_indptr, qlen)
    run_data_checks(_data_checks(*as_jax(kv_indices, kv_indptr), kv.shape[0]))


def _data_checks(kv_indices: jax.Array, kv_indptr: jax.Array, tokens: int) -> list[DataCheck]:
    op = "mla_decode"
    return [
        *csr_check(op, "kv_indices", "kv_indptr", kv_indices.shape[0], kv_indptr),
        range_check(op, "kv_indices", kv_indices, tokens, f"kv has {tokens} tokens"),
    ]


def merge_attn_states(
    o_parts: jax.Array,
    lse_parts: jax.Array,
    *,
    return_lse: bool = False,
    implementation: str | None = None,
):
    """Combines attention partials (split KV, or context-parallel shards across devices).

    Weights are ``exp(lse_s - max_s lse_s)``; a -inf partial has weight 0 (its o is ignored,
    even if NaN); when every partial is -inf the output is 0 and the lse -inf. Differentiable
    w.r.t. ``o_parts`` and ``lse_parts`` with every implementation (the "xla" gradient).

    Args:
      o_parts: [n, S, H, D] float partial outputs, each normalized by its own sum.
      lse_parts: [n, S, H] float32 natural-log LSEs.
      return_lse: also return the combined lse.
      implementation: None, "xla", "mosaic" (the same float32 merge as "xla": the Mosaic GPU
        decode has no merge kernel), "pallas" or "gfx950_emulation" (as for ``mla_decode``;
        the emulation rounds the merged output to bf16, as the gfx950 combine kernel does).
    Returns:
      o [n, H, D] in o_parts' dtype (combined in float32), and with ``return_lse`` also
      lse [n, H] float32.
    """
    op = "merge_attn_states"
    check_array(op, "o_parts", o_parts, ndim=4)
    if not jnp.issubdtype(o_parts.dtype, jnp.floating):
        raise TypeError(f"{op}: o_parts must be a float array, got {np.dtype(o_parts.dtype).name}")
    check_array(op, "lse_parts", lse_parts, dtypes=[jnp.float32], shape=o_parts.shape[:3])
    if o_parts.shape[1] < 1:
        raise ValueError(
            f"{op}: o_parts needs at least one partial (S >= 1), got shape {list(o_parts.shape)}"
        )
    impl = resolve_implementation(op, implementation, _IMPLEMENTATIONS)
    o, lse = impl.combine(*as_jax(o_parts, lse_parts))
    return (o, lse) if return_lse else o
