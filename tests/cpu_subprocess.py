"""Runs a command in a fresh Python process on the CPU backend (optionally with N virtual CPU
devices) from the repository root, and fails the test with the end of its output if it fails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout under test first on PYTHONPATH, so a child
    process imports this ``jax_sparse_mla`` whether or not the package is installed (a script run
    by path gets its own folder, not the working directory, as ``sys.path[0]``)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_on_cpu(argv: list[str], *, devices: int | None = None, timeout: int = 300):
    """``argv`` run with JAX_PLATFORMS=cpu (and ``devices`` host devices); returns the
    completed process after asserting exit status 0."""
    env = child_env(JAX_PLATFORMS="cpu")
    if devices is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run
