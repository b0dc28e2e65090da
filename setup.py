"""Builds the XLA FFI library (``jax_sparse_mla/ffi/_jsm_ffi*.so``) at install time.

The library holds the handlers (``jax_sparse_mla/ffi/csrc``) linked with the kernel objects
of ``build/gfx950`` (``$JAX_SPARSE_MLA_KERNEL_DIR``) when that kernel build exists. On a
machine with a gfx950 GPU (or ``JAX_SPARSE_MLA_BUILD_KERNELS=1``) the kernels are compiled
first. See BUILD.md.
"""

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "build_backend"))
from jsm_build_backend import build_kernels  # noqa: E402


def _build_lib_module():
    """``jax_sparse_mla/ffi/build_lib.py``, loaded by path (the package is not installed yet)."""
    spec = importlib.util.spec_from_file_location(
        "_jsm_build_lib", HERE / "jax_sparse_mla/ffi/build_lib.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildFfiLibrary(build_ext):
    """Compiles and links the FFI library instead of a Python extension module."""

    def build_extension(self, ext):
        if platform.system() != "Linux":
            print("jax_sparse_mla: the FFI library (ROCm, Linux only) is not built here")
            return
        lib = _build_lib_module()
        kernel_dir = Path(os.environ.get("JAX_SPARSE_MLA_KERNEL_DIR", HERE / "build/gfx950"))
        if build_kernels():
            env = dict(os.environ, PYTHONPATH=str(HERE))
            cmd = [sys.executable, "-m", "jax_sparse_mla.build", "--arch", "gfx950"]
            subprocess.run([*cmd, "--out", str(kernel_dir)], cwd=HERE, env=env, check=True)
        try:
            compiler = lib.compiler()
        except RuntimeError as e:
            print(f"jax_sparse_mla: the FFI library is not built: {e}")
            return
        output = Path(self.get_ext_fullpath(ext.name))
        lib.build_library(output, kernel_dir, cxx=compiler)
        print(f"jax_sparse_mla: built {output} ({len(lib.manifest_kernels(kernel_dir))} kernels)")


setup(
    ext_modules=[Extension("jax_sparse_mla.ffi._jsm_ffi", sources=[])],
    cmdclass={"build_ext": BuildFfiLibrary},
)
