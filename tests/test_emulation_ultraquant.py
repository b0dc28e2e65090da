"""The gfx950 ultraquant_decode emulation (partials + reduce) against the float64 oracle and "xla".

The op's query is ``q8 = e4m3(clamp(H q / 16, +-448))`` in the natural rotated order K is
stored in (``oracle.uq_query``: the definition, as UltraQuant's own implementations compute
it); the kernel computes it with float32 butterflies, which the tests check gives exactly the
oracle's ``q8`` on their inputs (the oracle rotates exactly; a float32 rotation could only
differ where it crosses an e4m3 rounding boundary). What is left between the emulation and the
float64 oracle is the kernel's arithmetic. Per output element (request, head, dim d), with the
oracle's weights ``w_k`` over the n valid keys, ``A_d = sum_k w_k |V_kd|``, ``M = max |V|``
and ``S = sm_scale max_k sum_i |q8_i k_i|`` (rotated dims):

* P in bf16 (the dominant term): ``bf16(p) = p (1 + e)``, ``|e| <= 2^-8`` (nearest of 8
  significant bits), and ``L`` sums the unrounded p, so O moves by ``<= 2^-8 A_d``.
* With P > 1 partitions each partial o is rounded to bf16 before the reduce:
  ``2^-8 sum_p W_p |o_p| / W <= 2^-8 A_d`` (``|o_p| <= A_p``). With P = 1 the reduce gives back
  the same bf16 value (``w o / w`` moves it by f32 ulps, far less than half a bf16 ulp).
* The final bf16 rounding: ``2^-8 |out|``, i.e. ``2^-8 |ref|`` and ``2^-8`` of the other terms.
* f32 arithmetic: ``2 oracle.attn_atol(n, M, S)``. The products ``q8_i k_i`` are exact in f32
  (4 and 3 significant bits); ``attn_atol`` budgets the score sum's ``4 2^-24 S`` and the f32
  softmax sums; doubling it covers the exp2 argument ``(s - M') c`` (the unscaled difference
  and its product with ``c = |sm_scale| log2e``, each rounded, and ``c``'s own rounding: three
  roundings of a value ``<= 2 S`` in nats, ``~2^-21 S``), the emulated exp2 (exact integer
  part, ``<= 2`` ulp fraction), one alpha rescale per 16-token tile and the reduce's weights.

So ``|emu - ref| <= 2^-8 |ref| + (1 + 2^-8) ((1 + [P > 1]) 2^-8 A_d + 2 attn_atol)``. The test
against the exact reference compares per-partition partials the same way (``A`` of the
partition; the lse within ``2 oracle.lse_atol``). The meta-tests check that the bound fails a
query paired with K through a column permutation (the removed layout) and one without the
e4m3 rounding. The last sections model the kernel's lane layouts and one scaled MFMA per
operand bit width, writer to scores. ``report`` prints the measured distances (``pytest -s``).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.emulation import bounds as B
from jax_sparse_mla.emulation import ultraquant as E
from jax_sparse_mla.formats import ultraquant_rotate
from jax_sparse_mla.reference.ultraquant import ultraquant_decode_partials_f32
from tests import cases as C
from tests import oracle as O

SM = 1.0 / 16.0
BF16_HALF_ULP = 2.0**-8


# ---------------------------------------------------------------------------------------------
# float64 side: the kernel's query, the oracle on it, the bound
# ---------------------------------------------------------------------------------------------


class Reference(NamedTuple):
    """The float64 oracle and the terms of the bound."""

    out: np.ndarray  # [B, Hq, 256]
    a: np.ndarray  # [B, Hq, 256]: sum_k w_k |V_kd|
    atol: np.ndarray  # [B, Hq, 1]: the f32 budget
    empty: np.ndarray  # [B, Hq]: no valid key
    n_keys: np.ndarray  # [B, Hq]
    score_abs: np.ndarray  # [B, Hq]: S (rotated dims)


def oracle_on(case, sm_scale=SM, q=None) -> Reference:
    """The float64 oracle (the op's e4m3 query) for ``case`` (its q, or ``q``) and the bound's
    terms."""
    q = case.q if q is None else q
    args = (case.block_tables, case.seq_lens, sm_scale)
    ref, lse, st = O.ultraquant_decode(q, case.cache, *args, stats=True)
    a, _ = O.ultraquant_decode(q, B.abs_v_cache(case.cache), *args)
    g = q.shape[1] // case.cache.shape[2]
    n, vmax, score_abs = O.stats_atol(st, ref.shape[:2], heads_per_entry=g)
    atol = 2 * O.attn_atol(n, vmax, score_abs)
    return Reference(ref, a, atol[..., None], np.isneginf(lse), n, score_abs)


def bound(ref, a, atol, num_partitions) -> np.ndarray:
    """``2^-8 |ref| + (1 + 2^-8) ((1 + [P > 1]) 2^-8 A + atol)`` (module docstring)."""
    p_terms = (2 if num_partitions > 1 else 1) * BF16_HALF_ULP * a
    return BF16_HALF_ULP * np.abs(ref) + (1 + BF16_HALF_ULP) * (p_terms + atol)


def check(out, r: Reference, num_partitions, what="") -> float:
    """Asserts the bound; rows without keys must be exactly 0. Returns the worst err / tol."""
    out = O.to_f64(out)
    assert np.all(np.isfinite(r.out)), f"{what}: broken case (a valid key reaches garbage)"
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    tol = bound(r.out, r.a, r.atol, num_partitions)
    err = np.abs(out - r.out)
    bad = np.argwhere(err > tol)
    ratio = float(np.max(err / np.maximum(tol, 1e-300)))
    assert bad.size == 0, (
        f"{what}: {len(bad)} elements out of bound, worst ratio {ratio:.3g}, first "
        + str([(tuple(i), out[tuple(i)], r.out[tuple(i)], tol[tuple(i)]) for i in bad[:3]])
    )
    assert np.all(out[r.empty] == 0), f"{what}: rows without keys must be 0"
    return ratio


def report(what, out, r: Reference, exact, ratio) -> None:
    """Measured distances (printed with pytest -s), relative to max|ref|; ``exact``: the
    oracle's exact-q attention."""
    out = O.to_f64(out)
    scale = np.maximum(np.max(np.abs(r.out)), 1e-30)
    print(
        f"\n{what}: worst err/bound {ratio:.2f}; relative to max|ref|: "
        f"max|emu - oracle| {np.max(np.abs(out - r.out)) / scale:.2e}, "
        f"max|emu - oracle(exact q)| {np.max(np.abs(out - exact)) / scale:.2e}, "
        f"max 2^-8 A {BF16_HALF_ULP * np.max(r.a) / scale:.2e}"
    )


# ---------------------------------------------------------------------------------------------
# the emulation
# ---------------------------------------------------------------------------------------------


@functools.cache
def _partials(num_partitions):
    return jax.jit(
        functools.partial(
            E.ultraquant_decode_gfx950_partials_emulation, num_partitions=num_partitions
        )
    )


_reduce = jax.jit(E.ultraquant_reduce_gfx950_emulation)
_rotate_query = jax.jit(E.rotate_query)


def run_partials(case, num_partitions):
    """The emulated partials (o, max_logit, exp_sum) as float64 arrays."""
    parts = _partials(num_partitions)(
        case.q,
        jnp.asarray(case.cache),
        jnp.asarray(case.block_tables),
        jnp.asarray(case.seq_lens),
        sm_scale=np.float32(SM),
    )
    return parts


def run(case, num_partitions, fresh=False):
    """The emulated output; ``fresh``: a new trace of the whole op (after a monkeypatch)."""
    if fresh:
        f = jax.jit(
            functools.partial(E.ultraquant_decode_gfx950_emulation, num_partitions=num_partitions)
        )
        out = f(
            case.q,
            jnp.asarray(case.cache),
            jnp.asarray(case.block_tables),
            jnp.asarray(case.seq_lens),
            sm_scale=np.float32(SM),
        )
    else:
        out = _reduce(*run_partials(case, num_partitions))
    assert out.dtype == jnp.bfloat16 and out.shape == case.q.shape
    return out


CASES = {
    # name: (uq_case arguments, num_partitions, seq_lens put in after writing the cache)
    "g8_bs16_p1_masked_clamped_empty": (
        dict(seed=1, seq_lens=(0, 1, 40, 48), hk=2, g=8, bs=16, p_bad_block=0.2, max_blocks=3),
        1,
        (-(2**31), 1, 40, 2**31 - 1),  # clamped to [0, 3 * 16]: every table entry is written
    ),
    "g6_bs32_p3_idle_partitions": (
        dict(seed=2, seq_lens=(5, 130, 257, 600), hk=1, g=6, bs=32),
        3,
        None,
    ),
    "g16_bs64_p8_idle_partitions": (
        dict(seed=3, seq_lens=(200, 1000), hk=1, g=16, bs=64),
        8,
        None,
    ),
    "g3_bs128_p2_masked": (
        dict(seed=4, seq_lens=(129, 300, 70), hk=2, g=3, bs=128, p_bad_block=0.3),
        2,
        None,
    ),
    "g8_bs256_p5_masked_empty_idle": (
        dict(seed=5, seq_lens=(0, 255, 256, 257, 700), hk=1, g=8, bs=256, p_bad_block=0.25),
        5,
        None,
    ),
}


@functools.cache
def make_case(name):
    """(case, num_partitions) of CASES[name], built once per session."""
    kw, num_partitions, seq_lens = CASES[name]
    kw = dict(kw)
    case = C.uq_case(kw.pop("seed"), **kw)
    if seq_lens is not None:
        case.seq_lens = np.int32(seq_lens)
    return case, num_partitions


@pytest.mark.parametrize("name", list(CASES))
def test_emulation_vs_oracle(name):
    case, num_partitions = make_case(name)
    np.testing.assert_array_equal(np.asarray(_rotate_query(case.q), np.float64), O.uq_query(case.q))
    out = run(case, num_partitions)
    r = oracle_on(case)
    ratio = check(out, r, num_partitions, what=name)
    args = (case.block_tables, case.seq_lens, SM)
    exact, _ = O.ultraquant_decode(case.q, case.cache, *args, exact_q=True)
    report(name, out, r, exact, ratio)


def test_rotate_query_saturates_and_rounds_to_even():
    r = C.rng(7)
    q = C.bf16_normal(r, (3, 5, 256), 4.0)
    q = q.at[0, 0].set(jnp.bfloat16(30000.0))  # rotated / 16 far above 448 in some dims
    q8 = np.asarray(_rotate_query(q), np.float64)
    np.testing.assert_array_equal(q8, O.uq_query(q))
    assert np.max(np.abs(q8)) == 448.0 and np.all(np.isfinite(q8))


# ---------------------------------------------------------------------------------------------
# partials against the exact reference (same partition mapping)
# ---------------------------------------------------------------------------------------------


def test_partials_vs_reference():
    """Per-partition partials against the exact reference's (same partition mapping); idle
    partitions (no tile) and empty requests included."""
    case, num_partitions = make_case("g8_bs256_p5_masked_empty_idle")
    reference = jax.jit(
        functools.partial(ultraquant_decode_partials_f32, num_partitions=num_partitions)
    )

    def reference_on(cache):
        o, lse = reference(
            case.q,
            jnp.asarray(cache),
            jnp.asarray(case.block_tables),
            jnp.asarray(case.seq_lens),
            sm_scale=jnp.float32(SM),
        )
        return O.to_f64(o), O.to_f64(lse)

    o_ref, lse_ref = reference_on(case.cache)
    a_ref, _ = reference_on(B.abs_v_cache(case.cache))
    o, m, exp_sum = (O.to_f64(x) for x in run_partials(case, num_partitions))
    r = oracle_on(case)  # budgets per (request, head): every partition sees fewer keys
    empty = np.isneginf(lse_ref)
    assert empty.any() and not empty.all()
    assert np.array_equal(np.isneginf(m), empty) and np.all(exp_sum[empty] == 0)
    assert np.all(o[empty] == 0)
    tol = bound(o_ref, a_ref, r.atol[:, None], 1)
    assert np.all(np.abs(o - o_ref) <= tol), np.max(np.abs(o - o_ref) / tol)
    lse = np.where(empty, 0.0, m + np.log(np.where(empty, 1.0, exp_sum)))
    ltol = 2 * O.lse_atol(r.n_keys[:, None], r.score_abs[:, None], lse_ref)
    assert np.all(np.abs(np.where(empty, 0.0, lse - lse_ref)) <= ltol)


def test_reduce_matches_merge():
    """The reduce against the float64 merge of the same partials (-inf partials, all -inf)."""
    r = C.rng(8)
    b, p, h = 3, 4, 5
    o = C.bf16_normal(r, (b, p, h, 256))
    ml = (r.standard_normal((b, p, h)) * 4).astype(np.float32)
    es = r.uniform(1.0, 50.0, (b, p, h)).astype(np.float32)
    ml[0, 1:] = -np.inf
    ml[1] = -np.inf
    es[np.isneginf(ml)] = 0.0
    out = jax.jit(E.ultraquant_reduce_gfx950_emulation)(o, jnp.asarray(ml), jnp.asarray(es))
    lse = np.where(np.isneginf(ml), -np.inf, ml.astype(np.float64) + np.log(np.maximum(es, 1)))
    ref, _ = O.merge_attn_states(o, lse)
    err = np.abs(O.to_f64(out) - ref)
    # f32 weights (exp2 argument <= |lse| + 8, ~2^-22 relative) and sums over 4 partials
    tol = BF16_HALF_ULP * np.abs(ref) + 2.0**-18 * np.max(np.abs(O.to_f64(o)))
    assert np.all(err <= tol) and np.all(O.to_f64(out)[1] == 0)
    np.testing.assert_array_equal(O.to_f64(out)[0], O.to_f64(o)[0, 0])


def test_reduce_keeps_partials_whose_max_logit_overflowed():
    """Partitions whose max logit |sm_scale M| overflowed float32 (+inf) weigh by their sums
    alone and the others 0 (a finite output, where max_logit - M would be NaN); a partition
    with keys whose max logit overflowed to -inf beside empty ones keeps its o."""
    r = C.rng(9)
    o = C.bf16_normal(r, (2, 3, 1, 256))
    ml = np.float32([[np.inf, 5.0, np.inf], [-np.inf, -np.inf, -np.inf]])[..., None]
    es = np.float32([[2.0, 3.0, 6.0], [0.0, 4.0, 0.0]])[..., None]
    out = O.to_f64(_reduce(o, jnp.asarray(ml), jnp.asarray(es)))
    o64 = O.to_f64(o)
    want = np.stack([(2 * o64[0, 0] + 6 * o64[0, 2]) / 8, o64[1, 1]])
    assert np.all(np.abs(out - want) <= BF16_HALF_ULP * np.abs(want) + 2.0**-20)


def test_jit_vmap():
    """vmap over a batch of query sets (the cache shared): each result within the bound."""
    case, num_partitions = make_case("g8_bs16_p1_masked_clamped_empty")
    q2 = jnp.stack([case.q, case.q[::-1]])
    f = functools.partial(
        E.ultraquant_decode_gfx950_emulation, sm_scale=SM, num_partitions=num_partitions
    )
    args = (jnp.asarray(case.cache), jnp.asarray(case.block_tables), jnp.asarray(case.seq_lens))
    batched = jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))(q2, *args)
    for q, out in zip(q2, batched, strict=True):
        check(out, oracle_on(case, q=q), num_partitions, what="vmap")


# ---------------------------------------------------------------------------------------------
# meta-tests: the bound catches wrong queries
# ---------------------------------------------------------------------------------------------


_ROTATE_QUERY = E.rotate_query
_D = np.arange(256)
# The removed layout: rotated dim d of K stored at this column (the kernel's q byte permutation,
# applied to K as well, so that q and K met through it twice).
REMOVED_K_COLUMN = (_D & 0x8F) | ((_D >> 2) & 0x10) | ((_D << 1) & 0x60)


def _with_removed_k_permutation(q):
    return _ROTATE_QUERY(q)[..., REMOVED_K_COLUMN]


def _without_e4m3(q):
    return ultraquant_rotate(q)  # the float32 rotated q: the exact-q attention


@pytest.mark.parametrize("variant", [_with_removed_k_permutation, _without_e4m3])
def test_bound_catches_wrong_query(variant, monkeypatch):
    case, num_partitions = make_case("g8_bs16_p1_masked_clamped_empty")
    r = oracle_on(case)
    check(run(case, num_partitions), r, num_partitions, what="correct")
    monkeypatch.setattr(E, "rotate_query", variant)
    with pytest.raises(AssertionError, match="out of bound"):
        check(run(case, num_partitions, fresh=True), r, num_partitions)


# ---------------------------------------------------------------------------------------------
# the kernel's own lane layouts: one 16-token tile through its address helpers
# ---------------------------------------------------------------------------------------------

LANES = np.arange(64)


def _d_lanes(d):
    """16x16 MFMA result -> [64 lanes, 4]: lane 16g + j holds rows 4g + [0, 4) of column j."""
    return np.stack([d[4 * (LANES >> 4) + e, LANES & 15] for e in range(4)], axis=1)


def _operand_k_index(bits: int) -> np.ndarray:
    """[4 lane groups, 32 elements]: the K index (of 128) that element e of lane group g holds in
    a v_mfma_scale_f32_16x16x128_f8f6f4 operand, by the operand's own bit width. 4-bit (e2m1):
    32 contiguous K values 32g + e (bytes 0-15, element 2m in byte m's low nibble). 8-bit
    (e4m3): byte e < 16 is K 16g + e, byte 16 + e is K 64 + 16g + e. (AMD's CDNA matrix-core
    blog, FlyDSL's fp8 x fp4 MoE GEMM and AMD's ISA emulator: kernels/gfx950/ultraquant.py.)"""
    g, e = np.arange(4)[:, None], np.arange(32)[None, :]
    if bits == 4:
        return 32 * g + e
    return np.where(e < 16, 16 * g + e, 64 + 16 * g + e - 16)


def _mfma_fp4_fp8(a, b, scale_a, scale_b):
    """v_mfma_scale_f32_16x16x128_f8f6f4 with A e2m1 (cbsz 4) and B e4m3: lane 16g + i holds
    row i of A (16 bytes) and column i of B (32 bytes) at the K indices of
    ``_operand_k_index``; the E8M0 scale of K 32g .. 32g+31 of row / column i is byte 0
    (op_sel 0) of lane 16g + i's scale operand. a [64, 16] and b [64, 32] bytes, scales [64]
    -> [64 lanes, 4] float64."""
    mat_a, mat_b = np.zeros((16, 128)), np.zeros((128, 16))
    sa, sb = np.zeros((16, 128)), np.zeros((128, 16))
    k4, k8 = _operand_k_index(4), _operand_k_index(8)
    for g in range(4):
        lanes = 16 * g + np.arange(16)
        nibbles = np.stack([a[lanes] & 15, a[lanes] >> 4], axis=-1).reshape(16, 32)
        mat_a[:, k4[g]] = O.E2M1_TABLE[nibbles]
        mat_b[k8[g], :] = O.e4m3_decode(b[lanes]).T
        ks = slice(32 * g, 32 * g + 32)
        sa[:, ks] = np.ldexp(1.0, (scale_a[lanes] & 0xFF).astype(np.int64) - 127)[:, None]
        sb[ks, :] = np.ldexp(1.0, (scale_b[lanes] & 0xFF).astype(np.int64) - 127)[None, :]
    return _d_lanes((mat_a * sa) @ (mat_b * sb))


def _mfma_bf16(a, b):
    """v_mfma_f32_16x16x16_bf16: lane 16g + i holds row i of A and column i of B, K 4g + [0, 4);
    a, b [64, 4] values -> [64 lanes, 4]."""
    mat_a, mat_b = np.zeros((16, 16)), np.zeros((16, 16))
    for g in range(4):
        lanes = 16 * g + np.arange(16)
        mat_a[:, 4 * g : 4 * g + 4] = a[lanes]
        mat_b[4 * g : 4 * g + 4, :] = b[lanes].T
    return _d_lanes(mat_a @ mat_b)


def _tr16(lds_b16, addrs):
    """ds_read_b64_tr_b16 (LDS as 2-byte elements): within each 16-lane row, lane t element k =
    element t % 4 of the 4 that lane 4k + t // 4 addresses."""
    addrs = np.asarray(addrs)
    assert np.all(addrs % 8 == 0)
    src = lds_b16[addrs[:, None] // 2 + np.arange(4)]
    t, k = np.arange(16)[:, None], np.arange(4)[None, :]
    return np.concatenate([src[16 * g + 4 * k + (t >> 2), t & 3] for g in range(4)])


def _words(b):
    """[..., 4n] little-endian bytes -> [..., n] uint32 words."""
    return np.ascontiguousarray(b, dtype=np.uint8).view("<u4").astype(np.int64)


@pytest.mark.parametrize("group_size", [8, 6])
@pytest.mark.parametrize("block_size", [16, 256])
def test_kernel_layout(group_size, block_size):
    """One 16-token tile (tokens 272 .. 287 of a request of 283 tokens: block-table column 17 of
    a 16-token-block table, or column 1 at slot 16 of a 256-token-block table; kv head 1 of 2,
    padded slots) through the kernel's lane mappings with the MFMA / tr16 semantics above: QK
    pairs each rotated K dim (natural order) with the same dim of q (stored permuted into LDS,
    read back as the 8-bit operand) under K's UE8M0 group scale and masks by the token of each
    score; V lands row-major in LDS, the tr16 reads give lane
    16g + i dim 16h + i of tokens 4g .. 4g+3, P (QK's result layout) meets V of the same token,
    and each result lands at its row and dims of the partial."""
    pytest.importorskip("flydsl", reason="needs the gfx950-build extra (flydsl)")
    K = pytest.importorskip("jax_sparse_mla.kernels.gfx950.ultraquant")
    r = C.rng(20 + group_size + block_size)
    tile_start, seq_len, hk, kv_head, slot_bytes = 272, 283, 2, 1, 288
    n_valid = seq_len - tile_start
    max_blocks = -(-seq_len // block_size)
    num_blocks = max_blocks + 3
    block_tables = r.permutation(num_blocks)[:max_blocks]
    stride_pos = hk * slot_bytes

    # The cache: garbage everywhere (masked tokens included), the tile's valid tokens written
    # where the reference reads token t: block block_tables[t // bs], slot t % bs.
    cache = r.integers(0, 256, num_blocks * block_size * stride_pos).astype(np.uint8)
    codes = r.integers(0, 256, (n_valid, 2, 128)).astype(np.uint8)  # K (rotated), V codes
    scales = r.integers(110, 145, (n_valid, 2, 8)).astype(np.uint8)
    for i in range(n_valid):
        pos = tile_start + i
        slot_index = block_tables[pos // block_size] * block_size + pos % block_size
        at = (slot_index * hk + kv_head) * slot_bytes
        slot = np.concatenate([codes[i, 0], scales[i, 0], codes[i, 1], scales[i, 1]])
        cache[at : at + O.UQ_SLOT_MIN] = slot
    k_want, v_want = np.zeros((16, 256)), np.zeros((16, 256))  # masked tokens read as 0
    k_want[:n_valid] = O.uq_dequantize(codes[:, 0], scales[:, 0])
    v_want[:n_valid] = O.uq_dequantize(codes[:, 1], scales[:, 1])

    # The tile's buffer: base = its first slot (block from the tile's block-table column),
    # range = its valid tokens (a load past it reads 0).
    block = block_tables[K._tile_block_column(tile_start, block_size)]
    first_slot = block * block_size + K._tile_block_offset(tile_start, block_size)
    base = first_slot * stride_pos + kv_head * slot_bytes

    def load(offset, n):
        at = np.asarray(offset)[:, None] + np.arange(n)
        return np.where(at < n_valid * stride_pos, cache[base + np.minimum(at, cache.size - 1)], 0)

    # q: rotated e4m3 rows 0..G-1 (dims in natural order) stored by the kernel's map (rows
    # G..15 stay zero): lane chunk c writes dims 32c + t, t < 16 at _q_store_offset, t >= 16
    # 32 bytes further.
    q8 = r.integers(0, 256, (group_size, 256)).astype(np.uint8)
    q8[(q8 & 0x7F) == 0x7F] = 0x38  # no NaN
    lds = np.zeros(K.LDS_BYTES, np.uint8)
    t = np.arange(32)
    for row in range(group_size):
        for c in range(8):
            lds[K._q_store_offset(row, c) + np.where(t < 16, t, t + 16)] = q8[row, 32 * c + t]
    q_rot = np.zeros((16, 256))
    q_rot[:group_size] = O.e4m3_decode(q8)

    # QK: two scaled MFMAs; lane l element e = token 4(l >> 4) + e, q row l & 15.
    k_off = K._k_lane_offset(LANES, stride_pos)
    k_scale_words = _words(load(K._k_scale_lane_offset(LANES, stride_pos), 8))
    raw = 0
    for h in range(2):
        a = load(K._k_codes_offset(k_off, h), 16)
        b = lds[K._q_operand_offset(LANES, h)[:, None] + np.arange(32)]
        scale_a = k_scale_words[:, h] >> K._k_scale_shift(K._k_lane_group(LANES))
        raw = raw + _mfma_fp4_fp8(a, b, scale_a, np.full(64, 0x7F))
    want_s = _d_lanes(k_want @ q_rot.T)
    np.testing.assert_allclose(raw, want_s, rtol=1e-12, atol=1e-12 * np.max(np.abs(want_s)))
    token = K._score_first_token(tile_start, K._k_lane_group(LANES))[:, None] + np.arange(4)
    d_token = tile_start + _d_lanes(np.broadcast_to(np.arange(16)[:, None], (16, 16)))
    np.testing.assert_array_equal(token, d_token)  # the kernel masks score e by token < seq_len

    # V: dequantized by lane (token l >> 2, dims 64 (l & 3) ..) into the row-major LDS tile.
    lds_v = np.full(K.LDS_BYTES // 2, np.nan)
    v_off = K._v_lane_offset(LANES, stride_pos)
    v_scale = _words(load(K._v_scale_lane_offset(LANES, stride_pos), 4))[:, 0]
    tok, chunk = K._v_lane_token_chunk(LANES)
    for hf in range(2):
        v_codes = load(K._v_codes_offset(v_off, hf), 16)
        byte = (v_scale >> K._v_scale_shift(chunk, hf)) & 0xFF
        scale = np.where(byte == 0, 0.0, np.ldexp(1.0, byte - 127))
        for w in range(4):
            c = v_codes[:, 4 * w : 4 * w + 4]
            vals = O.E2M1_TABLE[np.stack([c & 15, c >> 4], axis=-1).reshape(64, 8)]
            at = K._v_stage_offset(tok, chunk, hf, w)
            assert np.all(at % 16 == 0) and np.all(at >= K.V_TILE)
            lds_v[at[:, None] // 2 + np.arange(8)] = vals * scale[:, None]
    v_rows = (K.V_TILE + np.arange(16)[:, None] * K.V_ROW_BYTES) // 2 + np.arange(256)
    np.testing.assert_array_equal(lds_v[v_rows], v_want)

    # PV: V^T operand by tr16, P = the QK result layout, results into the partial's rows.
    p = O.round_bf16(r.uniform(0.0, 1.0, (16, 16)))  # [token, q row]
    p_op = _d_lanes(p)
    out = np.full(16 * 256, np.nan)
    for h in range(16):
        v_op = _tr16(lds_v, K._v_read_offset(LANES, h))
        want_op = v_want[4 * (LANES >> 4)[:, None] + np.arange(4), 16 * h + (LANES & 15)[:, None]]
        np.testing.assert_array_equal(v_op, want_op)
        at = K._out_offset(K._out_lane_offset(LANES), h)[:, None] // 2 + np.arange(4)
        out[at] = _mfma_bf16(v_op, p_op)
    want_o = p.T @ v_want  # [q row, dim]
    np.testing.assert_allclose(out.reshape(16, 256), want_o, rtol=1e-12, atol=1e-300)


# ---------------------------------------------------------------------------------------------
# the kernel's q byte permutation is the 8-bit operand layout; writer to scores in one MFMA model
# ---------------------------------------------------------------------------------------------


def _kernel_q_lds(K, q8_codes) -> np.ndarray:
    """The LDS bytes of the kernel's q tile: rotated dims 32c + t of row ``row`` (lane chunk c)
    at ``_q_store_offset(row, c) + t`` (t < 16) and 32 bytes further (t >= 16); q8_codes
    [G, 256] e4m3 codes in natural rotated order."""
    lds = np.zeros(K.LDS_BYTES, np.uint8)
    t = np.arange(32)
    for row in range(q8_codes.shape[0]):
        for c in range(8):
            lds[K._q_store_offset(row, c) + np.where(t < 16, t, t + 16)] = q8_codes[row, 32 * c + t]
    return lds


def test_kernel_q_store_is_the_8bit_operand_layout():
    """Rotated q dim d, stored by the kernel and read back as QK MFMA h's e4m3 B operand (lane
    group g: bytes 128h + 32g .. +31 of the row), sits at K index d - 128h of MFMA h, which is
    where the e2m1 A operand (32 contiguous K values per lane group, ``_k_codes_offset``) holds
    K's rotated dim d."""
    pytest.importorskip("flydsl", reason="needs the gfx950-build extra (flydsl)")
    K = pytest.importorskip("jax_sparse_mla.kernels.gfx950.ultraquant")
    lds = _kernel_q_lds(K, (np.arange(256) % 128)[None, :].astype(np.uint8))  # byte = d mod 128
    for h in range(2):
        b = lds[K._q_operand_offset(LANES, h)[:, None] + np.arange(32)]  # [64 lanes, 32 bytes]
        np.testing.assert_array_equal(b[0:64:16], _operand_k_index(8))  # row 0, lane groups


def _qk_scores(K, slots, q8_codes) -> np.ndarray:
    """Raw scores [16 tokens, 16 q rows] of one 16-token tile (slots [16, slot_bytes] of one KV
    head) through the kernel's q store, operand offsets and the scaled MFMA model."""
    lds = _kernel_q_lds(K, q8_codes)
    stride = slots.shape[-1]
    flat = slots.reshape(-1)
    k_off = K._k_lane_offset(LANES, stride)
    k_scale_words = _words(flat[K._k_scale_lane_offset(LANES, stride)[:, None] + np.arange(8)])
    raw = 0
    for h in range(2):
        a = flat[K._k_codes_offset(k_off, h)[:, None] + np.arange(16)]
        b = lds[K._q_operand_offset(LANES, h)[:, None] + np.arange(32)]
        scale_a = k_scale_words[:, h] >> K._k_scale_shift(K._k_lane_group(LANES))
        raw = raw + _mfma_fp4_fp8(a, b, scale_a, np.full(64, 0x7F))
    scores = np.empty((16, 16))
    scores[4 * (LANES >> 4)[:, None] + np.arange(4), (LANES & 15)[:, None]] = raw
    return scores


def test_writer_kernel_mfma_scores_are_the_dot_product():
    """K written by ``ultraquant_store``, q rotated by the emulation's (= the kernel's) rotation,
    both through the kernel's layouts and the MFMA model: every score is the dot product of the
    unrotated q8 and the unrotated dequantized K (orthonormal H/16 cancels). The removed layout
    (K's columns permuted as q's bytes are) gives other numbers through the same model."""
    pytest.importorskip("flydsl", reason="needs the gfx950-build extra (flydsl)")
    K = pytest.importorskip("jax_sparse_mla.kernels.gfx950.ultraquant")
    r = C.rng(41)
    g = 8
    k = jnp.asarray(r.standard_normal((16, 1, 256)), jnp.float32)
    q = C.bf16_normal(r, (1, g, 256))
    cache = jsm.ultraquant_store(
        jnp.zeros((1, 16, 1, O.UQ_SLOT_MIN), jnp.uint8), k, k, jnp.arange(16, dtype=jnp.int32)
    )
    slots = np.asarray(cache)[0, :, 0]  # [16, 272]
    q8 = np.asarray(E.rotate_query(q), np.float64)[0]  # [G, 256] rotated e4m3 values
    q_true = O.uq_unrotate(q8)

    def true_scores(k_rot):
        return O.uq_unrotate(k_rot) @ q_true.T  # [16 tokens, G]

    scores = _qk_scores(K, slots, O.e4m3_encode(q8))
    want = true_scores(O.uq_unpack(slots)[0])
    np.testing.assert_allclose(scores[:, :g], want, rtol=1e-9, atol=1e-9 * np.max(np.abs(want)))
    assert np.all(scores[:, g:] == 0)

    permuted = jsm.formats.ultraquant_rotate(k)[..., np.argsort(REMOVED_K_COLUMN)]
    codes, scales = jsm.formats.ultraquant_quantize(permuted)
    old = slots.copy()
    old[:, :136] = np.concatenate([np.asarray(codes), np.asarray(scales)], axis=-1)[:, 0]
    old_want = true_scores(O.uq_unpack(old)[0][:, REMOVED_K_COLUMN])
    old_err = np.abs(_qk_scores(K, old, O.e4m3_encode(q8))[:, :g] - old_want)
    assert np.max(old_err) > 0.1 * np.max(np.abs(old_want))
