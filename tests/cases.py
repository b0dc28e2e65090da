"""The one case generator used by every test (seeded numpy RNG).

Records / caches for sparse_mla and mla_decode are built with the ORACLE writers (bytes are the
input; the library writers are tested separately in test_formats.py). UltraQuant caches are built
with the LIBRARY writer ``ultraquant_store`` (the decode oracle reads the bytes it wrote), over a
cache pre-filled with garbage bytes (NaN scale bytes) so that any read of an unused slot shows.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from tests import oracle as O

NAN_BF16 = 0x7FC0
NAN_F32_BYTES = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)


def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def to_bf16(x) -> jnp.ndarray:
    return jnp.asarray(np.asarray(x, np.float32), jnp.bfloat16)


def bf16_normal(r, shape, scale=1.0) -> jnp.ndarray:
    return to_bf16(r.standard_normal(shape) * scale)


# ---------------------------------------------------------------------------------------------
# fp8_ds_mla records
# ---------------------------------------------------------------------------------------------


def random_latent(r, n, binades=(-3, 4)) -> np.ndarray:
    """[n, 512] float32, normal with a per-row and per-128-block magnitude 2^k, k in binades."""
    row = 2.0 ** r.integers(binades[0], binades[1], size=(n, 1, 1))
    blk = 2.0 ** r.integers(-1, 2, size=(n, 4, 1))
    x = r.standard_normal((n, 4, 128)) * row * blk
    return x.reshape(n, 512).astype(np.float32)


def random_rope(r, n, scale=1.0) -> np.ndarray:
    return (r.standard_normal((n, 64)) * scale).astype(np.float32)


def nan_records(n) -> np.ndarray:
    """Records full of NaN: fp8 NaN codes, NaN scales, NaN bf16 rope."""
    rec = np.full((n, O.RECORD_BYTES), 0x7F, np.uint8)
    rec[:, 512:528] = np.tile(NAN_F32_BYTES, 4)
    rec[:, 528:656] = np.frombuffer(np.full(64, NAN_BF16, "<u2").tobytes(), np.uint8)
    return rec


def make_records(r, n, *, nan_rows=None, binades=(-3, 4)) -> np.ndarray:
    """uint8 [n, 656] records written by the oracle; rows in nan_rows are NaN garbage."""
    rec = O.pack_fp8_ds_mla(random_latent(r, n, binades), random_rope(r, n))
    if nan_rows is not None and len(nan_rows):
        rec[np.asarray(nan_rows)] = nan_records(len(nan_rows))
    return rec


def make_csr(
    r,
    n_q,
    n_rec,
    *,
    min_len=0,
    max_len=24,
    p_empty=0.15,
    p_neg=0.1,
    p_oob=0.05,
    p_dup=0.1,
    long_rows=(),
    pool=None,
):
    """Random CSR (idx int32 [nnz], indptr int32 [n_q+1]).

    Rows: some empty, lengths in [min_len, max_len] (rows listed in long_rows get that length
    instead: long_rows is a dict row -> length or a sequence of (row, length)). Entries: drawn
    from pool (default all records) with -1 entries, out-of-range entries (n_rec, n_rec+k,
    2^31-1, -2^31) and duplicates mixed in.
    """
    pool = np.arange(n_rec) if pool is None else np.asarray(pool)
    long_rows = dict(long_rows)
    lens = r.integers(min_len, max_len + 1, n_q)
    lens[r.random(n_q) < p_empty] = 0
    for row, ln in long_rows.items():
        lens[row] = ln
    rows = []
    for ln in lens:
        e = r.choice(pool, size=ln, replace=ln > len(pool))
        u = r.random(ln)
        e = np.where(u < p_neg, -1, e)
        oob = r.choice(np.array([n_rec, n_rec + 1, n_rec + 1000, 2**31 - 1, -(2**31), -7]), ln)
        e = np.where((u >= p_neg) & (u < p_neg + p_oob), oob, e)
        dup = (r.random(ln) < p_dup) & (ln > 1)
        if ln > 1:
            src = r.integers(0, ln, ln)
            e = np.where(dup, e[src], e)
        rows.append(e)
    idx = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return idx, indptr


@dataclass
class SparseCase:
    q: jnp.ndarray  # bf16 [n_q, H, 576]
    kv: np.ndarray  # uint8 [..., 656]
    idx: np.ndarray  # int32
    indptr: np.ndarray  # int32
    sm_scale: float | None = None
    meta: dict = field(default_factory=dict)

    def args(self) -> tuple:
        """(q, kv, idx, indptr) as jax arrays."""
        return self.q, jnp.asarray(self.kv), jnp.asarray(self.idx), jnp.asarray(self.indptr)


def sparse_case(
    seed,
    *,
    n_q=6,
    h=4,
    n_rec=40,
    kv_lead=None,
    n_nan=6,
    q_scale=1.0,
    sm_scale=None,
    **csr_kw,
) -> SparseCase:
    """Random sparse_mla case; the last n_nan records are NaN garbage that no entry references."""
    r = rng(seed)
    n_total = n_rec + n_nan
    kv = make_records(r, n_total, nan_rows=np.arange(n_rec, n_total))
    perm = r.permutation(n_total)  # scatter the NaN rows around
    kv = kv[perm]
    inv = np.argsort(perm)
    good = inv[:n_rec]  # positions of the real records
    idx, indptr = make_csr(r, n_q, n_total, pool=good, **csr_kw)
    if kv_lead is not None:
        assert int(np.prod(kv_lead)) == n_total
        kv = kv.reshape(*kv_lead, O.RECORD_BYTES)
    q = bf16_normal(r, (n_q, h, O.KDIM), q_scale)
    return SparseCase(q, kv, idx, indptr, sm_scale, dict(nan_rows=inv[n_rec:]))


# ---------------------------------------------------------------------------------------------
# mla_decode
# ---------------------------------------------------------------------------------------------


@dataclass
class DecodeCase:
    q: jnp.ndarray  # bf16 [B*qlen, H, 576]
    kv: jnp.ndarray  # float8_e4m3fn (or uint8) [tokens, 576]
    kv_codes: np.ndarray  # uint8 view
    kv_indices: np.ndarray
    kv_indptr: np.ndarray
    qlen: int
    k_scale: float
    v_scale: float
    sm_scale: float | None = None

    def args(self) -> tuple:
        """(q, kv, kv_indices, kv_indptr) as jax arrays."""
        return self.q, self.kv, jnp.asarray(self.kv_indices), jnp.asarray(self.kv_indptr)


def decode_case(
    seed,
    *,
    seq_lens=(1, 37, 300),
    qlen=1,
    h=4,
    k_scale=0.0173,
    v_scale=0.0291,
    p_masked=0.0,
    n_nan=7,
    as_uint8=False,
    sm_scale=None,
    n_indices=0,
) -> DecodeCase:
    """Random decode batch. Tokens are scattered over a cache with n_nan NaN tokens that no
    index references; with p_masked > 0 some indices are -1 / out of range (masked keys that still
    occupy a position); ``n_indices``: kv_indices padded with -1 to that length (past the last
    request: never read; its length picks the gfx950 kernel)."""
    r = rng(seed)
    total = int(sum(seq_lens))
    tokens = total + n_nan
    lat = random_latent(r, tokens, binades=(-1, 2))
    rope = random_rope(r, tokens)
    # cache values x/k_scale: choose x ~ O(1..4) so that K = code * k_scale ~ O(1)
    codes = O.mla_cache_codes(lat, rope, scale=k_scale)
    perm = r.permutation(tokens)
    codes = codes[perm]
    nan_tok = np.argsort(perm)[total:]
    codes[nan_tok] = 0x7F
    good = np.argsort(perm)[:total]
    r.shuffle(good)
    kv_indices = good.astype(np.int64)
    if p_masked > 0:
        m = r.random(total) < p_masked
        bad = r.choice(np.array([-1, tokens, tokens + 5, 2**31 - 1, -(2**31)]), total)
        kv_indices = np.where(m, bad, kv_indices)
    kv_indices = np.pad(kv_indices, (0, max(n_indices - total, 0)), constant_values=-1)
    kv_indices = kv_indices.astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    b = len(seq_lens)
    q = bf16_normal(r, (b * qlen, h, O.KDIM))
    kv = jnp.asarray(codes) if as_uint8 else jnp.asarray(codes).view(jnp.float8_e4m3fn)
    return DecodeCase(q, kv, codes, kv_indices, kv_indptr, qlen, k_scale, v_scale, sm_scale)


def decode_oracle(case: DecodeCase, **kw):
    """``oracle.mla_decode`` on the case (kw: num_splits, stats, k_transform)."""
    return O.mla_decode(
        case.q,
        case.kv_codes,
        case.kv_indices,
        case.kv_indptr,
        case.qlen,
        case.k_scale,
        case.v_scale,
        case.sm_scale,
        **kw,
    )


# ---------------------------------------------------------------------------------------------
# UltraQuant
# ---------------------------------------------------------------------------------------------


def garbage_cache(r, nb, bs, hk, slot_bytes=272) -> np.ndarray:
    """Uninitialized-looking cache: random bytes, every scale byte 0xFF (UE8M0 NaN)."""
    c = r.integers(0, 256, size=(nb, bs, hk, slot_bytes), dtype=np.uint8)
    c[..., 128:136] = 0xFF
    c[..., 264:272] = 0xFF
    return c


def uq_kv(r, t, hk, *, binades=(-3, 3)) -> tuple[jnp.ndarray, jnp.ndarray]:
    """bf16 K and V [t, hk, 256] with per-(token, head) magnitudes over a few binades."""
    mk = 2.0 ** r.integers(binades[0], binades[1], (t, hk, 1))
    mv = 2.0 ** r.integers(binades[0], binades[1], (t, hk, 1))
    k = bf16_normal(r, (t, hk, 256)) * to_bf16(mk)
    v = bf16_normal(r, (t, hk, 256)) * to_bf16(mv)
    return k, v


@dataclass
class UQCase:
    q: jnp.ndarray  # bf16 [B, Hq, 256]
    cache: np.ndarray  # uint8 [nb, bs, Hk, slot]
    block_tables: np.ndarray  # int32 [B, max_blocks]
    seq_lens: np.ndarray  # int32 [B]
    k: jnp.ndarray = None
    v: jnp.ndarray = None
    slot_mapping: np.ndarray = None

    def args(self) -> tuple:
        """(q, cache, block_tables, seq_lens) as jax arrays."""
        arrays = (self.cache, self.block_tables, self.seq_lens)
        return self.q, *map(jnp.asarray, arrays)


def uq_case(seed, **kw) -> UQCase:
    """Paged UltraQuant batch (``_written_uq_case``). Built once per arguments (the library's
    store compiles per shape; the suites ask for a case once per implementation); each call
    returns its own copy of the numpy arrays."""
    c = _written_uq_case(seed, **kw)
    arrays = ("cache", "block_tables", "seq_lens", "slot_mapping")
    return dataclasses.replace(c, **{a: getattr(c, a).copy() for a in arrays})


@functools.cache
def _written_uq_case(
    seed,
    *,
    seq_lens=(1, 40, 100),
    hk=2,
    g=8,
    bs=16,
    slot_bytes=272,
    extra_blocks=3,
    p_bad_block=0.0,
    q_scale=1.0,
    max_blocks=None,
    k_ramp=0,
) -> UQCase:
    """Paged UltraQuant batch. Each request gets distinct random blocks; the tokens are written by
    the library's ultraquant_store into a garbage-filled cache. Block-table entries past a
    request's last block hold random (possibly garbage-block or out-of-range) values. ``k_ramp``:
    position j of a request of n tokens has its K times 2^floor(k_ramp * j / n), so that its
    scores' running max keeps rising along the sequence."""
    import jax

    import jax_sparse_mla as jsm

    r = rng(seed)
    seq_lens = np.asarray(seq_lens, np.int64)
    need = [int(-(-max(s, 0) // bs)) for s in seq_lens]
    max_blocks = max(max(need), 1) + 1 if max_blocks is None else max_blocks
    assert max_blocks >= max(need)
    nb = sum(need) + extra_blocks
    cache = garbage_cache(r, nb, bs, hk, slot_bytes)
    blocks = r.permutation(nb)
    bt = r.integers(-3, nb + 3, size=(len(seq_lens), max_blocks)).astype(np.int64)
    slots, ramp = [], []
    o = 0
    for b, n in enumerate(need):
        bt[b, :n] = blocks[o : o + n]
        o += n
        for j in range(max(int(seq_lens[b]), 0)):
            slots.append(bt[b, j // bs] * bs + j % bs)
            ramp.append(2.0 ** (k_ramp * j // int(seq_lens[b])))
    if p_bad_block > 0:  # masked blocks inside the sequence (never written)
        for b, n in enumerate(need):
            for i in range(n):
                if r.random() < p_bad_block:
                    bt[b, i] = r.choice([-1, nb, nb + 17, 2**31 - 1])
    slot_mapping = np.asarray(slots, np.int32)
    t = len(slots)
    k, v = uq_kv(r, t, hk)
    k = k * to_bf16(np.asarray(ramp).reshape(t, 1, 1))  # powers of two: exact in bf16
    # add a few skipped tokens (-1 / out of range) carrying huge values: must not be written
    ks, vs = uq_kv(r, 3, hk)
    k = jnp.concatenate([k, ks * 1000])
    v = jnp.concatenate([v, vs * 1000])
    slot_mapping = np.concatenate([slot_mapping, np.int32([-1, nb * bs, nb * bs + 999])])
    perm = r.permutation(t + 3)
    k, v, slot_mapping = k[perm], v[perm], slot_mapping[perm].astype(np.int32)
    cache = np.asarray(
        jax.jit(jsm.ultraquant_store)(jnp.asarray(cache), k, v, jnp.asarray(slot_mapping)), np.uint8
    )
    q = bf16_normal(r, (len(seq_lens), hk * g, 256), q_scale)
    return UQCase(q, cache, bt.astype(np.int32), seq_lens.astype(np.int32), k, v, slot_mapping)
