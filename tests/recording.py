"""The recording build of the FFI library (``build_lib.build_library(..., recording=True)``):
the real handlers and FlyDSL objects with a HIP whose ``hipModuleLaunchKernel`` logs each launch
instead of running it. Registering its handlers for the CPU is process-wide, so the tests that
use it run their scenarios in a subprocess."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest


def recording_library(directory: Path) -> Path:
    """Builds the recording library in ``directory``; skips the test without the kernel build
    (``python -m jax_sparse_mla.build --arch gfx950``) or a C++ compiler."""
    from jax_sparse_mla._build import build_lib

    kernel_dir = build_lib.DEFAULT_KERNEL_DIR
    if not (kernel_dir / "manifest.json").exists():
        pytest.skip(
            f"no kernel build at {kernel_dir}: python -m jax_sparse_mla.build --arch gfx950"
        )
    try:
        build_lib.compiler()
    except RuntimeError as e:
        pytest.skip(str(e))
    library = directory / "recording.so"
    build_lib.build_library(library, kernel_dir, recording=True)
    return library


def register_for_cpu(path: str):
    """(In the subprocess) loads the recording library and registers its handlers for the CPU;
    returns the library and ``take()``: the launches logged since the last call, as events."""
    from jax_sparse_mla.ffi import register_targets

    lib = ctypes.CDLL(path)
    register_targets(lib, "cpu")
    lib.jsm_record_take.restype = ctypes.c_size_t

    def take() -> list[dict]:
        size = lib.jsm_record_take(None, 0)
        buf = ctypes.create_string_buffer(size + 4096)
        lib.jsm_record_take(buf, len(buf))
        return json.loads(buf.value.decode())

    return lib, take
