"""Self-checks of the independent oracle (tests/oracle.py): codec tables, rounding rules, fixed
points, the Hadamard rotation and the attention helpers. These do not touch the library."""

import math

import numpy as np
import pytest

from tests import oracle as O


def test_e4m3_table():
    t = O.E4M3_TABLE
    assert t[0x00] == 0.0 and t[0x80] == 0.0 and math.copysign(1, t[0x80]) == -1
    assert t[0x01] == 2.0**-9  # smallest subnormal
    assert t[0x07] == 7 * 2.0**-9  # largest subnormal
    assert t[0x08] == 2.0**-6  # smallest normal
    assert t[0x38] == 1.0
    assert t[0x7E] == 448.0 and t[0xFE] == -448.0
    nan = [c for c in range(256) if np.isnan(t[c])]
    assert nan == [0x7F, 0xFF]
    assert np.all(np.isfinite(np.delete(t, [0x7F, 0xFF])))


def test_e4m3_roundtrip_all_codes():
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint8)
    assert np.array_equal(O.e4m3_encode(O.e4m3_decode(codes)), codes)


def test_e4m3_ties_to_even_and_saturation():
    pos = O.E4M3_TABLE[:0x7F]
    mids = (pos[1:] + pos[:-1]) / 2  # between code c and c+1
    got = O.e4m3_encode(mids)
    lo = np.arange(0x7E)
    want = np.where(lo % 2 == 0, lo, lo + 1)
    assert np.array_equal(got, want)
    assert np.array_equal(O.e4m3_encode(-mids), want | 0x80)
    # just above / below a midpoint
    assert np.array_equal(O.e4m3_encode(np.nextafter(mids, np.inf)), lo + 1)
    assert np.array_equal(O.e4m3_encode(np.nextafter(mids, -np.inf)), lo)
    for x in (448.0, 449.0, 464.0, 480.0, 1e6, 3e38, np.inf):
        assert O.e4m3_encode(x) == 0x7E and O.e4m3_encode(-x) == 0xFE
    assert O.e4m3_encode(2.0**-10) == 0x00  # tie between 0 and 2^-9 -> even (0)
    assert O.e4m3_encode(3 * 2.0**-10) == 0x02  # tie between 1 and 2 subnormal codes -> 2
    assert O.e4m3_encode(-0.0) == 0x80


def test_e4m3_matches_ml_dtypes():
    # Cross-check of the hand-written codec (ml_dtypes is used here only, never in the oracle).
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            (rng.standard_normal(20000) * 2.0 ** rng.integers(-12, 10, 20000)).astype(np.float32),
            ((O.E4M3_TABLE[:0x7E] + O.E4M3_TABLE[1:0x7F]) / 2).astype(np.float32),
            np.float32([448, 460, 463.9, -450]),
        ]
    )
    # ml_dtypes turns |x| >= 464 into NaN; the format saturates, so compare below that only.
    x = x[np.abs(x) < 464]
    want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = O.e4m3_encode(x.astype(np.float64))
    assert np.array_equal(got, want)


def test_bf16_codec():
    assert O.f32_to_bf16_bits(1.0) == 0x3F80
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even -> 1.0; 1 + 3*2^-8 -> 1 + 2^-6
    assert O.round_bf16(1 + 2.0**-8) == 1.0
    assert O.round_bf16(1 + 3 * 2.0**-8) == 1 + 2.0**-6
    assert O.round_bf16(1 + 2.0**-8 + 2.0**-20) == 1 + 2.0**-7
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(50000) * 2.0 ** rng.integers(-30, 30, 50000)).astype(np.float32)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(O.f32_to_bf16_bits(x), want)


def test_ds_mla_scale_fixed_points():
    def scale_of(amax):
        lat = np.zeros((1, 512), np.float32)
        lat[0, :128] = np.float32(amax)
        return O.ds_mla_scales(lat)[0]

    assert scale_of(448.0)[0] == 1.0
    assert scale_of(336.0)[0] == 1.0
    assert scale_of(0.0)[0] == 2.0**-13
    assert scale_of(449.0)[0] == 2.0
    assert scale_of(224.0)[0] == 0.5
    assert scale_of(225.0)[0] == 1.0
    assert scale_of(448.0 * 2**7)[0] == 2.0**7
    assert np.all(scale_of(5.0)[1:] == 2.0**-13)


def test_pack_unpack_roundtrip():
    rng = np.random.default_rng(2)
    lat = (rng.standard_normal((16, 512)) * 3).astype(np.float32)
    rope = rng.standard_normal((16, 64)).astype(np.float32)
    rec = O.pack_fp8_ds_mla(lat, rope)
    assert rec.shape == (16, 656) and rec.dtype == np.uint8
    l2, r2 = O.unpack_fp8_ds_mla(rec)
    assert np.array_equal(r2, O.round_bf16(rope))
    s = O.ds_mla_scales(lat).repeat(128, 1)
    # e4m3 rounding: <= 2^-4 of the value (half ulp, 3 mantissa bits), or half the smallest
    # subnormal step (2^-10 * scale) near zero
    assert np.all(np.abs(l2 - lat) <= 2.0**-4 * np.abs(lat) + 2.0**-10 * s)
    assert np.all(np.abs(l2) <= 448 * s)


def test_hadamard_rotation():
    h = O.H256_ORTHO
    assert np.array_equal(h @ h, np.eye(256))  # exact: entries +-1/16, sums of 256 terms
    assert np.array_equal(h, h.T)
    assert O.H256[3, 5] == -1 and O.H256[3, 12] == 1  # popcount(1) odd, popcount(0) even
    e = np.eye(256)[[0, 0x10, 0x40]]  # e_d rotates to Hadamard row d, natural order
    np.testing.assert_array_equal(O.uq_rotate_exact(e), O.H256[[0, 0x10, 0x40]] / 16.0)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((5, 256))
    assert np.allclose(O.uq_unrotate(O.uq_rotate_exact(k)), k, rtol=0, atol=1e-13)
    q = rng.standard_normal((5, 256))
    assert np.allclose(np.sum(q * k, -1), np.sum(O.uq_rotate_exact(q) * O.uq_rotate_exact(k), -1))


def test_floor_log2_plus_half_exact():
    for n in range(-140, 120):
        b = 2.0 ** (n + 0.5)  # irrational boundary: f32 neighbours on both sides
        below = np.float32(b)
        if float(below) > b:
            below = np.nextafter(below, np.float32(0))
        above = np.nextafter(below, np.float32(np.inf))
        if below == 0:
            continue
        assert O._floor_log2_plus_half_exact(np.float64(below)) == n
        assert O._floor_log2_plus_half_exact(np.float64(above)) == n + 1
    rng = np.random.default_rng(4)
    t = np.abs(rng.standard_normal(10000) * 2.0 ** rng.integers(-60, 60, 10000)).astype(np.float32)
    ref = np.floor(np.log2(t.astype(np.float64)) + 0.5)
    assert np.array_equal(O._floor_log2_plus_half_exact(t), ref)


def test_e2m1_rounding():
    lv = O.E2M1_LEVELS
    assert lv.tolist() == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    codes = O.e2m1_encode_scaled(O.E2M1_MIDPOINTS)
    assert np.array_equal(O.E2M1_TABLE[codes], lv[:-1])  # ties -> lower level
    assert np.array_equal(O.E2M1_TABLE[O.e2m1_encode_scaled(lv)], lv)
    assert O.e2m1_encode_scaled(0.0) == 0 and O.e2m1_encode_scaled(-0.0) == 0
    assert O.e2m1_encode_scaled(-0.25) == 0x9  # tie -> -0.5
    assert O.e2m1_encode_scaled(0.25) == 0  # tie -> +0
    assert O.e2m1_encode_scaled(-0.2) == 0  # rounds to zero -> +0 code
    assert O.e2m1_encode_scaled(100.0) == 7 and O.e2m1_encode_scaled(-100.0) == 0xF


def test_uq_quantize_basic():
    x = np.zeros((256,), np.float32)
    c, s = O.uq_quantize(x)
    assert np.all(c == 0) and np.all(s == 0)
    x[:32] = 1.0  # t = 0.156 -> log2 = -2.68 -> e = -3 -> y = 8 -> saturates to 6
    c, s = O.uq_quantize(x)
    assert s[0] == 124 and np.all(s[1:] == 0)
    assert np.all(c[:16] == 0x77)
    x = np.zeros((256,), np.float32)
    x[32] = 2.0**-125
    c, s = O.uq_quantize(x)
    assert s[1] == 1  # exponent clamped to -126


def test_attention_helpers():
    q = np.ones((1, 2, 576))
    rec = O.pack_fp8_ds_mla(np.zeros((3, 512)), np.zeros((3, 64)))
    out, lse = O.sparse_mla(q, rec, np.array([0, 1, 2]), np.array([0, 3]))
    assert np.all(out == 0) and np.allclose(lse, np.log(3))
    out, lse = O.sparse_mla(q, rec, np.array([-1, 3]), np.array([0, 2]))
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    o, l2 = O.merge_attn_states(np.ones((1, 2, 1, 4)), np.array([[[-np.inf], [0.0]]]))
    assert np.allclose(o, 1) and np.allclose(l2, 0)
    o, l2 = O.merge_attn_states(np.full((1, 2, 1, 4), np.nan), np.full((1, 2, 1), -np.inf))
    assert np.all(o == 0) and np.all(np.isneginf(l2))
