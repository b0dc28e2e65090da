"""The ops over 8 virtual CPU devices (tests/sharding_checks.py, in a process of its own so that
the rest of the suite keeps one device): shard_map with check_vma=True for every
implementation, results equal to one device's, the compiled HLO's collectives, and gradients
through the sharded wrappers equal to one device's."""

from __future__ import annotations

import sys

import pytest

from tests.cpu_subprocess import run_on_cpu


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
        "placement_explicit",
        "placement_auto",
        "plain_ops_explicit",
        "validation",
        "writers_explicit",
        "writers_auto",
        "readme",
    ],
)
def test_sharded(check):
    run = run_on_cpu([sys.executable, "-m", "tests.sharding_checks", check], timeout=600)
    assert f"{check} ok" in run.stdout
