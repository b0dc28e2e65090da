"""Varying manual axes: what ``jax.shard_map`` (default ``check_vma=True``) needs of the ops.

Inside ``shard_map`` every value carries the set of mesh axes it varies over (an input sharded
over ``"x"`` varies over ``"x"``; a constant varies over none). A loop carry must keep its type
across iterations, so a carry initialised from constants must start as varying as what the loop
body mixes into it (``fori_loop``, ``vary_like``); a Pallas ``out_shape`` must state it
(``out_struct``); a custom VJP's cotangent must vary like its primal (``sum_like``).
Outside ``shard_map`` every set is empty and all of these are no-ops.

jax 0.10.2 and 0.11 spell it the same way (``jax.typeof(x).manual_axis_type.varying``,
``ShapeDtypeStruct(..., manual_axis_type=)``, ``jax.lax.pcast(..., to="varying")``); the
spelling lives only here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import ManualAxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def varying_axes(*xs) -> frozenset[str]:
    """The mesh axes any leaf of ``xs`` (arrays, tracers, Python or NumPy scalars) varies over."""

    def axes(x):
        mat = x.manual_axis_type if isinstance(x, jax.ShapeDtypeStruct) else None
        mat = (
            jax.typeof(x).manual_axis_type
            if mat is None and not isinstance(x, jax.ShapeDtypeStruct)
            else mat
        )
        return frozenset() if mat is None else mat.varying

    return frozenset().union(*(axes(x) for x in jax.tree.leaves(xs)))


def vary_like(tree, *like):
    """``tree`` with every leaf cast to vary over (at least) the axes ``like`` varies over."""
    axes = varying_axes(*like)

    def cast(x):
        missing = axes - varying_axes(x)
        return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree.map(cast, tree)


def sum_like(ct, primal):
    """The cotangent ``ct`` of ``primal`` summed over the mesh axes it varies over and
    ``primal`` does not: a value every device of an axis uses alike gets the sum of their
    cotangents (what the transpose of ``pcast`` to varying does)."""
    extra = varying_axes(ct) - varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


def fori_loop(lower, upper, body, init):
    """``jax.lax.fori_loop`` whose carry starts as varying as ``body`` makes it (whatever the
    body reads: closed-over arrays included), with an int32 loop index (also under x64)."""
    init = vary_like(init, jax.eval_shape(body, jnp.int32(0), init))
    # with concrete bounds jax runs a scan whose counter is a Python int: int64 under x64
    return jax.lax.fori_loop(lower, upper, lambda t, c: body(t.astype(jnp.int32), c), init)


def out_struct(shape, dtype, *like) -> jax.ShapeDtypeStruct:
    """``ShapeDtypeStruct(shape, dtype)`` of a kernel output computed from ``like``: it varies
    over the mesh axes ``like`` varies over."""
    mat = ManualAxisType(varying=varying_axes(*like))
    return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=mat)


def replicated(x):
    """``x`` (a jax array or tracer) with no dimension split over an Explicit mesh axis.

    On a mesh of Explicit axes (``jax.make_mesh``'s default) an array's type carries its
    sharding, and gathers or reshapes over a split dimension need an output sharding stated;
    the ops' index arithmetic states none, so an input split that way is first gathered onto
    every device (what XLA does for a kernel it cannot partition on an Auto mesh; the
    ``*_sharded`` wrappers keep the data in place instead). Auto and Manual axes never appear
    in the type: such arrays are returned as they are."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is None or all(s is None for s in sharding.spec):
        return x
    mesh = sharding.mesh if isinstance(x, jax.core.Tracer) else x.sharding.mesh
    return jax.sharding.reshard(x, NamedSharding(mesh, P()))


def split_only_over(x, dims: tuple[int, ...]):
    """``x`` and its Explicit sharding (for an ``out_sharding=``), where Explicit mesh axes split
    at most the dimensions ``dims``; else ``x`` gathered (``replicated``) and None. Arrays that
    no Explicit axis splits come back as they are, with None (XLA propagates the rest)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is None or all(s is None for s in sharding.spec):
        return x, None
    if all(s is None for d, s in enumerate(sharding.spec) if d not in dims):
        return x, sharding
    return replicated(x), None
