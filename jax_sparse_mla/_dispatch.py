"""Choosing an implementation: ``implementation=None`` picks the best one available.

Each op module keeps a table ``name -> function`` of the implementations it has; this module
knows the names and why a missing one is missing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TypeVar

import jax

IMPLEMENTATIONS = ("xla", "gfx950_emulation", "pallas", "flydsl")

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


def by_platform(default: Callable, **per_platform: Callable) -> Callable:
    """``fn(*arrays, **options)`` that runs ``per_platform[p]`` when lowered for platform ``p``
    (e.g. ``cuda=...``) and ``default`` elsewhere (``jax.lax.platform_dependent``: a lowering
    holds only its own platform's branch). Every branch must return the same shapes."""

    def run(*args, **options):
        branches = {p: functools.partial(f, **options) for p, f in per_platform.items()}
        return jax.lax.platform_dependent(
            *args, default=functools.partial(default, **options), **branches
        )

    return run
