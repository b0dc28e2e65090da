"""One list of compiled configurations (kernels/gfx950/configs.py), read by every consumer."""

import functools
import importlib.util

import pytest

from jax_sparse_mla._build import build, build_lib
from jax_sparse_mla.ffi import calls
from jax_sparse_mla.kernels.gfx950 import configs


@pytest.mark.skipif(importlib.util.find_spec("flydsl") is None, reason="needs FlyDSL")
def test_kernel_modules_compile_exactly_the_listed_configurations():
    for module in build.KERNEL_MODULES:
        compiled = tuple(c.symbol for c in build.kernel_module("gfx950", module).CONFIGS)
        assert compiled == configs.symbols()[module], module
    assert set(configs.symbols()) == set(build.KERNEL_MODULES)


@pytest.mark.skipif(importlib.util.find_spec("flydsl") is None, reason="needs FlyDSL")
def test_kernel_modules_launch_the_listed_threads_per_workgroup():
    """And use the listed tiles; UltraQuant's LDS lets the listed workgroups share a CU."""
    module = functools.partial(build.kernel_module, "gfx950")
    uq = module("ultraquant")
    assert uq.LDS_PER_CU // uq.LDS_BYTES == configs.ULTRAQUANT_WORKGROUPS_PER_CU
    assert (uq.TILE, uq.TILE_GROUP) == (configs.ULTRAQUANT_TILE, configs.ULTRAQUANT_TILE_GROUP)
    decode = module("mla_decode")
    assert (decode.BLOCK, decode.ROWS) == (configs.MLA_DECODE_BLOCK, configs.MLA_DECODE_ROWS)
    assert module("sparse_mla").THREADS == configs.SPARSE_MLA_THREADS
    assert module("mla_decode").THREADS == configs.MLA_DECODE_PARTIALS_THREADS
    m128 = module("mla_decode_m128")
    assert (m128.ROWS, m128.BLOCK) == (configs.MLA_DECODE_M128_ROWS, configs.MLA_DECODE_M128_BLOCK)
    assert m128.THREADS == configs.MLA_DECODE_PARTIALS_THREADS
    assert m128.split_blocks is decode.split_blocks  # the same splits of whole 128s
    assert 64 * module("mla_decode").COMBINE_WAVES == configs.MLA_DECODE_COMBINE_THREADS
    assert module("ultraquant").THREADS == configs.ULTRAQUANT_THREADS


def test_handlers_header_holds_the_threads_per_workgroup():
    header = build_lib.configs_module().cpp_header()
    for name, value in (
        ("kSparseMlaThreads", configs.SPARSE_MLA_THREADS),
        ("kMlaDecodePartialsThreads", configs.MLA_DECODE_PARTIALS_THREADS),
        ("kMlaDecodeCombineThreads", configs.MLA_DECODE_COMBINE_THREADS),
        ("kUltraquantThreads", configs.ULTRAQUANT_THREADS),
    ):
        assert f"constexpr int64_t {name} = {value};" in header


def test_python_checks_read_the_list():
    assert calls.KERNEL_QLENS == configs.MLA_DECODE_QLENS
    assert calls.KERNEL_GROUP_SIZES == configs.ULTRAQUANT_GROUP_SIZES
    assert calls.KERNEL_BLOCK_SIZES == configs.ULTRAQUANT_BLOCK_SIZES


def test_handlers_header_is_generated_from_the_list():
    """build_lib loads configs.py by path (before installation) and writes the handlers' header;
    the handlers hard-code no configuration set."""
    header = build_lib.configs_module().cpp_header()
    assert "constexpr int64_t kSparseMaxHeads = 16;" in header
    assert "KernelQlen(int64_t v) { return v == 1 || v == 2 || v == 4; }" in header
    assert 'KernelBlockSizeText = "16, 32, 64, 128, 256"' in header
    assert "constexpr int64_t kMlaDecodeM128Rows = 128;" in header
    assert 'constexpr const char* kMlaDecodeM128 = "jsm_mla_decode_partials_m128";' in header
    assert "return qlen == 1 && heads > 0 &&" in header
    handlers = (build_lib.CSRC / "handlers.cc").read_text()
    assert '#include "jsm_configs.h"' in handlers
    hard_coded = ("qlen != 1", "g == 6", "bs == 16", "kSparseMaxHeads =", "bits != 8", "% 128")
    for text in (*hard_coded, "qlen == 1", '_m128"', "/ 16;", "+ 15"):
        assert text not in handlers


def test_symbols_are_unique_c_identifiers():
    names = [s for group in configs.symbols().values() for s in group]
    assert len(names) == len(set(names)) == len(configs.all_symbols())
    assert all(s.startswith("jsm_") and s.isidentifier() for s in names)


K8, K32 = 8192, 32768  # keys per request


@pytest.mark.parametrize(
    ("qlen", "heads", "batch", "keys", "rows"),
    [
        (1, 128, 64, K8, 128),  # 4 splits of 2048 keys fill 256 CUs
        (1, 128, 128, K8, 128),
        (1, 128, 16, K32, 128),  # 16 splits of 2048
        (1, 256, 32, K8, 128),  # 2 groups: 4 splits of 2048
        (1, 128, 512, 100, 128),  # one split each: no partials
        (1, 128, 1, K8, 16),  # 64 splits would leave 192 CUs idle
        (1, 128, 4, K32, 16),  # 64 splits of 512 keys: partials 1/2.5 of K's bytes
        (1, 128, 32, K8, 16),  # 8 splits of 1024
        (1, 192, 128, K8, 16),  # not whole groups of 128
        (2, 128, 128, K8, 16),
        (1, 0, 128, K8, 16),
    ],
)
def test_mla_decode_rows(qlen, heads, batch, keys, rows):
    """The 128-row kernel where it serves the shape and fills 256 CUs with splits of at least
    2048 keys (or one split); else the 16-row kernels. Its symbol and 64-key softmax blocks
    follow."""
    got = configs.mla_decode_rows(qlen, heads, batch, batch * keys, 256)
    assert got == rows
    symbol = configs.mla_decode_partials_launch(qlen, got)
    assert symbol in configs.user_symbols()
    assert (symbol == configs.MLA_DECODE_M128) == (rows == 128)
    assert configs.mla_decode_softmax_block(got) == (64 if rows == 128 else 128)
    assert configs.mla_decode_head_groups(qlen, heads, got) == -(-heads * qlen // rows)
