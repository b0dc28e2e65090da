"""The implementations the shared op suites run against on this machine.

Every op suite is parametrized over ``available()``: the exact "xla" path, the gfx950
emulation, "pallas" (compiled on a CUDA GPU, Pallas interpret mode elsewhere) and, on an MI355
(gfx950) only, the "flydsl" kernels.
"""

from __future__ import annotations

import functools

import jax

from jax_sparse_mla.ffi import is_gfx950


@functools.cache
def has_gfx950() -> bool:
    try:
        return any(is_gfx950(d) for d in jax.devices("rocm"))
    except RuntimeError:
        return False


@functools.cache
def available() -> tuple[str, ...]:
    """The implementation names that run on this machine, "xla" first."""
    names = ("xla", "gfx950_emulation", "pallas")
    return (*names, "flydsl") if has_gfx950() else names
