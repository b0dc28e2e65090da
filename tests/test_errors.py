"""Bad arguments: trace-time ValueError / TypeError naming the argument; data checks with
validate=True and the validate_* functions; implementation selection."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests import cases as C
from tests import oracle as O


def names(exc_info, *candidates):
    msg = str(exc_info.value)
    assert any(re.search(rf"(?<![\w]){re.escape(c)}(?![\w])", msg) for c in candidates), (
        f"message does not name any of {candidates}: {msg!r}"
    )


# ---------------------------------------------------------------------------------------------
# sparse_mla
# ---------------------------------------------------------------------------------------------


def sparse_args():
    r = C.rng(0)
    kv = jnp.asarray(C.make_records(r, 8))
    q = C.bf16_normal(r, (3, 2, 576))
    idx = jnp.asarray(np.int32([0, 1, 2, 7, -1]))
    indptr = jnp.asarray(np.int32([0, 2, 2, 5]))
    return dict(q=q, kv=kv, idx=idx, indptr=indptr)


SPARSE_BAD = [
    ("q", lambda a: a["q"].astype(jnp.float32), TypeError),
    ("q", lambda a: a["q"].astype(jnp.float16), TypeError),
    ("q", lambda a: a["q"][0], ValueError),
    ("q", lambda a: a["q"][..., :512], ValueError),
    ("kv", lambda a: a["kv"].astype(jnp.int8), TypeError),
    ("kv", lambda a: a["kv"].astype(jnp.float32), TypeError),
    ("kv", lambda a: a["kv"][:, :655], ValueError),
    ("idx", lambda a: a["idx"].astype(jnp.float32), TypeError),
    ("idx", lambda a: np.asarray(a["idx"], np.int64), TypeError),
    ("idx", lambda a: a["idx"][None], ValueError),
    ("indptr", lambda a: a["indptr"][:-1], ValueError),
    ("indptr", lambda a: a["indptr"].astype(jnp.float32), TypeError),
    ("indptr", lambda a: a["indptr"][None], ValueError),
]


@pytest.mark.parametrize("name,mutate,exc", SPARSE_BAD)
def test_sparse_mla_static(name, mutate, exc):
    a = sparse_args()
    a[name] = mutate(a)
    with pytest.raises(exc) as e:
        jsm.sparse_mla(a["q"], a["kv"], a["idx"], a["indptr"])
    names(e, name)
    if isinstance(a[name], jax.Array):  # (jit canonicalizes a numpy int64 array to int32)
        with pytest.raises(exc) as e:  # at trace time under jit too
            jax.jit(jsm.sparse_mla)(a["q"], a["kv"], a["idx"], a["indptr"])
        names(e, name)
    with pytest.raises(exc) as e:
        jsm.validate_sparse_mla(a["q"], a["kv"], a["idx"], a["indptr"])
    names(e, name)


def test_implementation_selection():
    a = sparse_args()
    args = (a["q"], a["kv"], a["idx"], a["indptr"])
    # "flydsl" is a ROCm custom call: on the CPU no handler is registered for it, so it fails
    # when lowered, naming ROCm (tests/test_dispatch.py: the MI355 and the build command too)
    with pytest.raises(NotImplementedError, match="implementation='flydsl' .* ROCm only"):
        jsm.sparse_mla(*args, implementation="flydsl")
    with pytest.raises(NotImplementedError, match="sm_scale must be static"):
        jax.jit(lambda s: jsm.sparse_mla(*args, sm_scale=s, implementation="flydsl"))(0.1)
    with pytest.raises(ValueError) as e:
        jsm.sparse_mla(*args, implementation="cuda")
    names(e, "implementation")
    d = decode_args()
    dec = functools.partial(jsm.mla_decode, qlen=2)
    par = functools.partial(jsm.mla_decode_partials, qlen=2)
    for f, args_ in (
        (dec, (d["q"], d["kv"], d["kv_indices"], d["kv_indptr"])),
        (par, (d["q"], d["kv"], d["kv_indices"], d["kv_indptr"])),
        (jsm.ultraquant_decode, tuple(uq_args().values())),
    ):
        with pytest.raises(NotImplementedError, match="ROCm only"):
            f(*args_, implementation="flydsl")
        with pytest.raises(ValueError) as e:
            f(*args_, implementation="nope")
        names(e, "implementation")
        for impl in ("xla", "pallas"):  # pallas: interpret mode off CUDA
            jax.jit(functools.partial(f, implementation=impl))(*args_)


def _scale_bytes(s):
    return np.frombuffer(np.float32(s).tobytes(), np.uint8)


SPARSE_DATA_BAD = [
    ("idx", lambda a: a.update(idx=jnp.asarray(np.int32([0, 1, 2, 8, -1])))),
    ("idx", lambda a: a.update(idx=jnp.asarray(np.int32([0, 1, 2, -2, -1])))),
    ("indptr", lambda a: a.update(indptr=jnp.asarray(np.int32([0, 3, 2, 5])))),
    ("indptr", lambda a: a.update(indptr=jnp.asarray(np.int32([0, 2, 2, 4])))),
    ("indptr", lambda a: a.update(indptr=jnp.asarray(np.int32([0, 2, 2, 6])))),
    ("indptr", lambda a: a.update(indptr=jnp.asarray(np.int32([-1, 2, 2, 5])))),
]


def _bad_scale(value):
    def f(a):
        kv = np.array(a["kv"])
        kv[7, 516:520] = _scale_bytes(value)  # record 7 is referenced
        a.update(kv=jnp.asarray(kv))

    return f


SCALE_BAD = [0.75, 3.0, 2.0**8, 2.0**20, 0.0, -1.0, np.nan, np.inf]


@pytest.mark.parametrize(
    "name,mutate",
    SPARSE_DATA_BAD + [("scale", _bad_scale(s)) for s in SCALE_BAD],
    ids=[f"{n}{i}" for i, (n, _) in enumerate(SPARSE_DATA_BAD)] + [f"scale{s}" for s in SCALE_BAD],
)
def test_sparse_mla_validate(name, mutate):
    a = sparse_args()
    jsm.validate_sparse_mla(a["q"], a["kv"], a["idx"], a["indptr"])  # valid: no error
    jsm.sparse_mla(a["q"], a["kv"], a["idx"], a["indptr"], validate=True)
    mutate(a)
    with pytest.raises(ValueError) as e:
        jsm.validate_sparse_mla(a["q"], a["kv"], a["idx"], a["indptr"])
    if name != "scale":
        names(e, name)
    with pytest.raises(ValueError):
        jsm.sparse_mla(a["q"], a["kv"], a["idx"], a["indptr"], validate=True)
    # without validate: no error (data-dependent checks are opt-in)
    jsm.sparse_mla(a["q"], a["kv"], a["idx"], a["indptr"])


def test_validate_scales_only_of_referenced_records():
    a = sparse_args()
    kv = np.array(a["kv"])
    kv[5] = C.nan_records(1)[0]  # record 5 is not referenced
    jsm.validate_sparse_mla(a["q"], jnp.asarray(kv), a["idx"], a["indptr"])


def test_validate_fp8_ds_mla_records():
    r = C.rng(1)
    lat = C.random_latent(r, 6, binades=(-20, 14))
    lat[0, :128] = 57344.0  # scale exactly 2^7: allowed
    rec = O.pack_fp8_ds_mla(lat, C.random_rope(r, 6))
    assert jsm.validate_fp8_ds_mla_records(jnp.asarray(rec)) is None
    assert jsm.validate_fp8_ds_mla_records(jnp.asarray(rec.reshape(2, 3, 656))) is None
    for s in SCALE_BAD:
        bad = rec.copy()
        bad[3, 524:528] = _scale_bytes(s)
        with pytest.raises(ValueError):
            jsm.validate_fp8_ds_mla_records(jnp.asarray(bad))
    big = O.pack_fp8_ds_mla(np.full((1, 512), 57345.0, np.float32), np.zeros((1, 64)))
    with pytest.raises(ValueError):  # the writer's own output for |latent| > 57344
        jsm.validate_fp8_ds_mla_records(jnp.asarray(big))
    with pytest.raises((TypeError, ValueError)) as e:
        jsm.validate_fp8_ds_mla_records(jnp.asarray(rec[:, :600]))
    names(e, "records")


def test_validate_under_jit_valid_input():
    a = sparse_args()
    f = jax.jit(lambda q, kv, i, p: jsm.sparse_mla(q, kv, i, p, validate=True))
    out = f(a["q"], a["kv"], a["idx"], a["indptr"])
    assert out.shape == (3, 2, 512)


def test_dense_to_csr_errors():
    with pytest.raises(ValueError) as e:
        jsm.dense_to_csr(jnp.zeros((5,), jnp.int32))
    names(e, "topk_idx")
    with pytest.raises(TypeError) as e:
        jsm.dense_to_csr(jnp.zeros((2, 5), jnp.float32))
    names(e, "topk_idx")


# ---------------------------------------------------------------------------------------------
# mla_decode
# ---------------------------------------------------------------------------------------------


def decode_args():
    case = C.decode_case(2, seq_lens=(3, 5), qlen=2, h=2)
    return dict(
        q=case.q,
        kv=case.kv,
        kv_indices=jnp.asarray(case.kv_indices),
        kv_indptr=jnp.asarray(case.kv_indptr),
    )


DECODE_BAD = [
    ("q", lambda a: a["q"].astype(jnp.float32), TypeError),
    ("q", lambda a: a["q"][0], ValueError),
    ("q", lambda a: a["q"][..., :512], ValueError),
    ("q", lambda a: a["q"][:3], ValueError),  # B * qlen rows expected
    ("kv", lambda a: a["kv"].view(jnp.uint8).view(jnp.float8_e4m3fnuz), TypeError),
    ("kv", lambda a: a["kv"].astype(jnp.float32), TypeError),
    ("kv", lambda a: a["kv"].view(jnp.uint8).view(jnp.float8_e5m2), TypeError),
    ("kv", lambda a: a["kv"][:, :512], ValueError),
    ("kv", lambda a: a["kv"][None], ValueError),
    ("kv_indices", lambda a: a["kv_indices"].astype(jnp.float32), TypeError),
    ("kv_indices", lambda a: a["kv_indices"][None], ValueError),
    ("kv_indptr", lambda a: a["kv_indptr"].astype(jnp.float32), TypeError),
    ("kv_indptr", lambda a: a["kv_indptr"][None], ValueError),
    ("kv_indptr", lambda a: a["kv_indptr"][:-1], ValueError),  # one request short of q's rows
]


@pytest.mark.parametrize("name,mutate,exc", DECODE_BAD)
@pytest.mark.parametrize("fn", ["mla_decode", "mla_decode_partials", "validate_mla_decode"])
def test_mla_decode_static(name, mutate, exc, fn):
    a = decode_args()
    a[name] = mutate(a)
    with pytest.raises(exc) as e:
        getattr(jsm, fn)(a["q"], a["kv"], a["kv_indices"], a["kv_indptr"], qlen=2)
    # a row-count mismatch may be reported against q, qlen or kv_indptr
    names(e, *((name, "qlen", "kv_indptr") if name == "q" else (name,)))


@pytest.mark.parametrize("kw", [{"qlen": 0}, {"qlen": 1.5}, {"num_splits": 0}, {"num_splits": -2}])
def test_mla_decode_bad_options(kw):
    a = decode_args()
    kw = {"qlen": 2, **kw}
    with pytest.raises((ValueError, TypeError)) as e:
        jsm.mla_decode(a["q"], a["kv"], a["kv_indices"], a["kv_indptr"], **kw)
    names(e, *[k for k in kw if kw[k] not in (2,)])


DECODE_DATA_BAD = [
    ("kv_indices", lambda a: a.update(kv_indices=a["kv_indices"].at[3].set(10**6))),
    ("kv_indices", lambda a: a.update(kv_indices=a["kv_indices"].at[0].set(-3))),
    ("kv_indptr", lambda a: a.update(kv_indptr=jnp.asarray(np.int32([0, 5, 3])))),
    ("kv_indptr", lambda a: a.update(kv_indptr=jnp.asarray(np.int32([0, 3, 7])))),
]


@pytest.mark.parametrize("name,mutate", DECODE_DATA_BAD)
def test_mla_decode_validate(name, mutate):
    a = decode_args()
    args = lambda: (a["q"], a["kv"], a["kv_indices"], a["kv_indptr"])  # noqa: E731
    jsm.validate_mla_decode(*args(), qlen=2)
    mutate(a)
    with pytest.raises(ValueError) as e:
        jsm.validate_mla_decode(*args(), qlen=2)
    names(e, name)
    with pytest.raises(ValueError):
        jsm.mla_decode(*args(), qlen=2, validate=True)
    with pytest.raises(ValueError):
        jsm.mla_decode_partials(*args(), qlen=2, validate=True, num_splits=2)


MERGE_BAD = [
    ("o_parts", lambda o, lse: (o[0], lse), ValueError),
    ("o_parts", lambda o, lse: (o.astype(jnp.int32), lse), TypeError),
    ("lse_parts", lambda o, lse: (o, lse[:, :1]), ValueError),
    ("lse_parts", lambda o, lse: (o, lse[..., None]), ValueError),
    ("lse_parts", lambda o, lse: (o, lse.astype(jnp.int32)), TypeError),
]


@pytest.mark.parametrize("name,mutate,exc", MERGE_BAD)
def test_merge_errors(name, mutate, exc):
    o = jnp.zeros((2, 3, 4, 8), jnp.float32)
    lse = jnp.zeros((2, 3, 4), jnp.float32)
    o, lse = mutate(o, lse)
    with pytest.raises(exc) as e:
        jsm.merge_attn_states(o, lse)
    names(e, name, "o_parts", "lse_parts")


# ---------------------------------------------------------------------------------------------
# ultraquant
# ---------------------------------------------------------------------------------------------


def uq_args():
    r = C.rng(3)
    return dict(
        q=C.bf16_normal(r, (2, 16, 256)),
        cache=jnp.asarray(C.garbage_cache(r, 4, 16, 2)),
        block_tables=jnp.asarray(np.int32([[0, 1], [2, 3]])),
        seq_lens=jnp.asarray(np.int32([20, 32])),
    )


UQ_BAD = [
    ("q", lambda a: a["q"].astype(jnp.float32), TypeError),
    ("q", lambda a: a["q"][0], ValueError),
    ("q", lambda a: a["q"][..., :128], ValueError),
    ("q", lambda a: a["q"][:, :15], ValueError),  # Hq not a multiple of Hk
    ("cache", lambda a: a["cache"].view(jnp.int8), TypeError),
    ("cache", lambda a: a["cache"][..., :268], ValueError),
    ("cache", lambda a: jnp.zeros((4, 16, 2, 274), jnp.uint8), ValueError),
    ("cache", lambda a: a["cache"][0], ValueError),
    ("block_tables", lambda a: a["block_tables"].astype(jnp.float32), TypeError),
    ("block_tables", lambda a: a["block_tables"][0], ValueError),
    ("block_tables", lambda a: a["block_tables"][:1], ValueError),
    ("seq_lens", lambda a: a["seq_lens"].astype(jnp.float32), TypeError),
    ("seq_lens", lambda a: a["seq_lens"][:1], ValueError),
]


@pytest.mark.parametrize("name,mutate,exc", UQ_BAD)
@pytest.mark.parametrize("fn", ["ultraquant_decode", "validate_ultraquant_decode"])
def test_ultraquant_decode_static(name, mutate, exc, fn):
    a = uq_args()
    a[name] = mutate(a)
    with pytest.raises(exc) as e:
        getattr(jsm, fn)(a["q"], a["cache"], a["block_tables"], a["seq_lens"])
    names(e, *((name, "cache") if name == "q" else (name,)))


UQ_DATA_BAD = [
    ("seq_lens", lambda a: a.update(seq_lens=jnp.asarray(np.int32([20, 33])))),
    ("seq_lens", lambda a: a.update(seq_lens=jnp.asarray(np.int32([-1, 3])))),
    ("block_tables", lambda a: a.update(block_tables=jnp.asarray(np.int32([[0, 4], [2, 3]])))),
    ("block_tables", lambda a: a.update(block_tables=jnp.asarray(np.int32([[0, 1], [-1, 3]])))),
]


@pytest.mark.parametrize("name,mutate", UQ_DATA_BAD)
def test_ultraquant_validate(name, mutate):
    a = uq_args()
    jsm.validate_ultraquant_decode(*a.values())
    mutate(a)
    with pytest.raises(ValueError) as e:
        jsm.validate_ultraquant_decode(*a.values())
    names(e, name)
    with pytest.raises(ValueError):
        jsm.ultraquant_decode(*a.values(), validate=True)


def test_ultraquant_bad_options():
    a = uq_args()
    with pytest.raises((ValueError, TypeError)) as e:
        jsm.ultraquant_decode(*a.values(), num_partitions=0)
    names(e, "num_partitions")


# ---------------------------------------------------------------------------------------------
# writers
# ---------------------------------------------------------------------------------------------


def test_writer_errors():
    lat = jnp.zeros((3, 512), jnp.float32)
    rope = jnp.zeros((3, 64), jnp.float32)
    slots = jnp.asarray(np.int32([0, 1, 2]))
    with pytest.raises(ValueError) as e:
        jsm.pack_fp8_ds_mla(lat[:, :511], rope)
    names(e, "latent")
    with pytest.raises(ValueError) as e:
        jsm.pack_fp8_ds_mla(lat, rope[:2])
    names(e, "rope", "latent")
    with pytest.raises(TypeError) as e:
        jsm.pack_fp8_ds_mla(lat.astype(jnp.int32), rope)
    names(e, "latent")
    with pytest.raises((TypeError, ValueError)) as e:
        jsm.unpack_fp8_ds_mla(jnp.zeros((3, 600), jnp.uint8))
    names(e, "records")
    cache = jnp.zeros((4, 656), jnp.uint8)
    with pytest.raises(ValueError) as e:
        jsm.concat_and_cache_ds_mla(cache[:, :600], lat, rope, slots)
    names(e, "cache")
    with pytest.raises(ValueError) as e:
        jsm.concat_and_cache_ds_mla(cache, lat, rope, slots[:2])
    names(e, "slot_mapping")
    with pytest.raises(TypeError) as e:
        jsm.concat_and_cache_ds_mla(cache, lat, rope, slots.astype(jnp.float32))
    names(e, "slot_mapping")
    mcache = jnp.zeros((4, 576), jnp.float8_e4m3fn)
    with pytest.raises(ValueError) as e:
        jsm.concat_and_cache_mla(mcache[:, :512], lat, rope, slots)
    names(e, "cache")
    with pytest.raises(TypeError) as e:
        jsm.concat_and_cache_mla(mcache.astype(jnp.float16), lat, rope, slots)
    names(e, "cache")
    ucache = jnp.zeros((2, 4, 2, 272), jnp.uint8)
    k = jnp.zeros((3, 2, 256), jnp.bfloat16)
    with pytest.raises(ValueError) as e:
        jsm.ultraquant_store(ucache, k[:, :1], k, slots)
    names(e, "k")
    with pytest.raises(ValueError) as e:
        jsm.ultraquant_store(ucache, k, k[:2], slots)
    names(e, "v")
    with pytest.raises(TypeError) as e:
        jsm.ultraquant_store(ucache, k, k, slots.astype(jnp.float32))
    names(e, "slot_mapping")
    with pytest.raises(ValueError) as e:
        jsm.ultraquant_store(ucache[..., :270], k, k, slots)
    names(e, "cache")
