"""examples/deepseek_v32_decode.py at a small size, in a process of its own: on one CPU device
and on 8 virtual CPU devices (heads split over them). The example checks its own output
against a dense attention over the same keys and exits non-zero beyond its bound."""

from __future__ import annotations

import sys

import pytest

from tests.cpu_subprocess import REPO, run_on_cpu

SMALL = ["--batch", "2", "--prompt", "64", "--steps", "3", "--d-model", "128", "--q-rank", "64"]
SMALL += ["--heads", "8", "--topk", "32"]


@pytest.mark.parametrize("devices", [1, 8])
def test_deepseek_v32_decode(devices):
    example = REPO / "examples" / "deepseek_v32_decode.py"
    run = run_on_cpu([sys.executable, str(example), *SMALL], devices=devices)
    assert f"on {devices} of {devices} cpu device(s)" in run.stdout, run.stdout
    assert "tokens/s" in run.stdout and run.stdout.rstrip().endswith("ok"), run.stdout
