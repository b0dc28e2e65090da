"""Exact jax-native implementations ("xla"): f32 dequantization, f32 online softmax, bf16 output.

They run on every platform and are the fallback and the reference of every kernel. Keys are
processed in tiles with an online softmax inside a ``lax`` loop, so temporaries scale with the
tile, never with the longest row.
"""
