"""With 64-bit types on (``jax_enable_x64``, as many JAX users run): a representative subset of
the shared suites, run in a process of its own with ``JAX_ENABLE_X64=1`` (the setting is
global; the rest of the suite runs without it). Indices stay int32 inside the ops."""

from __future__ import annotations

import subprocess
import sys

from tests.cpu_subprocess import REPO, child_env

# every op with the implementations that run on the CPU, the writers, validation, checked,
# gradients through implementation=None with numpy indices, and large scales
SUBSET = [
    "tests/test_sparse_mla.py::test_masking_and_empty_rows",
    "tests/test_sparse_mla.py::test_dense_to_csr",
    "tests/test_mla_decode.py::test_decode_masked_indices_and_short_sequences",
    "tests/test_mla_decode.py::test_partials_eager",
    "tests/test_mla_decode.py::test_merge_ignores_o_of_empty_partials",
    "tests/test_ultraquant.py::test_seq_lens_clamped_and_empty",
    "tests/test_formats.py::test_concat_and_cache_ds_mla",
    "tests/test_formats.py::test_concat_and_cache_mla",
    "tests/test_formats.py::test_ultraquant_store_random_kv",
    "tests/test_validate.py::test_checked_decode_ultraquant_and_vmap",
    "tests/test_gradients.py::test_default_implementation_gradient",
    "tests/test_sm_scale.py::test_sparse_mla",
]


def test_x64_subset():
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
    argv += SUBSET
    env = child_env(JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1")
    run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
