"""Choosing an implementation: ``implementation=None`` picks the best one available."""

from __future__ import annotations

IMPLEMENTATIONS = ("xla", "pallas", "flydsl")

# Implementations that are part of the API but not built yet, and what is missing.
_MISSING = {
    "pallas": "the Pallas kernel for NVIDIA GPUs is not written yet",
    "flydsl": "the FlyDSL gfx950 kernel and its XLA FFI custom call are not written yet",
}


def resolve_implementation(op: str, implementation: str | None) -> str:
    """Returns the implementation to run for ``op``.

    ``None`` resolves to ``"xla"`` (the exact jax-native implementation, every platform).
    An unknown name raises ValueError; a known kernel that does not exist yet raises
    NotImplementedError naming the missing piece.
    """
    if implementation is None:
        return "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation in _MISSING:
        raise NotImplementedError(
            f"{op}: implementation={implementation!r} is unavailable: {_MISSING[implementation]}. "
            "Use implementation='xla' (or None)."
        )
    return implementation
