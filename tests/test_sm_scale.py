"""Any finite ``sm_scale`` gives a finite result where the exact attention is finite: the
exact path, the Pallas and the Mosaic GPU kernels ("mosaic": a Hopper GPU, ``gpu`` marker) and
the gfx950 kernels' emulation take the running maximum of the scores times the scale's sign and
multiply by |sm_scale| only after it is subtracted (and merges of partials whose lse overflows
float32 keep the overflowed ones). A scale of 1e37 makes every scaled score overflow float32
(|q·k| is ~10 here); the float64 oracle does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests import cases as C
from tests import oracle as O

SCALES = [1e37, -1e37]
MOSAIC = pytest.param("mosaic", marks=pytest.mark.gpu)  # a Hopper GPU; no interpret mode
IMPLS = ["xla", "pallas", MOSAIC]  # "pallas": interpret mode on the CPU


def _close(got, want, what):
    """Within the bf16 output rounding (2^-8 |want|) plus 2^-8 of the row's largest value."""
    got, want = np.asarray(jnp.asarray(got, jnp.float32), np.float64), np.asarray(want)
    assert np.all(np.isfinite(got)), what
    tol = 2.0**-8 * np.abs(want) + 2.0**-8 * np.max(np.abs(want), axis=-1, keepdims=True)
    assert np.all(np.abs(got - want) <= tol), (what, np.max(np.abs(got - want)))


# the gfx950 sparse_mla kernel also scales after the max; its emulation is its arithmetic
@pytest.mark.parametrize("impl", [*IMPLS, "gfx950_emulation"])
@pytest.mark.parametrize("sm_scale", SCALES)
def test_sparse_mla(sm_scale, impl):
    c = C.sparse_case(5, n_q=4, h=2, n_rec=30, p_oob=0.0, p_neg=0.0, p_dup=0.0, min_len=1)
    out = jsm.sparse_mla(*c.args(), sm_scale=sm_scale, implementation=impl)
    _close(out, O.sparse_mla(c.q, c.kv, c.idx, c.indptr, sm_scale)[0], "sparse_mla")
    grad = jax.grad(
        lambda q: jnp.sum(jsm.sparse_mla(q, *c.args()[1:], sm_scale=sm_scale).astype(jnp.float32))
    )(c.q)
    assert np.all(np.isfinite(np.asarray(grad, np.float32)))


@pytest.mark.parametrize("impl", [*IMPLS, "gfx950_emulation"])
@pytest.mark.parametrize("sm_scale", SCALES)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_mla_decode(sm_scale, num_splits, impl):
    c = C.decode_case(6, seq_lens=(3, 140), h=2, n_nan=0)
    scales = dict(k_scale=c.k_scale, v_scale=c.v_scale, sm_scale=sm_scale)
    out = jsm.mla_decode(*c.args(), **scales, num_splits=num_splits, implementation=impl)
    want = C.decode_oracle(C.dataclasses.replace(c, sm_scale=sm_scale))[0]
    if num_splits == 1:
        _close(out, want, "mla_decode")
    else:  # the splits' lse overflow float32: their relative weights are lost, not finiteness
        assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.parametrize("impl", [*IMPLS, "gfx950_emulation"])
@pytest.mark.parametrize("sm_scale", SCALES)
def test_ultraquant_decode(sm_scale, impl):
    c = C.uq_case(7, seq_lens=(5, 40), hk=1, g=2)
    out = jsm.ultraquant_decode(*c.args(), sm_scale=sm_scale, num_partitions=1, implementation=impl)
    want = O.ultraquant_decode(c.q, c.cache, c.block_tables, c.seq_lens, sm_scale)[0]
    _close(out, want, "ultraquant_decode")
