"""Pieces shared by the Pallas kernels: gathers, launch parameters, the CUDA/interpret switch."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_sparse_mla._platform import by_platform
from jax_sparse_mla._vma import out_struct, vary_like, varying_axes

# Programs to aim for when splitting work: two resident programs on each of the H200's 132 SMs.
TARGET_PROGRAMS = 264


def on_cuda_or_interpret(kernel_fn: Callable) -> Callable:
    """``kernel_fn(*arrays, **options, interpret=...)`` compiled (Triton) when lowered for CUDA
    and run in Pallas interpret mode elsewhere.

    The choice is made per lowering platform (``_platform.by_platform``: a lowering holds only
    its own platform's branch). ``options`` may hold traced scalars.
    """
    run = by_platform(
        default=functools.partial(kernel_fn, interpret=True),
        cuda=functools.partial(kernel_fn, interpret=False),
    )
    return functools.wraps(kernel_fn)(run)


def call(
    kernel,
    *,
    grid,
    out_shape,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    name: str,
    in_specs=pl.no_block_spec,
    out_specs=pl.no_block_spec,
):
    """``pl.pallas_call`` with Triton launch parameters; refs without a spec are whole arrays.

    Each output varies over the mesh axes its inputs vary over (``jax.shard_map``).
    """

    def pallas(shapes):
        return pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=shapes,
            in_specs=in_specs,
            out_specs=out_specs,
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            name=name,
        )

    def run(*args):
        shapes = jax.tree.map(lambda s: out_struct(s.shape, s.dtype, *args), out_shape)
        if interpret and varying_axes(*args):
            # Pallas' interpreter cannot lower a kernel over values that vary across mesh axes,
            # and running it in a host callback deadlocks XLA:CPU (the callback's computation
            # waits for the devices that wait for the callback). Fail clearly instead, at run
            # time: this branch is traced, but never lowered, when the target is a CUDA GPU.
            return jax.pure_callback(_interpret_under_shard_map, shapes, *args)
        return pallas(shapes)(*vary_like(args, *args))

    return run


def _interpret_under_shard_map(*_):
    raise NotImplementedError(
        "jax_sparse_mla: implementation='pallas' in Pallas interpret mode (no CUDA GPU) cannot run "
        "inside jax.shard_map on values that vary across mesh axes; use implementation='xla' or "
        "'gfx950_emulation' there (None picks 'xla'), or run on a CUDA GPU, where the kernel is "
        "compiled"
    )


def widen_offsets(x):
    """``x`` padded along its first axis past 2^32 bytes when it holds [2^31, 2^32] bytes.

    Pallas' Triton lowering computes element offsets in int32 for arrays up to 2^32 bytes, which
    overflows for byte arrays of 2^31 bytes or more; past 2^32 bytes it uses int64. The pad is a
    copy of the array (correct, but it costs a pass over it) and happens only in that window.
    """
    nbytes = x.size * x.dtype.itemsize
    if not 2**31 <= nbytes <= 2**32:
        return x
    row_bytes = nbytes // x.shape[0]
    extra = (2**32 - nbytes) // row_bytes + 1
    return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def gather_rows(ref, rows, start: int, width: int, valid, *, stride: int = 1):
    """``ref[rows[i], start + stride * c]`` for c < width: [len(rows), width], 0 where not valid.

    ``ref`` is a whole 2-D array in device memory; ``rows`` [R] int32 (already in range where
    ``valid``); ``valid`` [R] bool. A row that is not valid is never read.
    """
    cols = start + stride * jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    safe = jnp.where(valid, rows, 0)[:, None]
    return plgpu.load(ref.at[safe, cols], mask=valid[:, None], other=0)


def gather_1d(ref, pos, valid):
    """``ref[pos]`` for a 1-D ref, 0 where not valid (never read there)."""
    return plgpu.load(ref.at[jnp.where(valid, pos, 0)], mask=valid, other=0)


def bytes_to_u32(b, word: int):
    """Little-endian uint32 word ``word`` of each row of ``b`` [R, W] uint8: [R] uint32."""
    col = jax.lax.broadcasted_iota(jnp.int32, (1, b.shape[1]), 1)
    shifted = b.astype(jnp.uint32) << ((col % 4) * 8).astype(jnp.uint32)
    return jnp.sum(jnp.where(col // 4 == word, shifted, jnp.uint32(0)), axis=1)


def e4m3_to_bf16(codes):
    """uint8 e4m3fn codes -> bfloat16 (exact: every e4m3fn value is a bf16 value)."""
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.bfloat16)


def dot_nt(a, b):
    """a [M, K] @ b[N, K]^T with float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, K] @ b [K, N] with float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def softmax_init(m_rows: int):
    """(running max [M] = -inf, running sum [M] = 0) of an online softmax over key tiles."""
    return jnp.full((m_rows,), -jnp.inf, jnp.float32), jnp.zeros((m_rows,), jnp.float32)


def softmax_update(m_run, l_run, s):
    """One key tile of scores s [M, N] float32 (-inf where masked).

    Returns (m, l, alpha [M], p [M, N]): rescale the accumulators by alpha, then add p @ V. A
    row that has seen no valid key keeps m = -inf and l = 0 while exp stays finite.
    """
    m_new = jnp.maximum(m_run, jnp.max(s, axis=1))
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_run - m_ref)
    p = jnp.exp(s - m_ref[:, None])
    return m_new, l_run * alpha + jnp.sum(p, axis=1), alpha, p


def softmax_finish(m_run, l_run):
    """(1 / l, or 0 for a row without keys; lse, or -inf for a row without keys)."""
    has = l_run != 0
    inv_l = jnp.where(has, 1.0 / jnp.where(has, l_run, 1.0), 0.0)
    lse = jnp.where(has, m_run + jnp.log(jnp.where(has, l_run, 1.0)), -jnp.inf)
    return inv_l, lse


def pow2_at_least(n: int, lo: int) -> int:
    """Smallest power of two >= max(n, lo)."""
    p = lo
    while p < n:
        p *= 2
    return p


def choose_splits(programs: int, avg_keys: float, min_keys: int) -> int:
    """Splits per row so that ``programs * splits`` reaches TARGET_PROGRAMS, each split keeping
    at least ``min_keys`` keys of an average row."""
    want = -(-TARGET_PROGRAMS // max(programs, 1))
    return int(max(1, min(want, avg_keys // min_keys)))
