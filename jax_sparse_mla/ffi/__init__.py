"""The XLA FFI library that runs the gfx950 FlyDSL kernels on ROCm.

The library (``_jsm_ffi*.so`` next to this file, built from ``csrc/`` and the kernel objects of
``python -m jax_sparse_mla.build --arch gfx950`` by an install or wheel build with
``JAX_SPARSE_MLA_KERNELS=gfx950``, or by that command with ``--link``; see BUILD.md) holds one
handler per custom call target. Importing ``jax_sparse_mla`` registers them for platform
"ROCM"; the library loads on any Linux machine (HIP is opened at first launch).
``JAX_SPARSE_MLA_FFI_LIBRARY`` points the loader at another copy. The library lists the
kernels it was linked with (``library_kernels``): one linked before the kernel build has none.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
import warnings
from pathlib import Path

import jax

# custom call target -> handler symbol in the library.
TARGETS = {
    "jsm_sparse_mla": "JsmSparseMla",
    "jsm_mla_decode_partials": "JsmMlaDecodePartials",
    "jsm_mla_decode_combine": "JsmMlaDecodeCombine",
    "jsm_ultraquant_partials": "JsmUltraquantPartials",
    "jsm_ultraquant_reduce": "JsmUltraquantReduce",
    "jsm_mfma_probe": "JsmMfmaProbe",  # diagnostic: one MFMA (kernels/gfx950/probe.py)
    "jsm_ds_read_tr_probe": "JsmDsReadTrProbe",  # diagnostic: one transposing LDS read (same)
}
LIBRARY_NAME = "_jsm_ffi"
_HERE = Path(__file__).resolve().parent


def library_path() -> Path | None:
    """``$JAX_SPARSE_MLA_FFI_LIBRARY``, else the library installed in this package, else None."""
    if env := os.environ.get("JAX_SPARSE_MLA_FFI_LIBRARY"):
        return Path(env)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := _HERE / f"{LIBRARY_NAME}{suffix}").exists():
            return path
    return None


_REGISTERED: set[str] = set()


def register_targets(library: ctypes.CDLL, platform: str) -> None:
    """Registers every handler of ``library`` as its custom call target for ``platform``."""
    for target, symbol in TARGETS.items():
        capsule = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(target, capsule, platform=platform)
    _REGISTERED.add(platform.lower())


def registered_platforms() -> frozenset[str]:
    """The platforms (lower case, as ``jax.lax.platform_dependent`` names them) the handlers
    were registered for in this process."""
    return frozenset(_REGISTERED)


@functools.cache
def rocm_library() -> ctypes.CDLL | None:
    """The FFI library, loaded and registered for "ROCM" once; None when it is not built."""
    path = library_path()
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    required = (*TARGETS.values(), "jsm_kernel_symbols")
    missing = [symbol for symbol in required if not hasattr(library, symbol)]
    if missing:
        warnings.warn(
            f"jax_sparse_mla: the FFI library {path} predates this version "
            f"(no {', '.join(missing)}): rebuild it (pip install -e ., or "
            "python -m jax_sparse_mla.build --arch gfx950 --link); until then the FlyDSL "
            "kernels are unavailable",
            stacklevel=2,
        )
        return None
    register_targets(library, "ROCM")
    return library


# A target's kernels are the linked symbols ``target`` or ``target_*``, unless named here.
_KERNEL_PREFIX = {"jsm_ultraquant_partials": "jsm_ultraquant_decode"}
BUILD_COMMAND = "python -m jax_sparse_mla.build --arch gfx950 --link"


@functools.cache
def library_kernels() -> frozenset[str]:
    """The symbols of the kernels linked into the FFI library (none without the library, or
    when it was linked without a kernel build)."""
    library = rocm_library()
    return frozenset() if library is None else kernel_symbols(library)


def kernel_symbols(library: ctypes.CDLL) -> frozenset[str]:
    """The kernels an FFI library was linked with (its ``jsm_kernel_symbols``)."""
    symbols = library.jsm_kernel_symbols
    symbols.restype = ctypes.c_char_p
    return frozenset(symbols().decode().split())


def missing_kernels(targets) -> list[str]:
    """The custom call targets of ``targets`` that have no kernel in the FFI library."""
    kernels = library_kernels()

    def linked(target: str) -> bool:
        prefix = _KERNEL_PREFIX.get(target, target)
        return any(k == prefix or k.startswith(f"{prefix}_") for k in kernels)

    return [t for t in targets if not linked(t)]
