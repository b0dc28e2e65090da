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
from jax.sharding import ManualAxisType


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
    body reads: closed-over arrays included)."""
    init = vary_like(init, jax.eval_shape(body, jnp.int32(0), init))
    return jax.lax.fori_loop(lower, upper, body, init)


def out_struct(shape, dtype, *like) -> jax.ShapeDtypeStruct:
    """``ShapeDtypeStruct(shape, dtype)`` of a kernel output computed from ``like``: it varies
    over the mesh axes ``like`` varies over."""
    mat = ManualAxisType(varying=varying_axes(*like))
    return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=mat)
