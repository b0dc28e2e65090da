"""``sparse_mla``: sparse MLA attention over fp8_ds_mla records with a CSR index stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla._checks import (
    DataCheck,
    as_jax,
    check_array,
    check_scalar,
    csr_check,
    first_true,
    range_check,
    run_data_checks,
)
from jax_sparse_mla._dispatch import resolve_implementation, with_exact_gradient
from jax_sparse_mla._platform import by_platform, gfx950_or, hopper_or
from jax_sparse_mla.emulation.sparse_mla import sparse_mla_gfx950_emulation
from jax_sparse_mla.ffi.calls import (
    default_sparse_splits,
    sparse_mla_configurations,
    sparse_mla_flydsl,
    sparse_mla_unsupported,
)
from jax_sparse_mla.formats import KV_DIM, MAX_KERNEL_SCALE, RECORD_BYTES, SCALES_OFFSET
from jax_sparse_mla.kernels.mosaic.sparse_mla import sparse_mla_mosaic, sparse_mla_mosaic_cuda
from jax_sparse_mla.kernels.pallas.sparse_mla import sparse_mla_kernel, sparse_mla_pallas
from jax_sparse_mla.reference.sparse_mla import no_keys, sparse_mla_xla

DEFAULT_SM_SCALE = KV_DIM**-0.5


def _lse_if(fn):
    """``fn`` (returning out and lse) as ``fn(..., *, return_lse) -> (out, lse or None)``."""

    def run(q, kv, idx, indptr, sm_scale, *, return_lse: bool):
        out, lse = fn(q, kv, idx, indptr, sm_scale)
        return out, (lse if return_lse else None)

    return run


_XLA = _lse_if(sparse_mla_xla)


def _gfx950_emulation(q, kv, idx, indptr, sm_scale):
    """The emulation with the key splits the kernels would use for these shapes."""
    splits = default_sparse_splits(q, idx)
    return sparse_mla_gfx950_emulation(q, kv, idx, indptr, sm_scale, splits)


# implementation name -> fn(q, kv, idx, indptr, sm_scale, *, return_lse) -> (out bf16, lse f32 or
# None); None is the choice of implementation=None: the FlyDSL kernel on gfx950 (ROCm), the
# Mosaic GPU kernel on Hopper GPUs, Pallas on later ones (_platform.hopper_choice), "xla"
# elsewhere. Every gradient is the "xla" path's.
_IMPLEMENTATIONS = {
    "xla": _XLA,
    **{
        name: with_exact_gradient(fn, _XLA)
        for name, fn in {
            "gfx950_emulation": _lse_if(_gfx950_emulation),
            "pallas": _lse_if(sparse_mla_pallas),
            "mosaic": _lse_if(sparse_mla_mosaic_cuda),
            "flydsl": sparse_mla_flydsl,
            None: by_platform(
                default=_XLA,
                cuda=hopper_or(
                    _lse_if(sparse_mla_kernel), _XLA, mosaic_fn=_lse_if(sparse_mla_mosaic)
                ),
                rocm=gfx950_or(
                    sparse_mla_flydsl, _XLA, sparse_mla_unsupported, sparse_mla_configurations
                ),
            ),
        }.items()
    },
}


def sparse_mla(
    q: jax.Array,
    kv: jax.Array,
    idx: jax.Array,
    indptr: jax.Array | None = None,
    *,
    topk_length: jax.Array | None = None,
    sm_scale=None,
    return_lse: bool = False,
    implementation: str | None = None,
    validate: bool = False,
):
    """Sparse MLA: each query row attends to its own list of fp8_ds_mla records.

    ``out[r, h] = softmax_k(sm_scale * q[r, h]·K_k) @ V_k`` over the rows
    ``idx[indptr[r]:indptr[r+1]]`` of ``kv`` (or, with ``indptr=None``, the row ``idx[r]`` of
    the indexer's ``[n_q, topk]`` layout), with K = latent ‖ rope (576) and V = latent (512).
    Entries < 0 or >= the number of kv rows are masked (never read); a row with no unmasked key
    gives out 0 and lse -inf. A row with ``indptr[r+1] < indptr[r]`` is empty. Every argument
    may be a jax or a numpy array; zero-size inputs (0 rows, heads, entries or records) give
    the empty or no-key result. Differentiable w.r.t. ``q`` and a traced ``sm_scale`` with
    every implementation (the gradient is always the exact "xla" path's; jit and vmap work).

    Args:
      q: [n_q, H, 576] bfloat16.
      kv: [..., 656] uint8 fp8_ds_mla records, any leading shape (read as rows).
      idx: [nnz] int32 record indices, CSR values; or [n_q, topk] int32 (the indexer's top-k
        per query, -1 padding) with ``indptr=None``.
      indptr: [n_q + 1] int32 CSR row pointers, each clipped to [0, nnz]: no value changes the
        cost (it follows nnz) or drops a valid key. None for 2-D ``idx``.
      topk_length: optional [n_q] int32 with 2-D ``idx`` (as FlashMLA's): row r uses its
        first ``clip(topk_length[r], 0, topk)`` entries.
      sm_scale: softmax scale (float or 0-d array); default 576 ** -0.5 (1 / sqrt(head dim)).
        DeepSeek-V3.2 must pass its own: ``192 ** -0.5 * mscale ** 2`` (192 = the q/k head dim
        before absorption, 128 nope + 64 rope; YaRN ``mscale = 0.1 * mscale_all_dim *
        ln(factor) + 1``, with the config's rope_scaling factor 40 and mscale_all_dim 1:
        ``192 ** -0.5 * 1.3689 ** 2 ≈ 0.1352``).
      return_lse: also return the natural-log LSE of the scaled scores.
      implementation: None (the FlyDSL kernel on gfx950 ROCm GPUs; the Mosaic GPU kernel on
        Hopper GPUs, the Pallas one on later NVIDIA GPUs (``_platform.hopper_choice``); "xla"
        elsewhere), "xla" (exact, every platform), "mosaic" (the Mosaic GPU
        kernel: CUDA Hopper only, no interpret mode), "pallas" (the Pallas Triton kernel:
        compiled on CUDA, Pallas interpret mode elsewhere), "flydsl" (the gfx950 kernel, an XLA
        FFI custom call on ROCm; needs a static sm_scale), "gfx950_emulation" (the gfx950
        kernel's own arithmetic in jnp, every platform).
      validate: check the data-dependent preconditions (see ``validate_sparse_mla``); raises
        ValueError on concrete inputs; under ``jax.jit`` a failure stops the call with a
        ``jax.errors.JaxRuntimeError`` carrying the same message, or inside ``checked`` raises
        the ValueError itself.
    Returns:
      out [n_q, H, 512] bfloat16, and with ``return_lse`` also lse [n_q, H] float32.
    """
    op = "sparse_mla"
    _check_static(op, q, kv, idx, indptr, topk_length)
    impl = resolve_implementation(op, implementation, _IMPLEMENTATIONS)
    scale = check_scalar(op, "sm_scale", DEFAULT_SM_SCALE if sm_scale is None else sm_scale)
    idx = _masked_topk(idx, topk_length) if indptr is None else as_jax(idx)[0]
    if validate:  # on the layout given, so that a message names the caller's position
        idx = run_data_checks(_data_checks(*as_jax(kv, idx), indptr), idx)
    if indptr is None:
        idx, indptr = _topk_as_csr(idx)
    q, kv, indptr = as_jax(q, kv, indptr)
    if q.size == 0 or kv.size == 0 or idx.size == 0:  # no key anywhere: no kernel launch
        out, lse = no_keys(q.shape[0], q.shape[1])
    else:
        out, lse = impl(q, kv, idx, indptr, sm_scale=scale, return_lse=return_lse)
    return (out, lse) if return_lse else out


def _check_static(op: str, q, kv, idx, indptr, topk_length) -> None:
    """The shapes and dtypes of ``sparse_mla``'s arguments: 1-D idx with indptr (CSR), or 2-D
    idx with ``indptr=None`` (and an optional topk_length)."""
    check_array(op, "q", q, dtypes=[jnp.bfloat16], ndim=3, last_dims=(KV_DIM,))
    check_array(op, "kv", kv, dtypes=[jnp.uint8], min_ndim=1, last_dims=(RECORD_BYTES,))
    n_q = q.shape[0]
    if indptr is None:
        check_array(op, "idx", idx, dtypes=[jnp.int32], shape=(n_q, None))
        if topk_length is not None:
            check_array(op, "topk_length", topk_length, dtypes=[jnp.int32], shape=(n_q,))
        return
    if topk_length is not None:
        raise ValueError(f"{op}: topk_length goes with 2-D idx and indptr=None, not CSR")
    check_array(op, "idx", idx, dtypes=[jnp.int32], ndim=1)
    check_array(op, "indptr", indptr, dtypes=[jnp.int32], shape=(n_q + 1,))


def validate_sparse_mla(q, kv, idx, indptr=None, *, topk_length=None) -> None:
    """Checks ``sparse_mla``'s arguments (the same ones: CSR ``idx`` and ``indptr``, or 2-D
    ``idx`` with an optional ``topk_length``), static and data-dependent; raises on the first
    problem.

    Data checks (computed where the data lives; only their findings reach the host):
    ``indptr`` starts >= 0, never decreases and ends at ``len(idx)``; every entry of ``idx`` is
    -1 (padding) or in [0, kv rows): any other value is flagged although ``sparse_mla`` masks
    it, at every position of ``idx`` (also positions no row's range covers; with 2-D ``idx``
    named as ``idx[row, j]``, entries past ``topk_length`` excepted); every kv row an in-range
    entry references has scales that are powers of two and <= 2^7 (the gfx950 kernel's
    precondition), named by its kv row. Raises ValueError.
    """
    op = "validate_sparse_mla"
    _check_static(op, q, kv, idx, indptr, topk_length)
    idx = _masked_topk(idx, topk_length) if indptr is None else idx
    run_data_checks(_data_checks(*as_jax(kv, idx), None if indptr is None else as_jax(indptr)[0]))


def _data_checks(kv: jax.Array, idx: jax.Array, indptr: jax.Array | None) -> list[DataCheck]:
    """The data checks of ``idx`` (CSR [nnz] with ``indptr``, or [n_q, topk] with None)."""
    op = "sparse_mla"
    records = kv.reshape(-1, RECORD_BYTES)
    rows = records.shape[0]
    ok = (idx >= 0) & (idx < rows)
    hit = jnp.where(ok, idx, rows).reshape(-1)
    referenced = jnp.zeros((rows,), bool).at[hit].set(True, mode="drop")
    csr = [] if indptr is None else csr_check(op, "idx", "indptr", idx.shape[0], indptr)
    return [
        *csr,
        range_check(op, "idx", idx, rows, f"kv has {rows} rows; -1 marks padding", allow=-1),
        *_scale_checks(op, "kv row", records, referenced, "in the rows idx references"),
    ]


def validate_fp8_ds_mla_records(records) -> None:
    """Raises ValueError unless every scale of ``records`` ([..., 656] uint8) is a power of two
    and <= 2^7 (the gfx950 sparse_mla kernel's precondition; the writer guarantees it for
    |latent| <= 57344). The message names the record by its index in ``records``' leading
    shape."""
    op = "validate_fp8_ds_mla_records"
    check_array(op, "records", records, dtypes=[jnp.uint8], min_ndim=1, last_dims=(RECORD_BYTES,))
    records = jnp.asarray(records)
    everything = jnp.ones(records.shape[:-1], bool)
    run_data_checks(_scale_checks(op, "records", records, everything, "in records"))


def _scale_checks(op: str, name: str, records, referenced, among: str) -> list[DataCheck]:
    """The scales of the records (``[..., 656]``) where ``referenced`` ([...] bool): each a
    positive power of two, and <= 2^7. Messages name the record by its index."""
    lead = records.shape[:-1]
    raw = records[..., SCALES_OFFSET : SCALES_OFFSET + 16].reshape(*lead, 4, 4)
    bits = jax.lax.bitcast_convert_type(raw, jnp.int32)  # [..., 4] float32 bits
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    normal = (exponent >= 1) & (exponent <= 254) & (mantissa == 0)
    subnormal = (exponent == 0) & (mantissa != 0) & ((mantissa & (mantissa - 1)) == 0)
    pow2 = (bits >= 0) & (normal | subnormal)
    used = referenced[..., None]
    limit = int(np.float32(MAX_KERNEL_SCALE).view(np.int32))

    def check(bad, problem: str) -> DataCheck:
        count, first = first_true(used & bad)
        *row, j = jnp.unravel_index(first, bits.shape) if bits.size else (first,) * bits.ndim
        value_bits = bits.reshape(-1)[first] if bits.size else jnp.int32(0)
        value = jax.lax.bitcast_convert_type(value_bits, jnp.float32)
        where = ", ".join(["{}"] * len(row))
        where = where if len(row) == 1 else f"({where})"
        message = (
            f"{op}: {name} {where} scale {{}} (latent dims {{}}..{{}}) is {{}}{problem} "
            f"({{}} such scale(s) {among})"
        )
        return DataCheck(count > 0, message, (*row, j, 128 * j, 128 * j + 127, value, count))

    return [
        check(~pow2, ", not a positive power of two; fp8_ds_mla scales are 2^k"),
        check(
            pow2 & (bits > limit),
            " > 2^7: the gfx950 kernel clamps it (finite but inexact); the writer keeps scales "
            "<= 2^7 for |latent| <= 57344",
        ),
    ]


def dense_to_csr(
    topk_idx: jax.Array, topk_length: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The [n_q, topk] index layout with -1 padding as CSR.

    Every row keeps its ``topk`` entries (the -1 padding stays and is masked by ``sparse_mla``;
    so do the entries past ``topk_length``), so the result has static shape and works under
    ``jax.jit``.

    Args:
      topk_idx: [n_q, topk] int32, -1 for padding.
      topk_length: optional [n_q] int32: row r keeps its first ``topk_length[r]`` entries.
    Returns:
      idx [n_q * topk] int32 and indptr [n_q + 1] int32 (``indptr[r] = r * topk``).
    """
    op = "dense_to_csr"
    check_array(op, "topk_idx", topk_idx, dtypes=[jnp.int32], ndim=2)
    if topk_length is not None:
        check_array(op, "topk_length", topk_length, dtypes=[jnp.int32], shape=(topk_idx.shape[0],))
    return _topk_as_csr(_masked_topk(topk_idx, topk_length))


def _masked_topk(topk_idx, topk_length) -> jax.Array:
    """[n_q, topk] int32 with -1 past each row's ``topk_length`` (None: every entry kept)."""
    (topk_idx,) = as_jax(topk_idx)
    if topk_length is None:
        return topk_idx
    keep = jnp.arange(topk_idx.shape[1], dtype=jnp.int32) < as_jax(topk_length)[0][:, None]
    return jnp.where(keep, topk_idx, -1)


def _topk_as_csr(topk_idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[n_q, topk] -> (idx [n_q * topk], indptr [n_q + 1] = r * topk)."""
    n_q, topk = topk_idx.shape
    return topk_idx.reshape(-1), jnp.arange(n_q + 1, dtype=jnp.int32) * topk
