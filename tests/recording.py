"""The recording build of the FFI library (``build_lib.build_library(..., recording=True)``):
the real handlers and FlyDSL objects with a HIP whose ``hipModuleLaunchKernel`` logs each launch
instead of running it. Registering its handlers for the CPU is process-wide, so the tests that
use it run their scenarios in a subprocess."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_subprocess import child_env


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


def run_recorded(script: str, directory: Path, timeout: int = 1200):
    """Builds the recording library in ``directory`` and runs ``script`` (a test module run as
    a script: it registers the library and prints one JSON value) on the CPU backend; returns
    that value."""
    library = recording_library(directory)
    proc = subprocess.run(
        [sys.executable, script, str(library)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(JAX_PLATFORMS="cpu"),  # the recording handlers are the CPU's
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])
