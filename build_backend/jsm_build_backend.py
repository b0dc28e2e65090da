"""PEP 517 backend: setuptools, plus the kernel build's tools on a machine with a gfx950 GPU.

On a machine with an AMD gfx950 (MI355) GPU, or with ``JAX_SPARSE_MLA_BUILD_KERNELS=1``, the
build also needs FlyDSL, torch (FlyDSL's compiler imports it), ziglang (an ``ld.lld``) and jax
to compile the kernels (setup.py runs ``python -m jax_sparse_mla.build``); elsewhere only the
FFI library is built, which needs jaxlib's headers and a C++ compiler.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the PEP 517 hooks we do not change)

KERNEL_BUILD_REQUIRES = ["flydsl>=0.5,<0.6", "torch", "ziglang>=0.13", "jax>=0.10.2"]
_GFX950_TARGET_VERSION = "90500"  # KFD's gfx_target_version of gfx950


def gfx950_present() -> bool:
    """Whether the KFD topology lists a gfx950 GPU (Linux, ROCm driver loaded)."""
    for props in Path("/sys/class/kfd/kfd/topology/nodes").glob("*/properties"):
        try:
            lines = props.read_text().splitlines()
        except OSError:
            continue
        if f"gfx_target_version {_GFX950_TARGET_VERSION}" in lines:
            return True
    return False


def build_kernels() -> bool:
    """Whether this build compiles the gfx950 kernels (``JAX_SPARSE_MLA_BUILD_KERNELS`` 1 / 0
    forces the choice; by default, when a gfx950 GPU is present)."""
    forced = os.environ.get("JAX_SPARSE_MLA_BUILD_KERNELS")
    return forced == "1" if forced in ("0", "1") else gfx950_present()


def _extra() -> list[str]:
    return KERNEL_BUILD_REQUIRES if build_kernels() else []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra()
