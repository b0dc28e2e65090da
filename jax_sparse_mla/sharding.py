"""The ops over a device mesh: heads (TP), query rows / requests (DP), KV context (DCP).

Each ``*_sharded`` function runs its op in a ``jax.shard_map`` over ``mesh``: every device
calls the op (any implementation, including the gfx950 FFI kernels, which XLA cannot partition
itself) on its own shard, and nothing but the DCP partials crosses devices. The arguments are
global arrays (jax or numpy, any placement, on a mesh of Explicit or Auto axes); each is put
on ``mesh`` with the spec below named for it first (``jax.device_put``), which moves nothing
when it already has that sharding (give it with ``jax.device_put`` and a ``NamedSharding``, or
a ``jax.jit`` in/out sharding, and no byte of q or the KV cache moves) and reshards it
otherwise. ``validate=True`` checks the global arrays once, before the per-device calls, so a
message names the global position (``idx[5, 2]``) and a failure is reported once. Axis
arguments are mesh axis names (or tuples of them),
None for a dimension that is not split; every split dimension must divide by its axes' size.
docs/sharding.md says why this is an explicit wrapper and not ``custom_partitioning``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_sparse_mla._checks import _CHECKIFY, DataCheck, as_jax, is_concrete, run_data_checks
from jax_sparse_mla._dispatch import resolve_implementation
from jax_sparse_mla.mla_decode import _IMPLEMENTATIONS as _DECODE
from jax_sparse_mla.mla_decode import _check_static as _decode_static
from jax_sparse_mla.mla_decode import _data_checks as _decode_checks
from jax_sparse_mla.mla_decode import _prepare, mla_decode
from jax_sparse_mla.reference.attention import merge_weights
from jax_sparse_mla.sparse_mla import _check_static as _sparse_static
from jax_sparse_mla.sparse_mla import _data_checks as _sparse_checks
from jax_sparse_mla.sparse_mla import _masked_topk, sparse_mla
from jax_sparse_mla.ultraquant import _check_static as _uq_static
from jax_sparse_mla.ultraquant import _data_checks as _uq_checks
from jax_sparse_mla.ultraquant import ultraquant_decode

Axis = str | tuple[str, ...] | None


def _shard_map(fn, mesh, in_specs, out_specs, args, checks=()):
    """``jax.shard_map(fn)`` over ``mesh`` applied to ``args`` (a tuple), each first put on
    ``mesh`` with its spec (``in_specs``: a pytree like ``args``), whatever its placement.

    ``checks`` (the op's DataChecks, computed on the global arrays) run once, before: concrete
    ones raise here, ``checked`` makes them checkify checks. Under ``jax.jit`` their findings
    (flags and positions: scalars) enter the shard_map replicated and every device runs the
    same report before its op: a failure stops all of them alike (a report on one device would
    leave the others waiting for it in a collective). Traced by ``checked``, the shard_map runs
    over the mesh's devices with Auto axes: checkify's rule for shard_map gathers its
    per-device error flags with an indexing that Explicit axes refuse (jax 0.10.2)."""
    found = [(c.failed, c.args) for c in checks]
    if _CHECKIFY.value or is_concrete(*jax.tree.leaves(found)):
        run_data_checks(checks)
        found = []
    if _CHECKIFY.value and any(t == AxisType.Explicit for t in mesh.axis_types):
        mesh = Mesh(
            mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
        )
    placed = jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
        args,
        in_specs,
        is_leaf=lambda x: x is None,
    )

    def body(found, args):
        if found:
            leaves, tree = jax.tree.flatten(args)
            local = [DataCheck(f, c.message, a) for (f, a), c in zip(found, checks, strict=True)]
            leaves[0] = run_data_checks(local, leaves[0])
            args = jax.tree.unflatten(tree, leaves)
        return fn(*args)

    specs = (jax.tree.map(lambda _: P(), found), tuple(in_specs))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs)(found, placed)


def _local_indptr(indptr: jax.Array, rows: Axis, n_local: int) -> jax.Array:
    """This device's ``n_local + 1`` entries of a replicated CSR ``indptr`` whose rows are split
    over ``rows`` (values stay global offsets into the replicated index stream)."""
    if rows is None:
        return indptr
    start = jax.lax.axis_index(rows) * n_local
    return jax.lax.dynamic_slice(indptr, (start,), (n_local + 1,))


def sparse_mla_sharded(
    q, kv, idx, indptr=None, *, mesh, heads: Axis = None, rows: Axis = None, **options
):
    """``sparse_mla`` with q's heads split over ``heads`` and its rows over ``rows``.

    Specs: q ``P(rows, heads, None)``; kv replicated (``P()``, every device reads any record);
    idx 2-D (the indexer's ``[n_q, topk]``) ``P(rows, None)``, or CSR idx and indptr replicated
    (each device slices its rows' pointers); ``topk_length`` (an option) ``P(rows)``. Options
    are ``sparse_mla``'s. Returns what ``sparse_mla`` returns, split like q
    (out ``P(rows, heads, None)``, lse ``P(rows, heads)``).
    """
    topk_length = options.pop("topk_length", None)
    dense = indptr is None
    checks = []
    if options.pop("validate", False):  # once, on the global arrays
        _sparse_static("sparse_mla_sharded", q, kv, idx, indptr, topk_length)
        if dense:  # masked here: the checks skip entries past topk_length
            idx, topk_length = _masked_topk(idx, topk_length), None
        ptr = None if dense else as_jax(indptr)[0]
        checks = _sparse_checks(*as_jax(kv, idx), ptr)
    arrays = {"q": q, "kv": kv, "idx": idx}
    specs = {"q": P(rows, heads, None), "kv": P(), "idx": P(rows, None) if dense else P()}
    if indptr is not None:
        arrays["indptr"], specs["indptr"] = indptr, P()
    if topk_length is not None:
        arrays["topk_length"], specs["topk_length"] = topk_length, P(rows)

    def local(a):
        ptr = a.get("indptr")
        if ptr is not None:
            ptr = _local_indptr(ptr, rows, a["q"].shape[0])
        return sparse_mla(
            a["q"], a["kv"], a["idx"], ptr, topk_length=a.get("topk_length"), **options
        )

    out = P(rows, heads, None)
    out_specs = (out, P(rows, heads)) if options.get("return_lse") else out
    return _shard_map(local, mesh, (specs,), out_specs, (arrays,), checks)


def mla_decode_sharded(
    q,
    kv,
    kv_indices,
    kv_indptr,
    *,
    mesh,
    heads: Axis = None,
    requests: Axis = None,
    context: Axis = None,
    qlen: int = 1,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    num_splits: int | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    validate: bool = False,
):
    """``mla_decode`` with q's heads split over ``heads``, requests over ``requests`` and the
    KV cache's tokens over ``context`` (decode context parallelism, DCP).

    Specs: q ``P(requests, heads, None)`` (whole requests per device: rows r * qlen + i);
    kv ``P(context, None)``; kv_indices and kv_indptr replicated (global token ids, so
    positions and causal bounds stay global). With ``context`` each device attends over the
    keys its shard holds (the others are masked where they stand) in ``num_splits`` (default 1)
    float32 partials, merged by ``merge_attn_states``' rule across ``context`` in float32 (only
    [B * qlen, H] maxima and sums and one weighted [B * qlen, H, 512] sum are all-reduced): the
    exact attention over every key, rounded once to bf16. The other arguments are
    ``mla_decode``'s (``validate`` checks the global arrays once). Returns out
    ``P(requests, heads, None)`` (and lse ``P(requests, heads)``), replicated over ``context``.
    """
    op = "mla_decode_sharded"
    scales = {"k_scale": k_scale, "v_scale": v_scale, "sm_scale": sm_scale}
    impl = resolve_implementation(op, implementation, _DECODE)
    checks = []
    if validate:  # once, on the global arrays
        _decode_static(op, q, kv, kv_indices, kv_indptr, qlen)
        checks = _decode_checks(*as_jax(kv_indices, kv_indptr), kv.shape[0])

    def local(q, kv, kv_indices, kv_indptr):
        kv_indptr = _local_indptr(kv_indptr, requests, q.shape[0] // qlen)
        if context is None:
            return mla_decode(
                q,
                kv,
                kv_indices,
                kv_indptr,
                qlen=qlen,
                **scales,
                num_splits=num_splits,
                return_lse=True,
                implementation=implementation,
            )
        first = jax.lax.axis_index(context) * kv.shape[0]  # this shard's first token id
        mine = (kv_indices >= first) & (kv_indices < first + kv.shape[0])
        local_indices = jnp.where(mine, kv_indices - first, -1)
        args, kw = _prepare(op, q, kv, local_indices, kv_indptr, qlen, *scales.values(), False)
        o, lse = impl.partials(*args, **kw, num_splits=num_splits or 1)
        return _merge_over(context, o.astype(jnp.float32), lse)

    out, lse = _shard_map(
        local,
        mesh,
        (P(requests, heads, None), P(context, None), P(), P()),
        (P(requests, heads, None), P(requests, heads)),
        (q, kv, kv_indices, kv_indptr),
        checks,
    )
    return (out, lse) if return_lse else out


def _merge_over(axis: Axis, o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``merge_attn_states``' rule over this device's partials (o [rows, S, H, D] float32, lse
    [rows, S, H]) and those of the other devices of ``axis``: weights ``exp(lse - max lse)``,
    a -inf partial weighs 0 (its o ignored); reduced with pmax / psum, so only [rows, H] maxima
    and sums and the weighted [rows, H, D] sum cross devices. Returns bf16 o and f32 lse.
    The shift m is a constant to differentiation (the result does not depend on it; pmax has
    no derivative)."""
    m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(lse, axis=1)), axis)
    m_ref = jnp.where(jnp.isinf(m), 0.0, m)
    w = merge_weights(lse, m[:, None])  # [rows, S, H]
    total = jax.lax.psum(jnp.sum(w, axis=1), axis)
    weighted = jnp.where((w != 0)[..., None], w[..., None] * o, 0.0)
    acc = jax.lax.psum(jnp.sum(weighted, axis=1), axis)
    has = total != 0  # 0 only when no device saw a key; NaN propagates
    out = jnp.where(has[..., None], acc / jnp.where(has, total, 1.0)[..., None], 0.0)
    lse = jnp.where(has, m_ref + jnp.log(jnp.where(has, total, 1.0)), -jnp.inf)
    return out.astype(jnp.bfloat16), jnp.where(m == jnp.inf, m, lse)


def ultraquant_decode_sharded(
    q, cache, block_tables, seq_lens, *, mesh, heads: Axis = None, requests: Axis = None, **options
):
    """``ultraquant_decode`` with query heads and the cache's KV heads split over ``heads``
    (query head h reads KV head h // G, so a device holding KV heads [a, b) holds query heads
    [a G, b G)) and requests over ``requests``.

    Specs: q ``P(requests, heads, None)``; cache ``P(None, None, heads, None)``; block_tables
    ``P(requests, None)``; seq_lens ``P(requests)``. Options are ``ultraquant_decode``'s.
    Returns [B, Hq, 256] bf16 ``P(requests, heads, None)``.
    """
    checks = []
    if options.pop("validate", False):  # once, on the global arrays
        _uq_static("ultraquant_decode_sharded", q, cache, block_tables, seq_lens)
        tables, lens = as_jax(block_tables, seq_lens)
        checks = _uq_checks(tables, lens, cache.shape[0], cache.shape[1])
    return _shard_map(
        functools.partial(ultraquant_decode, **options),
        mesh,
        (P(requests, heads, None), P(None, None, heads, None), P(requests, None), P(requests)),
        P(requests, heads, None),
        (q, cache, block_tables, seq_lens),
        checks,
    )
