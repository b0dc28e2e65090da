"""The ops over 8 virtual CPU devices (tests/sharding_checks.py, in a process of its own so that
the rest of the suite keeps one device): shard_map with check_vma=True for every
implementation, results equal to one device's, the compiled HLO's collectives, and gradients
through the sharded wrappers equal to one device's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "check",
    [
        "sparse_mla",
        "mla_decode",
        "ultraquant",
        "lowering",
        "pallas_interpret_refused",
        "gradients_xla",
        "gradients_gfx950_emulation",
    ],
)
def test_sharded(check):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.sharding_checks", check],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert f"{check} ok" in run.stdout
