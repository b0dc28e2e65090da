"""The Mosaic GPU sparse_mla kernel on any machine: its layout helpers against NumPy, and its
CUDA lowering (lowered here without a GPU).

Its numerics run in the shared suites (tests/test_sparse_mla.py and the others, through
tests/impls.py) on a Hopper GPU only: the kernel is inline PTX and wgmma and has no interpret
mode.
"""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels.mosaic import sparse_mla as K

sparse_mla_module = importlib.import_module("jax_sparse_mla.sparse_mla")  # the op's module


def test_permute_q_blocks_hold_even_and_odd_dims():
    """Block 2c + p, column j holds latent dim 128c + 2j + p; block 8 is the rope; heads are
    padded with zeros to hbs * m."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(3, 20, 576)).astype(np.float32)
    blocks = np.asarray(K._permute_q(jnp.asarray(q), 16, 2))
    assert blocks.shape == (3, 2, K.BLOCKS, 16, K.DB)
    heads = blocks.transpose(0, 1, 3, 2, 4).reshape(3, 32, K.BLOCKS, K.DB)
    for c in range(K.CHUNKS):
        for p in range(2):
            np.testing.assert_array_equal(
                heads[:, :20, 2 * c + p], q[:, :, 128 * c + p : 128 * c + 128 : 2]
            )
    np.testing.assert_array_equal(heads[:, :20, -1], q[:, :, 512:])
    assert not heads[:, 20:].any()


def test_unpermute_out_inverts_the_block_order():
    o = np.arange(2 * 512, dtype=np.float32).reshape(2, 512)
    permuted = np.concatenate(
        [o[:, 128 * c + p : 128 * c + 128 : 2] for c in range(K.CHUNKS) for p in range(2)], axis=1
    )
    np.testing.assert_array_equal(np.asarray(K._unpermute_out(jnp.asarray(permuted))), o)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_work_covers_each_row_once_in_tile_multiples(splits):
    """Each row's splits tile [start, start + length) in order, cut at multiples of T, with
    indptr clipped to [0, nnz] (a decreasing entry makes an empty row)."""
    nnz = 1000
    indptr = np.array([0, 0, 130, 129, 700, 2000, 900], np.int32)
    work = np.asarray(K._work(jnp.zeros(nnz, jnp.int32), jnp.asarray(indptr), splits))
    assert work.shape == (6, splits, K.WORK) and not work[..., 2:].any()
    for r in range(6):
        start = min(max(indptr[r], 0), nnz)
        end = min(max(indptr[r + 1], start), nnz)
        pos = start
        for s in range(splits):
            first, length = work[r, s, :2]
            assert length >= 0 and (length == 0 or first == pos)
            if s < splits - 1 and work[r, s + 1, 1]:
                assert length % K.T == 0
            pos += length
        assert pos == end, (r, work[r])


def test_register_split_fits_the_launch_allocation():
    """``setmaxnreg`` takes multiples of 8 in [24, 256], and the warpgroups together may hold
    no more than the CTA got at launch (ptxas: 65536 over ``.maxntid`` threads, rounded down
    to 8 each)."""
    threads = 128 * (K.CONSUMERS + 1)
    for regs in (K.consumer_registers(), K.PRODUCER_REGISTERS):
        assert regs % 8 == 0 and 24 <= regs <= 256
    held = 128 * (K.CONSUMERS * K.consumer_registers() + K.PRODUCER_REGISTERS)
    assert held <= 65536 // threads // 8 * 8 * threads


def test_stages_fit_shared_memory():
    """Two record stages fit beside the rest: one alone would leave the producer no room to
    run ahead of the consumers."""
    assert 2 <= K.stages_for() <= K.MAX_STAGES


def _lowered_text(n_q, h, rows, topk, implementation="mosaic"):
    args = (
        jax.ShapeDtypeStruct((n_q, h, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows, 656), jnp.uint8),
        jax.ShapeDtypeStruct((n_q * topk,), jnp.int32),
        jax.ShapeDtypeStruct((n_q + 1,), jnp.int32),
    )
    fn = jax.jit(lambda *a: jsm.sparse_mla(*a, implementation=implementation, return_lse=True))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("sm90", [True, False])
@pytest.mark.parametrize("n_q,h", [(1, 16), (4, 2), (128, 128)])
def test_none_lowers_to_mosaic_on_hopper_and_to_pallas_past_it(monkeypatch, sm90, n_q, h):
    """implementation=None for CUDA, whatever q's shape: the Mosaic GPU kernel on a Hopper GPU,
    the Pallas (Triton) one on a later GPU, which has no sm_90a wgmma."""
    monkeypatch.setattr(sparse_mla_module, "cuda_is_sm90", lambda: sm90)
    text = _lowered_text(n_q, h, 500, 64, implementation=None)
    assert ("@mosaic_gpu" in text) == sm90
    assert ("__gpu$xla.gpu.triton" in text) == (not sm90)


@pytest.mark.parametrize("h", [1, 16, 17, 32, 64, 128])
def test_cuda_lowering_hands_the_cache_itself_to_the_kernel(h):
    """One Mosaic GPU custom call per op call, whose cache operand is the argument itself (no
    view, pad or copy of it), for any head count (16 heads per CTA)."""
    text = _lowered_text(3, h, 5000, 200)
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    assert len(calls) == 1, text[:2000]
    assert calls[0].split(",")[0].strip() == "%arg1"


def test_cuda_lowering_of_a_cache_over_4_gib_has_no_copy_of_it():
    """Past 2^32 bytes (and past 2^31 records' bytes) the kernel still reads the cache in place:
    its byte offsets are 64-bit (``mul.wide`` in the gather)."""
    rows = 2**32 // 656 + 10
    text = _lowered_text(2, 16, rows, 64)
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    assert calls and calls[0].split(",")[0].strip() == "%arg1"
    assert "mul.wide.s32" in K._GATHER_PTX


def test_more_than_2_31_records_is_refused_by_name():
    args = (
        jax.ShapeDtypeStruct((1, 16, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((2**31, 656), jnp.uint8),
        jax.ShapeDtypeStruct((64,), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
    )
    fn = jax.jit(lambda *a: K.sparse_mla_mosaic(*a, 0.1))
    with pytest.raises(NotImplementedError, match="int32 record indices"):
        fn.trace(*args)


@pytest.mark.parametrize("implementation", ["mosaic", None])
def test_vmap_runs_the_kernel_once_per_batch_element(implementation):
    """Under vmap, "mosaic" and None (the Mosaic kernel on Hopper) both lower for CUDA to one
    Mosaic GPU call inside a loop over the batch (the kernel's own vmap rule; it has no
    batched grid)."""
    args = (
        jax.ShapeDtypeStruct((2, 128, 16, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1000, 656), jnp.uint8),
        jax.ShapeDtypeStruct((2, 128 * 64), jnp.int32),
        jax.ShapeDtypeStruct((2, 129), jnp.int32),
    )
    fn = jax.vmap(
        lambda q, kv, i, p: jsm.sparse_mla(q, kv, i, p, implementation=implementation),
        (0, None, 0, 0),
    )
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "stablehlo.while" in text
