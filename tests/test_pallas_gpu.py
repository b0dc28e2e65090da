"""The Pallas kernels at full size on an NVIDIA GPU against the "xla" implementation.

Both sides are compared with a rigorous tolerance built from global bounds (every bound is an
upper bound of the per-row one that ``tests/pallas_checks.py`` uses against the oracle):
|pallas - xla| <= |pallas - exact| + |xla - exact| <= 2 * 2^-8 |xla| (bf16 outputs, |exact| ~
|xla|) + 2^-8 max|V| (bf16 P) + 2 * attn_atol(n, max|V|, S), with S = sm_scale * sum_d |q_d| *
max_k |K_kd| >= every score magnitude; the lse differ by at most 2 * lse_atol(n, S, lse).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.formats import ultraquant_rotate, ultraquant_unpack, unpack_fp8_ds_mla
from tests import oracle as O

pytestmark = pytest.mark.gpu


def assert_close(what, out, ref, vmax, score_bound, n_keys, lse=None, ref_lse=None):
    """out, ref [R, H, D]; vmax scalar; score_bound [R, H]; n_keys broadcastable to [R, H]."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    n = np.broadcast_to(np.asarray(n_keys, np.float64), ref.shape[:2])
    atol = 2.0**-8 * vmax + 2 * O.attn_atol(n, vmax, score_bound)  # [R, H]
    tol = 2 * 2.0**-8 * np.abs(ref) + atol[..., None]
    err = np.abs(out - ref)
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    assert np.all(err <= tol), f"{what}: worst err/tol {np.max(err / tol):.3g}"
    if lse is not None:
        lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), f"{what}: -inf lse"
        fin = np.isfinite(ref_lse)
        ltol = 2 * O.lse_atol(n, score_bound, ref_lse)
        lerr = np.abs(np.where(fin, lse - np.where(fin, ref_lse, 0), 0))
        assert np.all(lerr <= ltol), f"{what}: lse worst err/tol {np.max(lerr / ltol):.3g}"


def fp8_codes(key, shape):
    bits = jax.random.bits(key, shape, jnp.uint8)
    return jnp.where(bits & 0x7F == 0x7F, bits - 1, bits)


def records(key, n):
    k1, k2, k3 = jax.random.split(key, 3)
    scales = 2.0 ** jax.random.randint(k2, (n, 4), -6, 2).astype(jnp.float32)
    rope = jax.random.normal(k3, (n, 64)).astype(jnp.bfloat16)
    to_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(n, -1)  # noqa: E731
    return jnp.concatenate([fp8_codes(k1, (n, 512)), to_bytes(scales), to_bytes(rope)], axis=1)


@functools.cache
def sparse_inputs():
    """200k records; 64 rows of topk 2048 (random over the cache, ~8% -1 and out of range),
    rows 0-2 empty / all -1 / all out of range, row 3 a long row of 60000 keys."""
    n, n_q, topk = 200_000, 64, 2048
    k = jax.random.split(jax.random.key(7), 4)
    kv = records(k[0], n)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, n, topk) for _ in range(n_q)]
    for r in rows[4:]:
        r[rng.random(topk) < 0.05] = -1
        r[rng.random(topk) < 0.03] = n + 5
    rows[0] = rows[0][:0]
    rows[1][:] = -1
    rows[2][:] = n
    rows[3] = rng.integers(0, n, 60000)
    idx = np.concatenate(rows).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    n_keys = np.array([np.sum((r >= 0) & (r < n)) for r in rows])
    latent, rope = unpack_fp8_ds_mla(kv)
    k_max = jnp.max(jnp.abs(jnp.concatenate([latent, rope.astype(jnp.float32)], 1)), 0)
    return kv, jnp.asarray(idx), jnp.asarray(indptr), n_keys, float(jnp.max(jnp.abs(latent))), k_max


@pytest.mark.parametrize("h", [12, 16, 64, 128])
def test_sparse_mla_full_size(h):
    kv, idx, indptr, n_keys, vmax, k_max = sparse_inputs()
    q = jax.random.normal(jax.random.key(h), (indptr.shape[0] - 1, h, 576)).astype(jnp.bfloat16)
    res = {
        impl: jax.jit(functools.partial(jsm.sparse_mla, return_lse=True, implementation=impl))(
            q, kv, idx, indptr
        )
        for impl in ("pallas", "xla")
    }
    score = 576**-0.5 * np.asarray(jnp.abs(q.astype(jnp.float32)) @ k_max)  # [n_q, H]
    (o, lse), (ox, lx) = res["pallas"], res["xla"]
    assert_close(f"sparse H={h}", o, ox, vmax, score, n_keys[:, None], lse, lx)
    assert np.all(np.asarray(o[:3], np.float32) == 0) and np.all(np.isneginf(lse[:3]))


@pytest.mark.parametrize("qlen,h", [(1, 12), (2, 16), (1, 128)])
def test_mla_decode_full_size(qlen, h):
    seq_lens = [0, 1, 2, 129, 5000, 8192, 32768, 300]
    tokens = sum(seq_lens) + 1000
    k = jax.random.split(jax.random.key(qlen * h), 3)
    cache = fp8_codes(k[0], (tokens, 576))
    kv_indices = jax.random.permutation(k[1], tokens)[: sum(seq_lens)].astype(jnp.int32)
    kv_indices = kv_indices.at[::97].set(-1)  # masked keys that keep their positions
    kv_indptr = jnp.asarray(np.cumsum([0] + seq_lens), jnp.int32)
    q = jax.random.normal(k[2], (len(seq_lens) * qlen, h, 576)).astype(jnp.bfloat16)
    run = lambda impl: jax.jit(functools.partial(  # noqa: E731
        jsm.mla_decode, qlen=qlen, k_scale=0.05, v_scale=0.02, return_lse=True,
        implementation=impl))(q, cache, kv_indices, kv_indptr)  # fmt: skip
    (o, lse), (ox, lx) = run("pallas"), run("xla")
    codes_max = 448.0
    score = 576**-0.5 * 0.05 * codes_max * np.asarray(jnp.sum(jnp.abs(q.astype(jnp.float32)), -1))
    n_keys = np.repeat(np.asarray(seq_lens), qlen)[:, None]
    assert_close(f"decode qlen={qlen} H={h}", o, ox, 0.02 * codes_max, score, n_keys, lse, lx)


def test_mla_decode_cache_between_2_and_4_gib():
    # int32 element offsets overflow in Pallas' Triton lowering for byte arrays of 2-4 GiB:
    # keys at the end of a 2.2 GiB cache must still be read right.
    tokens = (2**31 + 2**27) // 576
    cache = fp8_codes(jax.random.key(1), (tokens, 576))
    seq = 4096
    kv_indices = jnp.arange(tokens - 2 * seq, tokens, dtype=jnp.int32)
    kv_indptr = jnp.asarray([0, seq, 2 * seq], jnp.int32)
    q = jax.random.normal(jax.random.key(2), (2, 16, 576)).astype(jnp.bfloat16)
    run = lambda impl: jax.jit(functools.partial(  # noqa: E731
        jsm.mla_decode, k_scale=0.05, v_scale=0.02, return_lse=True, implementation=impl
    ))(q, cache, kv_indices, kv_indptr)  # fmt: skip
    (o, lse), (ox, lx) = run("pallas"), run("xla")
    score = 576**-0.5 * 0.05 * 448 * np.asarray(jnp.sum(jnp.abs(q.astype(jnp.float32)), -1))
    assert_close("decode 2.2 GiB cache", o, ox, 0.02 * 448, score, np.full((2, 1), seq), lse, lx)


@pytest.mark.parametrize("g", [6, 8, 16])
def test_ultraquant_full_size(g):
    hk, bs = 8, 64
    seq_lens = np.array([0, 1, 32768, 4000], np.int32)
    blocks_per = 512
    nb = len(seq_lens) * blocks_per + 8
    k = jax.random.split(jax.random.key(g), 4)
    codes = jax.random.bits(k[0], (nb, bs, hk, 2, 128), jnp.uint8)
    scales = jax.random.randint(k[1], (nb, bs, hk, 2, 8), 120, 131).astype(jnp.uint8)
    cache = jnp.concatenate([codes, scales], -1).reshape(nb, bs, hk, 272)
    tables = jax.random.permutation(k[2], nb)[: len(seq_lens) * blocks_per]
    tables = tables.reshape(len(seq_lens), blocks_per).astype(jnp.int32).at[3, 5].set(-1)
    q = jax.random.normal(k[3], (len(seq_lens), hk * g, 256)).astype(jnp.bfloat16)
    args = (q, cache, tables, jnp.asarray(seq_lens))
    o = jax.jit(functools.partial(jsm.ultraquant_decode, implementation="pallas"))(*args)
    ox = jax.jit(functools.partial(jsm.ultraquant_decode, implementation="xla"))(*args)
    k_st, v = ultraquant_unpack(cache)
    vmax = float(jnp.max(jnp.abs(v)))
    k_max = jnp.max(jnp.abs(k_st), axis=(0, 1, 2))  # per stored dim
    q_rot = jnp.abs(ultraquant_rotate(q))
    score = np.asarray(q_rot @ k_max) / 16  # [B, Hq]
    n_keys = np.minimum(seq_lens, blocks_per * bs)[:, None]
    assert_close(f"ultraquant G={g}", o, ox, vmax, score, n_keys)
    assert np.all(np.asarray(o[0], np.float32) == 0)
