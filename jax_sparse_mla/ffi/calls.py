"""``implementation="flydsl"``: the custom calls of the gfx950 kernels, one function per op.

Each function emits ``jax.ffi.ffi_call`` to a target of ``jax_sparse_mla.ffi.TARGETS``. The
handlers (``csrc/handlers.cc``) check the buffers again and pick the compiled configuration.
Scalars the kernels take as launch arguments (sm_scale, k_scale, v_scale) must be static: a
traced scale is unsupported (``implementation=None`` then runs "xla").

Each ``*_unsupported(...)`` returns why the kernels cannot serve a call (or None); the function
itself raises NotImplementedError with that reason. Each ``*_configurations(...)`` (same
arguments) names the compiled kernel configurations the call launches: what the self-check must
have verified before ``implementation=None`` runs it. Under ``jax.vmap`` a call runs once per
batch element (``vmap_method="sequential"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import _platform, ffi
from jax_sparse_mla._unavailable import unavailable
from jax_sparse_mla._vma import vary_like
from jax_sparse_mla.formats import LATENT_DIM, RECORD_BYTES, UQ_HEAD_DIM
from jax_sparse_mla.kernels.gfx950 import configs
from jax_sparse_mla.kernels.gfx950.configs import MLA_DECODE_QLENS as KERNEL_QLENS
from jax_sparse_mla.kernels.gfx950.configs import ULTRAQUANT_BLOCK_SIZES as KERNEL_BLOCK_SIZES
from jax_sparse_mla.kernels.gfx950.configs import ULTRAQUANT_GROUP_SIZES as KERNEL_GROUP_SIZES
from jax_sparse_mla.kernels.gfx950.configs import kernel_group_size
from jax_sparse_mla.kernels.gfx950_model import (
    MI355X_CUS,
    mla_decode_splits,
    sparse_mla_splits,
    ultraquant_partitions,
)


def device_cus() -> int:
    """The CUs of this process's first ROCm device (jax's ``core_count``), else the MI355X's
    (assumed when lowering for ROCm on a host without the GPU)."""
    devices = _platform.rocm_devices()
    return int(getattr(devices[0], "core_count", 0) or MI355X_CUS) if devices else MI355X_CUS


NEEDS_ROCM = (
    "jax_sparse_mla: implementation='flydsl' runs the gfx950 (AMD MI355) kernels, XLA FFI "
    "custom calls, on ROCm only, and this lowering is for another platform: use 'xla' or "
    "'gfx950_emulation' here (None chooses per platform), or lower for ROCm. On an MI355 the "
    f"kernels come with JAX_SPARSE_MLA_KERNELS=gfx950 pip install, or {ffi.BUILD_COMMAND} "
    "(BUILD.md)"
)


def _call(target: str, results, *args, **attrs):
    if _platform.rocm_devices():
        if ffi.rocm_library() is None:
            raise RuntimeError(
                "jax_sparse_mla: implementation='flydsl' needs the FFI library, which this "
                "install does not have (JAX_SPARSE_MLA_KERNELS=gfx950 pip install ..., or the "
                "gfx950 wheel, see BUILD.md)"
            )
        if ffi.missing_kernels([target]):
            raise RuntimeError(
                f"jax_sparse_mla: implementation='flydsl': the FFI library has no {target} "
                f"kernel ({len(ffi.library_kernels())} kernels linked); build the kernels and "
                f"relink: {ffi.BUILD_COMMAND}"
            )
    # jax.shard_map: the arguments must vary alike; the results vary as they do
    args = vary_like(args, *args)

    def call(*xs):
        return vary_like(
            jax.ffi.ffi_call(target, results, vmap_method="sequential")(*xs, **attrs), *xs
        )

    def elsewhere(*xs):  # a platform without the handlers: fails when lowered
        return vary_like(unavailable(NEEDS_ROCM, list(results), *xs), *xs)

    # ROCm, and any platform the handlers were registered for (the recording-HIP tests: CPU)
    platforms = {"rocm", *ffi.registered_platforms()}
    branches = {p: call for p in platforms}
    return jax.lax.platform_dependent(*args, default=elsewhere, **branches)


def _static(x) -> float | None:
    """The value of a scale as a Python float, or None when it is traced."""
    if isinstance(x, jax.core.Tracer):
        return None
    return float(np.asarray(x))


def _nonstatic(names_values) -> str | None:
    traced = [n for n, v in names_values if _static(v) is None]
    if traced:
        return f"{', '.join(traced)} must be static (a Python float), not traced"
    return None


def _require(why: str | None, op: str) -> None:
    if why is not None:
        raise NotImplementedError(f"{op}: implementation='flydsl' cannot run this call: {why}")


# ---------------------------------------------------------------------------------------------
# sparse_mla
# ---------------------------------------------------------------------------------------------


def sparse_mla_unsupported(q, kv, idx, indptr, sm_scale, *, return_lse=False) -> str | None:
    return _nonstatic([("sm_scale", sm_scale)])


def sparse_mla_configurations(q, kv, idx, indptr, sm_scale, *, return_lse=False):
    return configs.sparse_mla_launches(q.shape[1], return_lse, default_sparse_splits(q, idx))


def default_sparse_splits(q, idx) -> int:
    """Key splits per row that fill the GPU's CUs (``device_cus``): one workgroup per (row,
    split, group of 16 heads), at most one split per 64 entries of the mean row
    (``sparse_mla_splits``; static: from the shapes of q and idx)."""
    return sparse_mla_splits(q.shape[0], q.shape[1], idx.shape[0], device_cus())


def sparse_mla_flydsl(q, kv, idx, indptr, sm_scale, *, return_lse: bool):
    """q [n_q, H, 576] bf16, kv [..., 656] u8, idx [nnz] / indptr [n_q + 1] int32 ->
    (out [n_q, H, 512] bf16, lse [n_q, H] f32 or None). Any H (groups of <= 16 heads). With
    S = ``default_sparse_splits`` > 1 the kernel writes bf16 partials [n_q, S, H, 512] and
    their LSEs, merged by the combine kernel; S = 1 writes the output itself."""
    _require(sparse_mla_unsupported(q, kv, idx, indptr, sm_scale), "sparse_mla")
    n_q, heads, _ = q.shape
    splits = default_sparse_splits(q, idx)
    results = [jax.ShapeDtypeStruct((n_q, splits, heads, LATENT_DIM), jnp.bfloat16)]
    if return_lse or splits > 1:
        results.append(jax.ShapeDtypeStruct((n_q, splits, heads), jnp.float32))
    records = kv.reshape(-1, RECORD_BYTES)
    res = _call(
        "jsm_sparse_mla", results, q, records, idx, indptr, sm_scale=np.float32(_static(sm_scale))
    )
    if splits > 1:
        out, lse = merge_attn_states_flydsl(*res)
    else:
        out, lse = res[0][:, 0], (res[1][:, 0] if return_lse else None)
    return out, (lse if return_lse else None)


# ---------------------------------------------------------------------------------------------
# mla_decode
# ---------------------------------------------------------------------------------------------


def mla_decode_unsupported(q, kv, kv_indices, kv_indptr, *, qlen, k_scale, v_scale, sm_scale, **_):
    if qlen not in KERNEL_QLENS:
        return f"qlen must be one of {KERNEL_QLENS}, got {qlen}"
    return _nonstatic([("k_scale", k_scale), ("v_scale", v_scale), ("sm_scale", sm_scale)])


def partials_rows(q, kv_indices, kv_indptr, qlen: int) -> int:
    """Query rows per partials CTA (``configs.mla_decode_rows`` on this device's CUs)."""
    batch = kv_indptr.shape[0] - 1
    return configs.mla_decode_rows(qlen, q.shape[1], batch, kv_indices.shape[0], device_cus())


def mla_decode_partials_configurations(q, kv, kv_indices, kv_indptr, *, qlen, **_):
    return (
        configs.mla_decode_partials_launch(qlen, partials_rows(q, kv_indices, kv_indptr, qlen)),
    )


def mla_decode_configurations(q, kv, kv_indices, kv_indptr, *, qlen, num_splits=None, **_):
    rows = partials_rows(q, kv_indices, kv_indptr, qlen)
    partials = configs.mla_decode_partials_launch(qlen, rows)
    if (num_splits or default_num_splits(q, kv_indices, kv_indptr, qlen)) == 1:
        return (partials,)  # one split writes the output itself
    return (partials, configs.MLA_DECODE_COMBINE)


def merge_configurations(o_parts, lse_parts):
    return (configs.MLA_DECODE_COMBINE,)


def default_num_splits(q, kv_indices, kv_indptr, qlen: int) -> int:
    """Splits that fill the GPU's CUs (``device_cus``): one CTA per (head group, split,
    request), a head group 16 query rows or, for the 128-row kernel (``partials_rows``), 128
    heads; at most one split per 128 keys of the mean request (``mla_decode_splits``)."""
    batch = kv_indptr.shape[0] - 1
    return mla_decode_splits(batch, q.shape[1], qlen, kv_indices.shape[0], device_cus())


def mla_decode_partials_flydsl(
    q, kv, kv_indices, kv_indptr, *, qlen, k_scale, v_scale, sm_scale, num_splits
):
    """kv: [tokens, 576] uint8 e4m3fn codes -> (o_parts [B*qlen, S, H, 512] bf16,
    lse_parts [B*qlen, S, H] f32). ``kv_indptr`` is clipped to [0, len(kv_indices)] here (the
    kernel reads the slice as given), so its cost and causal bounds follow len(kv_indices)."""
    _require(
        mla_decode_unsupported(
            q,
            kv,
            kv_indices,
            kv_indptr,
            qlen=qlen,
            k_scale=k_scale,
            v_scale=v_scale,
            sm_scale=sm_scale,
        ),
        "mla_decode",
    )
    rows, heads, _ = q.shape
    results = [
        jax.ShapeDtypeStruct((rows, num_splits, heads, LATENT_DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows, num_splits, heads), jnp.float32),
    ]
    scales = {"k_scale": k_scale, "v_scale": v_scale, "sm_scale": sm_scale}
    return tuple(
        _call(
            "jsm_mla_decode_partials",
            results,
            q,
            kv,
            kv_indices,
            jnp.clip(kv_indptr, 0, kv_indices.shape[0]),
            qlen=np.int32(qlen),
            cta_rows=np.int32(partials_rows(q, kv_indices, kv_indptr, qlen)),
            **{name: np.float32(_static(value)) for name, value in scales.items()},
        )
    )


def merge_unsupported(o_parts, lse_parts) -> str | None:
    if o_parts.dtype != jnp.bfloat16 or o_parts.shape[-1] != LATENT_DIM:
        return (
            f"the combine kernel takes bf16 [n, S, H, 512] partials, got {o_parts.dtype.name} "
            f"{list(o_parts.shape)}"
        )
    return None


def merge_attn_states_flydsl(o_parts, lse_parts):
    """o_parts [n, S, H, 512] bf16, lse_parts [n, S, H] f32 -> (out [n, H, 512] bf16, lse)."""
    _require(merge_unsupported(o_parts, lse_parts), "merge_attn_states")
    n, _, heads, dim = o_parts.shape
    results = [
        jax.ShapeDtypeStruct((n, heads, dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, heads), jnp.float32),
    ]
    return tuple(_call("jsm_mla_decode_combine", results, o_parts, lse_parts))


def mla_decode_flydsl(q, kv, kv_indices, kv_indptr, *, qlen, num_splits, **scales):
    """Partials (num_splits None: ``default_num_splits``) then the combine kernel; one split's
    partial is the output itself (the combine of one partial returns its o and lse exactly:
    weight ``exp2(0) = 1``, ``log2(1) = 0``), so it is not launched."""
    splits = num_splits or default_num_splits(q, kv_indices, kv_indptr, qlen)
    o_parts, lse_parts = mla_decode_partials_flydsl(
        q, kv, kv_indices, kv_indptr, qlen=qlen, num_splits=splits, **scales
    )
    if splits == 1:
        return o_parts[:, 0], lse_parts[:, 0]
    return merge_attn_states_flydsl(o_parts, lse_parts)


# ---------------------------------------------------------------------------------------------
# ultraquant_decode
# ---------------------------------------------------------------------------------------------


def ultraquant_unsupported(q, cache, block_tables, seq_lens, *, sm_scale, **_) -> str | None:
    g = q.shape[1] // cache.shape[2]
    if kernel_group_size(g) is None:
        return f"query heads per KV head must be <= {KERNEL_GROUP_SIZES[-1]}, got {g}"
    if cache.shape[1] not in KERNEL_BLOCK_SIZES:
        return f"block_size must be one of {KERNEL_BLOCK_SIZES}, got {cache.shape[1]}"
    return _nonstatic([("sm_scale", sm_scale)])


def ultraquant_configurations(q, cache, block_tables, seq_lens, **_):
    return configs.ultraquant_launches(q.shape[1] // cache.shape[2], cache.shape[1])


def default_num_partitions(batch: int, kv_heads: int, max_tokens: int) -> int:
    """Partitions that fill the GPU (12 one-wave groups per CU), at most one per 128 tokens
    (``ultraquant_partitions``)."""
    return ultraquant_partitions(batch, kv_heads, max_tokens, device_cus())


def ultraquant_decode_flydsl(q, cache, block_tables, seq_lens, *, sm_scale, num_partitions):
    """q [B, Hq, 256] bf16 -> [B, Hq, 256] bf16: the decode kernel's per-partition partials,
    then the reduce kernel. G not compiled (e.g. 3) runs as the next compiled G with zero
    query rows that are dropped."""
    _require(
        ultraquant_unsupported(q, cache, block_tables, seq_lens, sm_scale=sm_scale),
        "ultraquant_decode",
    )
    batch, hq, _ = q.shape
    hk = cache.shape[2]
    g = hq // hk
    kg = kernel_group_size(g)
    if kg != g:
        q = jnp.pad(q.reshape(batch, hk, g, UQ_HEAD_DIM), ((0, 0), (0, 0), (0, kg - g), (0, 0)))
        q = q.reshape(batch, hk * kg, UQ_HEAD_DIM)
    parts = num_partitions or default_num_partitions(
        batch, hk, block_tables.shape[1] * cache.shape[1]
    )
    partials = ultraquant_partials_flydsl(
        q, cache, block_tables, seq_lens, sm_scale=sm_scale, num_partitions=parts
    )
    out = ultraquant_reduce_flydsl(*partials)
    if kg != g:
        out = out.reshape(batch, hk, kg, UQ_HEAD_DIM)[:, :, :g].reshape(batch, hq, UQ_HEAD_DIM)
    return out


def ultraquant_partials_flydsl(q, cache, block_tables, seq_lens, *, sm_scale, num_partitions):
    """The decode kernel alone: q [B, Hk * G, 256] bf16 (G compiled) -> out_parts
    [B, Hk, P, G, 256] bf16, max_logits and exp_sums [B, Hk, P, G] f32."""
    batch, hq, _ = q.shape
    hk = cache.shape[2]
    shape = (batch, hk, num_partitions, hq // hk)
    return _call(
        "jsm_ultraquant_partials",
        [
            jax.ShapeDtypeStruct((*shape, UQ_HEAD_DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct(shape, jnp.float32),
            jax.ShapeDtypeStruct(shape, jnp.float32),
        ],
        q,
        cache,
        block_tables,
        seq_lens,
        sm_scale=np.float32(_static(sm_scale)),
    )


def ultraquant_reduce_flydsl(out_parts, max_logits, exp_sums):
    """The reduce kernel alone: [B, Hk, P, G, 256] bf16 partials, [B, Hk, P, G] f32 max logits
    and exp sums -> [B, Hk * G, 256] bf16."""
    batch, hk, _, g, _ = out_parts.shape
    result = [jax.ShapeDtypeStruct((batch, hk * g, UQ_HEAD_DIM), jnp.bfloat16)]
    return _call("jsm_ultraquant_reduce", result, out_parts, max_logits, exp_sums)[0]


# ---------------------------------------------------------------------------------------------
# Diagnostics: one scaled MFMA 16x16x128, one transposing LDS read (kernels/gfx950/probe.py)
# ---------------------------------------------------------------------------------------------


def mfma_probe(a, b, scales, *, a_format: int):
    """One ``v_mfma_scale_f32_16x16x128_f8f6f4`` on per-lane registers, for layout tests.

    a, b: [64, 32] uint8 (lane l's A / B operand bytes; A e4m3 with ``a_format`` 0, e2m1 in
    bytes 0-15 with 4); scales: [64, 2] int32 (lane l's E8M0 scale_a, scale_b) ->
    [64, 4] float32 (lane l's accumulator).
    """
    result = [jax.ShapeDtypeStruct((64, 4), jnp.float32)]
    return _call("jsm_mfma_probe", result, a, b, scales, a_format=np.int32(a_format))[0]


def ds_read_tr_probe(lds, addrs, *, bits: int):
    """One ``ds_read_b64_tr_b8`` (``bits`` 8) or ``ds_read_b64_tr_b16`` (16), for lane-map tests.

    lds: [1024] uint8 (the LDS contents); addrs: [64] int32 (lane l's read address, taken
    modulo 1024 and rounded down to a multiple of 8) -> [64, 2] uint32 (lane l's result
    registers, register 0 = result bytes 0-3).
    """
    result = [jax.ShapeDtypeStruct((64, 2), jnp.uint32)]
    return _call("jsm_ds_read_tr_probe", result, lds, addrs, bits=np.int32(bits))[0]
