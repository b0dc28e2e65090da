"""The implementations the shared op suites run against on this machine, and each one's tolerance.

Every op suite (test_sparse_mla, test_mla_decode, test_ultraquant, test_transforms,
test_properties, test_memory, test_causal, test_gradients, test_indptr, test_inputs) is
parametrized per op over ``available(op)``: the names of that op's implementation table that
run here. Those are the exact "xla" path, the gfx950 emulation, "pallas" (compiled on a CUDA GPU,
Pallas interpret mode elsewhere), on a Hopper NVIDIA GPU (sm_90) only "mosaic" (the Mosaic GPU
kernels: no interpret mode; every op) and, on an MI355 (gfx950) only, the
"flydsl" kernels. A test of one op is parametrized with that op's decorator (``each_sparse``,
``each_decode``, ``each_partials``, ``each_merge``, ``each_ultraquant``), a test that runs
several ops with ``each_of(*ops)`` (the names every one of them has). Each implementation is
checked against the float64 oracle (tests/oracle.py) with its own derived bound:

* "xla": ``oracle.check_attention`` (the bf16 output rounding on top of float32 arithmetic);
* "pallas" and "mosaic": ``pallas_checks.check_kernel_attention`` (that plus ``2^-8 max|V|``
  for P in bf16);
* "gfx950_emulation" and "flydsl": the bounds that tests/test_emulation_*.py derive from the
  emulation's arithmetic, which the kernels share (``expected`` for sparse_mla,
  ``expected_partials`` / ``merged_bound`` / ``merge_bound`` for mla_decode and the merge,
  ``oracle_on`` for ultraquant_decode).

``default(op)`` is what ``implementation=None`` picks here for ``op``; tests about None check its
output with that implementation's tolerance.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla._platform import cuda_is_hopper, cuda_is_sm90, gpu_platforms, hopper_choice
from jax_sparse_mla.ffi.calls import (
    default_num_partitions,
    default_num_splits,
    default_sparse_splits,
)
from jax_sparse_mla.reference.ultraquant import ultraquant_query
from tests import cases as C
from tests import oracle as O
from tests import test_emulation_mla_decode as DE
from tests import test_emulation_sparse_mla as SE
from tests import test_emulation_ultraquant as UE
from tests.pallas_checks import check_kernel_attention

GFX950 = ("gfx950_emulation", "flydsl")  # share the emulation's bounds
BF16_P = ("pallas", "mosaic")  # GPU kernels that round P to bf16 before P V

# op -> the module whose ``_IMPLEMENTATIONS`` table (name -> function) serves it
OP_MODULES = {
    "sparse_mla": "jax_sparse_mla.sparse_mla",
    "mla_decode": "jax_sparse_mla.mla_decode",
    "mla_decode_partials": "jax_sparse_mla.mla_decode",
    "merge_attn_states": "jax_sparse_mla.mla_decode",
    "ultraquant_decode": "jax_sparse_mla.ultraquant",
}


def has_gfx950() -> bool:
    return "gfx950" in gpu_platforms()


def has_cuda() -> bool:
    return "cuda" in gpu_platforms()


def implementations(op: str) -> tuple[str, ...]:
    """The implementation names of ``op``'s table (jax_sparse_mla's ``_IMPLEMENTATIONS``)."""
    if op not in OP_MODULES:
        raise ValueError(f"unknown op {op!r}: one of {tuple(OP_MODULES)}")
    table = importlib.import_module(OP_MODULES[op])._IMPLEMENTATIONS
    return tuple(name for name in table if name is not None)


def has_mosaic() -> bool:
    """True where "mosaic" runs: a Hopper CUDA GPU (sm_90; it has no interpret mode)."""
    return has_cuda() and cuda_is_sm90()


@functools.cache
def available(op: str | None = None) -> tuple[str, ...]:
    """The implementation names that run on this machine, "xla" first; with ``op`` only those
    that op has (``implementations(op)``)."""
    names = ["xla", "gfx950_emulation", "pallas"]
    if has_mosaic():
        names.append("mosaic")
    if has_gfx950():
        names.append("flydsl")
    if op is not None:
        names = [n for n in names if n in implementations(op)]
    return tuple(names)


def common(*ops: str) -> tuple[str, ...]:
    """The names of ``available()`` that every one of ``ops`` has (a test running them all)."""
    return tuple(n for n in available() if all(n in available(op) for op in ops))


@functools.cache
def default(op: str) -> str:
    """What ``implementation=None`` runs here for ``op``: "flydsl" on an MI355; on a Hopper or
    later NVIDIA GPU ``hopper_choice()`` ("mosaic" on a Hopper, "pallas" past it) for the ops
    with a Mosaic GPU kernel (None's merge is Pallas'), else "pallas"; "xla" elsewhere."""
    names = implementations(op)
    if has_gfx950():
        return "flydsl"
    if not (has_cuda() and cuda_is_hopper()):
        return "xla"
    return hopper_choice() if "mosaic" in names and op != "merge_attn_states" else "pallas"


def interpreted(impl: str) -> bool:
    """True for "pallas" off CUDA (Pallas interpret mode: slow, so suites use smaller shapes)."""
    return impl == "pallas" and not has_cuda()


def _f64(x) -> np.ndarray:
    return O.to_f64(x)


def _attention_check(impl: str):
    return check_kernel_attention if impl in BF16_P else O.check_attention


# ---------------------------------------------------------------------------------------------
# sparse_mla
# ---------------------------------------------------------------------------------------------


def check_sparse(impl: str, case, out, lse=None, what="sparse_mla") -> None:
    """sparse_mla's (out, lse or None) for ``case`` (tests/cases.SparseCase) against the oracle."""
    what = f"{what} [{impl}]"
    if impl in GFX950:  # the key splits the kernels (and the emulation) use for these shapes
        splits = default_sparse_splits(case.q, np.asarray(case.idx))
        ref, ref_lse, tol, lse_tol = SE.expected(case, splits)
        if lse is not None:
            SE.check(_f64(out), _f64(lse), ref, ref_lse, tol, lse_tol, what)
        else:
            O.assert_within(out, ref, tol, what)
            assert np.all(_f64(out)[np.isneginf(ref_lse)] == 0), f"{what}: rows without keys"
        return
    ref, ref_lse, st = O.sparse_mla(case.q, case.kv, case.idx, case.indptr, case.sm_scale, True)
    _attention_check(impl)(out, ref, st, lse, ref_lse, what=what)


# ---------------------------------------------------------------------------------------------
# mla_decode
# ---------------------------------------------------------------------------------------------


def decode_splits(impl: str, case, num_splits: int | None) -> int:
    """The splits ``mla_decode(..., num_splits=num_splits)`` of a gfx950 implementation uses."""
    if num_splits is not None:
        return num_splits
    if impl == "flydsl":
        return default_num_splits(case.q, case.kv_indices, case.kv_indptr, case.qlen)
    return 1


@functools.cache
def jitted(fn, **static):
    """``jax.jit(fn)`` with static keyword arguments, one per set of them (so the suites share
    compiled shapes)."""
    return jax.jit(functools.partial(fn, **static))


def with_scales(fn, impl: str, scales: dict, **static):
    """``fn`` jitted with ``static`` keyword arguments and the ``scales`` (name -> float or
    None), as a function of its array arguments. The scales are traced 0-d float32 arrays (one
    compiled function serves every value), except None (the op's default) and for "flydsl",
    whose kernels take static scales."""
    traced = {k: v for k, v in scales.items() if v is not None and impl != "flydsl"}
    fixed = {k: v for k, v in scales.items() if k not in traced}
    f = jitted(fn, implementation=impl, **static, **fixed)
    return lambda *args: f(*args, **{k: jnp.float32(v) for k, v in traced.items()})


def decode_fn(fn, impl: str, case, **options):
    """``fn`` (mla_decode or mla_decode_partials) for ``case`` (tests/cases.DecodeCase) jitted,
    as a function of (q, kv, kv_indices, kv_indptr), its scales passed by ``with_scales``."""
    scales = dict(k_scale=case.k_scale, v_scale=case.v_scale, sm_scale=case.sm_scale)
    return with_scales(fn, impl, scales, qlen=case.qlen, **options)


def decode_partials(impl: str, case, num_splits: int):
    return decode_fn(jsm.mla_decode_partials, impl, case, num_splits=num_splits)(*case.args())


def check_decode(impl: str, case, out, lse, num_splits=None, what="mla_decode") -> None:
    """mla_decode's (out, lse) against the oracle. For the gfx950 implementations the bound is
    that of merging their own partials (computed here with the splits the decode used)."""
    what = f"{what} [{impl}]"
    if impl in GFX950:
        s = decode_splits(impl, case, num_splits)
        o_p, lse_p = decode_partials(impl, case, s)
        DE.check(_f64(out), _f64(lse), *DE.merged_bound(case, s, _f64(o_p), _f64(lse_p)), what)
        return
    ref, ref_lse, st = C.decode_oracle(case, stats=True)
    _attention_check(impl)(out, ref, st, lse, ref_lse, what=what)


def check_partials(impl: str, case, num_splits: int, o_parts, lse_parts, what="partials"):
    """mla_decode_partials' (o_parts, lse_parts) against the oracle's partials; the full row's
    stats bound every split's (more keys, larger max|V| and score_abs)."""
    what = f"{what} [{impl}]"
    n, h = case.q.shape[:2]
    assert o_parts.shape == (n, num_splits, h, 512) and lse_parts.shape == (n, num_splits, h)
    assert o_parts.dtype == jnp.bfloat16 and lse_parts.dtype == jnp.float32
    if impl in GFX950:
        exp = DE.expected_partials(case, num_splits)
        DE.check(_f64(o_parts), _f64(lse_parts), *exp, what)
        return
    ref, ref_lse, st = C.decode_oracle(case, num_splits=num_splits, stats=True)
    _attention_check(impl)(
        _f64(o_parts).reshape(n * num_splits, h, 512),
        ref.reshape(n * num_splits, h, 512),
        [x for x in st for _ in range(num_splits)],
        _f64(lse_parts).reshape(n * num_splits, h),
        ref_lse.reshape(n * num_splits, h),
        what=what,
    )


def merge_tolerance(impl: str, o_parts, lse_parts, ref, ref_lse):
    """(tol, lse_tol) of merge_attn_states against ``oracle.merge_attn_states``.

    "xla" / "pallas" / "mosaic": f32 weights, ~ a few 2^-24 relative on each term
    (``2^-20 max_s |o_s|``), plus the output rounding when o_parts is bf16 (``2^-8 |ref|``); lse
    ``2^-21 (|lse| + 1)``.
    gfx950: the emulated combine's bound (``merge_bound``, bf16 output whatever the input)."""
    o64, l64 = _f64(o_parts), _f64(lse_parts)
    live = np.isfinite(l64)[..., None]
    o64 = np.where(live, o64, 0.0)
    if impl in GFX950:
        return DE.merge_bound(o64, l64, ref, ref_lse)
    rel = 2.0**-8 if o_parts.dtype == jnp.bfloat16 else 0.0
    tol = rel * np.abs(ref) + 2.0**-20 * np.max(np.abs(o64), axis=1)
    return tol, 2.0**-21 * (np.abs(np.where(np.isfinite(ref_lse), ref_lse, 0.0)) + 1)


# ---------------------------------------------------------------------------------------------
# ultraquant_decode
# ---------------------------------------------------------------------------------------------


def uq_partitions(impl: str, case, num_partitions: int | None) -> int:
    """The partitions ``ultraquant_decode(..., num_partitions=...)`` of a gfx950 implementation
    uses (its bound depends on whether partials are rounded to bf16 before the reduce)."""
    if num_partitions is not None:
        return num_partitions
    if impl == "flydsl":
        _, bs, hk, _ = case.cache.shape
        return default_num_partitions(case.q.shape[0], hk, case.block_tables.shape[1] * bs)
    return 1


def check_uq(
    impl: str, case, out, sm_scale=1 / 16, num_partitions=None, what="ultraquant", exact_q=False
):
    """ultraquant_decode's output for ``case`` (tests/cases.UQCase) against the oracle (its
    e4m3 query, or the float32 one with ``exact_q``), each implementation with its bound."""
    what = f"{what} [{impl}]"
    assert out.dtype == jnp.bfloat16 and out.shape == case.q.shape
    check_uq_query(case.q, exact_q)
    if impl in GFX950:
        UE.check(out, UE.oracle_on(case, sm_scale), uq_partitions(impl, case, num_partitions), what)
        return
    ref, _, st = O.ultraquant_decode(
        case.q, case.cache, case.block_tables, case.seq_lens, sm_scale, stats=True, exact_q=exact_q
    )
    g = case.q.shape[1] // case.cache.shape[2]
    _attention_check(impl)(out, ref, st, heads_per_entry=g, what=what)


def check_uq_query(q, exact_q=False) -> None:
    """The tolerances' premise: the library's e4m3 query (float32 rotation, then e4m3) is the
    oracle's (exact rotation, then e4m3) for this q. It could only differ where the float32
    rotation crosses an e4m3 rounding boundary (one element in ~2^19 of random queries): such
    a case needs another seed. (The float32 query of ``exact_q`` is within ``attn_atol``'s
    score budget.)"""
    if exact_q:
        return
    got = np.asarray(_ultraquant_query(jnp.asarray(q)), np.float64)
    np.testing.assert_array_equal(got, O.uq_query(q), "the float32 rotation crossed an e4m3 tie")


_ultraquant_query = jax.jit(ultraquant_query)


def each_of(*ops: str):
    """Parametrizes a test over the implementations here that every one of ``ops`` has."""
    return pytest.mark.parametrize("impl", common(*ops))


# A test of one op, run with every implementation of that op on this machine
each_sparse = each_of("sparse_mla")
each_decode = each_of("mla_decode")
each_partials = each_of("mla_decode_partials")
each_merge = each_of("merge_attn_states")
each_ultraquant = each_of("ultraquant_decode")

# From which length of the memory tests (test_memory.py: "short", "long", "very long") on an
# implementation's compiled temporaries no longer change: fixed key tiles for "xla"; splits
# that grow with the row until the GPU is full for the GPU kernels and the gfx950 emulation
# (sparse_mla's, as the kernel's: their partials).
MEMORY_FLAT_FROM = {
    "xla": "short",
    "gfx950_emulation": "long",
    "pallas": "long",
    "mosaic": "long",
    "flydsl": "long",
}
