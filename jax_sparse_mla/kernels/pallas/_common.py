"""Pieces shared by the Pallas kernels: gathers, launch parameters, the CUDA/interpret switch,
and the uint32-word view of the byte caches."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_sparse_mla._platform import by_platform
from jax_sparse_mla._unavailable import unavailable
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
    byte_args: tuple[int, ...] = (),
    words: bool | None = None,
):
    """``pl.pallas_call`` with Triton launch parameters; refs without a spec are whole arrays.

    Each output varies over the mesh axes its inputs vary over (``jax.shard_map``). The
    arguments at ``byte_args`` (byte caches [..., 4k] of a one-byte dtype, e.g. uint8 or
    float8_e4m3fn codes, read with ``gather_words``) reach the kernel as uint32 words [..., k]
    when ``words`` (default: compiled, i.e. not ``interpret``; see ``as_words``: no copy of the
    cache), else as uint8 (a same-width bitcast).
    """
    if words is None:
        words = not interpret

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
            # waits for the devices that wait for the callback). Fail clearly instead, when
            # lowered: this branch is traced, but never lowered, when the target is a CUDA GPU.
            return unavailable(INTERPRET_UNDER_SHARD_MAP, shapes, *args)
        args = vary_like(args, *args)
        if words:  # right before the call: nothing else may consume a punned view (as_words)
            view = functools.partial(as_words, pun=not interpret)
        else:
            view = _as_uint8
        args = [view(a) if i in byte_args else a for i, a in enumerate(args)]
        return pallas(shapes)(*args)

    return run


INTERPRET_UNDER_SHARD_MAP = (
    "jax_sparse_mla: implementation='pallas' in Pallas interpret mode (no CUDA GPU) cannot run "
    "inside jax.shard_map on values that vary across mesh axes; use implementation='xla' or "
    "'gfx950_emulation' there (None picks 'xla'), or run on a CUDA GPU, where the kernel is "
    "compiled"
)


# ---------------------------------------------------------------------------------------------
# Byte caches as uint32 words, without a copy
# ---------------------------------------------------------------------------------------------
#
# Pallas' Triton lowering (jax/_src/pallas/triton/lowering.py, ``_compute_offsets_from_indices``)
# computes a ref's element offsets in int32 when the whole array holds at most 2^32 bytes
# (``64 if full_size > 2**32 else 32``, full_size = elements * itemsize) and in int64 beyond. A
# uint8 cache of 2^31 to 2^32 bytes has element offsets past 2^31 - 1: int32 overflows there.
# The same cache as uint32 words has bytes / 4 elements, so every offset of a cache of at most
# 2^32 bytes stays below 2^30 (int32 is exact), and a larger one gets int64 offsets: exact at
# every size, under vmap too (a batch of caches is one array of the batch's bytes).
#
# The word view must not copy the cache. jax's ``bitcast_convert_type`` from uint8 [..., 4] to
# uint32 is a copy under XLA: XLA:GPU and XLA:CPU expand a bitcast-convert between element
# widths into slices, shifts and ors (``BitcastDtypesExpander``), which write a new array, a
# pass over the whole cache. ``as_words`` is therefore a primitive of its own: its value is the
# word view (shape and dtype), and when lowered for CUDA only, with ``pun=True``, its result is
# the uint8 cache itself. Its only consumer there is the compiled ``pallas_call`` (``call``
# binds it right before the call), whose Triton custom call passes the buffer's address to the
# kernel: the kernel, compiled for uint32 words, reads the cache's own bytes (the same bytes and
# size: [..., 4k] uint8 and [..., k] uint32 have the same row-major layout). Any other consumer
# of a punned value would read uint8 as uint32: most (element-wise ops, reshapes, calls, the
# function's results) fail StableHLO's verifier at lowering, but not all (a reduction lowers),
# so only ``call`` binds it with ``pun=True``, on the arguments it hands to the kernel. Everywhere
# else (interpret mode, other platforms, multi-platform lowerings) ``as_words`` is the real
# conversion, a copy.

_as_words_p = Primitive("jax_sparse_mla_as_words")


def as_words(x, *, pun: bool):
    """Bytes ``x`` [..., 4k] (uint8, or another one-byte dtype such as float8_e4m3fn: its bits)
    as little-endian uint32 words [..., k] (see the notes above; ``pun=True`` only for an
    argument of the compiled ``pallas_call``)."""
    if jnp.dtype(x.dtype).itemsize != 1 or x.ndim == 0 or x.shape[-1] % 4:
        raise ValueError(f"as_words takes bytes [..., 4k], got {x.dtype}{list(x.shape)}")
    return _as_words_p.bind(x, pun=pun)


def _as_uint8(x):
    return x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)


def _words_by_conversion(x):
    b = _as_uint8(x).reshape(*x.shape[:-1], x.shape[-1] // 4, 4).astype(jnp.uint32)
    shift = 8 * jax.lax.broadcasted_iota(jnp.uint32, (4,), 0)
    return jnp.sum(b << shift, axis=-1, dtype=jnp.uint32)  # disjoint bits: the sum is the or


def _as_words_abstract_eval(x, *, pun):
    del pun
    return x.update(shape=(*x.shape[:-1], x.shape[-1] // 4), dtype=jnp.dtype(jnp.uint32))


def _as_words_lowering(ctx, x, *, pun):
    if pun and tuple(ctx.platforms or ctx.module_context.platforms) == ("cuda",):
        return [x]  # the cache itself, for the compiled pallas_call (see the notes above)
    return mlir.lower_fun(_words_by_conversion, multiple_results=False)(ctx, x)


def _as_words_batch(args, dims, *, pun):
    (x,), (d,) = args, dims
    if d == x.ndim - 1:  # the byte axis must stay last
        x, d = jnp.moveaxis(x, d, 0), 0
    return _as_words_p.bind(x, pun=pun), d


_as_words_p.def_impl(lambda x, *, pun: _words_by_conversion(x))
_as_words_p.def_abstract_eval(_as_words_abstract_eval)
mlir.register_lowering(_as_words_p, _as_words_lowering)
batching.primitive_batchers[_as_words_p] = _as_words_batch


def gather_words(ref, rows, start: int, count: int, valid):
    """Bytes ``[start, start + 4 * count)`` of rows ``rows`` of a byte cache as ``count``
    little-endian uint32 words: [len(rows), count], 0 where not valid (never read there).

    ``ref`` is the cache as ``call`` passes it: uint32 words (compiled) or uint8 bytes (interpret
    mode; the words are assembled from the bytes). ``start`` is a multiple of 4.
    """
    assert start % 4 == 0, start
    if ref.dtype == jnp.uint32:
        return gather_rows(ref, rows, start // 4, count, valid)
    return _words_by_conversion(gather_rows(ref, rows, start, 4 * count, valid))


def _interleave(lo, hi):
    """[R, n] lo, hi -> [R, 2n] with lo[:, j] at 2j and hi[:, j] at 2j + 1 (Triton: a join)."""
    return jnp.stack([lo, hi], axis=-1).reshape(lo.shape[0], 2 * lo.shape[1])


def word_halves(words):
    """uint32 words [R, n] -> their little-endian 16-bit halves [R, 2n] (uint32 < 2^16)."""
    return _interleave(words & jnp.uint32(0xFFFF), words >> jnp.uint32(16))


def word_bytes(words):
    """uint32 words [R, n] -> their little-endian bytes [R, 4n] uint8 (byte k of word j at
    4j + k: the cache's own byte order)."""
    halves = word_halves(words)
    return _interleave(halves & jnp.uint32(0xFF), halves >> jnp.uint32(8)).astype(jnp.uint8)


def gather_bytes(ref, rows, start: int, count: int, valid):
    """Bytes ``[start, start + count)`` of rows ``rows`` of a byte cache: [len(rows), count]
    uint8, 0 where not valid (never read there); read as words (``gather_words``), ``start``
    and ``count`` multiples of 4."""
    return word_bytes(gather_words(ref, rows, start, count // 4, valid))


def word_column(words, c: int):
    """Column ``c`` of ``words`` [R, n]: [R] (a masked sum; Triton has no column slice)."""
    col = jax.lax.broadcasted_iota(jnp.int32, (1, words.shape[1]), 1)
    return jnp.sum(jnp.where(col == c, words, jnp.uint32(0)), axis=1, dtype=words.dtype)


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


def score_sign_and_scale(sm_scale):
    """(sign, scale) of a scale of the scores: the kernels take the max of ``sign * q·k`` and
    multiply by ``scale`` (|sm_scale|, at least float32's smallest normal, so that masked -inf
    scores give 0, never 0 x -inf) only after subtracting it: any finite sm_scale gives finite
    weights."""
    return jnp.sign(sm_scale), jnp.maximum(jnp.abs(sm_scale), jnp.finfo(jnp.float32).tiny)


def softmax_update(m_run, l_run, s, scale):
    """One key tile of signed scores s [M, N] float32 (-inf where masked), to be scaled by
    ``scale`` > 0 (``score_sign_and_scale``).

    Returns (m, l, alpha [M], p [M, N]): rescale the accumulators by alpha, then add p @ V. A
    row that has seen no valid key keeps m = -inf and l = 0 while exp stays finite.
    """
    m_new = jnp.maximum(m_run, jnp.max(s, axis=1))
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(scale * (m_run - m_ref))
    p = jnp.exp(scale * (s - m_ref[:, None]))
    return m_new, l_run * alpha + jnp.sum(p, axis=1), alpha, p


def softmax_finish(m_run, l_run, scale):
    """(1 / l, or 0 for a row without keys; lse, or -inf for a row without keys)."""
    has = l_run != 0
    inv_l = jnp.where(has, 1.0 / jnp.where(has, l_run, 1.0), 0.0)
    lse = jnp.where(has, scale * m_run + jnp.log(jnp.where(has, l_run, 1.0)), -jnp.inf)
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
