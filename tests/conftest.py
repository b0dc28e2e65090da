"""Skips tests whose hardware is missing: ``gpu`` (an NVIDIA GPU) and ``gfx950`` (an MI355)."""

from __future__ import annotations

import functools

import jax
import pytest

from jax_sparse_mla.ffi import is_gfx950


@functools.cache
def _platforms() -> frozenset:
    found = set()
    for name in ("cuda", "rocm"):
        try:
            devices = jax.devices(name)
        except RuntimeError:
            continue
        found.add(name)
        if name == "rocm" and any(is_gfx950(d) for d in devices):
            found.add("gfx950")
    return frozenset(found)


def pytest_collection_modifyitems(config, items):
    skips = {
        "gpu": ("cuda", "no CUDA GPU: jax.devices() has no gpu"),
        "gfx950": ("gfx950", "no MI355 (gfx950) ROCm device"),
    }
    for item in items:
        for marker, (needs, reason) in skips.items():
            if marker in item.keywords and needs not in _platforms():
                item.add_marker(pytest.mark.skip(reason=reason))
