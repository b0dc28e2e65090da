"""``ultraquant_decode``: paged decode over a 4-bit UltraQuant (FP4 E2M1 + UE8M0) KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_mla._checks import (
    DataCheck,
    as_jax,
    check_array,
    check_positive_int,
    check_scalar,
    range_check,
    run_data_checks,
)
from jax_sparse_mla._dispatch import resolve_implementation, with_exact_gradient
from jax_sparse_mla._platform import by_platform, gfx950_or, hopper_or
from jax_sparse_mla.emulation.ultraquant import ultraquant_decode_gfx950_emulation
from jax_sparse_mla.ffi.calls import (
    ultraquant_configurations,
    ultraquant_decode_flydsl,
    ultraquant_unsupported,
)
from jax_sparse_mla.formats import UQ_HEAD_DIM, check_ultraquant_cache
from jax_sparse_mla.kernels.mosaic.ultraquant import mosaic_or, ultraquant_decode_mosaic_cuda
from jax_sparse_mla.kernels.pallas.ultraquant import (
    ultraquant_decode_kernel,
    ultraquant_decode_pallas,
)
from jax_sparse_mla.reference.ultraquant import ultraquant_decode_xla

DEFAULT_SM_SCALE = 1.0 / 16.0


# implementation name -> fn(q, cache, block_tables, seq_lens, *, sm_scale, num_partitions) -> bf16
# (num_partitions None: the implementation's choice); None is the choice of
# implementation=None: the FlyDSL kernels on gfx950 (ROCm), the Mosaic GPU kernel on Hopper
# itself (the Pallas one past it, or for shapes the Mosaic kernel does not take), "xla"
# everywhere else. Every gradient is the "xla" path's.
_CUDA_CHOICE = hopper_or(
    ultraquant_decode_kernel, ultraquant_decode_xla, mosaic_or(ultraquant_decode_kernel)
)
_IMPLEMENTATIONS = {
    "xla": ultraquant_decode_xla,
    **{
        name: with_exact_gradient(fn, ultraquant_decode_xla)
        for name, fn in {
            "gfx950_emulation": ultraquant_decode_gfx950_emulation,
            "pallas": ultraquant_decode_pallas,
            "mosaic": ultraquant_decode_mosaic_cuda,
            "flydsl": ultraquant_decode_flydsl,
            None: by_platform(
                default=ultraquant_decode_xla,
                cuda=_CUDA_CHOICE,
                rocm=gfx950_or(
                    ultraquant_decode_flydsl,
                    ultraquant_decode_xla,
                    ultraquant_unsupported,
                    ultraquant_configurations,
                ),
            ),
        }.items()
    },
}
# The implementations of exact_q=True (the float32 rotated q), called with exact_q=True: the
# gfx950 kernels take q in e4m3 only, so implementation=None runs "xla" on ROCm.
_EXACT_Q_IMPLEMENTATIONS = {
    "xla": ultraquant_decode_xla,
    "pallas": _IMPLEMENTATIONS["pallas"],
    "mosaic": _IMPLEMENTATIONS["mosaic"],
    None: with_exact_gradient(
        by_platform(default=ultraquant_decode_xla, cuda=_CUDA_CHOICE), ultraquant_decode_xla
    ),
}


def ultraquant_decode(
    q: jax.Array,
    cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale=DEFAULT_SM_SCALE,
    num_partitions: int | None = None,
    implementation: str | None = None,
    validate: bool = False,
    exact_q: bool = False,
) -> jax.Array:
    """GQA decode against an UltraQuant cache written by ``ultraquant_store``.

    Query head h reads KV head ``h // G`` (``Hq = Hk * G``). Token j < seq_len of request b is
    slot ``(block_tables[b, j // block_size], j % block_size)``. q is rotated as K was (H/16,
    so the rotation cancels in q.K and the output is in V's own space) and then rounded to
    e4m3 (OCP e4m3fn, nearest even, saturating at ±448), as UltraQuant's own implementations
    (vLLM's kernels and reference attention) compute it; ``exact_q=True`` keeps the float32
    rotated q instead (docs/semantics.md). A block-table entry outside
    [0, num_blocks) masks its tokens; ``seq_lens`` is clamped to [0, max_blocks * block_size]; a
    request with no key gives 0. Every argument may be a jax or a numpy array; zero-size inputs
    (0 requests, query heads, blocks or block slots) give the empty or zero result.
    Differentiable w.r.t. ``q`` and a traced ``sm_scale`` with every implementation (the
    gradient is always the "xla" path's; through the e4m3 rounding of q it is
    straight-through, 0 where the rotated q saturates past ±448).

    Args:
      q: [B, Hq, 256] bfloat16, not rotated.
      cache: [num_blocks, block_size, Hk, slot_bytes] uint8 (slot_bytes >= 272, multiple of 4).
      block_tables: [B, max_blocks] int32.
      seq_lens: [B] int32.
      sm_scale: softmax scale (float or 0-d array); default 1/16 = 256 ** -0.5 (1 / sqrt(head
        dim)). A model passes its own: 1 / sqrt(its q/k head dim), times YaRN's ``mscale ** 2``
        (``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``) when it uses YaRN, as DeepSeek-V3.2
        does for MLA (``192 ** -0.5 * mscale ** 2 ≈ 0.1352``, see ``sparse_mla``).
      num_partitions: P (static; default 1 for "xla", enough to fill the GPU for "pallas" and
        "mosaic"): for "xla" partition p owns the tile-groups p, p + P, ..., for "pallas" and
        "mosaic" a contiguous run of tokens; the partitions are reduced in float32 at the end,
        so the answer does not depend on P.
      implementation: None (the FlyDSL kernels on an MI355, "xla" there with ``exact_q``; on
        a Hopper GPU the Mosaic GPU kernel, or the Pallas one past 32 query heads per KV head
        or for a slot_bytes that is not a multiple of 16; the Pallas kernel on later NVIDIA
        GPUs; "xla" elsewhere), "xla" (the op computed exactly in float32), "pallas"
        (compiled on CUDA, Pallas interpret mode elsewhere), "mosaic" (the Mosaic GPU kernel:
        NVIDIA Hopper only, the same numerics as "pallas"; NotImplementedError for the shapes
        above), "flydsl" or "gfx950_emulation" (the gfx950 kernels' own arithmetic in jnp,
        every platform); these two do not serve ``exact_q`` (NotImplementedError).
      validate: run ``validate_ultraquant_decode``'s data checks (ValueError on concrete
        inputs or inside ``checked``; otherwise under ``jax.jit`` a
        ``jax.errors.JaxRuntimeError`` with the same message).
      exact_q: score with the float32 rotated q (no e4m3 rounding); static.
    Returns:
      [B, Hq, 256] bfloat16.
    """
    op = "ultraquant_decode"
    _check_static(op, q, cache, block_tables, seq_lens)
    check_positive_int(op, "num_partitions", num_partitions, allow_none=True)
    scale = check_scalar(op, "sm_scale", sm_scale)
    if not isinstance(exact_q, bool):
        raise TypeError(f"{op}: exact_q must be a bool (static), got {type(exact_q).__name__}")
    if exact_q and implementation in ("gfx950_emulation", "flydsl"):
        raise NotImplementedError(
            f"{op}: implementation={implementation!r} rounds q to e4m3 in its kernel; "
            "exact_q=True runs with 'xla', 'pallas' or 'mosaic'"
        )
    table = _EXACT_Q_IMPLEMENTATIONS if exact_q else _IMPLEMENTATIONS
    impl = resolve_implementation(op, implementation, table)
    q, cache, block_tables, seq_lens = as_jax(q, cache, block_tables, seq_lens)
    if validate:
        checks = _data_checks(block_tables, seq_lens, cache.shape[0], cache.shape[1])
        seq_lens = run_data_checks(checks, seq_lens)
    if q.size == 0 or cache.size == 0:  # no key anywhere: nothing to compute or launch
        return jnp.zeros(q.shape, jnp.bfloat16)
    options = {"exact_q": True} if exact_q else {}
    return impl(
        q,
        cache,
        block_tables,
        seq_lens,
        sm_scale=scale,
        num_partitions=num_partitions,
        **options,
    )


def _check_static(op, q, cache, block_tables, seq_lens) -> None:
    check_array(op, "q", q, dtypes=[jnp.bfloat16], ndim=3, last_dims=(UQ_HEAD_DIM,))
    check_ultraquant_cache(op, cache)
    b, hq, _ = q.shape
    hk = cache.shape[2]
    if (hk == 0 and hq != 0) or (hk != 0 and hq % hk):
        raise ValueError(
            f"{op}: q's head count ({hq}) must be a multiple of the cache's KV heads ({hk})"
        )
    check_array(op, "block_tables", block_tables, dtypes=[jnp.int32], shape=(b, None))
    if block_tables.shape[1] < 1:
        raise ValueError(
            f"{op}: block_tables must have at least one column, got {list(block_tables.shape)}"
        )
    check_array(op, "seq_lens", seq_lens, dtypes=[jnp.int32], shape=(b,))


def validate_ultraquant_decode(q, cache, block_tables, seq_lens) -> None:
    """Checks ``ultraquant_decode``'s arguments, static and data-dependent; raises on the first
    problem.

    Data checks (computed where the data lives; only their findings reach the host): every
    seq_len is in [0, max_blocks * block_size] (flagged although the op clamps it); every
    block-table entry a request uses (the first ``ceil(seq_len / block_size)``) is in
    [0, num_blocks) (flagged although the op masks its tokens; entries past those are never
    checked). Raises ValueError.
    """
    _check_static("validate_ultraquant_decode", q, cache, block_tables, seq_lens)
    checks = _data_checks(*as_jax(block_tables, seq_lens), cache.shape[0], cache.shape[1])
    run_data_checks(checks)


def _data_checks(block_tables, seq_lens, num_blocks: int, block_size: int) -> list[DataCheck]:
    op = "ultraquant_decode"
    capacity = block_tables.shape[1] * block_size
    blocks = -(-jnp.clip(seq_lens, 0, capacity) // max(block_size, 1))
    used = jnp.arange(block_tables.shape[1])[None, :] < blocks[:, None]
    return [
        range_check(
            op,
            "seq_lens",
            seq_lens,
            capacity + 1,
            f"block_tables holds {capacity} tokens per request",
        ),
        range_check(
            op,
            "block_tables",
            jnp.where(used, block_tables, 0),
            num_blocks,
            f"the cache has {num_blocks} blocks",
        ),
    ]
