"""Skips tests whose hardware is missing: ``gpu`` (an NVIDIA GPU) and ``gfx950`` (an MI355).

Asked for by name (``-m gfx950``) without a gfx950 device, the run fails instead, saying what
jax sees and what to install. Under pytest-xdist (``-n``), jax does not preallocate GPU
memory. Each test module frees its compiled programs when it ends.
"""

from __future__ import annotations

import gc
import os
import re

# Several pytest-xdist workers share one GPU: each would otherwise take 75% of its memory when
# jax starts (XLA's preallocation) and the second worker's start fails. Set before jax's
# backends start; an explicit setting wins.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

from jax_sparse_mla._platform import devices_seen, gpu_platforms


def _gfx950_requested(config) -> bool:
    """Whether the marker expression (``-m``) asks for the gfx950 tests by name."""
    return "gfx950" in re.sub(r"\bnot\s+gfx950\b", "", config.getoption("markexpr") or "")


def _no_gfx950_message() -> str:
    return (
        f"-m gfx950 asks for the MI355 tests, but jax {jax.__version__} sees no gfx950 ROCm "
        f"device: jax.devices() = {devices_seen()}. On an MI355 install the ROCm jax plugin that "
        "matches jax (pip install -e '.[rocm,test]', see README, MI355) and check "
        "rocminfo | grep gfx950"
    )


def pytest_collection_modifyitems(config, items):
    if _gfx950_requested(config) and "gfx950" not in gpu_platforms():
        pytest.exit(_no_gfx950_message(), returncode=pytest.ExitCode.TESTS_FAILED)
    skips = {
        "gpu": ("cuda", "no CUDA GPU: jax.devices() has no gpu"),
        "gfx950": ("gfx950", "no MI355 (gfx950) ROCm device"),
    }
    for item in items:
        for marker, (needs, reason) in skips.items():
            if marker in item.keywords and needs not in gpu_platforms():
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees the module's compiled programs when it ends (``jax.clear_caches`` empties every
    jitted function's cache, ``impls.jitted``'s too). Each program XLA compiles for the CPU
    holds memory maps of its own; kept for the whole suite they reach Linux's default limit of
    65530 maps per process (vm.max_map_count) near its end, and XLA's CPU compiler then
    crashes (a segmentation fault) when a map fails."""
    yield
    jax.clear_caches()
    gc.collect()
