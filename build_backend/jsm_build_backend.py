"""PEP 517 backend: setuptools, with the kernel content of the build chosen explicitly.

``JAX_SPARSE_MLA_KERNELS`` (or the config setting ``kernels``, e.g. ``pip wheel -C
kernels=gfx950 .``; the setting wins) names what the build compiles, never guessed from the build
host:

- ``none`` (the default): the Python package only, a pure wheel. No compiler, no jaxlib, no
  FlyDSL; on ROCm ``implementation=None`` runs the jax-native implementation.
- ``gfx950``: the gfx950 FlyDSL kernels compiled ahead of time (any Linux machine, no GPU) and
  linked with the handlers into the XLA FFI library ``jax_sparse_mla/ffi/_jsm_ffi*.so``. The
  build then also needs FlyDSL, torch (FlyDSL's compiler imports it), ziglang (an ``ld.lld``),
  jax, jaxlib's FFI headers and a C++17 compiler; a missing one is an error naming the fix.

setup.py reads the choice through ``kernel_choice``.
"""

from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (the PEP 517 hooks we do not change)

ENV = "JAX_SPARSE_MLA_KERNELS"
CHOICES = ("none", "gfx950")
KERNEL_BUILD_REQUIRES = [
    "flydsl>=0.5,<0.6",
    "torch",
    "ziglang>=0.13",
    "jax>=0.10.2",
    "jaxlib>=0.10.2",
]


def kernel_choice(config_settings: dict | None = None) -> str:
    """``config_settings["kernels"]``, else ``$JAX_SPARSE_MLA_KERNELS``, else ``"none"``."""
    value = (config_settings or {}).get("kernels") or os.environ.get(ENV) or "none"
    if value not in CHOICES:
        raise ValueError(
            f"jax_sparse_mla: {ENV} (or the config setting 'kernels') must be one of {CHOICES}, "
            f"got {value!r}: 'gfx950' builds the FFI library with the MI355 kernels, 'none' the "
            "Python package alone"
        )
    return value


def _setuptools_settings(config_settings: dict | None) -> dict | None:
    """``config_settings`` without ours, exporting the kernel choice to setup.py (same process)."""
    os.environ[ENV] = kernel_choice(config_settings)
    if config_settings is None:
        return None
    return {k: v for k, v in config_settings.items() if k != "kernels"}


def _extra(config_settings: dict | None) -> list[str]:
    return KERNEL_BUILD_REQUIRES if kernel_choice(config_settings) == "gfx950" else []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra(config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    settings = _setuptools_settings(config_settings)
    return _setuptools.build_wheel(wheel_directory, settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    settings = _setuptools_settings(config_settings)
    return _setuptools.build_editable(wheel_directory, settings, metadata_directory)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    settings = _setuptools_settings(config_settings)
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, settings)
