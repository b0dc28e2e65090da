"""The 128-row mla_decode partials kernel (``kernels/gfx950/mla_decode_m128.py``): what is its
own. Its build (no spill, LDS, occupancy: ``tests/test_codeobject.py``), its barriers and its
prologue order (``tests/test_isa.py``) are checked with every configuration's; here its ISA
keeps the design's instruction counts, and its lane mappings compute one block's scores and PV
exactly.

The ISA test needs the kernel build (``python -m jax_sparse_mla.build --arch gfx950``); the
layout test needs flydsl (the kernel module's address helpers).
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_sparse_mla._build import build_lib
from jax_sparse_mla._build.codeobject import read_kernel_resources
from jax_sparse_mla._build.isa import kernel_text
from jax_sparse_mla.kernels.gfx950 import configs


def test_isa_has_the_design():
    """Per 64-key block 36 QK + 32 PV scaled MFMAs, 128 V transposing reads and 5 DMA (and 5
    DMA in the prologue); the LDS the module states."""
    K = pytest.importorskip("jax_sparse_mla.kernels.gfx950.mla_decode_m128")
    kernel_dir = build_lib.DEFAULT_KERNEL_DIR
    entries = {e["symbol"]: e for e in build_lib.manifest_kernels(kernel_dir)}
    if configs.MLA_DECODE_M128 not in entries:
        pytest.skip(f"no kernel build at {kernel_dir}: python -m jax_sparse_mla.build")
    entry = entries[configs.MLA_DECODE_M128]
    (r,) = read_kernel_resources((kernel_dir / entry["object"]).read_bytes())
    assert r.lds_bytes == K.LDS_BYTES and r.workgroup_size == K.THREADS
    isa = (kernel_dir / entry["isa"]).read_text()
    code = "\n".join(line for _, line in kernel_text(isa, r.name))
    assert code.count("v_mfma_scale_f32_16x16x128_f8f6f4") == K.QK_STEPS * K.KEY_TILES + K.LAT_TILES
    assert code.count("ds_read_b64_tr_b8") == 4 * K.LAT_TILES
    assert code.count("global_load_lds_dwordx4") == 2 * K.DMA_INSTR


# ---------------------------------------------------------------------------------------------
# The kernel's data layout, lane by lane (the kernel module's own address helpers; the MFMA and
# tr8 semantics of tests/test_emulation_mla_decode.py)
# ---------------------------------------------------------------------------------------------


def _permlane32_swap(first, second):
    """v_permlane32_swap on [64, ...] lane data: rows 2 and 3 (lanes 32..63) of ``first`` are
    swapped with rows 0 and 1 of ``second``; returns (first', second')."""
    return (
        np.concatenate([first[:32], second[:32]]),
        np.concatenate([first[32:], second[32:]]),
    )


def _other_halves(first, second):
    """The other reading of the swap: rows 0 and 1 of ``first`` with rows 2 and 3 of ``second``."""
    return (
        np.concatenate([second[32:], first[32:]]),
        np.concatenate([second[:32], first[:32]]),
    )


def _other_order(first, second):
    """The other reading of the results: the two returned in the other order."""
    return _permlane32_swap(first, second)[::-1]


LANES = np.arange(64)
T, G = LANES & 15, LANES >> 4  # lane (row / key t, lane group g)
BYTE = np.arange(16)


def _slot(K, codes):
    """The K slot after every wave's DMA of the block's ``codes`` [64 keys, 576]."""
    lds = np.zeros(K.SLOT_BYTES, np.uint8)
    for w in range(K.WAVES):
        for i in range(K.DMA_INSTR):
            key, off, copies = K._dma_source(w, LANES, i)
            dst = w * K.DMA_BYTES + 1024 * i + 16 * LANES[copies]
            lds[dst[:, None] + BYTE] = codes[key[copies, None], off[copies, None] + BYTE]
    return lds


def _pv(K, lds, p_hi, p_lo, swap=_permlane32_swap):
    """O [16 rows, 512] of one block as the kernel's PV computes it: P's e4m3 hi / lo codes
    [16 rows, 64 keys] paired by ``swap``, V^T by the tr8 reads of the slot."""
    from tests.test_emulation_mla_decode import _mfma, _tr8

    first, second = [], []
    for kt in range(K.KEY_TILES):
        keys = 16 * kt + 4 * G[:, None] + np.arange(4)
        x, y = swap(p_hi[T[:, None], keys], p_lo[T[:, None], keys])
        first.append(x)
        second.append(y)
    b = np.concatenate(first + second, 1)  # [64 lanes, 32 bytes]
    p_scale = np.where(G % 2 == 0, 127, 122)
    v_base = K._v_bases(T, G & 1)
    o = np.zeros((16, 512))
    for jt in range(K.LAT_TILES):
        a = np.concatenate([_tr8(lds, v_base[jt % 2] + K._v_const(jt, q)) for q in range(4)], 1)
        lat = 16 * jt + 4 * G[:, None] + np.arange(4)
        o[T[:, None], lat] = _mfma(a, b, np.full(64, 127), p_scale)
    return o


def _block(K, seed):
    """A block's K codes (no NaN) and P [16 rows, 64 keys] in [0, 256) with its hi / lo."""
    from tests import cases as C
    from tests import oracle as O

    r = C.rng(seed)
    codes = r.integers(0, 256, (K.BLOCK, 576)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    p = r.uniform(0, 256, (16, K.BLOCK))
    p_hi = O.e4m3_encode(p)
    p_lo = O.e4m3_encode((p - O.e4m3_decode(p_hi)) * 32)
    want_o = (O.e4m3_decode(p_hi) + O.e4m3_decode(p_lo) / 32) @ O.e4m3_decode(codes[:, :512])
    return r, codes, p_hi, p_lo, want_o


def test_kernel_layout():
    """One 64-key block through the kernel's lane mappings (each wave's DMA into the swizzled
    slot, the QK A operands with q's hi / lo as B, P's hi / lo paired by v_permlane32_swap,
    the tr8 V^T reads) computes ``S = K (hi + lo / 32) 2^(s - 127)`` and
    ``O = (hi + lo / 32)_P V`` exactly, for every key and latent."""
    pytest.importorskip("flydsl", reason="the kernel module (its address helpers) needs flydsl")
    K = pytest.importorskip("jax_sparse_mla.kernels.gfx950.mla_decode_m128")
    from tests.test_emulation_mla_decode import _mfma, q_operands

    r, codes, p_hi, p_lo, want_o = _block(K, 12)
    lds = _slot(K, codes)
    key, chunk = np.meshgrid(np.arange(K.BLOCK), np.arange(36), indexing="ij")
    at = 576 * key + 16 * K._swizzle(key, chunk)
    np.testing.assert_array_equal(lds[at[..., None] + BYTE], codes.reshape(K.BLOCK, 36, 16))

    hi, lo, k_scale_b, want_s = q_operands(r, codes)
    k_rd = K._k_offsets(T, G & 1)
    for kt in range(K.KEY_TILES):
        acc = 0
        for s in range(9):
            base = kt * 16 * 576 + 64 * s
            a = np.concatenate([lds[base + k_rd[h][:, None] + BYTE] for h in range(2)], 1)
            dims = 64 * s + 32 * (G[:, None] & 1) + np.arange(32)
            b = np.where(G[:, None] < 2, hi[T[:, None], dims], lo[T[:, None], dims])
            acc = acc + _mfma(a, b, np.full(64, 127), k_scale_b)
        keys = 16 * kt + 4 * G[:, None] + np.arange(4)
        np.testing.assert_allclose(acc, want_s[keys, T[:, None]], rtol=1e-12, atol=1e-300)

    np.testing.assert_allclose(_pv(K, lds, p_hi, p_lo), want_o, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("swap", [_other_halves, _other_order])
def test_the_other_swap_readings_are_far_off(swap):
    """Had ``v_permlane32_swap`` the other direction (no MI355 probe checks it), P's hi / lo
    would meet other keys' V or the other scale: O far outside the self-check's bound (2^-7
    of |o| and more), which its 128-row cases would report."""
    pytest.importorskip("flydsl", reason="the kernel module (its address helpers) needs flydsl")
    K = pytest.importorskip("jax_sparse_mla.kernels.gfx950.mla_decode_m128")
    _, codes, p_hi, p_lo, want_o = _block(K, 13)
    wrong = _pv(K, _slot(K, codes), p_hi, p_lo, swap)
    assert np.median(np.abs(wrong - want_o) / np.abs(want_o)) > 2**-3
