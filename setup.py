"""The XLA FFI library ``jax_sparse_mla/ffi/_jsm_ffi*.so``, built when the build asks for the
gfx950 kernels (``JAX_SPARSE_MLA_KERNELS=gfx950``, see ``build_backend/jsm_build_backend.py``).

With ``gfx950`` the kernels are compiled (``python -m jax_sparse_mla.build``, into
``$JAX_SPARSE_MLA_KERNEL_DIR``, default ``build/gfx950``; incremental) and linked with the
handlers of ``jax_sparse_mla/ffi/csrc``; the wheel is then platform-specific. With ``none`` there
is no extension and the wheel is pure Python. See BUILD.md.
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
from jsm_build_backend import ENV, kernel_choice  # noqa: E402

NO_KERNELS = f"or build without kernels: {ENV}=none"


def _build_lib_module():
    """``jax_sparse_mla/_build/build_lib.py``, loaded by path (the package is not installed yet)."""
    spec = importlib.util.spec_from_file_location(
        "_jsm_build_lib", HERE / "jax_sparse_mla/_build/build_lib.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildFfiLibrary(build_ext):
    """Compiles the gfx950 kernels, then compiles and links the FFI library (not a Python
    extension module); every failure stops the build with the fix in its message."""

    def build_extension(self, ext):
        if platform.system() != "Linux":
            raise SystemExit(
                f"jax_sparse_mla: {ENV}=gfx950 builds a Linux library (ROCm), this is "
                f"{platform.system()}; {NO_KERNELS}"
            )
        lib = _build_lib_module()
        try:
            compiler = lib.compiler()
            lib.ffi_include_dir()
        except RuntimeError as e:
            message = f"jax_sparse_mla: cannot build the FFI library: {e}; {NO_KERNELS}"
            raise SystemExit(message) from e
        kernel_dir = Path(os.environ.get("JAX_SPARSE_MLA_KERNEL_DIR", HERE / "build/gfx950"))
        env = dict(os.environ, PYTHONPATH=str(HERE))
        cmd = [sys.executable, "-m", "jax_sparse_mla.build", "--arch", "gfx950"]
        if subprocess.run([*cmd, "--out", str(kernel_dir)], cwd=HERE, env=env).returncode:
            raise SystemExit(
                "jax_sparse_mla: compiling the gfx950 kernels failed (output above); they need "
                "the gfx950-build extra's packages (flydsl, a CPU torch, ziglang), which an "
                f"isolated build installs itself; {NO_KERNELS}"
            )
        output = Path(self.get_ext_fullpath(ext.name))
        lib.build_library(output, kernel_dir, cxx=compiler)
        print(f"jax_sparse_mla: built {output} ({len(lib.manifest_kernels(kernel_dir))} kernels)")


with_kernels = kernel_choice() == "gfx950"
setup(
    ext_modules=[Extension("jax_sparse_mla.ffi._jsm_ffi", sources=[])] if with_kernels else [],
    cmdclass={"build_ext": BuildFfiLibrary},
)
