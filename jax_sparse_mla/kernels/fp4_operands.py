"""What both NVIDIA UltraQuant kernels ("pallas" and "mosaic") hand the tensor cores.

* q, rotated (``reference.ultraquant.ultraquant_query``), as bf16 pieces whose sum is q
  exactly (``bf16_pieces``, ``q_pieces`` of them): one for the op's e4m3 q (every e4m3 value
  is a bf16 value), three for the float32 q of ``exact_q``. q.K on bf16 tensor cores is then
  float32-accurate.
* Each E2M1 code of K and V as the bf16 of value * 2^-6 (the value of the e4m3 byte with the
  code's bits moved up two places: exact, the subnormal 0.5 included), times its group's UE8M0
  scale (a power of two: exact). ``FP4_BIAS`` = 2^6 goes back into the score scale and the
  output scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EXACT_Q_PIECES = 3  # bf16 pieces of a float32 q
FP4_BIAS = 64.0  # each code enters as its value * 2^-6


def q_pieces(exact_q: bool) -> int:
    """bf16 pieces of the rotated q: 1 for its e4m3 rounding, 3 for the float32 q."""
    return EXACT_Q_PIECES if exact_q else 1


def bf16_pieces(x, count: int):
    """float32 x -> ``count`` bf16 arrays summing to x (exactly for count = 3).

    Each piece is x's remaining top 8 significant bits, cut off the float32 bits (no rounding
    convert: XLA on GPU may drop a float32 -> bf16 -> float32 round trip as excess precision).
    """
    pieces = []
    for _ in range(count):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
        top = jax.lax.bitcast_convert_type(bits, jnp.float32)
        pieces.append(top.astype(jnp.bfloat16))  # exact: the low 16 bits are zero
        x = x - top  # exact
    return pieces
