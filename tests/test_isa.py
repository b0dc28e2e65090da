"""The waits before every ``s_barrier`` of the compiled gfx950 kernels, read from their ISA.

The build keeps each kernel's final ISA (``objects/<symbol>.s``); the first test proves it is
the code object's own code (reassembled by ziglang's LLVM it gives the bytes of the kernel in
the object). Then, for every ``s_barrier``, over the kernel's control-flow graph:

* no LDS operation is outstanding when it is reached on any path, and the nearest ``s_waitcnt``
  or ``ds_*`` before it is an ``s_waitcnt`` whose ``lgkmcnt`` is 0 (the hardware half of a
  workgroup LDS release: ``kernels/gfx950/_primitives.py:lds_barrier``);
* where an LDS DMA may still be in flight (mla_decode's two mid-block barriers, by design),
  that wait names no ``vmcnt`` at all: the barrier does not drain the next block's K rows.

Needs the kernel build (``python -m jax_sparse_mla.build --arch gfx950``); the synthetic cases
run without it.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest

from jax_sparse_mla._build import build_lib
from jax_sparse_mla._build.codeobject import read_kernel_code, read_kernel_resources
from jax_sparse_mla._build.isa import assemble_kernel, barriers, count_waits, kernel_text
from jax_sparse_mla.kernels.gfx950 import configs

SYMBOLS = sorted(configs.all_symbols())

# Per kernel module: (s_barrier count, of which an LDS DMA may be in flight at).
# The first prefix that a symbol starts with counts.
DESIGN = {
    "mla_decode_partials_m128": (2, 0),  # zeroed slots; per block: top (its DMA landed)
    "mla_decode_partials": (5, 2),  # zeroed slots; per block: top, row maxima, P; epilogue
    "sparse_mla": (4, 0),  # per tile: top, row maxima, P; epilogue (the DMA waits at the top)
}


def design(symbol: str) -> tuple[int, int]:
    for prefix, counts in DESIGN.items():
        if symbol.startswith(f"jsm_{prefix}"):
            return counts
    return 0, 0  # one-wave workgroups (ultraquant, probes) and the combine: no LDS sharing


# ---------------------------------------------------------------------------------------------
# The analysis, on small hand-written kernels
# ---------------------------------------------------------------------------------------------


def isa(body: str) -> str:
    return f"k:\n{textwrap.dedent(body)}.Lfunc_end0:\n"


def test_wait_after_the_last_lds_write():
    (b,) = barriers(
        isa("""\
        ds_write_b32 v1, v2
        v_add_f32_e32 v3, v3, v3
        s_waitcnt vmcnt(3) lgkmcnt(0)
        s_barrier
        s_endpgm
        """),
        "k",
    )
    assert not b.lds_pending and not b.dma_in_flight
    assert b.nearest_wait == {"vmcnt": 3, "lgkmcnt": 0} and b.line == 5


def test_lds_write_after_the_wait_is_pending():
    (b,) = barriers(
        isa("""\
        s_waitcnt lgkmcnt(0)
        ds_write_b32 v1, v2
        s_barrier
        """),
        "k",
    )
    assert b.lds_pending and b.nearest.mnemonic == "ds_write_b32" and b.nearest_wait is None


def test_a_back_edge_carries_an_outstanding_lds_read():
    """The loop-top barrier is reached from the loop's end, where a ds_read is outstanding;
    the code before it in program order waited."""
    (b,) = barriers(
        isa("""\
        ds_write_b32 v1, v2
        s_waitcnt lgkmcnt(0)
        .LBB0_1:
        s_barrier
        ds_read_b32 v3, v1
        s_cbranch_scc1 .LBB0_1
        s_endpgm
        """),
        "k",
    )
    assert b.lds_pending and b.nearest_wait == {"lgkmcnt": 0}


def test_dma_in_flight_unless_vmcnt_0():
    found = barriers(
        isa("""\
        global_load_lds_dwordx4 v[0:1], off
        buffer_load_dword v2, s[0:3], 0 offen lds
        s_waitcnt vmcnt(1) lgkmcnt(0)
        s_barrier
        s_waitcnt vmcnt(0)
        s_barrier
        buffer_load_dword v2, s[0:3], 0 offen
        s_barrier
        """),
        "k",
    )
    assert [b.dma_in_flight for b in found] == [True, False, False]
    assert found[0].nearest_wait == {"vmcnt": 1, "lgkmcnt": 0}


def test_unreachable_barrier_is_skipped_and_waits_are_counted():
    text = isa("""\
        s_waitcnt vmcnt(0)
        s_endpgm
        s_barrier
        s_waitcnt vmcnt(0) lgkmcnt(1)
        """)
    assert barriers(text, "k") == []
    assert count_waits(text, "k", "vmcnt") == 2 and count_waits(text, "k", "lgkmcnt") == 0
    with pytest.raises(ValueError, match="no kernel 'x'"):
        kernel_text(text, "x")


# ---------------------------------------------------------------------------------------------
# The built kernels
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built() -> dict[str, dict]:
    kernel_dir = build_lib.DEFAULT_KERNEL_DIR
    if not (kernel_dir / "manifest.json").exists():
        pytest.skip(f"no kernel build at {kernel_dir}: python -m jax_sparse_mla.build")
    out = {}
    for entry in json.loads((kernel_dir / "manifest.json").read_text())["kernels"]:
        obj = (kernel_dir / entry["object"]).read_bytes()
        isa_path = kernel_dir / entry.get("isa", f"objects/{entry['symbol']}.s")
        if not isa_path.exists():
            pytest.skip(f"{isa_path} missing: rebuild (python -m jax_sparse_mla.build)")
        (resources,) = read_kernel_resources(obj)
        out[entry["symbol"]] = {
            "name": resources.name,
            "isa": isa_path.read_text(),
            "code": read_kernel_code(obj)[resources.name],
        }
    return out


def kernel(built, symbol) -> dict:
    if symbol not in built:
        pytest.skip(f"{symbol} is not in the kernel build")
    return built[symbol]


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_isa_is_the_code_object(built, symbol):
    """The ISA text, reassembled, is byte for byte the kernel's code in the object."""
    if importlib.util.find_spec("ziglang") is None:
        pytest.skip("needs ziglang (the gfx950-build extra) to assemble")
    k = kernel(built, symbol)
    assert assemble_kernel(k["isa"], k["name"]) == k["code"]


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_every_barrier_waits_for_lds(built, symbol):
    k = kernel(built, symbol)
    found = barriers(k["isa"], k["name"])
    assert len(found) == design(symbol)[0]
    for b in found:
        assert not b.lds_pending, f"line {b.line}: an LDS operation may be outstanding"
        assert b.nearest is not None and b.nearest.mnemonic == "s_waitcnt", (
            f"line {b.line}: {b.nearest} before the barrier"
        )
        assert b.nearest_wait.get("lgkmcnt") == 0, f"line {b.line}: {b.nearest}"


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_barriers_keep_the_dma_in_flight(built, symbol):
    k = kernel(built, symbol)
    in_flight = [b for b in barriers(k["isa"], k["name"]) if b.dma_in_flight]
    assert len(in_flight) == design(symbol)[1]
    for b in in_flight:
        assert "vmcnt" not in b.nearest_wait, f"line {b.line}: {b.nearest} drains the DMA"


def _instructions(k) -> list[list[str]]:
    """The kernel's instructions in program order, each as its words."""
    lines = kernel_text(k["isa"], k["name"])
    return [line.split() for _, line in lines if line.startswith("\t") and line.split()]


@pytest.mark.parametrize(
    "symbol", [s for s in SYMBOLS if s.startswith(("jsm_sparse_mla", "jsm_mla_decode_partials"))]
)
def test_first_gather_waits_for_no_q_load(built, symbol):
    """Before the first LDS DMA is issued, nothing waits for q's words (the first
    ``global_load_dwordx4``) ahead of the loads of the entries that the DMA needs (the last
    ``buffer_load`` before it): sparse_mla loads q's words and tile 0's entries together and
    splits q while the DMA is in flight; mla_decode (both partials kernels, the 128-row one
    included) loads q after issuing block 0's DMA. The
    previous order (q loaded and its maximum taken, then the entries, then the DMA) paid one
    memory latency more before the first gather left."""
    code = _instructions(kernel(built, symbol))
    dma = next(i for i, ins in enumerate(code) if ins[0].startswith("global_load_lds"))
    entries = max(i for i, ins in enumerate(code[:dma]) if ins[0].startswith("buffer_load"))
    q_words = [i for i, ins in enumerate(code[:dma]) if ins[0] == "global_load_dwordx4"]
    if symbol.startswith("jsm_mla_decode_partials"):
        assert not q_words, f"q loaded before block 0's DMA is issued: {q_words}"
    if q_words:
        waits = [
            (i, ins)
            for i, ins in enumerate(code[q_words[0] : entries], q_words[0])
            if ins[0] == "s_waitcnt" and "vmcnt" in ins[1]
        ]
        assert not waits, f"waits for q's words before the DMA's entries are loaded: {waits}"
