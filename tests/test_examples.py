"""examples/deepseek_v32_decode.py at a small size, in a process of its own: on one CPU device
and on 8 virtual CPU devices (heads split over them). The example checks its own output
against a dense attention over the same keys and exits non-zero beyond its bound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--batch", "2", "--prompt", "64", "--steps", "3", "--d-model", "128", "--q-rank", "64"]
SMALL += ["--heads", "8", "--topk", "32"]


@pytest.mark.parametrize("devices", [1, 8])
def test_deepseek_v32_decode(devices):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "deepseek_v32_decode.py"), *SMALL],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert f"on {devices} of {devices} cpu device(s)" in run.stdout, run.stdout
    assert "tokens/s" in run.stdout and run.stdout.rstrip().endswith("ok"), run.stdout
