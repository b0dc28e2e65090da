"""validate=True: the data checks run where the data lives and only their findings (counts, a
first bad index and its value) reach the host; a bad record scale is named by its kv row; under
jax.jit a failure stops the call with the op's own message and nothing on stderr, and inside
jax_sparse_mla.checked it raises the op's own DataError."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_sparse_mla as jsm
from jax_sparse_mla import _checks
from tests import cases as C

RUNTIME_ERRORS = (ValueError, jax.errors.JaxRuntimeError)


def _sparse(bad_row=None):
    r = C.rng(50)
    kv = C.make_records(r, 12)
    if bad_row is not None:
        kv[bad_row, 516:520] = np.frombuffer(np.float32(3.0).tobytes(), np.uint8)  # scale 1
    q = C.bf16_normal(r, (3, 2, 576))
    idx = np.int32([0, 1, 9, 9, 11, -1])  # rows 0, 1, 9, 11 referenced
    indptr = np.int32([0, 2, 4, 6])
    return q, jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(indptr)


def _bad_sparse(bad):
    """sparse_mla's arguments with one bad scale (kv row 9), idx entry or indptr entry."""
    q, kv, idx, indptr = _sparse(bad_row=9 if bad == "scale" else None)
    if bad == "idx":
        idx = idx.at[3].set(12)
    if bad == "indptr":
        indptr = indptr.at[2].set(1)
    return q, kv, idx, indptr


SCALE_MSG = r"sparse_mla: kv row 9 scale 1 \(latent dims 128\.\.255\) is 3\.0, not a positive power"


def test_names_the_kv_row_eagerly():
    args = _sparse(bad_row=9)
    with pytest.raises(ValueError, match=SCALE_MSG):
        jsm.sparse_mla(*args, validate=True)
    with pytest.raises(ValueError, match=SCALE_MSG):
        jsm.validate_sparse_mla(*args)
    jsm.sparse_mla(*_sparse(bad_row=5), validate=True)  # row 5 is not referenced


def test_two_d_idx_is_named_at_its_row_and_column():
    """validate_sparse_mla takes what sparse_mla takes (2-D idx, topk_length); a bad entry is
    named where the caller put it; entries past topk_length are masked, so never flagged."""
    q, kv, _, _ = _sparse()
    topk = np.full((q.shape[0], 4), -1, np.int32)
    topk[:, :2] = 1
    topk[2, 3] = 99
    message = r"sparse_mla: idx\[2, 3\] = 99 is outside"
    with pytest.raises(ValueError, match=message):
        jsm.validate_sparse_mla(q, kv, topk)
    with pytest.raises(ValueError, match=message):
        jsm.sparse_mla(q, kv, topk, validate=True)
    lengths = np.full(q.shape[0], 3, np.int32)
    jsm.validate_sparse_mla(q, kv, topk, topk_length=lengths)


@pytest.mark.parametrize("bad", ["scale", "idx", "indptr"])
def test_under_jit_the_ops_message_and_a_quiet_stderr(bad, capfd):
    q, kv, idx, indptr = _bad_sparse(bad)
    f = jax.jit(lambda *a: jsm.sparse_mla(*a, validate=True))
    with pytest.raises(ValueError) as eager:
        jsm.validate_sparse_mla(q, kv, idx, indptr)
    capfd.readouterr()
    with pytest.raises(RUNTIME_ERRORS) as e:
        jax.block_until_ready(f(q, kv, idx, indptr))
    assert str(eager.value) in str(e.value)  # the same message as eagerly
    assert capfd.readouterr().err == ""  # no callback traceback logged


def test_under_jit_valid_input_runs(capfd):
    args = _sparse()
    out = jax.jit(lambda *a: jsm.sparse_mla(*a, validate=True))(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jsm.sparse_mla(*args)))
    assert capfd.readouterr().err == ""


def _validated_sparse(*a):
    return jsm.sparse_mla(*a, validate=True)


@pytest.mark.parametrize("where", ["checked(jit)", "jit inside checked"])
@pytest.mark.parametrize("bad", ["scale", "idx", "indptr"])
def test_checked_raises_the_ops_data_error(bad, where, capfd):
    args = _bad_sparse(bad)
    with pytest.raises(ValueError) as eager:
        jsm.validate_sparse_mla(*args)
    f = jax.jit(_validated_sparse)
    g = jsm.checked(f) if where == "checked(jit)" else jsm.checked(lambda *a: 2 * f(*a))
    capfd.readouterr()
    with pytest.raises(jsm.DataError) as e:
        g(*args)
    assert str(e.value) == str(eager.value)
    if bad == "scale":
        assert "kv row 9 scale 1" in str(e.value)
    assert capfd.readouterr().err == ""


def test_checked_valid_input_gives_the_unvalidated_output(capfd):
    args = _sparse()
    want = np.asarray(jsm.sparse_mla(*args))
    f = jax.jit(_validated_sparse)
    np.testing.assert_array_equal(np.asarray(jsm.checked(f)(*args)), want)
    np.testing.assert_array_equal(np.asarray(jsm.checked(_validated_sparse)(*args)), want)
    assert capfd.readouterr().err == ""


def test_checked_and_plain_jit_share_one_jitted_function():
    """jit traces again when the mode changes: each call gets its own form of the checks."""
    good, bad = _sparse(), _bad_sparse("idx")
    f = jax.jit(_validated_sparse)
    jax.block_until_ready(f(*good))  # traced with the host callback
    with pytest.raises(jsm.DataError, match=r"idx\[3\] = 12 is outside"):
        jsm.checked(f)(*bad)
    with pytest.raises(RUNTIME_ERRORS, match=r"idx\[3\] = 12 is outside"):
        jax.block_until_ready(f(*bad))  # the callback form again (formatted on the host)
    np.testing.assert_array_equal(np.asarray(jsm.checked(f)(*good)), np.asarray(f(*good)))


def test_checked_decode_ultraquant_and_vmap(capfd):
    c = C.decode_case(53, seq_lens=(4, 9), h=2, n_nan=0)
    bad = jnp.asarray(c.kv_indices).at[5].set(10**6)
    f = jsm.checked(jax.jit(lambda *a: jsm.mla_decode(*a, validate=True)))
    with pytest.raises(jsm.DataError, match=r"mla_decode: kv_indices\[5\] = 1000000 is outside"):
        f(c.q, c.kv, bad, jnp.asarray(c.kv_indptr))
    u = C.uq_case(54, seq_lens=(3, 20), hk=1, g=2)
    bt = jnp.asarray(u.block_tables).at[1, 0].set(-5)
    g = jsm.checked(jax.jit(lambda *a: jsm.ultraquant_decode(*a, validate=True)))
    with pytest.raises(jsm.DataError, match=r"ultraquant_decode: block_tables\[1, 0\] = -5"):
        g(u.q, jnp.asarray(u.cache), bt, jnp.asarray(u.seq_lens))
    q, kv, idx, indptr = _sparse(bad_row=11)
    h = jsm.checked(jax.vmap(lambda x: _validated_sparse(x, kv, idx, indptr)))
    with pytest.raises(jsm.DataError, match="kv row 11 scale 1"):
        h(jnp.stack([q, q]))
    assert capfd.readouterr().err == ""


def test_checked_leaves_other_checks_and_jit_alone():
    def positive(x):
        checkify.check(x > 0, "x must be positive, got {}", x)
        return x

    with pytest.raises(ValueError, match="x must be positive") as e:
        jsm.checked(positive)(jnp.float32(-1))
    assert not isinstance(e.value, jsm.DataError)
    with pytest.raises(TypeError, match="checked: call it outside jax.jit"):
        jax.jit(jsm.checked(_validated_sparse))(*_sparse())


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _callback_operands(fn, *args):
    """Sizes of the arrays every host callback of ``jit(fn)`` receives."""
    return [
        int(np.prod(v.aval.shape))
        for eqn in _eqns(jax.make_jaxpr(fn)(*args).jaxpr)
        if "callback" in eqn.primitive.name
        for v in eqn.invars
    ]


def test_the_kv_cache_stays_on_the_device():
    q, kv, idx, indptr = _sparse()
    kv = jnp.concatenate([kv] * 40)  # 480 rows: a copy would show
    sizes = _callback_operands(lambda *a: jsm.sparse_mla(*a, validate=True), q, kv, idx, indptr)
    assert sizes and max(sizes) <= 3, sizes
    c = C.decode_case(51, seq_lens=(4, 9), h=2, n_nan=0)
    args = (c.q, c.kv, jnp.asarray(c.kv_indices), jnp.asarray(c.kv_indptr))
    sizes = _callback_operands(lambda *a: jsm.mla_decode(*a, validate=True), *args)
    assert sizes and max(sizes) <= 3, sizes
    u = C.uq_case(52, seq_lens=(3, 20), hk=1, g=2)
    args = (u.q, jnp.asarray(u.cache), jnp.asarray(u.block_tables), jnp.asarray(u.seq_lens))
    sizes = _callback_operands(lambda *a: jsm.ultraquant_decode(*a, validate=True), *args)
    assert sizes and max(sizes) <= 3, sizes


def test_under_checked_the_kv_cache_stays_on_the_device():
    """Inside ``checked`` no callback at all; the error value carries scalars only."""
    q, kv, idx, indptr = _sparse()
    kv = jnp.concatenate([kv] * 40)
    with _checks._CHECKIFY(True):
        closed = jax.make_jaxpr(checkify.checkify(_validated_sparse))(q, kv, idx, indptr)
    names = [eqn.primitive.name for eqn in _eqns(closed.jaxpr)]
    assert not [n for n in names if "callback" in n or n == "check"], names
    *error, out = closed.out_avals
    assert out.shape == (3, 2, 512) and error
    assert max(int(np.prod(a.shape)) for a in error) <= 1


def test_decode_and_ultraquant_under_jit(capfd):
    c = C.decode_case(53, seq_lens=(4, 9), h=2, n_nan=0)
    bad = jnp.asarray(c.kv_indices).at[5].set(10**6)
    f = jax.jit(lambda *a: jsm.mla_decode(*a, validate=True))
    with pytest.raises(RUNTIME_ERRORS, match=r"mla_decode: kv_indices\[5\] = 1000000 is outside"):
        jax.block_until_ready(f(c.q, c.kv, bad, jnp.asarray(c.kv_indptr)))
    u = C.uq_case(54, seq_lens=(3, 20), hk=1, g=2)
    bt = jnp.asarray(u.block_tables).at[1, 0].set(-5)
    g = jax.jit(lambda *a: jsm.ultraquant_decode(*a, validate=True))
    with pytest.raises(RUNTIME_ERRORS, match=r"ultraquant_decode: block_tables\[1, 0\] = -5"):
        jax.block_until_ready(g(u.q, jnp.asarray(u.cache), bt, jnp.asarray(u.seq_lens)))
    assert capfd.readouterr().err == ""


def test_under_vmap():
    q, kv, idx, indptr = _sparse()
    qs = jnp.stack([q, q])
    out = jax.vmap(lambda x: jsm.sparse_mla(x, kv, idx, indptr, validate=True))(qs)
    assert out.shape == (2, 3, 2, 512)
    bad_kv = _sparse(bad_row=11)[1]
    with pytest.raises(RUNTIME_ERRORS, match="kv row 11 scale 1"):
        jax.block_until_ready(
            jax.vmap(lambda x: jsm.sparse_mla(x, bad_kv, idx, indptr, validate=True))(qs)
        )


def test_records_named_by_their_index():
    r = C.rng(55)
    rec = np.array(jsm.pack_fp8_ds_mla(C.random_latent(r, 6), C.random_rope(r, 6)))
    rec[4, 524:528] = np.frombuffer(np.float32(2.0**9).tobytes(), np.uint8)  # scale 3 > 2^7
    with pytest.raises(ValueError, match=r"records 4 scale 3 .* > 2\^7"):
        jsm.validate_fp8_ds_mla_records(rec)
    with pytest.raises(ValueError, match=r"records \(1, 1\) scale 3"):
        jsm.validate_fp8_ds_mla_records(rec.reshape(2, 3, 656))
