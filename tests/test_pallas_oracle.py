"""The Pallas kernels at small shapes against the float64 oracle, with the tolerance of
``tests/pallas_checks.py`` (bf16 P). ``implementation="pallas"`` runs the kernels in Pallas
interpret mode on the CPU and compiled on CUDA, so the same tests cover both."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels.pallas.ultraquant import ultraquant_partials_kernel
from tests import cases as C
from tests import oracle as O
from tests.pallas_checks import check_kernel_attention


def sparse_run(case):
    f = jax.jit(functools.partial(jsm.sparse_mla, sm_scale=case.sm_scale, return_lse=True,
                                  implementation="pallas"))  # fmt: skip
    return f(case.q, jnp.asarray(case.kv), jnp.asarray(case.idx), jnp.asarray(case.indptr))


def sparse_check(case):
    out, lse = sparse_run(case)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    ref, ref_lse, st = O.sparse_mla(case.q, case.kv, case.idx, case.indptr, case.sm_scale, True)
    check_kernel_attention(out, ref, st, lse, ref_lse, what="sparse_mla pallas")
    return out, lse


@pytest.mark.parametrize("h", [1, 12, 16, 64])
def test_sparse_heads(h):
    sparse_check(C.sparse_case(30 + h, n_q=4, h=h, n_rec=40))


def test_sparse_long_rows_split_and_scales():
    # rows of 1, 129 and 700 keys: the average row is long enough for internal splits + merge
    case = C.sparse_case(31, n_q=3, h=4, n_rec=300, sm_scale=0.3, q_scale=4.0,
                         long_rows={0: 1, 1: 129, 2: 700})  # fmt: skip
    sparse_check(case)


def test_sparse_masking_empty_and_indptr():
    r = C.rng(32)
    n_rec = 15
    kv = C.make_records(r, n_rec, nan_rows=[12, 13, 14]).reshape(3, 5, 656)
    rows = [[], [-1, -1], [n_rec, 2**31 - 1, -(2**31)], [11], [3, 3, 3, 5], [5, -1, n_rec, 3]]
    idx = np.int32([e for row in rows for e in row])
    indptr = np.int32(np.cumsum([0] + [len(row) for row in rows]))
    indptr[4] = indptr[3] - 1  # a decreasing pointer: row 3 is empty, row 4 grows
    case = C.SparseCase(C.bf16_normal(r, (len(rows), 16, 576)), kv, idx, indptr)
    out, lse = sparse_check(case)
    assert np.all(np.isneginf(np.asarray(lse)[[0, 1, 2, 3]]))


def decode_run(case, num_splits, fn=jsm.mla_decode, **kw):
    f = jax.jit(functools.partial(fn, qlen=case.qlen, num_splits=num_splits,
                                  implementation="pallas", **kw))  # fmt: skip
    return f(case.q, case.kv, jnp.asarray(case.kv_indices), jnp.asarray(case.kv_indptr),
             k_scale=jnp.float32(case.k_scale), v_scale=jnp.float32(case.v_scale))  # fmt: skip


def decode_oracle(case, num_splits=None):
    return O.mla_decode(case.q, case.kv_codes, case.kv_indices, case.kv_indptr, case.qlen,
                        case.k_scale, case.v_scale, case.sm_scale, num_splits=num_splits,
                        stats=True)  # fmt: skip


@pytest.mark.parametrize("qlen,h,num_splits", [(1, 4, None), (2, 12, 3), (4, 16, None)])
def test_decode(qlen, h, num_splits):
    case = C.decode_case(40 + qlen, seq_lens=(0, 1, 37, 300, 5), qlen=qlen, h=h, p_masked=0.1)
    out, lse = decode_run(case, num_splits, return_lse=True)
    ref, ref_lse, st = decode_oracle(case)
    check_kernel_attention(out, ref, st, lse, ref_lse, what="mla_decode pallas")


def test_decode_partials_and_merge():
    case = C.decode_case(45, seq_lens=(3, 300, 130), qlen=2, h=4, p_masked=0.1)
    o_parts, lse_parts = decode_run(case, 3, fn=jsm.mla_decode_partials)
    ref, ref_lse, st = decode_oracle(case, num_splits=3)
    n, s, h = lse_parts.shape
    check_kernel_attention(
        np.asarray(o_parts, np.float32).reshape(n * s, h, 512), ref.reshape(n * s, h, 512),
        [x for x in st for _ in range(s)], np.asarray(lse_parts).reshape(n * s, h),
        ref_lse.reshape(n * s, h), what="partials pallas",
    )  # fmt: skip
    o_parts = np.asarray(o_parts, np.float32).copy()
    lse_parts = np.asarray(lse_parts).copy()
    lse_parts[0, :, 1] = -np.inf  # every partial -inf: out 0, lse -inf
    o_parts[1, 0] = np.nan  # a -inf partial's o is ignored even when NaN
    lse_parts[1, 0] = -np.inf
    o, lse = jsm.merge_attn_states(jnp.asarray(o_parts), jnp.asarray(lse_parts),
                                   return_lse=True, implementation="pallas")  # fmt: skip
    ref_o, ref_l = O.merge_attn_states(o_parts, lse_parts)
    np.testing.assert_allclose(np.asarray(o), ref_o, rtol=2e-6, atol=2e-6 * np.abs(ref_o).max())
    np.testing.assert_allclose(np.asarray(lse), ref_l, rtol=1e-6)


def uq_args(case):
    return (case.q, jnp.asarray(case.cache), jnp.asarray(case.block_tables),
            jnp.asarray(case.seq_lens))  # fmt: skip


@pytest.mark.parametrize(
    "g,hk,bs,num_partitions", [(8, 2, 16, None), (6, 1, 64, 3), (16, 1, 16, None)]
)
def test_ultraquant(g, hk, bs, num_partitions):
    case = C.uq_case(50 + g, seq_lens=(0, 1, 40, 300), hk=hk, g=g, bs=bs, p_bad_block=0.1)
    out = jax.jit(functools.partial(jsm.ultraquant_decode, num_partitions=num_partitions,
                                    implementation="pallas"))(*uq_args(case))  # fmt: skip
    assert out.dtype == jnp.bfloat16 and out.shape == case.q.shape
    ref, _, st = O.ultraquant_decode(case.q, case.cache, case.block_tables, case.seq_lens,
                                     stats=True)  # fmt: skip
    check_kernel_attention(out, ref, st, heads_per_entry=g, what="ultraquant pallas")


def test_ultraquant_lse():
    # the op returns no lse: check the kernel's own (scores from the 3-piece rotated q)
    case = C.uq_case(55, seq_lens=(1, 40, 200), hk=2, g=8, bs=16, q_scale=4.0)
    kernel = functools.partial(
        ultraquant_partials_kernel, sm_scale=1 / 16, num_partitions=1, interpret=True
    )
    o, lse = jax.jit(kernel)(*uq_args(case))
    ref, ref_lse, st = O.ultraquant_decode(case.q, case.cache, case.block_tables, case.seq_lens,
                                           stats=True)  # fmt: skip
    check_kernel_attention(o[:, 0], ref, st, lse[:, 0], ref_lse, heads_per_entry=8,
                           what="ultraquant pallas lse")  # fmt: skip


def test_default_choice_is_by_lowering_platform():
    case = C.sparse_case(60, n_q=2, h=4, n_rec=20)
    args = (case.q, jnp.asarray(case.kv), jnp.asarray(case.idx), jnp.asarray(case.indptr))
    f = jax.jit(jsm.sparse_mla)
    triton = "__gpu$xla.gpu.triton"
    assert triton not in f.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert triton in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    chosen = "pallas" if jax.default_backend() == "gpu" else "xla"
    np.testing.assert_array_equal(
        np.asarray(f(*args), np.float32),
        np.asarray(jsm.sparse_mla(*args, implementation=chosen), np.float32),
    )
