"""Checks a wheel built with the gfx950 kernels, as installed, on a machine without ROCm.

    python .ci/check_wheel.py dist/jax_sparse_mla-*.whl

Unpacks the wheel into a scratch directory and imports ``jax_sparse_mla`` from there (not from
the source tree) in a subprocess: the FFI library in the wheel loads and registers every
handler (``ffi.TARGETS``) for ROCm; the kernels it lists are exactly every configuration of
``kernels/gfx950/configs.py``; each of them is in its kernel table, up to the HIP call (which
fails here, saying the ROCm runtime is unavailable, instead of "not in this FFI library").
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CHECK = """
import ctypes, sys
from pathlib import Path
import jax_sparse_mla
from jax_sparse_mla import ffi
from jax_sparse_mla.kernels.gfx950 import configs

root = Path(sys.argv[1])
assert Path(jax_sparse_mla.__file__).is_relative_to(root), jax_sparse_mla.__file__
assert ffi.library_path().is_relative_to(root), ffi.library_path()
library = ffi.rocm_library()  # loads it and registers every handler for ROCM
assert library is not None, "the wheel's FFI library did not load"
for symbol in ffi.TARGETS.values():
    assert getattr(library, symbol), symbol
linked, expected = ffi.library_kernels(), configs.all_symbols()
assert linked == expected, f"missing {sorted(expected - linked)}, extra {sorted(linked - expected)}"
assert ffi.missing_kernels(ffi.TARGETS) == []
message = ctypes.create_string_buffer(1024)
for symbol in sorted(expected):
    library.jsm_prepare_launch(symbol.encode(), 0, message, len(message))
    assert "the ROCm runtime is unavailable" in message.value.decode(), message.value
print(f"{jax_sparse_mla.__version__}: {len(linked)} kernels, {len(ffi.TARGETS)} handlers")
"""


def main(wheel: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
        env = {"PYTHONPATH": tmp, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
        subprocess.run([sys.executable, "-c", CHECK, tmp], cwd=tmp, env=env, check=True)
    print(f"{Path(wheel).name}: ok")


if __name__ == "__main__":
    main(sys.argv[1])
