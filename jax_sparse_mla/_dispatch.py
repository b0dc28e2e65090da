"""Choosing an implementation: ``implementation=None`` picks the best one available.

Each op module keeps a table ``name -> function`` of the implementations it has; this module
knows the names and why a missing one is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

IMPLEMENTATIONS = ("xla", "gfx950_emulation", "pallas", "flydsl")

# Implementations that are part of the API but not built yet, and what is missing.
_MISSING = {
    "pallas": "the Pallas kernel for NVIDIA GPUs is not written yet",
    "flydsl": "the XLA FFI custom call that runs the FlyDSL gfx950 kernel is not written yet",
}

F = TypeVar("F")


def resolve_implementation(op: str, implementation: str | None, table: Mapping[str, F]) -> F:
    """Returns the function of ``table`` that runs ``op`` for ``implementation``.

    ``None`` resolves to ``"xla"`` (the exact jax-native implementation, every platform).
    An unknown name raises ValueError; a known implementation that ``op`` does not have yet
    raises NotImplementedError naming the missing piece.
    """
    name = "xla" if implementation is None else implementation
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if name not in table:
        why = _MISSING.get(name, f"{op} has no {name!r} implementation")
        raise NotImplementedError(
            f"{op}: implementation={name!r} is unavailable: {why}. "
            "Use implementation='xla' (or None)."
        )
    return table[name]
