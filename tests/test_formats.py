"""Writers and readers of the three record formats, byte for byte against the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import formats as F
from tests import cases as C
from tests import oracle as O

_rotate_k = getattr(F, "ultraquant_rotate_k", None) or F.ultraquant_rotate
# Jitted entry points: XLA compiles eager (op-by-op) calls per primitive and per shape, which is
# slow on CPU; test_ultraquant_store_bytes also runs the eager path.
rotate_k = jax.jit(_rotate_k)
uq_store = jax.jit(jsm.ultraquant_store)
uq_quantize = jax.jit(F.ultraquant_quantize)


def u8(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8) if np.asarray(x).dtype != np.uint8 else np.asarray(x)


def assert_bytes_equal(got, want, what=""):
    got, want = u8(got), u8(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{what}: {len(bad)} bytes differ, first at {bad[:5].tolist()}: " + str(
        [(int(got[tuple(b)]), int(want[tuple(b)])) for b in bad[:5]]
    )


# ---------------------------------------------------------------------------------------------
# fp8_ds_mla
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pack_random(seed, dtype):
    r = C.rng(seed)
    lat = C.random_latent(r, 64, binades=(-20, 12))  # includes scale floor and 2^7+ scales
    rope = C.random_rope(r, 64, scale=3.0)
    lat_j, rope_j = jnp.asarray(lat, dtype), jnp.asarray(rope, dtype)
    want = O.pack_fp8_ds_mla(np.asarray(lat_j.astype(jnp.float32)), np.asarray(rope_j, np.float32))
    got = jsm.pack_fp8_ds_mla(lat_j, rope_j)
    assert got.dtype == jnp.uint8 and got.shape == (64, 656)
    assert_bytes_equal(got, want, "pack_fp8_ds_mla")


def _block(values, amax=None):
    lat = np.zeros((1, 512), np.float32)
    lat[0, : len(values)] = values
    if amax is not None:
        lat[0, 127] = amax
    return lat


def _scales_of(rec):
    return np.asarray(rec)[:, 512:528].copy().view("<f4")


def test_pack_scale_fixed_points():
    lat = np.zeros((4, 512), np.float32)
    lat[0, :128] = 448.0
    lat[1, 5] = -336.0
    lat[2, 130] = 449.0
    lat[3, 300] = 448.0 * 2**7
    rope = np.zeros((4, 64), np.float32)
    got = jsm.pack_fp8_ds_mla(jnp.asarray(lat), jnp.asarray(rope))
    s = _scales_of(got)
    assert s[0].tolist() == [1.0, 2.0**-13, 2.0**-13, 2.0**-13]
    assert s[1, 0] == 1.0
    assert s[2, 1] == 2.0
    assert s[3, 2] == 2.0**7
    assert_bytes_equal(got, O.pack_fp8_ds_mla(lat, rope))


def test_pack_scale_boundaries():
    # amax / 448 exactly a power of two, and one f32 ulp either side, across many binades
    amax = []
    for k in range(-20, 20):
        a = np.float32(448.0 * 2.0**k)
        amax += [a, np.nextafter(a, np.float32(0)), np.nextafter(a, np.float32(np.inf))]
    amax += [np.float32(448e-4), np.float32(0.0448), np.float32(0.04480001)]  # near the 1e-4 floor
    amax = np.float32(amax)
    n = -(-len(amax) // 4)
    lat = np.zeros((n * 4, 128), np.float32)
    lat[: len(amax), 0] = amax
    lat[: len(amax), 1] = -amax / 3
    lat = lat.reshape(n, 512)
    rope = np.zeros((n, 64), np.float32)
    assert_bytes_equal(
        jsm.pack_fp8_ds_mla(jnp.asarray(lat), jnp.asarray(rope)), O.pack_fp8_ds_mla(lat, rope)
    )


def test_pack_e4m3_ties_and_subnormals():
    # scale 1 (amax 448): x/scale == x; every midpoint between neighbouring codes, both signs,
    # and just either side of each midpoint
    pos = O.E4M3_TABLE[:0x7F]
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)
    vals = np.concatenate(
        [mids, -mids, np.nextafter(mids, np.float32(1e9)), -np.nextafter(mids, np.float32(0))]
    )
    vals = np.concatenate([vals, pos.astype(np.float32), np.float32([2**-10, 3 * 2**-11])])
    n_blocks = -(-len(vals) // 127)
    lat = np.zeros((n_blocks * 128,), np.float32)
    for b in range(n_blocks):
        chunk = vals[b * 127 : (b + 1) * 127]
        lat[b * 128 : b * 128 + len(chunk)] = chunk
    n = -(-n_blocks // 4)
    lat = np.concatenate([lat, np.zeros(n * 512 - lat.size, np.float32)]).reshape(n * 4, 128)
    lat[:, 127] = 448.0  # keep every scale 1.0
    lat = lat.reshape(n, 512)
    rope = np.zeros((n, 64), np.float32)
    want = O.pack_fp8_ds_mla(lat, rope)
    assert np.all(_scales_of(want) == 1.0)
    assert_bytes_equal(jsm.pack_fp8_ds_mla(jnp.asarray(lat), jnp.asarray(rope)), want)


def test_pack_negative_zero_keeps_sign():
    # e4m3fn(x / scale) of -0 and of tiny negatives that round to zero is -0 (0x80), like every
    # IEEE-style converter (ml_dtypes, hardware cvt)
    lat = np.zeros((1, 512), np.float32)
    lat[0, 0] = 448.0
    lat[0, 1] = -0.0
    lat[0, 2] = -(2.0**-12)
    lat[0, 3] = 2.0**-12
    rope = np.zeros((1, 64), np.float32)
    got = u8(jsm.pack_fp8_ds_mla(jnp.asarray(lat), jnp.asarray(rope)))
    assert got[0, 1] == 0x80 and got[0, 2] == 0x80 and got[0, 3] == 0x00


def test_pack_rope_bf16_rne():
    rope = np.float32(
        [1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, -(1 + 2.0**-8), 3e38, 1e-40] * 10
        + [0.0] * 4
    ).reshape(1, 64)
    lat = np.zeros((1, 512), np.float32)
    got = u8(jsm.pack_fp8_ds_mla(jnp.asarray(lat), jnp.asarray(rope)))
    assert_bytes_equal(got[:, 528:], O.pack_fp8_ds_mla(lat, rope)[:, 528:], "rope")


def test_pack_bf16_rope_copied():
    r = C.rng(3)
    rope = C.bf16_normal(r, (5, 64))
    lat = jnp.zeros((5, 512), jnp.bfloat16)
    got = u8(jsm.pack_fp8_ds_mla(lat, rope))
    assert_bytes_equal(got[:, 528:], np.asarray(rope).view(np.uint8).reshape(5, 128), "rope")


@pytest.mark.parametrize("lead", [(7,), (2, 3), (2, 1, 2)])
def test_unpack(lead):
    r = C.rng(4)
    n = int(np.prod(lead))
    rec = O.pack_fp8_ds_mla(C.random_latent(r, n, binades=(-15, 10)), C.random_rope(r, n))
    # also arbitrary (valid, non-NaN) bytes: any code, any power-of-two scale
    raw = r.integers(0, 256, (n, 656), dtype=np.uint8)
    raw[:, :512][raw[:, :512] & 0x7F == 0x7F] = 0x11
    raw[:, 512:528] = np.float32(2.0 ** r.integers(-30, 30, (n, 4))).view(np.uint8).reshape(n, 16)
    raw[:, 528:] = O.f32_to_bf16_bits(r.standard_normal((n, 64)) * 100).astype("<u2").view(np.uint8)
    for recs in (rec, raw):
        lat, rope = jsm.unpack_fp8_ds_mla(jnp.asarray(recs.reshape(*lead, 656)))
        assert lat.dtype == jnp.float32 and lat.shape == (*lead, 512)
        assert rope.dtype == jnp.bfloat16 and rope.shape == (*lead, 64)
        w_lat, w_rope = O.unpack_fp8_ds_mla(recs)
        np.testing.assert_array_equal(np.asarray(lat).reshape(n, 512), w_lat)
        np.testing.assert_array_equal(np.asarray(rope, np.float64).reshape(n, 64), w_rope)


@pytest.mark.parametrize("lead", [(20,), (4, 5), (2, 5, 2)])
def test_concat_and_cache_ds_mla(lead):
    r = C.rng(5)
    rows = int(np.prod(lead))
    cache0 = r.integers(0, 256, (*lead, 656), dtype=np.uint8)
    t = 9
    lat = C.random_latent(r, t)
    rope = C.random_rope(r, t)
    slots = r.choice(rows, size=t, replace=False).astype(np.int32)
    slots[2] = -1
    slots[5] = rows
    slots[7] = rows + 100
    got = jsm.concat_and_cache_ds_mla(
        jnp.asarray(cache0), jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(slots)
    )
    assert got.shape == cache0.shape and got.dtype == jnp.uint8
    want = cache0.reshape(rows, 656).copy()
    rec = O.pack_fp8_ds_mla(lat, rope)
    for i, s in enumerate(slots):
        if 0 <= s < rows:
            want[s] = rec[i]
    assert_bytes_equal(np.asarray(got).reshape(rows, 656), want, "concat_and_cache_ds_mla")


@pytest.mark.parametrize("as_uint8", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-5])
def test_concat_and_cache_mla(as_uint8, scale):
    r = C.rng(6)
    tokens, t = 24, 10
    cache0 = r.integers(0, 256, (tokens, 576), dtype=np.uint8)
    lat = C.random_latent(r, t, binades=(-8, 5)) * np.float32(scale)
    rope = C.random_rope(r, t) * np.float32(scale)
    lat[0, :8] = np.float32([449, -449, 464, -500, 1e6, -1e30, 0.0, -0.0]) * np.float32(scale)
    # e4m3 midpoints (both signs) exactly after the division by a power-of-two scale
    pos = O.E4M3_TABLE[:0x7F]
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)
    if scale == 2.0**-5:
        lat[1, :126] = mids * np.float32(scale)
        lat[2, :126] = -mids * np.float32(scale)
    slots = r.choice(tokens, size=t, replace=False).astype(np.int32)
    slots[3] = -1
    slots[4] = tokens + 3
    cache = jnp.asarray(cache0) if as_uint8 else jnp.asarray(cache0).view(jnp.float8_e4m3fn)
    got = jsm.concat_and_cache_mla(
        cache, jnp.asarray(lat), jnp.asarray(rope), jnp.asarray(slots), scale=scale
    )
    assert got.dtype == cache.dtype and got.shape == cache.shape
    want = cache0.copy()
    codes = O.mla_cache_codes(lat, rope, scale)
    for i, s in enumerate(slots):
        if 0 <= s < tokens:
            want[s] = codes[i]
    assert_bytes_equal(u8(np.asarray(got)), want, "concat_and_cache_mla")


# ---------------------------------------------------------------------------------------------
# UltraQuant
# ---------------------------------------------------------------------------------------------


def exact_kv(r, t, hk):
    """bf16 multiples of 2^-6 in [-8, 8]: every Hadamard sum (<= 2^11 in magnitude, multiple of
    2^-6: 17 bits) is exact in float32, so the library's float32 rotation is the exact one."""
    k = r.integers(-512, 513, (t, hk, 256)) / 64.0
    v = r.integers(-512, 513, (t, hk, 256)) / 64.0
    # vary the magnitude per token (powers of two keep exactness as long as |x| <= 8)
    k = k * 2.0 ** -r.integers(0, 6, (t, hk, 1)).astype(np.float64)
    return C.to_bf16(k), C.to_bf16(v)


@pytest.mark.parametrize("slot_bytes,eager", [(272, True), (288, False)])
def test_ultraquant_store_bytes(slot_bytes, eager):
    r = C.rng(7)
    nb, bs, hk = 5, 4, 3
    cache0 = r.integers(0, 256, (nb, bs, hk, slot_bytes), dtype=np.uint8)
    t = 12
    k, v = exact_kv(r, t, hk)
    # group-level structure: zero groups (K and V), -0.0, tiny and large V groups
    k = k.at[0].set(0.0)
    v = v.at[1, 0, :32].set(0.0)
    v = v.at[1, 1, 32:64].set(-0.0)
    slots = r.choice(nb * bs, size=t, replace=False).astype(np.int32)
    slots[4] = -1
    slots[9] = nb * bs
    slots[10] = 2**31 - 1
    store = jsm.ultraquant_store if eager else uq_store
    got = store(jnp.asarray(cache0), k, v, jnp.asarray(slots))
    assert got.shape == cache0.shape and got.dtype == jnp.uint8
    want = O.ultraquant_store(cache0, np.asarray(k, np.float64), np.asarray(v, np.float64), slots)
    assert_bytes_equal(got, want, "ultraquant_store")


def test_ultraquant_store_random_kv():
    # generic bf16 inputs: the float32 rotation may round, so compare the decoded values of the
    # library's bytes with the oracle quantizer applied to the library's own float32 rotation
    r = C.rng(8)
    nb, bs, hk, t = 3, 8, 2, 20
    k, v = C.uq_kv(r, t, hk, binades=(-8, 8))
    cache0 = C.garbage_cache(r, nb, bs, hk)
    slots = r.choice(nb * bs, size=t, replace=False).astype(np.int32)
    got = np.asarray(uq_store(jnp.asarray(cache0), k, v, jnp.asarray(slots)))
    rot = np.asarray(rotate_k(k), np.float32)
    k_max = np.max(np.abs(np.asarray(k, np.float32)))
    exact = O.uq_rotate_exact(np.asarray(k, np.float64))
    np.testing.assert_allclose(rot, exact, rtol=0, atol=2.0**-22 * k_max)
    kc, ks = O.uq_quantize(rot)
    vc, vs = O.uq_quantize(np.asarray(v, np.float32))
    want = cache0.copy().reshape(nb * bs, hk, 272)
    want[slots] = np.concatenate([kc, ks, vc, vs], axis=-1)
    assert_bytes_equal(got.reshape(nb * bs, hk, 272), want, "ultraquant_store")


def test_ldexp_exact():
    """``x * 2^n`` rounded once, from the bits: float32 values over the whole range (subnormals,
    zeros of both signs, inf, NaN) times 2^n for n from -300 to 300, against NumPy's ldexp in
    float64 rounded to float32 (a correctly rounded reference: the float64 product is exact)."""
    r = C.rng(46)
    x = r.standard_normal(4000) * 2.0 ** r.integers(-160, 128, 4000)
    x = np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-149, -(2.0**-149)]])
    with np.errstate(over="ignore"):
        x = x.astype(np.float32)
        for n in (-300, -200, -150, -149, -126, -25, -1, 0, 1, 24, 126, 150, 200, 300):
            got = np.asarray(jax.jit(F.ldexp_exact)(jnp.asarray(x), jnp.int32(n)))
            want = np.ldexp(x.astype(np.float64), n).astype(np.float32)
            np.testing.assert_array_equal(got.view(np.uint32) == want.view(np.uint32), True, n)


def test_ultraquant_rotate_exact():
    r = C.rng(9)
    k, _ = exact_kv(r, 6, 2)
    got = np.asarray(rotate_k(k))
    assert got.dtype == np.float32 and got.shape == (6, 2, 256)
    np.testing.assert_array_equal(got, O.uq_rotate_exact(np.asarray(k, np.float64)))
    # a unit vector e_d lands, rotated, on the Hadamard row d / 16 in natural column order
    e = np.eye(256, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(rotate_k(jnp.asarray(e))), O.H256 / 16.0)


def test_ultraquant_store_k_natural_order():
    """K = 16 e_16 rotates to (-1)^bit4(d): +1 on dims 0-15, -1 on 16-31, ... in natural order.
    Each 32-group has amax 1: scale 2^floor(log2(0.156) + 0.5) = 2^-3 (byte 124), 1 / 2^-3 = 8
    saturates to E2M1 6 (code 0x7, -6 is 0xF): K codes are 8 bytes 0x77 then 8 bytes 0xFF per
    group. (A column permutation of K would mix the signs inside the groups.)"""
    k = jnp.zeros((1, 1, 256), jnp.float32).at[0, 0, 16].set(16.0)
    cache = uq_store(jnp.zeros((1, 1, 1, 272), jnp.uint8), k, k, jnp.zeros((1,), jnp.int32))
    slot = np.asarray(cache)[0, 0, 0]
    np.testing.assert_array_equal(slot[:128], np.tile([0x77] * 8 + [0xFF] * 8, 8))
    np.testing.assert_array_equal(slot[128:136], np.full(8, 124))


def _tie_groups():
    """[n, 256] float32 groups whose scale exponent is known and whose values hit every E2M1
    midpoint and level (both signs), saturation and zero."""
    lv, mid = O.E2M1_LEVELS, O.E2M1_MIDPOINTS
    rows = []
    for e in (0, -3, 5, -120, 100):
        # amax = 8 * 2^e -> t = 1.248 * 2^e -> exponent e; y = x / 2^e
        g1 = np.concatenate([mid, -mid[:2], [8.0, 0.0]])  # 14 + 2 + 2 = 18 values
        g1 = np.concatenate([g1, lv[:14]])  # 32 values
        g2 = np.concatenate([-mid, [-8.0, -0.0], np.nextafter(mid, 10), [7.0, 6.5]])
        g3 = np.concatenate([np.nextafter(mid, -10), lv[::-1][:15], [-6.5, 5.0, 5.5]])
        g4 = np.concatenate([lv, -lv[:7], lv * 0.999, [-8.0, 0.0, 0.0]])[:32]
        row = np.concatenate([g1, g2, g3, g4, -g1, -g2, -g3, -g4])
        assert row.shape == (256,)
        rows.append(row * 2.0**e)
    return np.asarray(rows, np.float32)


def test_ultraquant_quantize_ties():
    x = _tie_groups()
    codes, scales = uq_quantize(jnp.asarray(x))
    w_codes, w_scales = O.uq_quantize(x)
    assert_bytes_equal(scales, w_scales, "scales")
    assert_bytes_equal(codes, w_codes, "codes")
    assert np.all(w_scales[0] == 127)


def test_ultraquant_store_v_ties():
    # the same tie groups through V (not rotated) of ultraquant_store
    # midpoints and levels need <= 4 significant bits: exact in bf16 (the f32 nextafter
    # neighbours round back onto the midpoints, which only adds more ties)
    v = C.to_bf16(_tie_groups()[:3])
    x = np.asarray(v, np.float32)
    t = v.shape[0]
    cache0 = np.zeros((1, t, 1, 272), np.uint8)
    got = uq_store(
        jnp.asarray(cache0),
        jnp.zeros((t, 1, 256), jnp.bfloat16),
        v[:, None],
        jnp.arange(t, dtype=jnp.int32),
    )
    wc, ws = O.uq_quantize(x)
    got = u8(got)[0, :, 0]
    assert_bytes_equal(got[:, 136:264], wc, "V codes")
    assert_bytes_equal(got[:, 264:272], ws, "V scales")
    assert np.all(got[:, :136] == 0)  # K all zero -> codes 0, scale byte 0


def test_ultraquant_quantize_exponent_edges():
    x = np.zeros((8, 256), np.float32)
    amax = np.float32(
        [2.0**-125, 2.0**-126, 2.0**-149, 2.0**-130, 3.0e38, 2.0**127, 1.0, 2.0**-120]
    )
    for i, a in enumerate(amax):
        x[i, 32 * (i % 8) : 32 * (i % 8) + 3] = [a, -a / 2, a / 3]
    # boundaries of floor(log2(0.156 amax) + 0.5): t = 2^(n+1/2) neighbours
    xb = np.zeros((40, 256), np.float32)
    for i, n in enumerate(range(-20, 20)):
        t = np.float32(2.0 ** (n + 0.5))
        a = np.float32(t / np.float32(0.156))
        for j, aa in enumerate(
            [a, np.nextafter(a, np.float32(0)), np.nextafter(a, np.float32(1e9))]
        ):
            xb[i, 32 * j] = aa
            xb[i, 32 * j + 1] = -aa * np.float32(0.3)
    x = np.concatenate([x, xb])
    codes, scales = uq_quantize(jnp.asarray(x))
    w_codes, w_scales = O.uq_quantize(x)
    assert w_scales[0, 0] == 1  # 2^-125: exponent -128 clamped to -126
    assert w_scales[4, 4] == 252  # 3e38: exponent 125 (the upper clamp, 127, is unreachable:
    # 0.156 * FLT_MAX < 2^125.5)
    assert_bytes_equal(scales, w_scales, "scales")
    assert_bytes_equal(codes, w_codes, "codes")


def test_ultraquant_store_tiny_v_group_clamp():
    v = np.zeros((1, 1, 256), np.float32)
    v[0, 0, :4] = [2.0**-125, -(2.0**-126), 2.0**-127, 0.0]
    v[0, 0, 32:34] = [3.0e38, -1e38]
    v_b = C.to_bf16(v)
    got = u8(
        uq_store(
            jnp.zeros((1, 1, 1, 272), jnp.uint8),
            jnp.zeros((1, 1, 256), jnp.bfloat16),
            v_b,
            jnp.zeros((1,), jnp.int32),
        )
    )
    wc, ws = O.uq_quantize(np.asarray(v_b, np.float32))
    assert ws[0, 0, 0] == 1
    assert_bytes_equal(got[0, 0, :, 264:272], ws[0], "V scales")
    assert_bytes_equal(got[0, 0, :, 136:264], wc[0], "V codes")


def test_ultraquant_quantize_scale_underflow():
    """A group whose scale underflows: 0.156 * amax below 2^-126 clamps to byte 1 (2^-126) with
    the codes of x / 2^-126, as vLLM's torch reference writes (its Triton store writes byte 0);
    where the float32 product is 0 (amax <= 3 * 2^-149) the group is a zero group (byte 0), as
    in the torch reference."""
    tiny = np.float32(2.0**-149)
    amax = np.float32([1, 2, 3, 4, 5, 2**20, 2**22, 2**23]) * tiny  # subnormal to 2^-126
    x = np.zeros((1, 256), np.float32)
    for g, a in enumerate(amax):
        x[0, 32 * g : 32 * g + 3] = [a, -a, a / 2]
    codes, scales = uq_quantize(jnp.asarray(x))
    w_codes, w_scales = O.uq_quantize(x)
    assert_bytes_equal(scales, w_scales, "scales")
    assert_bytes_equal(codes, w_codes, "codes")
    np.testing.assert_array_equal(w_scales[0], [0, 0, 0, 1, 1, 1, 1, 1])
    assert np.all(w_codes[0, :48] == 0) and w_codes[0, 112] == 0xA2  # y = 1, -1


def _subnormal_rows(r, t, hk, scale):
    """bf16 rows of random multiples of ``scale`` (subnormal float32 values for a tiny scale)."""
    return C.to_bf16(r.integers(-127, 128, (t, hk, 256)) * scale)


@pytest.mark.parametrize("eager", [False, True])
def test_ultraquant_store_subnormal_rows(eager):
    """K and V rows of subnormal values (~3e-39, and a few 2^-149 multiples) stored byte for
    byte as the oracle's exact rotation and quantizer give them, although XLA:CPU flushes
    subnormals: the rotation prescales each row (its K rotates to normal values ~5e-38), the
    quantizer divides by its scale on the bits."""
    r = C.rng(45)
    k = _subnormal_rows(r, 4, 2, 2.0**-133)
    v = _subnormal_rows(r, 4, 2, 2.0**-133)
    k = k.at[3, 1].set(_subnormal_rows(r, 1, 1, 2.0**-149)[0, 0])
    v = v.at[3, 1].set(_subnormal_rows(r, 1, 1, 2.0**-149)[0, 0])
    assert np.all(np.abs(np.asarray(k, np.float32)) < 2.0**-126)
    cache0 = C.garbage_cache(r, 2, 2, 2)
    slots = np.int32([0, 3, 1, 2])
    store = jsm.ultraquant_store if eager else uq_store
    got = np.asarray(store(jnp.asarray(cache0), k, v, slots))
    want = O.ultraquant_store(cache0, np.asarray(k, np.float64), np.asarray(v, np.float64), slots)
    assert_bytes_equal(got, want, "ultraquant_store subnormal rows")
    k_back, v_back = O.uq_unpack(got)
    assert np.count_nonzero(k_back) > 1000 and np.count_nonzero(v_back) > 1000
    rotated = np.asarray(rotate_k(k), np.float64)
    np.testing.assert_array_equal(rotated, O.uq_rotate_exact(np.asarray(k, np.float64)))


def test_ultraquant_rotate_prescale_limits():
    """Rows at float32's ends rotate exactly: a row of 2^127-sized values (its partial sums
    would overflow without the prescale, its rotation fits) and one of subnormals rotating to
    subnormals. A row mixing 2^100 and 2^-145 keeps only what lies within 2^-244 of its
    largest magnitude: the tiny value may be flushed before the butterflies."""
    big = np.zeros((3, 256), np.float32)
    big[0, :8] = 2.0**127  # partial sums up to 2^130, the rotated values up to 2^126
    big[0, 8:16] = -(2.0**126)
    big[1, :3] = [2.0**-140, -(2.0**-140), 3 * 2.0**-140]  # rotates to +-{1, 3, 5} 2^-144
    big[2, :2] = [2.0**100, 2.0**100]
    big[2, 2] = 2.0**-145  # 2^-244 below 2^100 is 2^-144: flushable
    got = np.asarray(rotate_k(jnp.asarray(big)), np.float64)
    want = O.uq_rotate_exact(big.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(got[:2], want[:2])
    assert np.all(np.isfinite(got)) and np.count_nonzero(got[1]) == 256
    # row 2: where the two 2^100 cancel the exact value is +-2^-149, which flush-to-zero
    # arithmetic (XLA:CPU) gives as 0; the other dims are 2^97 +- 2^-149 -> 2^97 either way
    cancel = np.abs(want[2]) < 1
    assert np.all(np.abs(want[2][cancel]) == 2.0**-149) and cancel.sum() == 128
    np.testing.assert_array_equal(got[2][~cancel], want[2][~cancel])
    assert np.all((got[2][cancel] == want[2][cancel]) | (got[2][cancel] == 0))


def test_ultraquant_unpack():
    r = C.rng(10)
    cache = r.integers(0, 256, (3, 4, 2, 276), dtype=np.uint8)
    # scale bytes 2..200: byte 0 means a zero group, 6 * 2^127 would overflow float32 and
    # 0.5 * 2^-126 is a float32 subnormal (XLA on CPU flushes those to zero)
    cache[..., 128:136] = r.integers(2, 200, (3, 4, 2, 8))
    cache[..., 264:272] = r.integers(2, 200, (3, 4, 2, 8))
    k, v = F.ultraquant_unpack(jnp.asarray(cache))
    wk, wv = O.uq_unpack(cache)
    assert k.shape == (3, 4, 2, 256) and v.shape == (3, 4, 2, 256)
    np.testing.assert_array_equal(np.asarray(k, np.float64), wk)
    np.testing.assert_array_equal(np.asarray(v, np.float64), wv)


def test_ultraquant_store_roundtrip_error():
    # y = v / s has |y| <= amax / s < 6.4 * sqrt(2) ~ 9.07: error <= 3.07 * s (saturation at 6),
    # and <= half a step (<= 1 * s) below 6
    r = C.rng(11)
    k, v = C.uq_kv(r, 8, 2)
    cache = uq_store(jnp.zeros((1, 8, 2, 272), jnp.uint8), k, v, jnp.arange(8, dtype=jnp.int32))
    kd, vd = O.uq_unpack(np.asarray(cache))
    vv = np.asarray(v, np.float64)
    s = 2.0 ** (np.asarray(cache)[..., 264:272].astype(np.float64) - 127)[0]
    err = np.abs(vd[0] - vv).reshape(8, 2, 8, 32)
    assert np.all(err <= s[..., None] * 3.07)
    kk = O.uq_unrotate(kd[0])
    rel = np.linalg.norm(kk - np.asarray(k, np.float64), axis=-1) / np.linalg.norm(
        np.asarray(k, np.float64), axis=-1
    )
    assert np.all(rel < 0.25)


# ---------------------------------------------------------------------------------------------
# Non-finite writer inputs: ±inf saturates with its sign, NaN as each docstring states
# ---------------------------------------------------------------------------------------------

INF, NAN = np.float32(np.inf), np.float32(np.nan)


def _non_finite_latent(r, dtype):
    lat = C.random_latent(r, 4)
    lat[0, 5] = INF  # block 0 of token 0: +inf
    lat[0, 130] = -INF  # block 1: -inf
    lat[0, 300] = NAN  # block 2: NaN
    lat[1, 0], lat[1, 1] = INF, -INF  # both signs in one block
    lat[2, 500] = -NAN  # a negative NaN
    rope = C.random_rope(r, 4)
    rope[0, :3] = [INF, -INF, NAN]
    # converted on the host: a GPU's f32 -> bf16 conversion would drop the NaN's sign and payload
    return jnp.asarray(lat.astype(dtype)), jnp.asarray(rope.astype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pack_non_finite(dtype):
    lat, rope = _non_finite_latent(C.rng(40), dtype)
    got = np.asarray(jax.jit(jsm.pack_fp8_ds_mla)(lat, rope))
    want = O.pack_fp8_ds_mla(np.asarray(lat, np.float32), np.asarray(rope, np.float32))
    assert_bytes_equal(got, want, "pack_fp8_ds_mla non-finite")
    # the rule itself: ±inf -> ±448 under scale 2^127 (reads back as ±inf), sign kept
    assert got[0, 5] == 0x7E and got[0, 130] == 0xFE and got[1, 0] == 0x7E and got[1, 1] == 0xFE
    assert got[0, 300] in (0x7F, 0xFF) and got[2, 500] == 0xFF
    scales = got[:, 512:528].copy().view("<f4")
    assert np.all(scales[0, :3] == 2.0**127) and scales[1, 0] == 2.0**127
    latent, _ = jsm.unpack_fp8_ds_mla(jnp.asarray(got))
    latent = np.asarray(latent)
    assert latent[0, 5] == np.inf and latent[0, 130] == -np.inf and np.isnan(latent[0, 300])
    assert np.all(latent[0, [6, 131, 301]] == 0)  # the rest of a non-finite block
    assert np.all(np.isfinite(latent[3]))


def test_concat_and_cache_ds_mla_non_finite():
    lat, rope = _non_finite_latent(C.rng(41), jnp.float32)
    cache0 = C.make_records(C.rng(42), 6)
    slots = np.int32([5, 0, -1, 2])
    got = jax.jit(jsm.concat_and_cache_ds_mla)(jnp.asarray(cache0), lat, rope, slots)
    want = cache0.copy()
    packed = O.pack_fp8_ds_mla(np.asarray(lat), np.asarray(rope))
    want[[5, 0, 2]] = packed[[0, 1, 3]]
    assert_bytes_equal(got, want, "concat_and_cache_ds_mla non-finite")


@pytest.mark.parametrize("as_uint8", [False, True])
def test_concat_and_cache_mla_non_finite(as_uint8):
    lat, rope = _non_finite_latent(C.rng(43), jnp.float32)
    cache0 = np.zeros((4, 576), np.uint8)
    cache = jnp.asarray(cache0) if as_uint8 else jnp.asarray(cache0).view(jnp.float8_e4m3fn)
    got = u8(
        np.asarray(
            jsm.concat_and_cache_mla(cache, lat, rope, np.arange(4, dtype=np.int32), scale=0.5)
        )
    )
    assert_bytes_equal(got, O.mla_cache_codes(lat, rope, 0.5), "concat_and_cache_mla")
    assert got[0, 5] == 0x7E and got[0, 130] == 0xFE and got[0, 512] == 0x7E
    assert got[0, 513] == 0xFE and got[0, 300] in (0x7F, 0xFF) and got[0, 514] in (0x7F, 0xFF)


def test_ultraquant_non_finite():
    r = C.rng(44)
    k, v = exact_kv(r, 3, 2)
    v = v.at[0, 0, 3].set(np.inf)
    v = v.at[0, 1, 40].set(-np.inf)
    v = v.at[1, 0, 100].set(np.nan)
    v = v.at[1, 1, 200].set(np.inf).at[1, 1, 201].set(-np.inf)
    k = k.at[2, 0, 7].set(np.inf)  # spreads as ±inf over every rotated dim
    cache0 = C.garbage_cache(r, 2, 2, 2)
    slots = np.int32([0, 3, 1])
    got = np.asarray(uq_store(jnp.asarray(cache0), k, v, slots))
    want = O.ultraquant_store(cache0, np.asarray(k, np.float64), np.asarray(v, np.float64), slots)
    assert_bytes_equal(got, want, "ultraquant_store non-finite")
    slot = got.reshape(4, 2, 272)
    # every group holding +-inf or NaN is a zero group (vLLM's torch reference and SGLang):
    # V groups 0 / 1 / 3 / 6, and all of K of token 2 (slot 1; inf spreads over every dim)
    zero_v = {(0, 0, 0), (0, 1, 1), (3, 0, 3), (3, 1, 6)}
    for s_, h, g_ in zero_v:
        assert slot[s_, h, 264 + g_] == 0
        assert np.all(slot[s_, h, 136 + 16 * g_ : 136 + 16 * (g_ + 1)] == 0)
    assert np.all(slot[1, 0, :136] == 0) and np.all(slot[1, 1, 128:136] != 0)
    finite = [(s_, h, g_) for s_ in (0, 3) for h in range(2) for g_ in range(8)]
    assert all(slot[t, h, 264 + g_] != 0 for t, h, g_ in finite if (t, h, g_) not in zero_v)
    codes, scales = uq_quantize(jnp.asarray(np.asarray(v, np.float32)))
    want_c, want_s = O.uq_quantize(np.asarray(v, np.float32))
    assert_bytes_equal(codes, want_c, "ultraquant_quantize codes")
    assert_bytes_equal(scales, want_s, "ultraquant_quantize scales")
