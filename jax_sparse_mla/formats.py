"""Record formats: fp8_ds_mla records, the fp8 latent cache of ``mla_decode``, UltraQuant slots.

Every writer here is a pure function that returns the updated cache. Under ``jax.jit`` with the
cache donated (``jax.jit(f, donate_argnums=...)``) XLA performs the update in place, so a
serving loop pays for the written rows only. A cache split over mesh axes along its first
dimension (and, for UltraQuant, its KV heads) keeps its split: each device writes its own
slots, with no collective; a cache split along its bytes is gathered first. All byte layouts
are little-endian and fp8 is OCP e4m3fn (never FNUZ); docs/formats.md describes the layouts
and rules.

Bit-exactness notes (XLA on CPU flushes subnormal floats to zero and its ``exp2`` is not exact at
integers): powers of two are built from exponent bits, ``ceil(log2)`` and ``round(log2)`` are read
off the float32 bits, and the UltraQuant rotation's prescale and the quantizer's division by
its power-of-two scale are done on the bits (``ldexp_exact``), so the bytes match an exact
(float64) reading of the rules for every input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla._checks import as_jax, check_array, check_equal, check_scalar
from jax_sparse_mla._vma import split_only_over

# fp8_ds_mla record layout.
LATENT_DIM = 512
ROPE_DIM = 64
KV_DIM = LATENT_DIM + ROPE_DIM  # 576: K = latent ‖ rope
SCALE_BLOCK = 128  # latent dims covered by one float32 scale
NUM_SCALES = LATENT_DIM // SCALE_BLOCK  # 4
RECORD_BYTES = LATENT_DIM + 4 * NUM_SCALES + 2 * ROPE_DIM  # 656
SCALES_OFFSET = LATENT_DIM  # 512
ROPE_OFFSET = SCALES_OFFSET + 4 * NUM_SCALES  # 528

FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_SCALE_RATIO = np.float32(1e-4)  # floor of amax / 448 in the fp8_ds_mla writer
MAX_KERNEL_SCALE = 2.0**7  # gfx950 sparse_mla precondition on every record scale

# UltraQuant slot layout (head dim 256).
UQ_HEAD_DIM = 256
UQ_GROUP = 32  # values per UE8M0 scale
UQ_GROUPS = UQ_HEAD_DIM // UQ_GROUP  # 8
UQ_CODE_BYTES = UQ_HEAD_DIM // 2  # 128: two E2M1 codes per byte, element 2i in the low nibble
UQ_K_CODES, UQ_K_SCALES = 0, 128
UQ_V_CODES, UQ_V_SCALES = 136, 264
UQ_SLOT_CONTENT_BYTES = 272

# E2M1: the 15 signed levels in increasing order, the code of each, and the midpoints between
# neighbours. Quantizing is ``level_index = sum(y > midpoints)``, so a tie goes to the lower level.
_E2M1_LEVELS = np.array(
    [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32
)
_E2M1_LEVEL_CODES = np.array(
    [0xF, 0xE, 0xD, 0xC, 0xB, 0xA, 0x9, 0x0, 0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7], dtype=np.uint8
)
_E2M1_MIDPOINTS = (_E2M1_LEVELS[1:] + _E2M1_LEVELS[:-1]) / 2
# Value of each 4-bit code (0x8 is -0).
E2M1_CODE_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
_E2M1_ZERO_LEVEL = 7  # index of level 0 (code 0x0)
_UQ_ZERO_AMAX_BITS = 3  # 0.156 * amax rounds to 0 in float32 up to amax = 3 * 2^-149
_SQRT2_MANTISSA = 0x3504F4  # smallest 23-bit mantissa m with 1 + m / 2^23 >= sqrt(2)
_UQ_COMPUTE_SCALE = np.float32(0.156)


def _f32_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def pow2(e: jax.Array) -> jax.Array:
    """Exact float32 ``2**e`` for int32 ``e`` in [-126, 128] (128 gives inf), from the bits."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _abs_max_bits(x: jax.Array, axis: int) -> jax.Array:
    """Bits of ``max |x|`` along ``axis``, computed on integers (exact even for subnormals)."""
    return jnp.max(_f32_bits(x) & 0x7FFFFFFF, axis=axis)


def _to_bytes(x: jax.Array) -> jax.Array:
    """[..., n] array of a 2- or 4-byte dtype -> [..., n * itemsize] uint8 (little-endian)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(*x.shape[:-1], x.shape[-1] * np.dtype(x.dtype).itemsize)


def _from_bytes(b: jax.Array, dtype) -> jax.Array:
    """[..., n * itemsize] uint8 -> [..., n] of ``dtype``."""
    size = np.dtype(dtype).itemsize
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // size, size), dtype)


def _e4m3_codes(x: jax.Array, source: jax.Array) -> jax.Array:
    """float32 ``x`` -> e4m3fn bytes, round to nearest even, saturated to ±448 (XLA does not
    saturate). Where ``source`` (the value ``x`` was computed from) is NaN the code is 0x7F, or
    0xFF when its sign bit is set: fixed here, since arithmetic on NaN keeps no sign on GPUs."""
    y = jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    codes = jax.lax.bitcast_convert_type(y, jnp.uint8)
    nan_code = jnp.where(jnp.signbit(source), jnp.uint8(0xFF), jnp.uint8(0x7F))
    return jnp.where(jnp.isnan(source), nan_code, codes)


def _rope_bf16(rope: jax.Array) -> jax.Array:
    """The rope as bf16: copied when it already is bf16, else rounded to nearest even; a NaN
    becomes the quiet NaN of its top 16 bits (sign and payload kept, as on the CPU; GPUs would
    give their canonical NaN)."""
    if rope.dtype == jnp.bfloat16:
        return rope
    r = rope.astype(jnp.float32)
    quiet = ((_f32_bits(r) >> 16) | 0x0040).astype(jnp.uint16)
    bits = jax.lax.bitcast_convert_type(r.astype(jnp.bfloat16), jnp.uint16)
    return jax.lax.bitcast_convert_type(jnp.where(jnp.isnan(r), quiet, bits), jnp.bfloat16)


# ---------------------------------------------------------------------------------------------
# fp8_ds_mla records
# ---------------------------------------------------------------------------------------------


def fp8_ds_mla_scales(latent: jax.Array) -> jax.Array:
    """Per-128 power-of-two scales of the fp8_ds_mla writer.

    ``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` with ``amax / 448`` in float32 and the
    ceil of its exact log2 (read off the bits), the exponent clamped to 127: a block holding
    ±inf or NaN (amax not finite) gets 2^127 (no finite block needs more than 2^120).

    Args:
      latent: [..., 512] float.
    Returns:
      [..., 4] float32 scales.
    """
    blocks = latent.astype(jnp.float32).reshape(*latent.shape[:-1], NUM_SCALES, SCALE_BLOCK)
    amax = jax.lax.bitcast_convert_type(_abs_max_bits(blocks, axis=-1), jnp.float32)
    ratio = jnp.maximum(amax / jnp.float32(FP8_MAX), MIN_SCALE_RATIO)
    bits = _f32_bits(ratio)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return pow2(jnp.minimum(exponent, 127))


def pack_fp8_ds_mla(latent: jax.Array, rope: jax.Array) -> jax.Array:
    """Packs tokens into 656-byte fp8_ds_mla records.

    Not differentiable: the result is bytes (a quantizer's derivative is zero almost
    everywhere), so ``jax.grad`` through it is zero, never an estimate.

    Non-finite values: ±inf saturates with its sign (code ±448 under the block scale 2^127,
    which reads back as ±inf); a NaN is stored as the e4m3fn NaN code (0x7F, 0xFF if negative)
    under the block scale 2^127, and the other values of a block holding ±inf or NaN become
    (signed) 0. The rope keeps its ±inf and NaN (bf16).

    Args:
      latent: [N, 512] float (bf16, f16 or f32), quantized to e4m3fn with per-128 pow2 scales.
      rope: [N, 64] float, stored as bf16 (copied when bf16, else rounded to nearest even).
    Returns:
      [N, 656] uint8 records: 512 e4m3fn codes, 4 float32 scales, 64 bf16 rope values.
    """
    op = "pack_fp8_ds_mla"
    check_array(op, "latent", latent, ndim=2, last_dims=(LATENT_DIM,))
    check_array(op, "rope", rope, ndim=2, last_dims=(ROPE_DIM,))
    _check_float(op, "latent", latent)
    _check_float(op, "rope", rope)
    check_equal(
        op, "token counts", latent.shape[0], rope.shape[0], "latent and rope need one row per token"
    )
    return _pack_records(*as_jax(latent, rope))


def _pack_records(latent: jax.Array, rope: jax.Array) -> jax.Array:
    lat = latent.astype(jnp.float32)
    scales = fp8_ds_mla_scales(lat)
    scaled = lat / jnp.repeat(scales, SCALE_BLOCK, axis=-1)
    codes = _e4m3_codes(jnp.where(jnp.isinf(lat), lat, scaled), lat)  # not inf x 2^-127 (0)
    return jnp.concatenate([codes, _to_bytes(scales), _to_bytes(_rope_bf16(rope))], axis=-1)


def unpack_fp8_ds_mla(records: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Reads fp8_ds_mla records. Not differentiable w.r.t. the records (integer bytes).

    Args:
      records: [..., 656] uint8.
    Returns:
      latent [..., 512] float32 (``code * scale``, exact) and rope [..., 64] bf16.
    """
    check_array(
        "unpack_fp8_ds_mla", "records", records, dtypes=[jnp.uint8], last_dims=(RECORD_BYTES,)
    )
    return _unpack_records(jnp.asarray(records))


def _unpack_records(records: jax.Array) -> tuple[jax.Array, jax.Array]:
    codes = jax.lax.bitcast_convert_type(records[..., :LATENT_DIM], jnp.float8_e4m3fn)
    scales = _from_bytes(records[..., SCALES_OFFSET:ROPE_OFFSET], jnp.float32)
    latent = codes.astype(jnp.float32) * jnp.repeat(scales, SCALE_BLOCK, axis=-1)
    rope = _from_bytes(records[..., ROPE_OFFSET:], jnp.bfloat16)
    return latent, rope


def _check_float(op: str, name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: {name} must be a float array, got {np.dtype(x.dtype).name}")


def _check_token_batch(op: str, latent, rope, slot_mapping) -> None:
    check_array(op, "latent", latent, ndim=2, last_dims=(LATENT_DIM,))
    check_array(op, "rope", rope, ndim=2, last_dims=(ROPE_DIM,))
    _check_float(op, "latent", latent)
    _check_float(op, "rope", rope)
    check_array(op, "slot_mapping", slot_mapping, dtypes=[jnp.int32], ndim=1)
    t = latent.shape[0]
    check_equal(op, "token counts", t, rope.shape[0], "latent and rope need one row per token")
    check_equal(
        op, "token counts", t, slot_mapping.shape[0], "slot_mapping needs one slot per token"
    )


def _scatter_rows(flat: jax.Array, slot_mapping: jax.Array, rows: jax.Array) -> jax.Array:
    """``flat[slot, ..., :w] = row`` (w = row width) for each slot in [0, len(flat)).

    Other slots (-1 included) skip. Duplicate slots write one of their rows (which one is
    unspecified). Bytes past ``w`` of a slot are left as they are. ``flat`` split over Explicit
    mesh axes along its slots (dimension 0) or the dimensions after them but the last keeps that
    split: each device writes the rows of its own slots (no gather of the cache, and in place
    when donated); other splits are gathered first.
    """
    flat, sharding = split_only_over(flat, tuple(range(flat.ndim - 1)))
    n = flat.shape[0]
    slots = jnp.where((slot_mapping >= 0) & (slot_mapping < n), slot_mapping, n)
    width = rows.shape[-1]
    rows = rows.astype(flat.dtype)
    return flat.at[slots, ..., :width].set(rows, mode="drop", out_sharding=sharding)


def concat_and_cache_ds_mla(
    cache: jax.Array, latent: jax.Array, rope: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Writes tokens into an fp8_ds_mla cache (vLLM's ``concat_and_cache_ds_mla``).

    Not differentiable (the cache is bytes: ``jax.grad`` through it is zero).

    Args:
      cache: [..., 656] uint8; its rows flattened are the slots (e.g. [blocks, block_size, 656]).
      latent: [T, 512] float.
      rope: [T, 64] float.
      slot_mapping: [T] int32 slot per token; -1 (or any slot outside the cache) skips the token.
    Returns:
      The updated cache, same shape. Functional; in place when the caller donates ``cache``.
    """
    op = "concat_and_cache_ds_mla"
    check_array(op, "cache", cache, dtypes=[jnp.uint8], min_ndim=2, last_dims=(RECORD_BYTES,))
    _check_token_batch(op, latent, rope, slot_mapping)
    latent, rope, slot_mapping = as_jax(latent, rope, slot_mapping)
    cache, _ = split_only_over(jnp.asarray(cache), (0,))
    flat = cache.reshape(-1, RECORD_BYTES)
    return _scatter_rows(flat, slot_mapping, _pack_records(latent, rope)).reshape(cache.shape)


# ---------------------------------------------------------------------------------------------
# fp8 latent cache of mla_decode
# ---------------------------------------------------------------------------------------------


def concat_and_cache_mla(
    cache: jax.Array,
    latent: jax.Array,
    rope: jax.Array,
    slot_mapping: jax.Array,
    *,
    scale=1.0,
) -> jax.Array:
    """Writes tokens into the fp8 latent cache read by ``mla_decode``.

    Not differentiable (the cache is fp8 / byte codes: ``jax.grad`` through it is zero).

    ``code = e4m3fn(float32(x) / scale)``, rounded to nearest even and saturated to ±448, for
    ``x = latent ‖ rope``: ±inf becomes ±448 (0x7E / 0xFE), NaN the e4m3fn NaN code (0x7F, 0xFF
    if negative). ``mla_decode`` reads K = code * k_scale and V = code[:512] * v_scale.

    Args:
      cache: [tokens, 576] float8_e4m3fn, or uint8 holding e4m3fn codes.
      latent: [T, 512] float.
      rope: [T, 64] float.
      slot_mapping: [T] int32 row per token; -1 (or any row outside the cache) skips the token.
      scale: per-tensor float32 scale (Python float or 0-d array).
    Returns:
      The updated cache, same shape and dtype. Functional; in place when ``cache`` is donated.
    """
    op = "concat_and_cache_mla"
    check_array(op, "cache", cache, dtypes=[jnp.float8_e4m3fn, jnp.uint8], shape=(None, KV_DIM))
    _check_token_batch(op, latent, rope, slot_mapping)
    s = check_scalar(op, "scale", scale)
    latent, rope, slot_mapping = as_jax(latent, rope, slot_mapping)
    cache = jnp.asarray(cache)
    x = jnp.concatenate([latent.astype(jnp.float32), rope.astype(jnp.float32)], axis=-1)
    codes = _e4m3_codes(x / s, x)
    if cache.dtype == jnp.float8_e4m3fn:
        codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    return _scatter_rows(cache, slot_mapping, codes)


# ---------------------------------------------------------------------------------------------
# UltraQuant FP4 slots
# ---------------------------------------------------------------------------------------------


def hadamard_transform(x: jax.Array) -> jax.Array:
    """Unnormalized Sylvester-ordered Walsh-Hadamard transform along the last axis (power of 2).

    ``y[i] = sum_j (-1)^popcount(i & j) x[j]``, in float32 butterflies.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard_transform: last axis must be a power of two, got {n}")
    lead = x.shape[:-1]
    y = x.astype(jnp.float32)
    h = n // 2
    while h >= 1:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        h //= 2
    return y.reshape(*lead, n)


def ldexp_exact(x: jax.Array, n: jax.Array) -> jax.Array:
    """``x * 2**n`` rounded once (to nearest even) for float32 ``x`` and int32 ``n``, from the
    bits: exact for subnormal inputs and results (flush-to-zero arithmetic never sees them).
    Past float32's range the result is ±inf; ±0, ±inf and NaN stay as they are."""
    bits = _f32_bits(x)
    mag = bits & 0x7FFFFFFF
    biased = mag >> 23
    # x = sig * 2^(q - 150), sig normalized to [2^23, 2^24) (subnormals shifted up)
    sig = jnp.where(biased > 0, (mag & 0x7FFFFF) | 0x800000, mag)
    up = jnp.maximum(jax.lax.clz(sig) - 8, 0)
    sig = sig << up
    q = jnp.maximum(biased, 1) - up + n
    normal = (q << 23) + (sig & 0x7FFFFF)  # q in [1, 254]
    shift = jnp.clip(1 - q, 1, 25)  # q < 1: a subnormal result, sig >> shift rounded to even
    kept = sig >> shift
    rest = sig - (kept << shift)
    half = 1 << (shift - 1)
    kept = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).astype(jnp.int32)
    out = jnp.where(q >= 255, 0x7F800000, jnp.where(q >= 1, normal, kept))
    out = jnp.where((mag == 0) | (biased == 255), mag, out)
    return jax.lax.bitcast_convert_type(out | (bits & jnp.int32(-0x80000000)), jnp.float32)


# A row's prescale brings its largest magnitude to [2^118, 2^119): the butterflies' partial
# sums (up to 256 of them) stay below 2^127.
_ROTATE_TOP = 118


def ultraquant_rotate(x: jax.Array) -> jax.Array:
    """The UltraQuant rotation ``H x / 16`` (orthonormal, natural Sylvester column order).

    Applied to K by ``ultraquant_store`` and to q by ``ultraquant_decode``; it cancels in
    ``q·k``. K is stored in this order: no column permutation. Each row is scaled by a power
    of two (its largest magnitude to [2^118, 2^119)) before the float32 butterflies and back
    after them (``ldexp_exact``), so that subnormal inputs and results are kept even where
    arithmetic flushes them (XLA:CPU): only values below 2^-244 of their row's largest
    magnitude can be flushed. A row holding ±inf or NaN is not scaled.

    Args:
      x: [..., 256] float.
    Returns:
      [..., 256] float32.
    """
    check_array("ultraquant_rotate", "x", x, last_dims=(UQ_HEAD_DIM,))
    return _rotate(x.astype(jnp.float32))


@jax.custom_jvp
def _rotate(x: jax.Array) -> jax.Array:
    amax = _abs_max_bits(x, axis=-1)[..., None]
    top = jnp.where(amax >= 0x00800000, (amax >> 23) - 127, -118 - jax.lax.clz(amax))
    shift = jnp.where((amax == 0) | (amax >= 0x7F800000), 0, _ROTATE_TOP - top)
    return ldexp_exact(hadamard_transform(ldexp_exact(x, shift)), -shift - 4)


@_rotate.defjvp
def _rotate_jvp(primals, tangents):
    """The rotation is linear: its derivative is itself, H/16 (the prescale's bit operations
    have no derivative of their own)."""
    (x,), (t,) = primals, tangents
    return _rotate(x), hadamard_transform(t) * jnp.float32(1.0 / 16.0)


def ultraquant_quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """UltraQuant FP4 quantizer over 32-groups of the last axis (values already rotated).

    Not differentiable (codes and scale bytes: ``jax.grad`` through it is zero).

    Per group: ``e = floor(log2(0.156 * amax) + 0.5)`` (float32 product, exact log2), clamped
    to [-126, 127] (an underflowing scale is 2^-126, byte 1), scale byte ``e + 127``; each
    value ``y = x / 2^e`` becomes the E2M1 level ``levels[sum(y > midpoints)]`` (ties to the
    lower level, ±6 saturation, zero as code 0). A zero group (scale byte 0, codes 0) is one
    whose float32 ``0.156 * amax`` is 0 (amax <= 3 * 2^-149) or not finite (the group holds
    ±inf or NaN), as in vLLM's torch reference (docs/formats.md).

    Args:
      x: [..., 256] float.
    Returns:
      codes [..., 128] uint8 (element 2i in the low nibble) and scales [..., 8] uint8.
    """
    check_array("ultraquant_quantize", "x", x, last_dims=(UQ_HEAD_DIM,))
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], UQ_GROUPS, UQ_GROUP)
    amax_bits = _abs_max_bits(groups, axis=-1)
    amax = jax.lax.bitcast_convert_type(amax_bits, jnp.float32)
    t_bits = _f32_bits(_UQ_COMPUTE_SCALE * amax)
    e = ((t_bits >> 23) & 0xFF) - 127 + ((t_bits & 0x7FFFFF) >= _SQRT2_MANTISSA).astype(jnp.int32)
    e = jnp.where(t_bits < 0x00800000, -126, e)  # 0.156 * amax below the normal range
    e = jnp.clip(e, -126, 127)
    # a zero group: 0.156 * amax is 0 in float32 (amax <= 3 * 2^-149) or not finite
    zero = (amax_bits <= _UQ_ZERO_AMAX_BITS) | (amax_bits >= 0x7F800000)
    scale_bytes = jnp.where(zero, 0, e + 127).astype(jnp.uint8)

    y = ldexp_exact(groups, -e[..., None])  # exact, subnormals included
    level = jnp.sum(y[..., None] > jnp.asarray(_E2M1_MIDPOINTS), axis=-1)
    level = jnp.where(zero[..., None], _E2M1_ZERO_LEVEL, level)
    codes = jnp.asarray(_E2M1_LEVEL_CODES)[level].reshape(*x.shape[:-1], UQ_HEAD_DIM)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(jnp.uint8), scale_bytes


def ultraquant_dequantize(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """FP4 codes and UE8M0 scales -> float32 values.

    Args:
      codes: [..., 128] uint8, two E2M1 codes per byte (element 2i in the low nibble).
      scales: [..., 8] uint8; byte b means ``2^(b - 127)``, and 0 means a zero group.
    Returns:
      [..., 256] float32.
    """
    nibbles = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], UQ_HEAD_DIM)
    values = jnp.asarray(E2M1_CODE_VALUES)[nibbles]
    scale = jax.lax.bitcast_convert_type(scales.astype(jnp.int32) << 23, jnp.float32)
    return values * jnp.repeat(scale, UQ_GROUP, axis=-1)


def ultraquant_unpack(cache: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Decodes UltraQuant slots. Not differentiable w.r.t. the cache (integer bytes).

    Args:
      cache: [..., slot_bytes] uint8 (e.g. [num_blocks, block_size, Hk, slot_bytes]).
    Returns:
      k_rot [..., 256] float32 (rotated, in the order ``ultraquant_rotate`` leaves it) and
      v [..., 256] float32 (V's own space).
    """
    check_array("ultraquant_unpack", "cache", cache, dtypes=[jnp.uint8], min_ndim=1)
    if cache.shape[-1] < UQ_SLOT_CONTENT_BYTES:
        raise ValueError(
            f"ultraquant_unpack: cache slots must hold >= {UQ_SLOT_CONTENT_BYTES} bytes, "
            f"got {cache.shape[-1]}"
        )
    return _unpack_slots(jnp.asarray(cache))


def _unpack_slots(slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    k = ultraquant_dequantize(
        slots[..., UQ_K_CODES:UQ_K_SCALES], slots[..., UQ_K_SCALES:UQ_V_CODES]
    )
    v = ultraquant_dequantize(
        slots[..., UQ_V_CODES:UQ_V_SCALES], slots[..., UQ_V_SCALES:UQ_SLOT_CONTENT_BYTES]
    )
    return k, v


def check_ultraquant_cache(op: str, cache) -> None:
    """Static checks of an UltraQuant cache [num_blocks, block_size, Hk, slot_bytes] uint8."""
    check_array(op, "cache", cache, dtypes=[jnp.uint8], ndim=4)
    slot = cache.shape[-1]
    if slot < UQ_SLOT_CONTENT_BYTES or slot % 4:
        raise ValueError(
            f"{op}: cache slot_bytes (last dim) must be a multiple of 4 and >= "
            f"{UQ_SLOT_CONTENT_BYTES}, got {slot}"
        )


def ultraquant_store(
    cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Quantizes tokens into an UltraQuant FP4 paged cache.

    Not differentiable (the cache is bytes: ``jax.grad`` through it is zero).

    K is rotated (``ultraquant_rotate``: H/16, natural column order) in float32 and quantized
    per 32-group of rotated dims (32g .. 32g+31); V is quantized as given. Bytes past 272 of a
    slot (padding) are left as they are. A group holding ±inf or NaN is stored as a zero
    group (``ultraquant_quantize``); a non-finite K value spreads over every rotated dim first,
    so its whole K is zero.

    Args:
      cache: [num_blocks, block_size, Hk, slot_bytes] uint8, slot_bytes >= 272, multiple of 4.
      k: [T, Hk, 256] float.
      v: [T, Hk, 256] float.
      slot_mapping: [T] int32, ``block * block_size + offset``; -1 (or out of range) skips.
    Returns:
      The updated cache. Functional; in place when ``cache`` is donated.
    """
    op = "ultraquant_store"
    check_ultraquant_cache(op, cache)
    nb, bs, hk, _ = cache.shape
    check_array(op, "k", k, ndim=3, shape=(None, hk, UQ_HEAD_DIM))
    check_array(op, "v", v, shape=k.shape)
    _check_float(op, "k", k)
    _check_float(op, "v", v)
    check_array(op, "slot_mapping", slot_mapping, dtypes=[jnp.int32], shape=(k.shape[0],))
    k, v, slot_mapping = as_jax(k, v, slot_mapping)
    cache, _ = split_only_over(jnp.asarray(cache), (0, 2))
    k_codes, k_scales = ultraquant_quantize(ultraquant_rotate(k))
    v_codes, v_scales = ultraquant_quantize(v.astype(jnp.float32))
    content = jnp.concatenate([k_codes, k_scales, v_codes, v_scales], axis=-1)  # [T, Hk, 272]
    flat = cache.reshape(nb * bs, hk, cache.shape[-1])
    return _scatter_rows(flat, slot_mapping, content).reshape(cache.shape)
