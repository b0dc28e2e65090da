"""Choosing an implementation by name, and the exact gradient of every implementation.

Each op module keeps a table ``name -> function`` of the implementations it has; this module
knows the names and why a missing one is missing. ``implementation=None`` is the table's
per-platform choice, built with ``_platform``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "gfx950_emulation", "pallas", "mosaic", "flydsl")

F = TypeVar("F")


def resolve_implementation(op: str, implementation: str | None, table: Mapping[str, F]) -> F:
    """Returns the function of ``table`` that runs ``op`` for ``implementation``.

    ``None`` resolves to ``table[None]`` where the op has one (its choice per lowering
    platform, see ``by_platform``), else to ``"xla"`` (the exact jax-native implementation).
    An unknown name raises ValueError; a known implementation that ``op`` does not have yet
    raises NotImplementedError naming the missing piece.
    """
    if implementation is None:
        return table.get(None) or table["xla"]
    name = implementation
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if name not in table:
        raise NotImplementedError(
            f"{op}: implementation={name!r} is unavailable: {op} has no {name!r} implementation. "
            "Use implementation='xla' (or None)."
        )
    return table[name]


def with_exact_gradient(fn: Callable, exact: Callable) -> Callable:
    """``fn(*arrays, **options)`` whose VJP is ``exact``'s (the "xla" implementation's).

    For implementations without a usable derivative of their own (Pallas kernels, FFI calls,
    emulated roundings): the forward pass is ``fn``, the backward pass the VJP of ``exact`` at
    the same arguments, its cotangents cast to ``exact``'s output dtypes. Options that are
    traced arrays (e.g. a traced ``sm_scale``) are differentiated too; static options (ints,
    numpy scalars) and integer / uint8 arrays get no cotangent. Works under ``jax.jit`` and
    ``jax.vmap``.
    """

    def run(*args, **options):
        traced = [k for k, v in options.items() if isinstance(v, jax.core.Tracer)]
        static = {k: v for k, v in options.items() if k not in traced}
        n = len(args)

        def bind(f):
            return lambda *xs: f(*xs[:n], **static, **dict(zip(traced, xs[n:], strict=True)))

        def forward(*xs):
            with jax.enable_x64(False):  # the kernels' own Python ints stay 32-bit under x64
                return bind(fn)(*xs)

        call = jax.custom_vjp(forward)

        def fwd(*xs):
            return forward(*xs), xs

        def bwd(xs, cts):
            # jax.vjp hands constant arguments (numpy index arrays under jax.jit) to the
            # function as numpy arrays, which the exact path cannot index with traced positions
            out, vjp = jax.vjp(lambda *ys: bind(exact)(*map(jnp.asarray, ys)), *xs)
            cts = jax.tree.map(lambda c, o: c.astype(o.dtype), cts, out)
            grads = vjp(cts)
            return tuple(
                g if jnp.issubdtype(x.dtype, jnp.inexact) else None
                for g, x in zip(grads, xs, strict=True)
            )

        call.defvjp(fwd, bwd)
        return call(*args, *(options[k] for k in traced))

    return run
