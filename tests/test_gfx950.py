"""The FlyDSL gfx950 kernels (``implementation="flydsl"``) on an AMD MI355, through XLA FFI.

Every test here is marked ``gfx950``: ``tests/conftest.py`` skips it unless jax sees a gfx950
(MI355) ROCm device. On an MI355, with the FFI library built (see BUILD.md), run

    python -m pytest -m gfx950 tests/test_gfx950.py -v

and send back (a) the full pytest output, (b) ``rocminfo | grep gfx`` and (c)
``python -c "import jax; print(jax.__version__, jax.devices())"``. Each test takes seconds; the
two tests over 4 GiB caches allocate about 5 GB of GPU memory each.

What is checked, for sparse_mla, mla_decode (partials, combine, both) and ultraquant_decode:

1. "flydsl" against "gfx950_emulation" (the kernels' own arithmetic in jnp, on the same GPU)
   within the kernel-vs-emulation bound that the emulation module's docstring states for MI355
   tests (``jax_sparse_mla/emulation/bounds.py``, the self-check's bounds too).
2. "flydsl" against the float64 oracle (``tests/oracle.py``) with the bounds of the emulation
   tests (``tests/test_emulation_*.py``; their helpers are imported, not copied): the bounds
   derive the error of the kernels' arithmetic, which the kernel shares with its emulation.
3. Edge cases: H = 1 / 12 / 16 / 20 / 128 (> 16 heads: head groups), empty and all-masked rows
   (-1 and >= rows), rows over 4096 keys, NaN / garbage in records, tokens and slots that no
   valid index reaches; mla_decode qlen 1 / 2 / 4, 1 to 16 splits with empty splits, empty
   requests; ultraquant G 6 / 8 / 16 and padded G (3, 12), block sizes 16 to 256, 1 to 8
   partitions, masked block-table entries (-1, >= num_blocks).
4. A sparse_mla cache and an ultraquant cache over 4 GiB, read past the 4 GiB byte offset.
5. jax.jit equals eager, jax.vmap equals a loop (tests/test_transforms.py runs the
   transforms, donation included, on every implementation against the oracle).
6. implementation=None lowers to the kernels' custom calls on the MI355.

The kernels use no atomics, so their runs are deterministic: results of the same kernels on the
same data (jit / eager, vmap / loop, compact / big cache, garbage in unreached records,
mla_decode / its two kernels one after the other) must be bit-identical. Under jax.vmap the
custom calls run once per batch element (``vmap_method="sequential"``).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.emulation import bounds as B
from jax_sparse_mla.emulation.sparse_mla import sparse_mla_partials_gfx950_emulation
from jax_sparse_mla.ffi.calls import (
    default_num_partitions,
    default_num_splits,
    default_sparse_splits,
)
from jax_sparse_mla.formats import RECORD_BYTES
from jax_sparse_mla.kernels.gfx950 import configs
from tests import cases as C
from tests import oracle as O
from tests import test_emulation_mla_decode as DE
from tests import test_emulation_sparse_mla as SE
from tests import test_emulation_ultraquant as UE
from tests.impls import jitted

pytestmark = pytest.mark.gfx950

IMPL = "flydsl"  # the implementation under test
EMU = "gfx950_emulation"
FOUR_GIB = 2**32
SPARSE_BIG_RECORDS = 6_600_000  # 6.6M records of 656 B = 4.33 GB
UQ_BIG_BLOCKS = 131_072  # blocks of 64 tokens x 2 heads x 272 B = 4.56 GB


def f64(x) -> np.ndarray:
    return O.to_f64(x)


def assert_same(a, b, what=""):
    """Bit-identical results (NaN equal to NaN), for bf16 / f32 / uint8 arrays."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype != np.uint8:
        a, b = a.astype(np.float32), b.astype(np.float32)
    np.testing.assert_array_equal(a, b, err_msg=what)


# =============================================================================================
# The scaled MFMA's operand layouts, as the kernels assume them (read these first on a failure)
# =============================================================================================

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
SMALL_E4M3 = [-4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4]  # exact sums in f32


def e4m3_codes(r, shape) -> np.ndarray:
    values = r.choice(SMALL_E4M3, size=shape).astype(np.float32)
    return np.asarray(jnp.asarray(values, jnp.float8_e4m3fn).view(jnp.uint8))


def e4m3_values(codes) -> np.ndarray:
    return f64(jnp.asarray(codes, jnp.uint8).view(jnp.float8_e4m3fn).astype(jnp.float32))


def per_lane(fn) -> np.ndarray:
    """[64, ...] stacked ``fn(g, i)`` for lane 16 g + i (g: lane group, i: row / column)."""
    return np.stack([fn(lane >> 4, lane & 15) for lane in range(64)])


def split_k_registers(codes) -> np.ndarray:
    """The 8-bit operand layout (sparse_mla, mla_decode, ultraquant's q): lane 16g + i holds row
    i's K [16g, 16g + 16) in bytes 0-15 and [64 + 16g, 64 + 16g + 16) in bytes 16-31."""
    return per_lane(
        lambda g, i: np.concatenate(
            [codes[i, 16 * g : 16 * g + 16], codes[i, 64 + 16 * g : 80 + 16 * g]]
        )
    )


def contiguous_k_registers(codes) -> np.ndarray:
    """The alternative 8-bit layout (no kernel assumes it): lane 16g + i holds row i's K
    [32g, 32g + 32)."""
    return per_lane(lambda g, i: codes[i, 32 * g : 32 * g + 32])


def contiguous_k_nibble_registers(nibbles) -> np.ndarray:
    """The 4-bit operand layout (ultraquant's K): lane 16g + i holds row i's K [32g, 32g + 32)
    two per byte (element 2t in the low nibble) in bytes 0-15."""
    packed = per_lane(
        lambda g, i: (
            nibbles[i, 32 * g : 32 * g + 32 : 2] | (nibbles[i, 32 * g + 1 : 32 * g + 32 : 2] << 4)
        )
    )
    return np.pad(packed, ((0, 0), (0, 16))).astype(np.uint8)


def scale_registers(sa, sb) -> np.ndarray:
    """Lane 16g + i holds the E8M0 scale of K group g (K // 32) of A's row i and B's column i."""
    return per_lane(lambda g, i: np.int32([sa[i, g], sb[i, g]]))


def mfma_expected(a, b, sa, sb) -> np.ndarray:
    """C[i, j] = sum_k a[i, k] 2^(sa[i, k // 32] - 127) b[j, k] 2^(sb[j, k // 32] - 127)."""
    wa = a * np.repeat(2.0 ** (sa - 127.0), 32, axis=1)
    wb = b * np.repeat(2.0 ** (sb - 127.0), 32, axis=1)
    return wa @ wb.T


def mfma_result(a_regs, b_regs, scales, a_format) -> np.ndarray:
    """The probe's C [16, 16]: lane 16G + j element r is C[4G + r, j]."""
    from jax_sparse_mla.ffi.calls import mfma_probe

    acc = f64(jitted(mfma_probe, a_format=a_format)(a_regs, b_regs, jnp.asarray(scales)))
    c = np.zeros((16, 16))
    for lane in range(64):
        c[4 * (lane >> 4) : 4 * (lane >> 4) + 4, lane & 15] = acc[lane]
    return c


def test_mfma_operand_layouts_e4m3():
    """sparse_mla and mla_decode assume the split-K layout of both 8-bit operands."""
    r = C.rng(31)
    a, b = e4m3_codes(r, (16, 128)), e4m3_codes(r, (16, 128))
    sa, sb = r.integers(124, 131, (16, 4)), r.integers(124, 131, (16, 4))
    want = mfma_expected(e4m3_values(a), e4m3_values(b), sa, sb)
    scales = scale_registers(sa, sb)
    got = mfma_result(split_k_registers(a), split_k_registers(b), scales, 0)
    if not np.array_equal(got, want):
        alt = mfma_result(contiguous_k_registers(a), contiguous_k_registers(b), scales, 0)
        pytest.fail(
            "e4m3 x e4m3 scaled MFMA: the split-K layout that sparse_mla and mla_decode assume "
            f"does not hold ({int(np.sum(got != want))} of 256 wrong); the contiguous 32-byte "
            f"layout {'does' if np.array_equal(alt, want) else 'does not either'}"
        )


def test_mfma_operand_layouts_e2m1_e4m3():
    """ultraquant assumes each operand laid out by its own bit width: the e2m1 A (K codes) with
    32 contiguous K values per lane group, the e4m3 B (q) split like sparse_mla's operands (AMD's
    CDNA matrix-core blog, FlyDSL's fp8 x fp4 MoE GEMM, AMD's ISA emulator: the kernel's
    docstring). The kernel stores q permuted so that this pairs equal rotated dims."""
    r = C.rng(32)
    a = r.integers(0, 16, (16, 128))
    b = e4m3_codes(r, (16, 128))
    sa, sb = r.integers(124, 131, (16, 4)), np.full((16, 4), 127)  # ultraquant: scale_b = 1
    want = mfma_expected(E2M1_VALUES[a], e4m3_values(b), sa, sb)
    scales = scale_registers(sa, sb)
    a_regs = contiguous_k_nibble_registers(a)
    got = mfma_result(a_regs, split_k_registers(b), scales, 4)
    if not np.array_equal(got, want):
        alt = mfma_result(a_regs, contiguous_k_registers(b), scales, 4)
        pytest.fail(
            "e2m1 x e4m3 scaled MFMA: the layout that ultraquant assumes (fp4 A contiguous, "
            f"fp8 B split) does not hold ({int(np.sum(got != want))} of 256 wrong); with B "
            f"contiguous too (fp4 contiguous, fp8 contiguous) it "
            f"{'does: store q unpermuted' if np.array_equal(alt, want) else 'does not either'}"
        )


# =============================================================================================
# The transposing LDS reads, as the kernels assume them
# =============================================================================================

TR_PROBE_ADDRS = C.rng(33).permutation(128)[:64] * 8  # 64 distinct 8-byte slots of the probe LDS
TR_SEMANTICS = {  # n = 64 / bits elements per lane, m = 16 / n
    "transposed": "within each row of 16 lanes, lane t element k is lane {m} k + t // {n}'s "
    "element t % {n}",
    "blocks": "within each row of 16 lanes, lane t element k is lane {n} (t // {n}) + k's element "
    "t % {n}: separate {n} x {n} transposes of consecutive lanes (the other lane grouping)",
    "plain": "no transpose: each lane gets its own 8 bytes, like ds_read_b64",
}


def tr_semantics(name, bits) -> str:
    """``TR_SEMANTICS[name]`` for ``ds_read_b64_tr_b{bits}``."""
    n = 64 // bits
    return TR_SEMANTICS[name].format(n=n, m=16 // n)


def tr_read_sources(addrs, bits, semantics="transposed") -> np.ndarray:
    """[64, 8]: the LDS byte that byte j of lane l's result comes from, when lane l reads at
    ``addrs[l]`` with ``ds_read_b64_tr_b{bits}`` under ``semantics`` (``tr_semantics``).

    "transposed" is AMD's documented semantics (CDNA4 ISA guide, section 11.4; the exact lane
    map of FlyDSL's CDNA4 copy atom, cited in ``kernels/gfx950/probe.py``): lane 16 g + t
    element k (of n = 64 / bits) = lane 16 g + (16 / n) k + t // n's element t % n.
    """
    size = bits // 8  # bytes per element
    n = 8 // size  # elements per lane
    lane, j = np.arange(64)[:, None], np.arange(8)[None, :]
    g, t, k = lane >> 4, lane & 15, j // size
    src, elem = {
        "transposed": (16 * g + (16 // n) * k + t // n, t % n),
        "blocks": (16 * g + n * (t // n) + k, t % n),
        "plain": (lane, k),
    }[semantics]
    return np.asarray(addrs)[src] + elem * size + j % size


def tr_probe_sources(addrs, bits, read=None) -> np.ndarray:
    """[64, 8]: the LDS byte each result byte of the probe came from: two runs, LDS byte a
    holding ``a & 255``, then ``a >> 8``. ``read(lds, addrs) -> [64, 2] uint32`` runs the probe
    (default: the ``ds_read_tr_probe`` kernel; the CPU tests pass models of the hardware)."""
    if read is None:
        from jax_sparse_mla.ffi.calls import ds_read_tr_probe

        fn = jitted(ds_read_tr_probe, bits=bits)

        def read(lds, addrs):
            return np.asarray(fn(jnp.asarray(lds), jnp.asarray(addrs, jnp.int32)))

    a = np.arange(1024)

    def run(pattern):
        regs = np.asarray(read(pattern.astype(np.uint8), addrs), "<u4")
        return regs.view(np.uint8).reshape(64, 8).astype(np.int64)

    return run(a & 255) | (run(a >> 8) << 8)


def check_tr_lane_map(bits, users, read=None):
    """The probe's ``ds_read_b64_tr_b{bits}`` against the documented semantics; on a failure the
    message names the semantics observed (``tr_semantics``) or shows lanes 0-15's sources.
    ``read``: as in ``tr_probe_sources``."""
    got = tr_probe_sources(TR_PROBE_ADDRS, bits, read)
    want = tr_read_sources(TR_PROBE_ADDRS, bits)
    if np.array_equal(got, want):
        return
    alternatives = {s: tr_read_sources(TR_PROBE_ADDRS, bits, s) for s in ("blocks", "plain")}
    seen = [s for s, alt in alternatives.items() if np.array_equal(got, alt)]
    if seen:
        observed = f"the hardware does this instead: {tr_semantics(seen[0], bits)}"
    else:
        lane_of = {int(a): lane for lane, a in enumerate(TR_PROBE_ADDRS)}
        rows = [
            " ".join(f"{lane_of.get(a & ~7, '?')}.{a & 7}" for a in got[t].tolist())
            for t in range(16)
        ]
        observed = (
            f"no known semantics matches; lanes 0-15 got (source lane.byte): {'; '.join(rows)}"
        )
    pytest.fail(
        f"ds_read_b64_tr_b{bits}: {int(np.sum(got != want))} of 512 result bytes differ from the "
        f"documented semantics that {users} assume ({tr_semantics('transposed', bits)}); {observed}"
    )


def test_ds_read_b64_tr_b8_lane_map():
    """sparse_mla and mla_decode read V^T from LDS with ds_read_b64_tr_b8 and assume: within each
    row of 16 lanes, lane t byte k = lane 2 k + t // 8's byte t % 8 (their module docstrings;
    tests/test_emulation_{sparse_mla,mla_decode}.py::_tr8 model it)."""
    check_tr_lane_map(8, "sparse_mla and mla_decode (V^T operands)")


def test_ds_read_b64_tr_b16_lane_map():
    """ultraquant reads V^T from LDS with ds_read_b64_tr_b16 and assumes: within each row of 16
    lanes, lane t element k (2 bytes) = lane 4 k + t // 4's element t % 4 (its _v_read_offset;
    tests/test_emulation_ultraquant.py::_tr16 models it)."""
    check_tr_lane_map(16, "ultraquant (V^T operands)")


# =============================================================================================
# sparse_mla
# =============================================================================================


def run_sparse(case, impl, kv=None, idx=None):
    """(out, lse) as float64 arrays; kv / idx replace the case's (e.g. a big cache)."""
    fn = jitted(jsm.sparse_mla, sm_scale=case.sm_scale, return_lse=True, implementation=impl)
    out, lse = fn(
        case.q,
        jnp.asarray(case.kv if kv is None else kv),
        jnp.asarray(case.idx if idx is None else idx),
        jnp.asarray(case.indptr),
    )
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert out.shape == (*case.q.shape[:2], 512) and lse.shape == case.q.shape[:2]
    return f64(out), f64(lse)


def check_sparse(case, out, lse, what):
    """flydsl's (out, lse) against the emulation (the kernel bound of the emulation module's
    docstring, ``bounds.sparse_mla_bound``) and the oracle (the emulation test's bound,
    ``SE.expected``)."""
    out_e, lse_e = run_sparse(case, EMU)
    args = (case.q, *map(jnp.asarray, (case.kv, case.idx, case.indptr)), SE._sm(case))
    splits = default_sparse_splits(case.q, np.asarray(case.idx))  # as the kernels split
    parts = sparse_mla_partials_gfx950_emulation(*args, splits) if splits > 1 else None
    tol = B.sparse_mla_bound(*args, out_e, lse_e, parts)
    SE.check(out, lse, out_e, lse_e, *tol, f"{what} vs emu")
    SE.check(out, lse, *SE.expected(case, splits), f"{what} vs oracle")


LONG_ROWS = {0: 1, 1: 5000, 2: 4096, 3: 4097, 4: 129}  # row -> keys (40 tiles of 128)
SPARSE_CASES = {
    # random CSR rows: empty rows, -1 padding, out-of-range entries, duplicates, NaN records
    # that no entry references (sparse_case); H > 16 runs as groups of <= 16 heads
    **{
        f"h{h}": functools.partial(
            C.sparse_case, 10 + h, n_q=5 if h < 128 else 3, h=h, max_len=40, p_neg=0.15
        )
        for h in (1, 12, 16, 20, 128)
    },
    "masking_h20": functools.partial(SE.masking_case, 20),
    "unusual_indptr": SE.unusual_indptr_case,
    "long_rows": functools.partial(
        C.sparse_case, 7, n_q=6, h=16, n_rec=300, max_len=8, long_rows=LONG_ROWS
    ),
    "peaky": functools.partial(
        C.sparse_case, 3, n_q=6, h=16, sm_scale=0.3, q_scale=8.0, max_len=60
    ),
    "flat": functools.partial(
        C.sparse_case, 3, n_q=6, h=16, sm_scale=0.01, q_scale=4.0, max_len=60
    ),
}


@pytest.mark.parametrize("name", list(SPARSE_CASES))
def test_sparse_mla(name):
    case = SPARSE_CASES[name]()
    out, lse = run_sparse(case, IMPL)
    check_sparse(case, out, lse, name)
    if name == "masking_h20":  # empty, all -1, all out of range
        assert np.all(out[:3] == 0) and np.all(np.isneginf(lse[:3]))


def test_sparse_mla_reached_nan_record_gives_nan_row():
    """A NaN record that an unmasked entry reaches makes its row NaN, and only its row (as the
    emulation, whose docstring says the kernel does the same)."""
    r = C.rng(9)
    kv = C.make_records(r, 8)
    kv[5] = C.nan_records(1)[0]
    q = C.bf16_normal(r, (2, 16, 576))
    case = C.SparseCase(q, kv, np.int32([1, 5, 2, 3]), np.int32([0, 2, 4]))
    out, lse = run_sparse(case, IMPL)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(lse[1]).all()


# =============================================================================================
# mla_decode: partials, combine (merge_attn_states), both (mla_decode)
# =============================================================================================

DECODE_CASES = {
    # name: (decode_case kwargs, num_splits); test_emulation_mla_decode's cases (qlen 1 / 2 / 4,
    # H 1 / 4 / 12 / 16 / 128, 1 to 16 splits with empty ones, empty requests, masked indices)
    **{name: (kw, s) for name, (kw, s, _) in DE.PARTIAL_CASES.items()},
    "q1_h16_s4_all_requests_empty": (dict(seed=11, seq_lens=(0, 0, 0), qlen=1, h=16), 4),
    "q2_h20_s16_long": (dict(seed=12, seq_lens=(4500, 1, 700), qlen=2, h=20, p_masked=0.05), 16),
}


@functools.cache
def decode_case(name):
    kw, num_splits = DECODE_CASES[name]
    return C.decode_case(**kw, as_uint8=True), num_splits


def _decode_args(case):
    static = dict(
        qlen=case.qlen, k_scale=case.k_scale, v_scale=case.v_scale, sm_scale=case.sm_scale
    )
    return case.args(), static


def run_partials(case, num_splits, impl):
    arrays, static = _decode_args(case)
    fn = jitted(jsm.mla_decode_partials, **static, num_splits=num_splits, implementation=impl)
    o, lse = fn(*arrays)
    n, h = case.q.shape[:2]
    assert o.shape == (n, num_splits, h, 512) and lse.shape == (n, num_splits, h)
    return o, lse


def run_decode(case, num_splits, impl):
    arrays, static = _decode_args(case)
    fn = jitted(
        jsm.mla_decode, **static, num_splits=num_splits, return_lse=True, implementation=impl
    )
    return fn(*arrays)


def run_merge(o_parts, lse_parts, impl):
    fn = jitted(jsm.merge_attn_states, return_lse=True, implementation=impl)
    o, lse = fn(jnp.asarray(o_parts, jnp.bfloat16), jnp.asarray(lse_parts, jnp.float32))
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    return o, lse


def partials_kernel_bound(case, num_splits, o_e, lse_e):
    """Kernel vs emulation per partial element, as the docstring of
    ``jax_sparse_mla/emulation/mla_decode.py`` states it for MI355 tests: the full bound (all
    keys) for every element and the LSE bound (``bounds.mla_decode_partials_bound``), and
    ``2^-7 |o_emu| + 2^-16 max|V|`` (V = code * v_scale of the split's visible keys) for 99% of
    the elements.

    Returns (full, tight, lse_tol, has_keys) over [B * qlen, S, H(, 512)].
    """
    ks, vs = float(np.float32(case.k_scale)), float(np.float32(case.v_scale))
    full, lse_tol = B.mla_decode_partials_bound(
        case.q,
        case.kv_codes,
        case.kv_indices,
        case.kv_indptr,
        qlen=case.qlen,
        k_scale=ks,
        v_scale=vs,
        sm_scale=DE._sm(case),
        o_e=o_e,
        lse_e=lse_e,
    )
    tight, has = 2.0**-7 * np.abs(f64(o_e)), np.zeros(lse_tol.shape, bool)
    for row, s, codes, _ in DE.split_keys(case, num_splits):
        if len(codes):
            tight[row, s] += 2.0**-16 * vs * np.abs(codes[:, :512]).max()
            has[row, s] = True
    return full, tight, lse_tol, has


def check_partials_vs_emulation(case, num_splits, o_k, lse_k, o_e, lse_e, what):
    full, tight, lse_tol, has = partials_kernel_bound(case, num_splits, o_e, lse_e)
    o_k, lse_k, o_e, lse_e = f64(o_k), f64(lse_k), f64(o_e), f64(lse_e)
    DE.check(o_k, lse_k, o_e, lse_e, full, lse_tol, f"{what} vs emu")
    err = np.abs(o_k - o_e)[has]
    if err.size:
        frac = float(np.mean(err <= tight[has]))
        assert frac >= 0.99, (
            f"{what} vs emu: only {frac:.4f} of the elements within the tight bound"
        )


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_mla_decode_partials(name):
    case, num_splits = decode_case(name)
    o_k, lse_k = run_partials(case, num_splits, IMPL)
    o_e, lse_e = run_partials(case, num_splits, EMU)
    check_partials_vs_emulation(case, num_splits, o_k, lse_k, o_e, lse_e, name)
    DE.check(f64(o_k), f64(lse_k), *DE.expected_partials(case, num_splits), f"{name} vs oracle")
    if "empty" in name and "all" not in name:  # splits without keys next to ones with
        assert np.any(np.isneginf(lse_k)) and np.any(np.isfinite(lse_k))


@pytest.mark.parametrize("qlen", [2, 4])
def test_mla_decode_causal_hidden_nan_key(qlen):
    """Causal rule (kernels/gfx950/mla_decode.py: the boundary keys' NaN V codes are zeroed in
    LDS before the PV MFMAs): NaN latent codes in the keys hidden from position 0 leave the
    partials of the rows that do not see them within the kernel-vs-emulation bound; the
    partials that see them are NaN (o and lse), exactly where the emulation's are."""
    case, num_splits = DE.causal_nan_case(qlen, slice(3, 9)), 2
    o_k, lse_k = run_partials(case, num_splits, IMPL)
    o_e, lse_e = run_partials(case, num_splits, EMU)
    seen = np.isnan(f64(lse_e))
    assert seen.any() and not seen[0::qlen].any()
    assert np.array_equal(np.isnan(f64(lse_k)), seen), "NaN lse where the emulation has none"
    assert np.all(np.isnan(f64(o_k)[seen])), "a row that sees a NaN key must be NaN"
    full, _, lse_tol, _ = partials_kernel_bound(case, num_splits, o_e, lse_e)
    keep = functools.partial(DE.outside, seen)
    DE.check(
        keep(o_k),
        keep(lse_k),
        keep(o_e),
        keep(lse_e),
        keep(full, 1.0),
        keep(lse_tol, 1.0),
        f"q{qlen} hidden NaN vs emu",
    )


@pytest.mark.parametrize("n, s, h", [(7, 6, 3), (5, 16, 128)])
def test_merge_attn_states(n, s, h):
    """Random bf16 partials with -inf ones (their o holds NaN / inf garbage), an all -inf row,
    a row with one finite partial, lse over a wide range (test_merge_random_partials' data)."""
    r = C.rng(9 + s)
    o = np.asarray(O.round_bf16(r.standard_normal((n, s, h, 512)) * 3), np.float32)
    lse = (r.standard_normal((n, s, h)) * 20).astype(np.float32)
    empty = r.random((n, s, h)) < 0.3
    empty[0] = True
    empty[1, 1:] = True
    empty[1, 0] = False
    lse[empty] = -np.inf
    o_bad = np.where(empty[..., None], np.nan, o)
    o_bad[..., 0] = np.where(empty, np.inf, o_bad[..., 0])
    out_k, lse_k = run_merge(o_bad, lse, IMPL)
    out_e, lse_e = run_merge(o_bad, lse, EMU)
    DE.check(
        f64(out_k),
        f64(lse_k),
        f64(out_e),
        f64(lse_e),
        *B.merge_bound(o_bad, lse, out_e, lse_e),
        "merge vs emu",
    )
    o_clean = f64(np.where(empty[..., None], 0.0, o))
    ref, ref_lse = O.merge_attn_states(o_clean, lse)
    DE.check(
        f64(out_k),
        f64(lse_k),
        ref,
        ref_lse,
        *DE.merge_bound(o_clean, f64(lse), ref, ref_lse),
        "merge vs oracle",
    )
    assert np.all(f64(out_k)[0] == 0) and np.all(np.isneginf(f64(lse_k)[0]))
    np.testing.assert_array_equal(f64(out_k)[1], f64(o)[1, 0])  # one finite partial: unchanged
    np.testing.assert_array_equal(f64(lse_k)[1], lse[1, 0])


def decode_vs_emulation_bound(case, num_splits, p_k, p_e):
    """|comb_e(P_k) - comb_e(P_e)|, the emulated combine of the kernel's partials against the
    emulated decode: each within ``DE.merge_bound`` of the exact merge of its partials, and the
    exact merges apart by at most the partials' kernel bound (``w_s`` the exact weights of the
    emulated partials; their lse apart by ``<= D``, so the weights by a factor ``e^(+-2D)``):
    ``sum_s w_s ((1 + g) tol_s + 2 g |o_s|)``, ``g = expm1(2 D)``; lse within ``D`` more."""
    (o_k, lse_k), (o_e, lse_e) = [(f64(o), f64(lse)) for o, lse in (p_k, p_e)]
    full, _, lse_tol, _ = partials_kernel_bound(case, num_splits, o_e, lse_e)
    y_k, yl_k = O.merge_attn_states(o_k, lse_k)
    y_e, yl_e = O.merge_attn_states(o_e, lse_e)
    tol_k, ltol_k = DE.merge_bound(o_k, lse_k, y_k, yl_k)
    tol_e, ltol_e = DE.merge_bound(o_e, lse_e, y_e, yl_e)
    fin = np.isfinite(lse_e)
    total = np.where(np.isfinite(yl_e), yl_e, 0.0)[:, None]
    w = np.where(fin, np.exp(np.where(fin, lse_e, 0.0) - total), 0.0)
    d = np.where(fin, lse_tol, 0.0).max(axis=1)  # [n, H]
    g = np.expm1(2 * d)[..., None]
    sens = (1 + g) * np.sum(w[..., None] * full, 1) + 2 * g * np.sum(w[..., None] * np.abs(o_e), 1)
    return tol_k + tol_e + sens, ltol_k + ltol_e + d


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_mla_decode(name):
    """mla_decode is its partials kernel then its combine kernel (bit for bit); against the
    oracle and against the emulated decode (through the emulated combine of the kernel's
    partials: combine bound, then the partials' bounds)."""
    case, num_splits = decode_case(name)
    out, lse = run_decode(case, num_splits, IMPL)
    p_k = run_partials(case, num_splits, IMPL)
    m_out, m_lse = run_merge(*p_k, IMPL)
    assert_same(out, m_out, "mla_decode = merge(partials)")
    assert_same(lse, m_lse, "mla_decode lse = merge(partials) lse")
    out, lse = f64(out), f64(lse)
    DE.check(out, lse, *DE.merged_bound(case, num_splits, *map(f64, p_k)), f"{name} vs oracle")
    x_out, x_lse = run_merge(*p_k, EMU)
    DE.check(
        out,
        lse,
        f64(x_out),
        f64(x_lse),
        *B.merge_bound(*p_k, x_out, x_lse),
        f"{name}: combine vs emulated combine",
    )
    p_e = run_partials(case, num_splits, EMU)
    dec_e, dec_lse_e = run_decode(case, num_splits, EMU)
    DE.check(
        f64(x_out),
        f64(x_lse),
        f64(dec_e),
        f64(dec_lse_e),
        *decode_vs_emulation_bound(case, num_splits, p_k, p_e),
        f"{name}: emulated combine of the kernel's partials vs emulated decode",
    )


# =============================================================================================
# ultraquant_decode
# =============================================================================================

UQ_EXTRA = {
    # name: (uq_case kwargs, num_partitions); G = 12 runs as the compiled G = 16, zero-padded
    "g12_bs64_p4_masked": (
        dict(seed=6, seq_lens=(1, 64, 65, 500), hk=2, g=12, bs=64, p_bad_block=0.1),
        4,
    ),
}
UQ_NAMES = list(UE.CASES) + list(UQ_EXTRA)  # G 8 / 6 / 16 / 3 / 8 / 12, bs 16 .. 256, P 1 .. 8


@functools.cache
def uq_case(name):
    """(case, num_partitions): test_emulation_ultraquant's CASES, or UQ_EXTRA."""
    if name in UE.CASES:
        return UE.make_case(name)
    kw, num_partitions = UQ_EXTRA[name]
    kw = dict(kw)
    return C.uq_case(kw.pop("seed"), **kw), num_partitions


def run_uq(case, num_partitions, impl, cache=None, block_tables=None):
    fn = jitted(
        jsm.ultraquant_decode, sm_scale=UE.SM, num_partitions=num_partitions, implementation=impl
    )
    out = fn(
        case.q,
        jnp.asarray(case.cache if cache is None else cache),
        jnp.asarray(case.block_tables if block_tables is None else block_tables),
        jnp.asarray(case.seq_lens),
    )
    assert out.dtype == jnp.bfloat16 and out.shape == case.q.shape
    return out


def check_uq(case, num_partitions, out, what):
    """flydsl's output against the emulation (the kernel bound of the emulation module's
    docstring, ``bounds.ultraquant_bound``) and the oracle (test_emulation_ultraquant's
    bound, ``UE.check``)."""
    ref = UE.oracle_on(case)
    out_e = run_uq(case, num_partitions, EMU)
    a_e = run_uq(case, num_partitions, EMU, cache=B.abs_v_cache(case.cache))
    tol = B.ultraquant_bound(
        case.q,
        case.cache,
        case.block_tables,
        case.seq_lens,
        sm_scale=UE.SM,
        num_partitions=num_partitions,
        out_e=out_e,
        a_e=a_e,
    )
    O.assert_within(out, f64(out_e), tol, f"{what} vs emu")
    assert np.all(f64(out)[ref.empty] == 0), f"{what}: rows without keys must be 0"
    UE.check(out, ref, num_partitions, what=f"{what} vs oracle")
    return ref


@pytest.mark.parametrize("name", UQ_NAMES)
def test_ultraquant_decode(name):
    case, num_partitions = uq_case(name)
    out = run_uq(case, num_partitions, IMPL)
    check_uq(case, num_partitions, out, name)


# =============================================================================================
# Garbage that no valid index reaches changes nothing (bit for bit)
# =============================================================================================


def sparse_reached(case) -> np.ndarray:
    recs = len(np.asarray(case.kv).reshape(-1, RECORD_BYTES))
    idx = np.asarray(case.idx, np.int64)
    pos = [O.csr_row_positions(case.indptr, r, len(idx)) for r in range(case.q.shape[0])]
    ent = idx[np.concatenate(pos)]
    return np.unique(ent[(ent >= 0) & (ent < recs)])


def decode_reached(case) -> np.ndarray:
    idx, ptr = np.asarray(case.kv_indices, np.int64), np.asarray(case.kv_indptr, np.int64)
    pos = [O.csr_row_positions(ptr, r, len(idx)) for r in range(len(ptr) - 1)]
    ent = idx[np.concatenate(pos)] if pos else np.zeros(0, np.int64)
    return np.unique(ent[(ent >= 0) & (ent < len(case.kv_codes))])


def uq_reached(case) -> np.ndarray:
    """[nb, bs] bool: the slots a valid token reads."""
    nb, bs = case.cache.shape[:2]
    bt = np.asarray(case.block_tables, np.int64)
    seq = np.clip(np.asarray(case.seq_lens, np.int64), 0, bt.shape[1] * bs)
    reached = np.zeros((nb, bs), bool)
    for b in range(bt.shape[0]):
        j = np.arange(seq[b])
        blk = bt[b, j // bs]
        ok = (blk >= 0) & (blk < nb)
        reached[blk[ok], j[ok] % bs] = True
    return reached


@pytest.mark.parametrize("op", ["sparse_mla", "mla_decode", "ultraquant_decode"])
def test_unreached_garbage_is_never_read(op):
    """Replacing every record / token / slot that no valid index reaches (NaN garbage in the
    cases) with random bytes or zeros leaves the output bit-identical."""
    r = C.rng(77)
    if op == "sparse_mla":
        case = SPARSE_CASES["masking_h20"]()
        kv = np.asarray(case.kv, np.uint8)
        keep = sparse_reached(case)
        run = lambda kv: run_sparse(case, IMPL, kv=kv)  # noqa: E731
    elif op == "mla_decode":
        case, num_splits = decode_case("q4_h16_s5_short")
        kv = np.asarray(case.kv_codes, np.uint8)
        keep = decode_reached(case)

        def run(kv):
            c = dataclasses.replace(case, kv=jnp.asarray(kv), kv_codes=kv)
            return run_decode(c, num_splits, IMPL)
    else:
        case, num_partitions = uq_case("g8_bs16_p1_masked_clamped_empty")
        kv = np.asarray(case.cache, np.uint8)
        keep = uq_reached(case)
        run = lambda kv: (run_uq(case, num_partitions, IMPL, cache=kv),)  # noqa: E731
    base = run(kv)
    for other in (r.integers(0, 256, kv.shape, dtype=np.uint8), np.zeros_like(kv)):
        other[keep] = kv[keep]
        for a, b in zip(base, run(other), strict=True):
            assert_same(a, b, f"{op}: garbage in unreached data changed the output")


# =============================================================================================
# Caches over 4 GiB
# =============================================================================================


def _spread(r, n, total, first_past):
    """n distinct indices in [0, total): 1/4 below first_past, the rest at or past it."""
    low = min(n // 4, first_past)
    below = r.choice(first_past, low, replace=False)
    above = first_past + r.choice(total - first_past, n - low, replace=False)
    return r.permutation(np.concatenate([below, above]))


def _remap(entries, where, n_small, n_big):
    """Entries into a small array -> the same entries into the big one: valid ones through
    ``where``, out-of-range ones stay out of range (negative ones unchanged)."""
    e = np.asarray(entries, np.int64)
    big = np.where((e >= 0) & (e < n_small), where[np.clip(e, 0, n_small - 1)], e)
    big = np.where(e >= n_small, np.minimum(e - n_small + n_big, 2**31 - 1), big)
    return big.astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _scatter_into_zeros(shape, at, rows):
    """A zero uint8 array of ``shape`` with ``rows`` at ``at``, built on the device."""
    return jnp.zeros(shape, jnp.uint8).at[at].set(rows)


def test_sparse_mla_cache_over_4gib():
    """6.6M records (4.33 GB); 3/4 of the referenced records start past the 4 GiB byte offset.
    The kernel on the big cache equals the kernel on the compact case bit for bit, is within the
    oracle bound, and within the sum of its and "xla"'s oracle bounds of "xla" on the same big
    inputs (test_emulation_sparse_mla.check_case's comparison)."""
    case = C.sparse_case(41, n_q=6, h=16, n_rec=400, max_len=60, long_rows={1: 4500})
    kv = np.asarray(case.kv, np.uint8).reshape(-1, RECORD_BYTES)
    n_big = SPARSE_BIG_RECORDS
    first_past = -(-FOUR_GIB // RECORD_BYTES)
    where = _spread(C.rng(42), len(kv), n_big, first_past)
    big_idx = _remap(case.idx, where, len(kv), n_big)
    big = _scatter_into_zeros((n_big, RECORD_BYTES), jnp.asarray(where), jnp.asarray(kv))
    assert big.size > FOUR_GIB
    assert np.sum(where[sparse_reached(case)] >= first_past) > 100

    out, lse = run_sparse(case, IMPL, kv=big, idx=big_idx)
    small_out, small_lse = run_sparse(case, IMPL)
    assert_same(out, small_out, "big vs compact cache")
    assert_same(lse, small_lse, "big vs compact cache (lse)")
    ref, ref_lse, tol, lse_tol = SE.expected(case)
    SE.check(out, lse, ref, ref_lse, tol, lse_tol, "big vs oracle")
    xo, xl = run_sparse(case, "xla", kv=big, idx=big_idx)
    _, _, st = O.sparse_mla(case.q, case.kv, case.idx, case.indptr, case.sm_scale, True)
    n_keys, vmax, sabs = O.stats_atol(st, ref.shape[:2])
    xtol = 2.0**-8 * np.abs(ref) + O.attn_atol(n_keys, vmax, sabs)[..., None]
    xltol = O.lse_atol(n_keys, sabs, np.where(np.isfinite(ref_lse), ref_lse, 0))
    SE.check(out, lse, xo, xl, tol + xtol, lse_tol + xltol, "big vs xla")


def test_ultraquant_cache_over_4gib():
    """131072 blocks of 64 tokens x 2 KV heads x 272 B (4.56 GB); 3/4 of the used blocks start
    past 4 GiB. The kernel on the big cache equals the kernel on the compact case bit for bit,
    is within the oracle bound, and within the sum of bounds of "xla" on the same big inputs:
    its oracle bound and "xla"'s (``oracle.check_attention``'s; both round q to e4m3)."""
    case = C.uq_case(51, seq_lens=(300, 1000, 77, 0), hk=2, g=8, bs=64, p_bad_block=0.1)
    num_partitions = 4
    nb, bs, hk, slot = case.cache.shape
    first_past = -(-FOUR_GIB // (bs * hk * slot))
    where = _spread(C.rng(52), nb, UQ_BIG_BLOCKS, first_past)
    big_bt = _remap(case.block_tables, where, nb, UQ_BIG_BLOCKS)
    big = _scatter_into_zeros(
        (UQ_BIG_BLOCKS, bs, hk, slot), jnp.asarray(where), jnp.asarray(case.cache)
    )
    assert big.size > FOUR_GIB
    assert np.sum(where[uq_reached(case).any(axis=1)] >= first_past) > 5

    out = run_uq(case, num_partitions, IMPL, cache=big, block_tables=big_bt)
    assert_same(out, run_uq(case, num_partitions, IMPL), "big vs compact cache")
    r = UE.oracle_on(case)
    UE.check(out, r, num_partitions, what="big vs oracle")
    xo = run_uq(case, num_partitions, "xla", cache=big, block_tables=big_bt)
    args = (case.cache, case.block_tables, case.seq_lens, UE.SM)
    _, _, st = O.ultraquant_decode(case.q, *args, stats=True)
    n_keys, vmax, sabs = O.stats_atol(st, r.out.shape[:2], heads_per_entry=8)
    xtol = 2.0**-8 * np.abs(r.out) + O.attn_atol(n_keys, vmax, sabs)[..., None]
    tol = UE.bound(r.out, r.a, r.atol, num_partitions) + xtol
    O.assert_within(out, f64(xo), tol, "big vs xla")


# =============================================================================================
# jit / vmap
# =============================================================================================


def op_call(op, impl):
    """(fn, array arguments) of a small call of ``op`` with ``implementation=impl``."""
    if op == "sparse_mla":
        case = C.sparse_case(31, n_q=4, h=20, n_rec=300, max_len=300)
        args = case.args()

        def fn(q, kv, idx, indptr):
            return jsm.sparse_mla(q, kv, idx, indptr, return_lse=True, implementation=impl)

    elif op == "mla_decode":
        case = C.decode_case(32, seq_lens=(0, 37, 300), qlen=2, h=16, as_uint8=True)
        args, _ = _decode_args(case)

        def fn(q, kv, kv_indices, kv_indptr):
            return jsm.mla_decode(
                q,
                kv,
                kv_indices,
                kv_indptr,
                qlen=2,
                k_scale=case.k_scale,
                v_scale=case.v_scale,
                num_splits=3,
                return_lse=True,
                implementation=impl,
            )

    else:
        case, num_partitions = uq_case("g6_bs32_p3_idle_partitions")
        args = case.args()

        def fn(q, cache, block_tables, seq_lens):
            return jsm.ultraquant_decode(
                q,
                cache,
                block_tables,
                seq_lens,
                num_partitions=num_partitions,
                implementation=impl,
            )

    return fn, args


OPS = ["sparse_mla", "mla_decode", "ultraquant_decode"]


def _leaves(x):
    return jax.tree_util.tree_leaves(x)


@pytest.mark.parametrize("op", OPS)
def test_jit_equals_eager(op):
    fn, args = op_call(op, IMPL)
    for a, b in zip(_leaves(fn(*args)), _leaves(jax.jit(fn)(*args)), strict=True):
        assert_same(a, b, f"{op}: jit vs eager")


@pytest.mark.parametrize("op", OPS)
def test_vmap_over_q_equals_loop(op):
    """jax.vmap over a leading batch of q (the cache, indices and the rest shared) equals a
    Python loop of the unbatched calls, jitted and not."""
    fn, (q, *shared) = op_call(op, IMPL)
    qs = jnp.stack([q, -q, q * 2])
    batched = jax.vmap(fn, in_axes=(0, *[None] * len(shared)))
    for result in (batched(qs, *shared), jax.jit(batched)(qs, *shared)):
        for b in range(len(qs)):
            one = fn(qs[b], *shared)
            for x, y in zip(_leaves(result), _leaves(one), strict=True):
                assert_same(x[b], y, f"{op}: vmap element {b} vs loop")


# =============================================================================================
# implementation=None on the MI355
# =============================================================================================

TARGETS = {
    "sparse_mla": ["jsm_sparse_mla"],
    "mla_decode": ["jsm_mla_decode_partials", "jsm_mla_decode_combine"],
    "ultraquant_decode": ["jsm_ultraquant_partials", "jsm_ultraquant_reduce"],
}


def lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("op", OPS)
def test_default_implementation_lowers_to_flydsl(op):
    fn, args = op_call(op, None)
    text = lowered_text(fn, *args)
    for target in TARGETS[op]:
        assert f"stablehlo.custom_call @{target}(" in text, f"{op}: no custom call @{target}"


@pytest.mark.parametrize("op", OPS)
def test_default_implementation_runs_flydsl(op):
    """implementation=None gives the kernels' results bit for bit, and so do the default
    num_splits / num_partitions of "flydsl" (None) and their explicit values."""
    fn, args = op_call(op, None)
    kernel, _ = op_call(op, IMPL)
    for a, b in zip(_leaves(fn(*args)), _leaves(kernel(*args)), strict=True):
        assert_same(a, b, f"{op}: implementation=None vs flydsl")
    if op == "mla_decode":
        case, _ = decode_case("q2_h20_s16_long")
        splits = default_num_splits(case.q, case.kv_indices, case.kv_indptr, case.qlen)
        for a, b in zip(run_decode(case, None, IMPL), run_decode(case, splits, IMPL), strict=True):
            assert_same(a, b, f"num_splits=None vs {splits}")
    if op == "ultraquant_decode":
        case, _ = uq_case("g8_bs256_p5_masked_empty_idle")
        batch, hk = case.q.shape[0], case.cache.shape[2]
        parts = default_num_partitions(batch, hk, case.block_tables.shape[1] * case.cache.shape[1])
        assert_same(run_uq(case, None, IMPL), run_uq(case, parts, IMPL), f"P=None vs {parts}")


def test_selfcheck_passes_every_configuration(tmp_path, monkeypatch):
    """Every kernel configuration's self-check cases, in child processes, on this MI355."""
    monkeypatch.setenv("JAX_SPARSE_MLA_SELFCHECK_CACHE", str(tmp_path))
    verdicts = jsm.selfcheck()
    assert len(verdicts) == len(configs.user_symbols()) == 53
    failed = {s: v for s, v in verdicts.items() if v.status != "pass"}
    assert failed == {}
