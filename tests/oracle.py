"""Independent float64 NumPy oracle for jax_sparse_mla.

Nothing here imports jax, ml_dtypes or jax_sparse_mla: every codec is written by hand from its
definition (docs/formats.md, docs/semantics.md) so that the library is checked against an
implementation that shares no code with it. All attention math is done in float64 on exactly
dequantized operands.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------------------------
# bf16 (by hand: float32 bits, round to nearest even on the top 16 bits)
# ----------------------------------------------------------------------------------------------


def f32_to_bf16_bits(x) -> np.ndarray:
    """float -> bf16 bit pattern (uint16), RNE. The input is first rounded to float32."""
    b = np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    # quiet NaN, sign kept
    return np.where(nan, ((b >> 16).astype(np.uint16) | np.uint16(0x0040)), rounded)


def bf16_bits_to_f64(bits) -> np.ndarray:
    bits = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16
    return np.ascontiguousarray(bits).view(np.float32).astype(np.float64)


def round_bf16(x) -> np.ndarray:
    """Values of x rounded (via float32) to bf16, as float64."""
    return bf16_bits_to_f64(f32_to_bf16_bits(x))


# ----------------------------------------------------------------------------------------------
# fp8 e4m3fn (OCP): bias 7, 3 mantissa bits, subnormals, max 448, 0x7F / 0xFF NaN, no inf
# ----------------------------------------------------------------------------------------------


def _e4m3_decode_code(c: int) -> float:
    sign = -1.0 if c & 0x80 else 1.0
    e = (c >> 3) & 0xF
    m = c & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * (m / 8.0) * 2.0**-6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


E4M3_TABLE = np.array([_e4m3_decode_code(c) for c in range(256)], dtype=np.float64)
E4M3_MAX = 448.0
# Positive finite magnitudes, ascending; index == code (0x00 .. 0x7E).
_E4M3_POS = E4M3_TABLE[:0x7F].copy()
assert np.all(np.diff(_E4M3_POS) > 0) and _E4M3_POS[-1] == 448.0


def e4m3_decode(codes) -> np.ndarray:
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(x) -> np.ndarray:
    """Exact value x (float64; pass float32 results) -> e4m3fn code, nearest with ties to the even
    code (even mantissa LSB), saturating to +-448. The sign is kept (-0 / tiny negatives -> 0x80),
    as every IEEE-style converter does. NaN -> 0x7F (with sign)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    a_sat = np.minimum(a, E4M3_MAX)
    hi = np.searchsorted(_E4M3_POS, a_sat, side="left")  # first magnitude >= a
    hi = np.minimum(hi, 0x7E)
    lo = np.maximum(hi - 1, 0)
    d_hi = _E4M3_POS[hi] - a_sat
    d_lo = a_sat - _E4M3_POS[lo]
    exact = d_hi == 0
    pick_hi = exact | (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    neg = np.signbit(x)
    code = np.where(neg, code | np.uint8(0x80), code).astype(np.uint8)
    code = np.where(np.isnan(x), np.where(neg, 0xFF, 0x7F), code).astype(np.uint8)
    return code


# ----------------------------------------------------------------------------------------------
# fp8_ds_mla records
# ----------------------------------------------------------------------------------------------

RECORD_BYTES = 656
LATENT = 512
ROPE = 64
KDIM = 576


def _ceil_log2_exact(v: np.ndarray) -> np.ndarray:
    """ceil(log2(v)) computed exactly for positive finite v."""
    m, e = np.frexp(np.asarray(v, dtype=np.float64))  # v = m * 2^e, m in [0.5, 1)
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def ds_mla_scales(latent_f32: np.ndarray) -> np.ndarray:
    """[N, 512] float32 -> [N, 4] float32 power-of-two scales (the format's writer rule)."""
    lat = np.asarray(latent_f32, dtype=np.float32).reshape(-1, 4, 128)
    amax = np.max(np.abs(lat), axis=-1)  # float32
    q = (amax / np.float32(448.0)).astype(np.float32)  # float32 division
    q = np.maximum(q, np.float32(1e-4))  # NaN stays NaN
    # a block holding +-inf or NaN: log2 is not finite, the exponent clamps to 127 (the largest
    # finite power of two; a finite block never needs more than 2^120)
    fin = np.isfinite(q)
    e = np.where(fin, _ceil_log2_exact(np.where(fin, q, 1.0)), 127)
    return np.ldexp(np.float32(1.0), e).astype(np.float32)


def pack_fp8_ds_mla(latent, rope) -> np.ndarray:
    """latent [N, 512], rope [N, 64] (any float; rounded to float32 first) -> uint8 [N, 656]."""
    lat = np.asarray(latent, dtype=np.float32)
    rp = np.asarray(rope, dtype=np.float32)
    n = lat.shape[0]
    assert lat.shape == (n, LATENT) and rp.shape == (n, ROPE)
    scales = ds_mla_scales(lat)  # [N, 4]
    scaled = (lat.reshape(n, 4, 128) / scales[:, :, None]).astype(np.float32)  # f32 division
    codes = e4m3_encode(scaled.astype(np.float64)).reshape(n, LATENT)
    out = np.zeros((n, RECORD_BYTES), dtype=np.uint8)
    out[:, :512] = codes
    out[:, 512:528] = np.ascontiguousarray(scales.astype("<f4")).view(np.uint8).reshape(n, 16)
    out[:, 528:656] = (
        np.ascontiguousarray(f32_to_bf16_bits(rp).astype("<u2")).view(np.uint8).reshape(n, 128)
    )
    return out


def unpack_fp8_ds_mla(records) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [..., 656] -> (latent float64 [..., 512] (exact f32 values), rope float64 [..., 64]
    (exact bf16 values))."""
    r = np.ascontiguousarray(np.asarray(records, dtype=np.uint8))
    lead = r.shape[:-1]
    r = r.reshape(-1, RECORD_BYTES)
    codes = e4m3_decode(r[:, :512]).reshape(-1, 4, 128)
    scales = r[:, 512:528].copy().view("<f4").astype(np.float64)  # [n, 4]
    latent = (codes * scales[:, :, None]).reshape(*lead, LATENT)
    rope = bf16_bits_to_f64(r[:, 528:656].copy().view("<u2")).reshape(*lead, ROPE)
    return latent, rope


def record_kv(records) -> tuple[np.ndarray, np.ndarray]:
    """rows [R, 656] -> K [R, 576], V [R, 512] float64."""
    lat, rope = unpack_fp8_ds_mla(np.asarray(records).reshape(-1, RECORD_BYTES))
    return np.concatenate([lat, rope], axis=-1), lat


# ----------------------------------------------------------------------------------------------
# fp8 latent cache (mla_decode)
# ----------------------------------------------------------------------------------------------


def mla_cache_codes(latent, rope, scale=1.0) -> np.ndarray:
    """[T,512], [T,64] -> uint8 codes [T, 576]: e4m3(float32(x) / float32(scale))."""
    x = np.concatenate(
        [np.asarray(latent, dtype=np.float32), np.asarray(rope, dtype=np.float32)], axis=-1
    )
    y = (x / np.float32(scale)).astype(np.float32)
    return e4m3_encode(y.astype(np.float64))


# ----------------------------------------------------------------------------------------------
# UltraQuant (head dim 256)
# ----------------------------------------------------------------------------------------------

UQ_D = 256
UQ_SLOT_MIN = 272


def hadamard(n: int = UQ_D) -> np.ndarray:
    """Sylvester Hadamard matrix with entries (-1)^popcount(i & j), float64, unnormalized."""
    i = np.arange(n)
    pc = np.vectorize(lambda v: bin(int(v)).count("1"))(i[:, None] & i[None, :])
    return np.where(pc % 2 == 0, 1.0, -1.0)


H256 = hadamard(UQ_D)
H256_ORTHO = H256 / 16.0  # orthonormal and symmetric: its own inverse


def uq_rotate_exact(k) -> np.ndarray:
    """Original-space K [..., 256] -> rotated (H/16, natural column order: the stored order),
    float64 exact."""
    return np.asarray(k, dtype=np.float64) @ H256_ORTHO  # H symmetric


def uq_unrotate(rot) -> np.ndarray:
    """Rotated K [..., 256] (natural column order, as stored) -> original space, float64."""
    return np.asarray(rot, dtype=np.float64) @ H256_ORTHO


E2M1_MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_LEVELS = np.concatenate([-E2M1_MAGS[:0:-1], E2M1_MAGS])  # 15 values -6 .. 6
E2M1_MIDPOINTS = (E2M1_LEVELS[1:] + E2M1_LEVELS[:-1]) / 2  # 14 values
# level index -> 4-bit code
_LEVEL_CODES = np.array([0x8 | m for m in range(7, 0, -1)] + list(range(8)), dtype=np.uint8)
E2M1_TABLE = np.array(
    [(-1.0 if c & 8 else 1.0) * E2M1_MAGS[c & 7] for c in range(16)], dtype=np.float64
)
assert np.array_equal(E2M1_TABLE[_LEVEL_CODES], E2M1_LEVELS)


def e2m1_encode_scaled(y) -> np.ndarray:
    """y (already divided by the group scale) -> 4-bit codes (uint8), the format's rounding."""
    y = np.asarray(y, dtype=np.float64)
    idx = np.sum(y[..., None] > E2M1_MIDPOINTS, axis=-1)
    return _LEVEL_CODES[idx]


def _floor_log2_plus_half_exact(t: np.ndarray) -> np.ndarray:
    """floor(log2(t) + 0.5) exactly for positive finite t: n with t in [2^(n-.5), 2^(n+.5))."""
    m, e = np.frexp(np.asarray(t, dtype=np.float64))  # t = m 2^e, log2 t in [e-1, e)
    # log2(t) + 0.5 >= e  <=>  log2(m) >= -0.5  <=>  m*m >= 0.5 (m*m exact in float64 for f32 m)
    return np.where(m * m >= 0.5, e, e - 1).astype(np.int64)


def uq_quantize(x) -> tuple[np.ndarray, np.ndarray]:
    """Rotated values [..., 256] (rounded to float32) -> (packed codes uint8 [..., 128],
    scale bytes uint8 [..., 8])."""
    x = np.asarray(x, dtype=np.float32)
    lead = x.shape[:-1]
    g = x.reshape(*lead, 8, 32)
    amax = np.max(np.abs(g), axis=-1)  # float32
    t = (np.float32(0.156) * amax).astype(np.float32)  # float32 multiply (subnormals kept)
    # vLLM's torch reference: a scale that is 0 (amax 0, or 0.156 * amax underflowing to 0)
    # or not finite (the group holds +-inf or NaN) makes a zero group: byte 0, codes +0
    zero = (t == 0) | ~np.isfinite(t)
    e = _floor_log2_plus_half_exact(np.where(zero, np.float32(1.0), t))
    e = np.clip(e, -126, 127)  # an underflowing scale is 2^-126 (byte 1)
    e = np.where(zero, 0, e)
    sbyte = np.where(zero, 0, e + 127).astype(np.uint8)
    y = g.astype(np.float64) / np.ldexp(1.0, e)[..., None]  # == the float32 division (exact)
    codes = e2m1_encode_scaled(y)
    codes = np.where(zero[..., None], 0, codes).astype(np.uint8).reshape(*lead, UQ_D)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, sbyte


def uq_dequantize(packed, sbytes) -> np.ndarray:
    """(uint8 [..., 128], uint8 [..., 8]) -> float64 [..., 256]. Scale byte b means 2^(b-127),
    0 a zero group."""
    packed = np.asarray(packed, dtype=np.uint8)
    lo = packed & 0xF
    hi = packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], UQ_D)
    vals = E2M1_TABLE[codes].reshape(*packed.shape[:-1], 8, 32)
    sb = np.asarray(sbytes, dtype=np.uint8).astype(np.int64)
    s = np.where(sb == 255, np.nan, np.where(sb == 0, 0.0, np.ldexp(1.0, sb - 127)))
    return (vals * s[..., None]).reshape(*packed.shape[:-1], UQ_D)


def uq_slot_bytes(k, v) -> np.ndarray:
    """One token's K [..., 256] and V [..., 256] (original space) -> slot bytes [..., 272].
    K is rotated exactly (float64) then rounded to float32 before quantizing."""
    k_stored = uq_rotate_exact(np.asarray(k, dtype=np.float64)).astype(np.float32)
    kc, ks = uq_quantize(k_stored)
    vc, vs = uq_quantize(np.asarray(v, dtype=np.float32))
    return np.concatenate([kc, ks, vc, vs], axis=-1)


def ultraquant_store(cache, k, v, slot_mapping) -> np.ndarray:
    """Reference writer: returns a new cache (bytes >= 272 of every slot untouched)."""
    cache = np.array(cache, dtype=np.uint8, copy=True)
    nb, bs, hk, _ = cache.shape
    slots = np.asarray(slot_mapping).astype(np.int64)
    data = uq_slot_bytes(k, v)  # [T, Hk, 272]
    for t, s in enumerate(slots):
        if 0 <= s < nb * bs:
            cache[s // bs, s % bs, :, :UQ_SLOT_MIN] = data[t]
    return cache


def uq_unpack(cache) -> tuple[np.ndarray, np.ndarray]:
    """cache uint8 [nb, bs, Hk, slot] -> (rotated K, V), float64 [nb, bs, Hk, 256]."""
    c = np.asarray(cache, dtype=np.uint8)
    k = uq_dequantize(c[..., 0:128], c[..., 128:136])
    v = uq_dequantize(c[..., 136:264], c[..., 264:272])
    return k, v


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


def _attend(q, k, v, scale, dot_transform=None):
    """q [H, D], k [n, D], v [n, Dv] float64 -> (out [H, Dv], lse [H]). n == 0 -> (0, -inf).
    dot_transform (meta-tests only) is applied to q.k before the scale, e.g. a bf16 rounding."""
    h = q.shape[0]
    if k.shape[0] == 0:
        return np.zeros((h, v.shape[-1])), np.full((h,), -np.inf)
    dots = q @ k.T  # [H, n]
    s = scale * (dots if dot_transform is None else dot_transform(dots))
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - m)
    den = np.sum(p, axis=-1, keepdims=True)
    out = (p @ v) / den
    lse = (m + np.log(den))[:, 0]
    return out, lse


def to_f64(x) -> np.ndarray:
    """Exact float64 view of a bf16 / f32 array (jax or numpy)."""
    return np.asarray(np.asarray(x).astype(np.float32), dtype=np.float64)


def csr_row_positions(indptr, r: int, nnz: int) -> np.ndarray:
    a, b = (min(max(int(x), 0), nnz) for x in (indptr[r], indptr[r + 1]))
    if b <= a:
        return np.zeros((0,), dtype=np.int64)
    p = np.arange(a, b, dtype=np.int64)
    return p[(p >= 0) & (p < nnz)]


def sparse_mla(q, records, idx, indptr, sm_scale=None, stats=False, dot_transform=None):
    """q [n_q, H, 576] (exact values), records [..., 656] -> (out [n_q,H,512], lse [n_q,H]).
    With stats=True also returns per-row dict(n_keys, v_absmax, score_abs) for tolerances.
    dot_transform: see _attend (meta-tests only)."""
    q = to_f64(q)
    n_q, h, d = q.shape
    assert d == KDIM
    recs = np.asarray(records, dtype=np.uint8).reshape(-1, RECORD_BYTES)
    n_rec = recs.shape[0]
    idx = np.asarray(idx).astype(np.int64)
    indptr = np.asarray(indptr).astype(np.int64)
    if sm_scale is None:
        sm_scale = KDIM**-0.5
    out = np.zeros((n_q, h, LATENT))
    lse = np.full((n_q, h), -np.inf)
    st = []
    for r in range(n_q):
        pos = csr_row_positions(indptr, r, idx.shape[0])
        ent = idx[pos]
        ent = ent[(ent >= 0) & (ent < n_rec)]
        k, v = record_kv(recs[ent])
        out[r], lse[r] = _attend(q[r], k, v, sm_scale, dot_transform)
        st.append(_stats(q[r], k, v, sm_scale))
    return (out, lse, st) if stats else (out, lse)


def _stats(q, k, v, scale):
    n = k.shape[0]
    return dict(
        n_keys=n,
        v_absmax=float(np.max(np.abs(v))) if n else 0.0,
        score_abs=float(np.max(np.abs(scale) * (np.abs(q) @ np.abs(k).T))) if n else 0.0,
    )


def _decode_request_kv(kv_codes, kv_indices, kv_indptr, r, k_scale, v_scale):
    """-> (valid mask [seq_len], K [seq_len, 576], V [seq_len, 512]) in position order."""
    tokens, n = kv_codes.shape[0], len(kv_indices)
    a, b = (min(max(int(x), 0), n) for x in (kv_indptr[r], kv_indptr[r + 1]))  # clipped
    ids = np.asarray(kv_indices[a:b]).astype(np.int64) if b > a else np.zeros(0, np.int64)
    valid = (ids >= 0) & (ids < tokens)
    codes = np.asarray(kv_codes, dtype=np.uint8)[np.where(valid, ids, 0)]
    vals = e4m3_decode(codes)
    k = vals * float(np.float32(k_scale))
    v = vals[:, :LATENT] * float(np.float32(v_scale))
    return valid, k, v


def mla_decode(
    q,
    kv_codes,
    kv_indices,
    kv_indptr,
    qlen=1,
    k_scale=1.0,
    v_scale=1.0,
    sm_scale=None,
    num_splits=None,
    stats=False,
    k_transform=None,
):
    """Full attention (num_splits=None) or partials (num_splits=S).
    Returns (out [B*qlen,H,512], lse [B*qlen,H]) or (o_parts [B*qlen,S,H,512], lse_parts).
    k_transform (meta-tests only) is applied to the dequantized K, e.g. to emulate a bf16 K."""
    q = to_f64(q)
    nrows, h, d = q.shape
    assert d == KDIM
    kv_indptr = np.asarray(kv_indptr).astype(np.int64)
    b = kv_indptr.shape[0] - 1
    assert nrows == b * qlen
    if sm_scale is None:
        sm_scale = KDIM**-0.5
    s_count = 1 if num_splits is None else int(num_splits)
    o = np.zeros((nrows, s_count, h, LATENT))
    lse = np.full((nrows, s_count, h), -np.inf)
    st = []
    for r in range(b):
        valid, k, v = _decode_request_kv(kv_codes, kv_indices, kv_indptr, r, k_scale, v_scale)
        if k_transform is not None:
            k = k_transform(k)
        seq = valid.shape[0]
        if num_splits is None:
            bounds = [(0, seq)]
        else:
            c = 128 * (-(-seq // (128 * s_count))) if seq > 0 else 0
            bounds = [(min(s * c, seq), min((s + 1) * c, seq)) for s in range(s_count)]
        for i in range(qlen):
            row = r * qlen + i
            last = seq - qlen + i  # inclusive
            for s, (lo, hi) in enumerate(bounds):
                j = np.arange(lo, hi)
                j = j[(j <= last) & valid[lo:hi]]
                o[row, s], lse[row, s] = _attend(q[row], k[j], v[j], sm_scale)
            jj = np.arange(seq)
            jj = jj[(jj <= last) & valid]
            st.append(_stats(q[row], k[jj], v[jj], sm_scale))
    if num_splits is None:
        res = (o[:, 0], lse[:, 0])
    else:
        res = (o, lse)
    return (*res, st) if stats else res


def merge_attn_states(o_parts, lse_parts):
    """o_parts [n, S, H, D], lse_parts [n, S, H] -> (o [n, H, D], lse [n, H]) in float64."""
    o_parts = to_f64(o_parts)
    lse_parts = to_f64(lse_parts)
    m = np.max(lse_parts, axis=1, keepdims=True)  # [n,1,H]
    all_inf = np.isneginf(m)
    m_safe = np.where(all_inf, 0.0, m)
    w = np.where(np.isneginf(lse_parts), 0.0, np.exp(lse_parts - m_safe))  # [n,S,H]
    den = np.sum(w, axis=1)  # [n,H]
    safe_den = np.where(den > 0, den, 1.0)
    # weight-0 partials must not contribute even if their o holds NaN
    contrib = np.where(w[..., None] > 0, w[..., None] * o_parts, 0.0)
    o = np.sum(contrib, axis=1) / safe_den[..., None]
    o = np.where((den > 0)[..., None], o, 0.0)
    lse = np.where(den > 0, m_safe[:, 0] + np.log(safe_den), -np.inf)
    return o, lse


def uq_query(q, exact_q=False) -> np.ndarray:
    """The query ultraquant_decode scores with (the format's definition, as vLLM's reference
    attention computes it): q [..., 256] rotated exactly by H/16, then rounded to e4m3fn (nearest
    even, saturating at +-448, NaN stays NaN) unless ``exact_q``. float64, rotated dims."""
    q_rot = uq_rotate_exact(to_f64(q))
    return q_rot if exact_q else e4m3_decode(e4m3_encode(q_rot))


def ultraquant_decode(
    q, cache, block_tables, seq_lens, sm_scale=1 / 16, stats=False, exact_q=False
):
    """q [B, Hq, 256] (exact values) -> out [B, Hq, 256] float64 (no lse: the op has none).
    Also returns lse [B, Hq] (for diagnostics). Scores are ``uq_query(q) . K`` in the rotated
    (stored) dims; the stats' score_abs is ``sm_scale max_k sum_i |q_i K_i|`` there."""
    q = uq_query(q, exact_q)
    bsz, hq, d = q.shape
    assert d == UQ_D
    cache = np.asarray(cache, dtype=np.uint8)
    nb, bs, hk, _ = cache.shape
    assert hq % hk == 0
    g = hq // hk
    bt = np.asarray(block_tables).astype(np.int64)
    max_blocks = bt.shape[1]
    sl = np.clip(np.asarray(seq_lens).astype(np.int64), 0, max_blocks * bs)
    out = np.zeros((bsz, hq, UQ_D))
    lse = np.full((bsz, hq), -np.inf)
    st = []
    for b in range(bsz):
        j = np.arange(sl[b])
        blk = bt[b, j // bs]
        ok = (blk >= 0) & (blk < nb)
        j, blk = j[ok], blk[ok]
        slots = cache[blk, j % bs]  # [n, Hk, slot]
        k, v = uq_unpack(slots[..., :UQ_SLOT_MIN])  # [n, Hk, 256], K rotated
        for kh in range(hk):
            hs = slice(kh * g, (kh + 1) * g)
            out[b, hs], lse[b, hs] = _attend(q[b, hs], k[:, kh], v[:, kh], sm_scale)
            st.append(_stats(q[b, hs], k[:, kh], v[:, kh], sm_scale))
    return (out, lse, st) if stats else (out, lse)


# ----------------------------------------------------------------------------------------------
# Tolerances
# ----------------------------------------------------------------------------------------------

EPS32 = 2.0**-24


def attn_atol(n_keys, v_absmax, score_abs):
    """Absolute error budget (before the bf16 output rounding) of an f32 attention.

    * sum_k p_k v_k accumulated in f32: ~ 2^-24 * max|V| * sqrt(n) (random-walk rounding) with a
      safety factor; blocked / online softmax rescaling adds a few more 2^-24 * max|V|.
    * every score s_k = sm_scale * q.k is an f32 dot product over up to 576 terms. Its rounding
      error is a random walk of D roundings of partial sums (each <= score_abs = sm_scale *
      sum|q_i k_i|), i.e. ~ 2^-24 * sqrt(D) * rms(partial sum) ~ 2^-24 * score_abs; we allow 4x.
      A score error ds moves the output by <= 2 * ds * max|V| (sum p_k |v_k - out| <= 2 max|V|).
    (UltraQuant's scores: the e4m3 q8_i times the fp4 K_i are exact products, so only the f32
    sum over the 256 dims is budgeted; with ``exact_q`` the library's float32 rotation of q
    (8 butterfly roundings per dim, a random walk) moves each score by ~2^-24 score_abs,
    inside the same 4x.)
    A bug such as rounding q, K, the rotated q or the scores to bf16 (2^-9 relative per element)
    gives a score error ~2^-9 * score_abs / sqrt(D) ~ 2^15 / 24 ~ 1000x this score budget
    (tests check that such errors are caught).
    """
    n = np.maximum(np.asarray(n_keys, dtype=np.float64), 1.0)
    return EPS32 * np.asarray(v_absmax) * (8.0 * np.sqrt(n) + 16.0 + 2.0 * 4.0 * score_abs)


def lse_atol(n_keys, score_abs, lse):
    """f32 lse: the score error (as in attn_atol) + a few ulps of |lse| (the max score and the
    final rounding) + log of a sum of n f32 exps (relative error ~ sqrt(n) 2^-24)."""
    n = np.maximum(np.asarray(n_keys, dtype=np.float64), 1.0)
    lse = np.where(np.isfinite(lse), np.abs(lse), 0.0)
    return EPS32 * (4.0 * lse + 4.0 * score_abs + 4.0 * np.sqrt(n) + 8.0)


def stats_atol(stats, shape, heads_per_entry=None):
    """Per-(row, head) atol / score_abs / n_keys arrays from the oracle's stats list.
    stats has one entry per row ([n, H] shape), or per (row, kv head) with heads_per_entry heads
    each (ultraquant_decode)."""
    n, h = shape
    g = h if heads_per_entry is None else heads_per_entry
    per = h // g
    assert len(stats) == n * per
    n_keys = np.zeros((n, h))
    vmax = np.zeros((n, h))
    sabs = np.zeros((n, h))
    for i, s in enumerate(stats):
        r, k = divmod(i, per)
        sl = slice(k * g, (k + 1) * g)
        n_keys[r, sl], vmax[r, sl], sabs[r, sl] = s["n_keys"], s["v_absmax"], s["score_abs"]
    return n_keys, vmax, sabs


def assert_within(out, ref, tol, what="") -> float:
    """Asserts out (finite) within ``tol`` of ``ref`` elementwise; returns the worst err / tol."""
    out, ref = to_f64(out), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    err = np.abs(out - ref)
    bad = np.argwhere(err > tol)
    ratio = float(np.max(err / np.maximum(tol, 1e-300), initial=0.0))
    assert bad.size == 0, (
        f"{what}: {len(bad)} elements out of bound (worst ratio {ratio:.3g}); first "
        + str([(tuple(i), out[tuple(i)], ref[tuple(i)], tol[tuple(i)]) for i in bad[:3]])
    )
    return ratio


def check_attention(out, ref, stats, lse=None, ref_lse=None, heads_per_entry=None, what=""):
    """Asserts a library attention output (bf16) against the float64 oracle.

    |out - ref| <= 2^-8 |ref| + attn_atol: 2^-8 |ref| is the bf16 output rounding (half an ulp of
    an 8-significant-bit format is at most 2^-8 of the value), attn_atol the float32 arithmetic
    before it (see attn_atol). Rows without keys must be exactly 0 with lse -inf.
    Returns the largest err / tolerance ratio seen (for calibration).
    """
    out = to_f64(out)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    n_keys, vmax, sabs = stats_atol(stats, ref.shape[:2], heads_per_entry)
    assert np.all(np.isfinite(ref)), (
        f"{what}: the case is broken: a valid entry reaches a NaN record (reference not finite)"
    )
    assert np.all(np.isfinite(out)), (
        f"{what}: non-finite output at {np.argwhere(~np.isfinite(out))[:5]}"
    )
    tol = 2.0**-8 * np.abs(ref) + attn_atol(n_keys, vmax, sabs)[..., None]
    err = np.abs(out - ref)
    ratio = float(np.max(err / np.where(tol > 0, tol, 1e-300))) if out.size else 0.0
    bad = np.argwhere(err > tol)
    assert bad.size == 0, (
        f"{what}: {len(bad)} outputs out of tolerance; worst ratio {ratio:.3g}; first "
        + str([(tuple(b), out[tuple(b)], ref[tuple(b)], tol[tuple(b)]) for b in bad[:4]])
    )
    empty = n_keys == 0
    assert np.all(out[empty] == 0), f"{what}: rows without keys must be 0"
    if lse is not None:
        lse = to_f64(lse)
        ref_lse = np.asarray(ref_lse, np.float64)
        assert lse.shape == ref_lse.shape
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), f"{what}: -inf lse mismatch"
        assert not np.any(np.isnan(lse)) and not np.any(np.isposinf(lse)), f"{what}: bad lse"
        fin = np.isfinite(ref_lse)
        ltol = lse_atol(n_keys, sabs, ref_lse)
        lerr = np.where(fin, np.abs(np.where(fin, lse, 0) - np.where(fin, ref_lse, 0)), 0)
        lbad = np.argwhere(lerr > ltol)
        lratio = float(np.max(lerr / ltol)) if lse.size else 0.0
        assert lbad.size == 0, (
            f"{what}: {len(lbad)} lse out of tolerance; worst ratio {lratio:.3g}; first "
            + str([(tuple(b), lse[tuple(b)], ref_lse[tuple(b)]) for b in lbad[:4]])
        )
        ratio = max(ratio, lratio)
    return ratio
