"""No copy of the cache on any call, whatever its size (issue 14).

The Pallas kernels read the byte caches as uint32 words (``kernels/pallas/_common.py``,
``as_words``): int32 element offsets are exact up to 4 GiB and Triton uses int64 past that, so
no cache is padded any more (caches of 2-4 GiB used to be copied on every call). Checked here
without allocating anything, on abstract caches of 3 GiB (the old pad window) and of just over
4 GiB:

* the traced program (jaxpr) hands the cache to the ``pallas_call`` through views only
  (reshape, same-width bitcast, the word view): no pad, slice, gather, concatenate or copy of it;
* the program lowered for CUDA (from this host) passes the cache's own buffer to the Triton
  custom call, and the kernel reads it as uint32 words with int32 offsets (3 GiB) or int64
  offsets (past 4 GiB), also for a vmapped batch of caches (2 x 1.5 GiB: one 3 GiB array for
  the kernel, whose byte offsets used to overflow without any pad);
* compiled for the CPU (Pallas interpret mode), the temporaries are far below the cache.

The word view reads the same bits as the bytes: the kernels give bit-identical answers either
way (interpret mode, the words made by a real conversion there). On a GPU (``gpu`` marker) the
compiled executables' temporaries stay far below the cache for "pallas" (and "mosaic" where an
op has it), and 3 GiB caches are read right at their end.
"""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import jax_sparse_mla as jsm
from jax_sparse_mla.kernels.pallas import _common
from jax_sparse_mla.kernels.pallas import mla_attention as MA
from jax_sparse_mla.kernels.pallas import mla_decode as PD
from jax_sparse_mla.kernels.pallas import ultraquant as PU
from tests import cases as C
from tests import impls

S = jax.ShapeDtypeStruct
SIZES = {"3GiB": 3 * 2**30, "4GiB+": 2**32 + 2**20}  # cache bytes (rounded to whole rows)
TRITON = "__gpu$xla.gpu.triton"


# ---------------------------------------------------------------------------------------------
# The ops on abstract caches
# ---------------------------------------------------------------------------------------------


def _sparse_mla(nbytes, impl):
    n = -(-nbytes // 656)
    fn = functools.partial(jsm.sparse_mla, return_lse=True, implementation=impl)
    args = (S((4, 16, 576), jnp.bfloat16), S((n, 656), jnp.uint8))
    return fn, (*args, S((256,), jnp.int32), S((5,), jnp.int32))


def _mla_decode(nbytes, impl, dtype=jnp.uint8, partials=False):
    n = -(-nbytes // 576)
    if partials:
        fn = functools.partial(jsm.mla_decode_partials, qlen=2, num_splits=4, implementation=impl)
    else:
        fn = functools.partial(jsm.mla_decode, qlen=2, return_lse=True, implementation=impl)
    args = (S((2 * 2, 16, 576), jnp.bfloat16), S((n, 576), dtype))
    return fn, (*args, S((512,), jnp.int32), S((3,), jnp.int32))


def _ultraquant(nbytes, impl):
    nb = -(-nbytes // (64 * 2 * 272))
    fn = functools.partial(jsm.ultraquant_decode, implementation=impl)
    args = (S((2, 16, 256), jnp.bfloat16), S((nb, 64, 2, 272), jnp.uint8))
    return fn, (*args, S((2, 8), jnp.int32), S((2,), jnp.int32))


OPS = {
    "sparse_mla": _sparse_mla,
    "mla_decode": _mla_decode,
    "mla_decode_fp8": functools.partial(_mla_decode, dtype=jnp.float8_e4m3fn),
    "mla_decode_partials": functools.partial(_mla_decode, partials=True),
    "ultraquant_decode": _ultraquant,
}
CACHE_ARG = 1  # every op takes the cache second
_MODULE = {
    "sparse_mla": "sparse_mla",
    "mla_decode": "mla_decode",
    "mla_decode_fp8": "mla_decode",
    "mla_decode_partials": "mla_decode",
    "ultraquant_decode": "ultraquant",
}


def _cache_bytes(args) -> int:
    cache = args[CACHE_ARG]
    return int(np.prod(cache.shape)) * cache.dtype.itemsize


def _skip_unless_implemented(op: str, impl: str) -> None:
    table = importlib.import_module(f"jax_sparse_mla.{_MODULE[op]}")._IMPLEMENTATIONS
    if impl not in table:
        pytest.skip(f"{op} has no {impl!r} implementation here")


# ---------------------------------------------------------------------------------------------
# The traced program: views of the cache reach pallas_call, nothing else takes them
# ---------------------------------------------------------------------------------------------

_VIEWS = {"reshape", "squeeze", "expand_dims", "pcast", "pvary", "jax_sparse_mla_as_words"}


def _is_view(eqn) -> bool:
    name = eqn.primitive.name
    if name == "bitcast_convert_type":
        return eqn.invars[0].aval.dtype.itemsize == eqn.outvars[0].aval.dtype.itemsize
    return name in _VIEWS


def _sub_jaxprs(eqn):
    """(jaxpr, offset) for each jaxpr inside ``eqn``: its invar i is ``eqn.invars[offset + i]``."""
    subs = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            j = v.jaxpr if isinstance(v, jex_core.ClosedJaxpr) else v
            if isinstance(j, jex_core.Jaxpr):
                subs.append((j, len(eqn.invars) - len(j.invars)))
    return subs


def cache_uses(jaxpr, cache_vars) -> tuple[int, list[str]]:
    """(pallas_calls reached by the cache, the other equations that take it or a view of it).

    Views (reshape, same-width bitcast, the word view, mesh-axis casts) are followed; calls, conds
    and custom-derivative wrappers are entered; a Pallas kernel is not (it reads rows of it).
    """
    views = set(cache_vars)
    calls, others = 0, []
    for eqn in jaxpr.eqns:
        hit = [i for i, v in enumerate(eqn.invars) if not isinstance(v, jex_core.Literal)]
        hit = [i for i in hit if eqn.invars[i] in views]
        if not hit:
            continue
        if eqn.primitive.name == "pallas_call":
            calls += 1
        elif _is_view(eqn):
            views.update(eqn.outvars)
        elif subs := _sub_jaxprs(eqn):
            for sub, offset in subs:
                if offset < 0 or any(i < offset for i in hit):
                    others.append(f"{eqn.primitive.name} (cannot follow the cache into it)")
                    continue
                n, o = cache_uses(sub, [sub.invars[i - offset] for i in hit])
                calls, others = calls + n, others + o
        else:
            others.append(f"{eqn.primitive.name}: {eqn}"[:300])
    return calls, others


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", OPS)
def test_traced_program_hands_the_cache_to_the_kernel_unchanged(op, size):
    fn, args = OPS[op](SIZES[size], "pallas")
    closed = jax.jit(fn).trace(*args).jaxpr
    calls, others = cache_uses(closed.jaxpr, [closed.jaxpr.invars[CACHE_ARG]])
    assert not others, f"{op} ({size}): the cache is copied or transformed: {others}"
    # a pallas_call in the compiled (CUDA) branch and one in the interpret-mode branch
    assert calls >= 2, f"{op} ({size}): the cache reaches {calls} pallas_call"


# ---------------------------------------------------------------------------------------------
# The program lowered for CUDA: the Triton custom call gets the cache's own buffer
# ---------------------------------------------------------------------------------------------


def _lower_for_cuda(fn, args):
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    except RuntimeError as e:  # jax >= 0.11 lowers Pallas for CUDA only beside a GPU
        if "No supported GPU devices" in str(e):
            pytest.skip("jax needs a GPU to lower Pallas for CUDA")
        raise


def _walk(op):
    for region in op.regions:
        for block in region:
            for inner in block:
                yield inner
                yield from _walk(inner)


def _attr_str(op, name) -> str:
    return str(op.attributes[name]).strip('"') if name in op.attributes else ""


def hlo_cache_uses(module, cache_index: int):
    """((Triton custom call, operand number) reached by main's argument ``cache_index``, the
    other users of it).

    Followed: reshape, same-width bitcast_convert, func.call into the callee's argument."""
    from jax._src.lib.mlir import ir

    funcs = {_attr_str(op, "sym_name"): op for op in module.body.operations}
    calls, others = [], []
    todo = [funcs["main"].regions[0].blocks[0].arguments[cache_index]]
    while todo:
        value = todo.pop()
        for use in value.uses:
            user = use.owner
            name = user.name
            if name == "stablehlo.custom_call" and _attr_str(user, "call_target_name") == TRITON:
                calls.append((user, use.operand_number))
            elif name == "stablehlo.reshape" or (
                name == "stablehlo.bitcast_convert"
                and ir.RankedTensorType(user.operands[0].type).element_type.width
                == ir.RankedTensorType(user.results[0].type).element_type.width
            ):
                todo.extend(user.results)
            elif name == "func.call":
                callee = funcs[ir.FlatSymbolRefAttr(user.attributes["callee"]).value]
                todo.append(callee.regions[0].blocks[0].arguments[use.operand_number])
            else:
                others.append(str(user)[:300])
    return calls, others


def _kernel_ir(call) -> str:
    """The Triton IR text of a ``__gpu$xla.gpu.triton`` custom call (its bytecode, parsed)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    config = ir.DictAttr(call.attributes["mhlo.backend_config"])
    with triton_lowering._new_ir_context():
        return str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))


def check_cuda_lowering(fn, args, what: str) -> None:
    """``fn`` lowered for CUDA hands the cache (argument CACHE_ARG) to one Triton call, through
    reshapes only, and the kernel reads it as uint32 words with int32 offsets up to 4 GiB and
    int64 offsets past it (Pallas' rule: int64 when the array holds more than 2^32 bytes)."""
    lowered = _lower_for_cuda(fn, args)
    calls, others = hlo_cache_uses(lowered.compiler_ir("stablehlo"), CACHE_ARG)
    assert not others, f"{what}: the cache goes to {others}"
    assert len(calls) == 1, f"{what}: {len(calls)} Triton calls read the cache"
    call, operand = calls[0]
    text = _kernel_ir(call)
    sig = re.search(r"tt\.func public @\w+\(([^)]*)\)", text).group(1)
    cache_ptr = sig.split(", %")[operand]
    assert "!tt.ptr<i32>" in cache_ptr, f"{what}: the kernel takes the cache as {cache_ptr}"
    arg = cache_ptr.split(":")[0].lstrip("%")
    splats = re.findall(rf"(%\d+) = tt\.splat %{arg} : \S+ -> (tensor<[^>]*>)", text)
    assert splats, f"{what}: no gather from the cache (%{arg}) in the kernel"
    width = 64 if _cache_bytes(args) > 2**32 else 32
    for ptrs, _ in splats:
        offsets = re.findall(rf"tt\.addptr {ptrs}, %\d+ : \S+, tensor<[\dx]+xi(\d+)>", text)
        assert offsets and set(offsets) == {str(width)}, (what, ptrs, offsets)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", OPS)
def test_cuda_lowering_passes_the_cache_itself(op, size):
    check_cuda_lowering(*OPS[op](SIZES[size], "pallas"), f"{op} ({size})")


@pytest.mark.parametrize("op", ["sparse_mla", "ultraquant_decode"])
def test_cuda_lowering_of_a_batch_of_caches(op):
    # vmap over two caches of 1.5 GiB: the kernel reads one 3 GiB array (as bytes, its int32
    # offsets would overflow although each cache is below 2 GiB)
    fn, args = OPS[op](SIZES["3GiB"] // 2, "pallas")
    cache = args[CACHE_ARG]
    args = (*args[:CACHE_ARG], S((2, *cache.shape), cache.dtype), *args[CACHE_ARG + 1 :])
    in_axes = [None] * len(args)
    in_axes[CACHE_ARG] = 0
    check_cuda_lowering(jax.vmap(fn, in_axes), args, f"{op} (2 x 1.5 GiB)")


def _decode_kernel_fp8(nbytes):
    """The Pallas mla_decode entry itself on a float8_e4m3fn cache (``jsm.mla_decode`` converts
    a float8 cache to uint8 codes before any implementation sees it; the kernel needs not)."""
    fn = functools.partial(
        PD.mla_decode_pallas, qlen=2, k_scale=0.5, v_scale=0.25, sm_scale=0.04, num_splits=None
    )
    args = (S((2 * 2, 16, 576), jnp.bfloat16), S((-(-nbytes // 576), 576), jnp.float8_e4m3fn))
    return fn, (*args, S((512,), jnp.int32), S((3,), jnp.int32))


@pytest.mark.parametrize("size", SIZES)
def test_float8_cache_reaches_the_kernel_unconverted(size):
    fn, args = _decode_kernel_fp8(SIZES[size])
    closed = jax.jit(fn).trace(*args).jaxpr
    calls, others = cache_uses(closed.jaxpr, [closed.jaxpr.invars[CACHE_ARG]])
    assert not others and calls >= 2, (calls, others)
    check_cuda_lowering(fn, args, f"mla_decode_pallas float8 ({size})")


# ---------------------------------------------------------------------------------------------
# Compiled for the CPU (interpret mode): temporaries far below the cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["sparse_mla", "mla_decode", "ultraquant_decode"])
def test_interpret_mode_temporaries_far_below_the_cache(op):
    fn, args = OPS[op](SIZES["3GiB"], "pallas")
    temp = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < _cache_bytes(args) / 16, f"{op}: {temp / 2**30:.2f} GiB of temporaries"


# ---------------------------------------------------------------------------------------------
# The word view reads the same bits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 16), (3, 2, 8), (7, 4)])
def test_as_words_is_the_little_endian_view(shape):
    """On the CPU (pinned: a pun lowered for CUDA is only valid as a Pallas call's operand)."""
    with jax.default_device(jax.devices("cpu")[0]):
        _check_as_words(shape)


def _check_as_words(shape):
    x = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    want = x.view("<u4")
    for pun in (False, True):  # the pun applies to CUDA lowerings only: a conversion here
        assert np.array_equal(_common.as_words(jnp.asarray(x), pun=pun), want)
        f8 = jnp.asarray(x).view(jnp.float8_e4m3fn)  # any one-byte dtype: its bits
        assert np.array_equal(_common.as_words(f8, pun=pun), want)
        got = jax.jit(functools.partial(_common.as_words, pun=pun))(jnp.asarray(x))
        assert np.array_equal(got, want)
    if len(shape) == 3:  # batching: over the leading axes, or moved off the byte axis
        for axis in (0, 1):
            got = jax.vmap(functools.partial(_common.as_words, pun=True), axis, axis)(x)
            assert np.array_equal(got, want)
        # batched along the byte axis: example b is x[:, b], its words want[:, b]
        got = jax.vmap(functools.partial(_common.as_words, pun=True), 2, 0)(np.moveaxis(x, 1, 2))
        assert np.array_equal(got, np.moveaxis(want, 1, 0))


def test_as_words_refuses_other_shapes():
    for bad in (jnp.zeros((3, 6), jnp.uint8), jnp.zeros((4,), jnp.int16), jnp.zeros((), jnp.uint8)):
        with pytest.raises(ValueError, match="as_words"):
            _common.as_words(bad, pun=False)


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("seed", [1, 2])
def test_sparse_mla_kernel_words_same_bits(seed):
    c = C.sparse_case(seed, n_q=3, h=16 if seed == 2 else 4)
    q, kv, idx, indptr = c.args()
    scales = jnp.float32([0.0416, 1.0])
    run = functools.partial(
        MA.mla_partials,
        fmt="ds_mla",
        qlen=1,
        heads=q.shape[1],
        num_splits=2,
        split_align=MA.BLOCK_K,
        out_dtype=jnp.float32,
        interpret=True,
    )
    got = run(q, kv, idx, indptr, scales, words=True)
    want = run(q, kv, idx, indptr, scales, words=False)
    assert all(_same_bits(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("qlen", [1, 3])
def test_mla_decode_kernel_words_same_bits(qlen):
    c = C.decode_case(qlen, qlen=qlen, p_masked=0.2, as_uint8=True)
    q, kv, kv_indices, kv_indptr = c.args()
    b = kv_indptr.shape[0] - 1
    h = q.shape[1]
    run = functools.partial(
        MA.mla_partials,
        fmt="fp8",
        qlen=qlen,
        heads=h,
        num_splits=3,
        split_align=128,
        out_dtype=jnp.float32,
        interpret=True,
    )
    args = (q.reshape(b, qlen * h, -1), kv, kv_indices, kv_indptr, jnp.float32([0.01, 0.02]))
    want = run(*args, words=False)
    for cache in (kv, kv.view(jnp.float8_e4m3fn)):  # float8 codes: read as their bits
        for words in (True, False):
            got = run(q.reshape(b, qlen * h, -1), cache, *args[2:], words=words)
            assert all(_same_bits(g, w) for g, w in zip(got, want, strict=True)), (
                cache.dtype,
                words,
            )


@pytest.mark.parametrize("kw", [{}, dict(g=6, slot_bytes=288, p_bad_block=0.2)])
def test_ultraquant_kernel_words_same_bits(kw):
    c = C.uq_case(4, **kw)
    run = functools.partial(PU._partials, sm_scale=0.0625, num_partitions=2, interpret=True)
    got, want = run(*c.args(), words=True), run(*c.args(), words=False)
    assert all(_same_bits(g, w) for g, w in zip(got[:2], want[:2], strict=True))


# ---------------------------------------------------------------------------------------------
# On an NVIDIA GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", OPS)
def test_gpu_compiled_temporaries_far_below_the_cache(op, size, impl):
    _skip_unless_implemented(op, impl)
    fn, args = OPS[op](SIZES[size], impl)
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    temp = analysis.temp_size_in_bytes
    assert temp < _cache_bytes(args) / 16, f"{op} [{impl}] ({size}): {temp / 2**30:.2f} GiB"


@pytest.mark.gpu
@pytest.mark.parametrize("size", SIZES)
def test_gpu_float8_cache_temporaries_far_below_the_cache(size):
    # the kernel entry itself: jsm.mla_decode's conversion of a float8 cache to uint8 codes
    # (mla_decode._prepare) is before it, and is what "mla_decode_fp8" above measures
    fn, args = _decode_kernel_fp8(SIZES[size])
    temp = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < _cache_bytes(args) / 16, f"mla_decode_pallas float8 ({size}): {temp / 2**30:.2f}"


@pytest.mark.gpu
def test_gpu_sparse_mla_reads_the_end_of_a_3_gib_cache():
    from jax_sparse_mla.formats import unpack_fp8_ds_mla
    from tests.test_pallas_gpu import assert_close, records

    n, tail, n_q, topk = SIZES["3GiB"] // 656, 16384, 8, 2048
    kv = jax.jit(lambda r: jnp.zeros((n, 656), jnp.uint8).at[n - tail :].set(r))(
        records(jax.random.key(3), tail)
    )
    rng = np.random.default_rng(3)
    idx = jnp.asarray(n - tail + rng.integers(0, tail, n_q * topk), jnp.int32)
    indptr = jnp.asarray(np.arange(n_q + 1) * topk, jnp.int32)
    q = jax.random.normal(jax.random.key(4), (n_q, 16, 576)).astype(jnp.bfloat16)
    (o, lse), (ox, lx) = (
        jax.jit(functools.partial(jsm.sparse_mla, return_lse=True, implementation=impl))(
            q, kv, idx, indptr
        )
        for impl in ("pallas", "xla")
    )
    latent, rope = unpack_fp8_ds_mla(kv[n - tail :])
    k_max = jnp.max(jnp.abs(jnp.concatenate([latent, rope.astype(jnp.float32)], 1)), 0)
    score = 576**-0.5 * np.asarray(jnp.abs(q.astype(jnp.float32)) @ k_max)
    vmax = float(jnp.max(jnp.abs(latent)))
    assert_close("sparse_mla 3 GiB", o, ox, vmax, score, np.full((n_q, 1), topk), lse, lx)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_gpu_ultraquant_reads_the_end_of_a_3_gib_cache(impl):
    if impl not in impls.available("ultraquant_decode"):
        pytest.skip(f"{impl!r} does not run here (Mosaic GPU: a Hopper GPU only)")
    from jax_sparse_mla.formats import ultraquant_rotate, ultraquant_unpack
    from tests.test_pallas_gpu import assert_close

    hk, bs, g, b, per = 2, 64, 8, 4, 64
    nb, tail = SIZES["3GiB"] // (bs * hk * 272), b * per
    k = jax.random.split(jax.random.key(5), 4)
    codes = jax.random.bits(k[0], (tail, bs, hk, 2, 128), jnp.uint8)
    scales = jax.random.randint(k[1], (tail, bs, hk, 2, 8), 120, 131).astype(jnp.uint8)
    written = jnp.concatenate([codes, scales], -1).reshape(tail, bs, hk, 272)
    cache = jax.jit(lambda w: jnp.zeros((nb, bs, hk, 272), jnp.uint8).at[nb - tail :].set(w))(
        written
    )
    tables = (nb - tail + jax.random.permutation(k[2], tail)).reshape(b, per).astype(jnp.int32)
    seq_lens = jnp.asarray([per * bs, 1, 3000, per * bs - 7], jnp.int32)
    q = jax.random.normal(k[3], (b, hk * g, 256)).astype(jnp.bfloat16)
    o, ox = (
        jax.jit(functools.partial(jsm.ultraquant_decode, implementation=name))(
            q, cache, tables, seq_lens
        )
        for name in (impl, "xla")
    )
    k_st, v = ultraquant_unpack(written)
    k_max = jnp.max(jnp.abs(k_st), axis=(0, 1, 2))
    score = np.asarray(jnp.abs(ultraquant_rotate(q)) @ k_max) / 16
    vmax = float(jnp.max(jnp.abs(v)))
    assert_close("ultraquant 3 GiB", o, ox, vmax, score, np.asarray(seq_lens)[:, None])
