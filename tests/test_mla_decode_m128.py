"""The 128-row mla_decode partials kernel (``kernels/gfx950/mla_decode_m128.py``, not launched
yet) compiles for gfx950 within its register and LDS budget, and its ISA keeps the design.

Compiled on the CPU (FlyDSL AOT) in a subprocess, as ``python -m jax_sparse_mla.build`` does;
needs the gfx950-build extra (flydsl, ziglang or an ld.lld).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from jax_sparse_mla._build.build import resource_problems, toolchain_env
from jax_sparse_mla._build.codeobject import read_kernel_resources
from jax_sparse_mla._build.isa import barriers, kernel_text
from tests.cpu_subprocess import REPO, child_env

_COMPILE = """
import json, sys
from pathlib import Path
from jax_sparse_mla._build.build import compile_with_isa
from jax_sparse_mla.kernels.gfx950 import mla_decode_m128 as m

out = Path(sys.argv[1])
compiled, isa = compile_with_isa(lambda _: m.compile_partials_m128(), None)
compiled.export_to_c(str(out), m.SYMBOL)
(out / "kernel.s").write_text(isa)
design = dict(
    symbol=m.SYMBOL,
    lds=m.LDS_BYTES,
    waves_per_simd=m.PARTIALS_WAVES_PER_EU,
    mfma=m.QK_STEPS * m.KEY_TILES + m.LAT_TILES,
    tr8=4 * m.LAT_TILES,
    dma=2 * m.DMA_INSTR,
)
(out / "design.json").write_text(json.dumps(design))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("flydsl", reason="needs the gfx950-build extra (flydsl)")
    out = tmp_path_factory.mktemp("m128")
    script = out / "compile.py"
    script.write_text(textwrap.dedent(_COMPILE))
    env = toolchain_env("gfx950", out) | {"PYTHONPATH": child_env()["PYTHONPATH"]}
    run = subprocess.run(
        [sys.executable, str(script), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    design = json.loads((out / "design.json").read_text())
    (resources,) = read_kernel_resources((out / f"{design['symbol']}.o").read_bytes())
    return design, resources, (out / "kernel.s").read_text()


def test_no_spill_no_scratch_lds_and_occupancy(compiled):
    """No spill, no scratch, LDS <= 160 KiB and 2 waves per SIMD (8 waves per CU)."""
    design, r, _ = compiled
    assert resource_problems(r, design["waves_per_simd"]) == []
    assert r.lds_bytes == design["lds"]
    assert r.workgroup_size == 512


def test_isa_has_the_design(compiled):
    """Per 64-key block 36 QK + 32 PV scaled MFMAs, 128 V transposing reads, 5 DMA (and 5 in
    the prologue); two barriers (after the prologue, at the top of each block), each after an
    ``lgkmcnt(0)`` wait with no LDS access outstanding, the block's after ``vmcnt(0)`` too."""
    design, r, isa = compiled
    code = "\n".join(line for _, line in kernel_text(isa, r.name))
    assert code.count("v_mfma_scale_f32_16x16x128_f8f6f4") == design["mfma"]
    assert code.count("ds_read_b64_tr_b8") == design["tr8"]
    assert code.count("global_load_lds_dwordx4") == design["dma"]
    found = barriers(isa, r.name)
    assert len(found) == 2
    for b in found:
        assert not b.lds_pending and not b.dma_in_flight, b
        assert b.nearest.mnemonic == "s_waitcnt" and b.nearest_wait.get("lgkmcnt") == 0, b
    assert found[1].nearest_wait.get("vmcnt") == 0, found[1]
