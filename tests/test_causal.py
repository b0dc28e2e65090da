"""Causal masking never multiplies a hidden value (mla_decode, qlen > 1): a key hidden from a
query position contributes exactly nothing to that position's output and LSE whatever its bytes
hold (NaN included), while a key that a position sees still propagates its NaN. Every
implementation (tests/impls.py): the gfx950 kernels and their emulation zero the boundary keys'
NaN V codes after the scores, so the hidden positions are bit for bit those of clean keys."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests import cases as C
from tests import impls

QLEN = 4
NAN_CODE = 0x7F


def _case(seq_lens=(9, 6)):
    c = C.decode_case(21, seq_lens=seq_lens, h=2, qlen=QLEN, n_nan=0, as_uint8=True)
    return c, np.asarray(c.kv_codes).copy()


def _run(impl, c, codes, num_splits=None):
    fn = impls.decode_fn(jsm.mla_decode, impl, c, num_splits=num_splits, return_lse=True)
    return fn(c.q, jnp.asarray(codes), jnp.asarray(c.kv_indices), jnp.asarray(c.kv_indptr))


@impls.each_decode
@pytest.mark.parametrize("num_splits", [1, 2])
def test_hidden_nan_key_changes_nothing(impl, num_splits):
    """Request 0's last key (position 8) is hidden from positions 0..2, seen by position 3.
    NaN in it (K and V bytes) leaves rows 0..2 bit for bit as they were and makes row 3 NaN."""
    c, codes = _case()
    out0, lse0 = (np.asarray(x, np.float32) for x in _run(impl, c, codes, num_splits=num_splits))
    assert np.all(np.isfinite(out0)) and np.all(np.isfinite(lse0))
    last = int(c.kv_indices[c.kv_indptr[1] - 1])
    for cols in (slice(0, 512), slice(0, 576), slice(7, 8)):  # V and K, all of it, one V dim
        bad = codes.copy()
        bad[last, cols] = NAN_CODE
        out, lse = (np.asarray(x, np.float32) for x in _run(impl, c, bad, num_splits=num_splits))
        hidden = slice(0, QLEN - 1)  # request 0's positions 0 .. qlen-2
        assert out[hidden].tobytes() == out0[hidden].tobytes(), (impl, cols)
        assert lse[hidden].tobytes() == lse0[hidden].tobytes(), (impl, cols)
        assert np.all(np.isnan(out[QLEN - 1])) and np.all(np.isnan(lse[QLEN - 1]))  # it sees it
        assert out[QLEN:].tobytes() == out0[QLEN:].tobytes()  # request 1 untouched


@impls.each_decode
def test_hidden_keys_of_a_short_request(impl):
    """seq_len < qlen: position i sees keys j <= seq_len - qlen + i; a position with no key
    gives 0 and -inf even when every hidden key is NaN."""
    c, codes = _case(seq_lens=(2, 5))
    bad = codes.copy()
    bad[np.asarray(c.kv_indices[:2])] = NAN_CODE
    out, lse = (np.asarray(x, np.float32) for x in _run(impl, c, bad))
    # request 0: seq_len 2, qlen 4 -> positions 0, 1 see nothing, positions 2, 3 see NaN keys
    assert np.all(out[:2] == 0) and np.all(np.isneginf(lse[:2]))
    assert np.all(np.isnan(out[2:4])) and np.all(np.isnan(lse[2:4]))
    assert np.all(np.isfinite(out[4:])) and np.all(np.isfinite(lse[4:]))
