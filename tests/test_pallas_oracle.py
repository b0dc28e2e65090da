"""What only the Pallas path has: the UltraQuant kernel's own lse (the op returns none) against
the float64 oracle, and implementation=None's choice by lowering platform. The op suites
(test_sparse_mla.py, test_mla_decode.py, test_ultraquant.py) run "pallas" like every other
implementation, with the tolerance of ``tests/pallas_checks.py`` (bf16 P)."""

import functools

import jax
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels.pallas.ultraquant import ultraquant_partials_kernel
from tests import cases as C
from tests import impls
from tests import oracle as O
from tests.pallas_checks import check_kernel_attention


def test_ultraquant_lse():
    # the op returns no lse: check the kernel's own (scores from the e4m3 rotated q)
    case = C.uq_case(55, seq_lens=(1, 40, 200), hk=2, g=8, bs=16, q_scale=4.0)
    kernel = functools.partial(
        ultraquant_partials_kernel, sm_scale=1 / 16, num_partitions=1, interpret=True
    )
    o, lse = jax.jit(kernel)(*case.args())
    ref, ref_lse, st = O.ultraquant_decode(
        case.q, case.cache, case.block_tables, case.seq_lens, stats=True
    )
    check_kernel_attention(
        o[:, 0], ref, st, lse[:, 0], ref_lse, heads_per_entry=8, what="ultraquant pallas lse"
    )


def test_default_choice_is_by_lowering_platform():
    """None lowered for the CPU holds no GPU kernel; lowered for CUDA (a Hopper target: no GPU
    is visible here, or a Hopper one is) it is the Mosaic GPU kernel; run, it equals what this
    machine's None picks (impls.default)."""
    case = C.sparse_case(60, n_q=2, h=4, n_rec=20)
    args = case.args()
    f = jax.jit(jsm.sparse_mla)
    gpu_calls = ("__gpu$xla.gpu.triton", "@mosaic_gpu")
    cpu_text = f.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert not any(call in cpu_text for call in gpu_calls)
    if impls.has_cuda() and not impls.has_mosaic():
        pytest.skip("this CUDA GPU is not a Hopper: None lowers elsewhere there (test_mosaic.py)")
    assert "@mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    np.testing.assert_array_equal(
        np.asarray(f(*args), np.float32),
        np.asarray(jsm.sparse_mla(*args, implementation=impls.default("sparse_mla")), np.float32),
    )
