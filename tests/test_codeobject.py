"""Reading kernel resources from AMDGPU code objects, and the occupancy they allow (gfx950)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import pytest

from jax_sparse_mla._build import build_lib
from jax_sparse_mla._build.build import resource_problems, toolchain_env
from jax_sparse_mla._build.codeobject import KernelResources, _unpack_msgpack, read_kernel_resources
from jax_sparse_mla.kernels.gfx950 import configs


def resources(**kw) -> KernelResources:
    base = dict(
        name="k",
        vgpr=32,
        agpr=0,
        vgpr_alloc=32,
        sgpr=20,
        lds_bytes=0,
        scratch_bytes=0,
        vgpr_spills=0,
        sgpr_spills=0,
        workgroup_size=256,
    )
    return KernelResources(**(base | kw))


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(vgpr_alloc=32), (8, "waves")),  # 512 // 32 = 16, capped at 8 waves per SIMD
        (dict(vgpr_alloc=128), (4, "vgpr")),
        (dict(vgpr_alloc=136), (3, "vgpr")),
        (dict(vgpr_alloc=512), (1, "vgpr")),
        # 4 workgroups of 4 waves fit 160 KiB at 40 KiB: 16 waves over 4 SIMDs.
        (dict(lds_bytes=40 * 1024), (4, "lds")),
        (dict(lds_bytes=40 * 1024 + 1), (3, "lds")),
        # One-wave workgroups of 17 KiB: 9 per CU, 2 per SIMD (rounded down).
        (dict(lds_bytes=17 * 1024, workgroup_size=64), (2, "lds")),
        (dict(sgpr=102), (7, "sgpr")),  # 800 // 112
    ],
)
def test_occupancy(kw, expected):
    assert resources(**kw).occupancy() == expected


def test_resource_problems():
    assert resource_problems(resources(), 8) == []
    assert resource_problems(resources(vgpr_spills=2), 1) == ["spills 2 VGPR / 0 SGPR"]
    assert resource_problems(resources(scratch_bytes=16), 1) == ["uses 16 B of scratch"]
    assert resource_problems(resources(lds_bytes=160 * 1024 + 4), 0) == ["LDS 163844 B > 160 KiB"]
    assert resource_problems(resources(vgpr_alloc=256), 4) == [
        "occupancy 2 < design 4 (limited by vgpr)"
    ]


def test_msgpack_subset():
    blob = (
        b"\x84"  # map of 4
        + b"\xa1a\x01"  # "a": 1
        + b"\xa1b\x93\xc3\xcd\x01\x00\xff"  # "b": [True, 256, -1]
        + b"\xd9\x04long\xce\x00\x01\x00\x00"  # "long": 65536
        + b"\xa1c\xdc\x00\x02\xc2\xcb"
        + struct.pack(">d", 0.5)  # "c": [False, 0.5]
    )
    value, end = _unpack_msgpack(blob, 0)
    assert value == {"a": 1, "b": [True, 256, -1], "long": 65536, "c": [False, 0.5]}
    assert end == len(blob)
    with pytest.raises(ValueError, match="unsupported MessagePack type byte 0xc1"):
        _unpack_msgpack(b"\xc1", 0)


def test_no_code_object():
    assert read_kernel_resources(b"\x7fELF" + bytes(100)) == []


_PROBE = """
import os, sys, torch
import flydsl.compiler as flyc
import flydsl.expr as fx

@flyc.kernel(known_block_size=[128, 1, 1])
def probe(a: fx.Tensor, n: fx.Int32):
    tid = fx.thread_idx.x

@flyc.jit
def launch(a: fx.Tensor, n: fx.Int32, stream: fx.Stream = fx.Stream(None)):
    probe(a, n).launch(grid=(n, 1, 1), block=(128, 1, 1), stream=stream)

flyc.compile(launch, torch.zeros(4), 3).export_to_c(sys.argv[1], "probe")
"""


def test_resources_match_the_compiler_dump(tmp_path):
    """The code object's metadata, read by us, equals the compiler's own ISA dump."""
    pytest.importorskip("flydsl", reason="needs the gfx950-build extra (flydsl)")
    env = toolchain_env("gfx950", tmp_path) | {
        "FLYDSL_DEBUG_DUMP_ASM": "1",
        "FLYDSL_DUMP_DIR": str(tmp_path / "dump"),
    }
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(_PROBE))
    subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, check=True)
    (r,) = read_kernel_resources((tmp_path / "probe.o").read_bytes())
    isa = (tmp_path / "dump" / "probe_0" / "22_final_isa.s").read_text()

    def meta(key: str) -> int:
        return int(re.search(rf"^\s+\.{key}:\s+(\d+)$", isa, re.M).group(1))

    assert r.name == "probe_0"
    assert r.workgroup_size == meta("max_flat_workgroup_size") == 128
    assert r.sgpr == meta("sgpr_count")
    assert r.vgpr == meta("vgpr_count")
    assert r.lds_bytes == meta("group_segment_fixed_size")
    assert r.scratch_bytes == meta("private_segment_fixed_size")
    next_free = int(re.search(r"\.amdhsa_next_free_vgpr (\d+)", isa).group(1))
    assert r.vgpr_alloc == max(8, -(-next_free // 8) * 8)
    assert os.path.exists(tmp_path / "probe.h")


def test_a_crashing_configuration_is_named(tmp_path, monkeypatch):
    """A compiler process that dies (an LLVM abort) fails only its culprit: the rest of its
    chunk is retried one configuration per process."""
    from jax_sparse_mla._build import build

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        n: int

        @property
        def symbol(self) -> str:
            return f"jsm_fake_{self.n}"

    calls = []

    def fake_worker(arch, chunk, objects, env):
        calls.append([j.index for j in chunk])
        for job in chunk:
            if job.index == 3:
                return -6, "LLVM ERROR: cannot select"
            (objects / f"{job.config.symbol}.json").write_text('{"seconds": 0}')
        return 0, ""

    monkeypatch.setattr(build, "_worker", fake_worker)
    monkeypatch.setattr(build, "KERNEL_MODULES", ("fake",))
    jobs = [build.Job("fake", i, Cfg(i), "key") for i in range(6)]
    failures = build._run_jobs("gfx950", jobs, tmp_path, {}, jobs=2)
    assert failures == {"jsm_fake_3": "LLVM ERROR: cannot select"}
    assert sorted(calls) == [[0, 1, 2], [3], [3, 4, 5], [4], [5]]  # two chunks, then singles
    done = sorted(p.name for p in tmp_path.glob("*.json"))
    assert done == [f"jsm_fake_{i}.json" for i in (0, 1, 2, 4, 5)]


@pytest.fixture(scope="module")
def manifest() -> dict[str, dict]:
    """The kernel build's manifest entries by symbol (``python -m jax_sparse_mla.build``)."""
    path = build_lib.DEFAULT_KERNEL_DIR / "manifest.json"
    if not path.exists():
        pytest.skip(f"no kernel build at {path.parent}: python -m jax_sparse_mla.build")
    return {e["symbol"]: e for e in json.loads(path.read_text())["kernels"]}


@pytest.mark.parametrize("symbol", sorted(configs.all_symbols()))
def test_built_configuration_meets_its_design(manifest, symbol):
    """Every configuration is built, read back from its own code object: no spill, no
    scratch, LDS <= 160 KiB and its design occupancy (what ``--report`` checks)."""
    entry = manifest[symbol]
    obj = (build_lib.DEFAULT_KERNEL_DIR / entry["object"]).read_bytes()
    (r,) = read_kernel_resources(obj)
    assert resource_problems(r, entry["design_waves_per_simd"]) == []
