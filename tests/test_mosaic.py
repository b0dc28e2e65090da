"""The Mosaic GPU kernels (sparse_mla, mla_decode, ultraquant_decode) on any machine: their
layout helpers against NumPy, and their CUDA lowering (lowered here without a GPU).

Their numerics run in the shared suites (tests/test_sparse_mla.py, test_mla_decode.py,
test_ultraquant.py and the others, through tests/impls.py) on a Hopper GPU only: the kernels
are inline PTX and wgmma and have no interpret mode.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _platform
from jax_sparse_mla.kernels.fp4_operands import EXACT_Q_PIECES
from jax_sparse_mla.kernels.mosaic import _pipeline as P
from jax_sparse_mla.kernels.mosaic import _wide as W
from jax_sparse_mla.kernels.mosaic import mla_decode as D
from jax_sparse_mla.kernels.mosaic import sparse_mla as K
from jax_sparse_mla.kernels.mosaic import ultraquant as U
from jax_sparse_mla.kernels.mosaic._launch import attention, signed_q
from tests import oracle as O
from tests import ptx_sim

FORMATS = {
    "sparse_mla": K.row_format(16),
    "sparse_mla, 32 rows": K.row_format(128),
    "mla_decode": D.row_format(1, 16),
    "causal, 16 rows": D.row_format(2, 8),
    "causal, 32 rows": D.row_format(2, 12),
    "ultraquant": U.row_format(8, 16),
    "ultraquant, 32 rows": U.row_format(24, 64),
}


def test_32_rows_per_cta_past_16():
    assert [D.row_format(qlen, h).m for qlen, h in [(1, 16), (2, 8), (1, 17), (2, 12), (4, 8)]] == [
        16,
        16,
        32,
        32,
        32,
    ]
    assert [K.row_format(h).m for h in (1, 16, 17, 32, 128)] == [16, 16, 32, 32, 32]


def test_a_groups_rows_take_the_fewest_ctas():
    """CTAs per query row or decode request: its rows (heads, or qlen x heads) in blocks of
    16 or 32; a block of padding rows alone would walk every key for nothing (it once doubled
    the causal decode's time on the H200)."""
    assert [K.row_format(h).blocks for h in (1, 16, 20, 32, 40, 128)] == [1, 1, 1, 1, 2, 4]
    shapes = [(1, 12), (2, 12), (2, 16), (4, 16), (3, 7)]
    assert [D.row_format(qlen, h).blocks for qlen, h in shapes] == [1, 1, 1, 2, 1]


def _unswizzle(buf: np.ndarray, rows: int, row_bytes: int = 128) -> np.ndarray:
    """SMEM bytes of bf16 blocks of ``rows`` rows of ``row_bytes`` bytes, swizzled as TMA and
    wgmma read them (byte offset o holds logical offset o ^ (((o >> 7) % (row_bytes / 16)) <<
    4)) -> [blocks, rows, row_bytes / 2] uint16 in logical order."""
    offsets = np.arange(buf.size)
    logical = np.empty_like(buf)
    logical[offsets ^ (((offsets >> 7) % (row_bytes // 16)) << 4)] = buf
    return logical.view("<u2").reshape(-1, rows, row_bytes // 2)


def _q_scale(rows: np.ndarray) -> np.ndarray:
    """The float16 formats' q exponents, from the math: for each row of ``rows`` (bf16 bits) the
    e that puts its largest |value| in [2^14, 2^15), at most 64 (-114 for NaN or infinity)."""
    out = []
    for top in np.abs(O.bf16_bits_to_f64(rows)).max(axis=1):
        if not np.isfinite(top):
            out.append(-114)
        else:
            out.append(64 if top == 0 else min(64, 14 - (math.frexp(float(top))[1] - 1)))
    return np.array(out)


def _stage_q(fmt, q: np.ndarray, row0: int) -> ptx_sim.Memory:
    """Both consumers' q passes run lane by lane (a float16 format's ``q_max_ptx`` first, as
    the kernel's barrier orders them) over q [heads, 576] (bf16 bits); the SMEM buffers start
    as 0xAB bytes, the rows' q maxima (m words: a row past them fails) as 0 (``init_ptx``)."""
    m = fmt.m
    mem = ptx_sim.Memory()
    operands = {"$0": mem.add("q", q.astype("<u2"), "global"), "$3": row0}
    operands["$1"] = mem.add("lat", np.full(P.LATENT_BLOCKS * m * 128, 0xAB, np.uint8), "shared")
    operands["$2"] = mem.add("rope", np.full(m * 128, 0xAB, np.uint8), "shared")
    operands["$4"] = mem.add("q_max", np.zeros(m, np.uint32), "shared")
    passes = [P.q_rows_ptx]
    if fmt.operand_dtype == jnp.float16:
        passes.insert(0, P.q_max_ptx)
    for ptx in passes:
        for c in range(P.CONSUMERS):
            ptx_sim.run(ptx(fmt, c), operands, lanes=128, memory=mem)
    return mem


@pytest.mark.parametrize(
    "fmt,row0",
    [
        (K.row_format(16), 0),
        (K.row_format(128), 96),
        (K.row_format(20), 0),
        (K.row_format(40), 32),
        (D.row_format(1, 12), 0),
        (D.row_format(2, 12), 0),
        (D.row_format(4, 16), 32),
    ],
)
def test_q_rows_ptx_stages_the_operand_blocks_of_the_ctas_rows(fmt, row0):
    """Both consumers' q staging (``q_rows_ptx``) run lane by lane: with the swizzle undone,
    block 2c + p, column j of row r holds dim 128c + 2j + p of q row row0 + r; the rope block
    holds its 64 dims (bf16 rope: ``sparse_mla``), or block p column j rope dim 2j + p (fp8
    rope: ``mla_decode``); rows past ``fmt.heads`` are zeros; every byte is written, and only
    the group's q rows are read. The float16 formats (``mla_decode``) hold each value times
    2^e, e putting the CTA's largest |q| in [2^14, 2^15), rounded to float16; their q spans
    2^-40 .. 2^20 in magnitude, so that some values round."""
    m, heads = fmt.m, fmt.heads
    rng = np.random.default_rng(heads)
    half = fmt.operand_dtype == jnp.float16
    if half:
        values = rng.normal(size=(heads, 576)) * 2.0 ** rng.integers(-40, 20, (heads, 576))
        q = O.f32_to_bf16_bits(values)
    else:
        q = rng.integers(0, 2**16, (heads, 576), np.uint16)
    mem = _stage_q(fmt, q, row0)
    rows = np.zeros((m, 576), np.uint16)
    mine = q[row0 : row0 + m]
    rows[: len(mine)] = mine
    if half:
        factor = (2.0 ** _q_scale(rows)).astype(np.float32)[:, None]
        scaled = O.bf16_bits_to_f64(rows).astype(np.float32) * factor
        rows = scaled.astype(np.float16).view(np.uint16)
    lat = _unswizzle(mem.array("lat", np.uint8), m)
    for c, p in itertools.product(range(P.CHUNKS), range(2)):
        np.testing.assert_array_equal(lat[2 * c + p], rows[:, 128 * c + p : 128 * c + 128 : 2])
    rope = _unswizzle(mem.array("rope", np.uint8), m, P.rope_swizzle(fmt))
    if fmt.rope_fp8:
        for p in range(2):
            np.testing.assert_array_equal(rope[p], rows[:, 512 + p :: 2])
    else:
        np.testing.assert_array_equal(rope[0], rows[:, 512:])


@pytest.mark.parametrize("kind", ["transposed", "wide", "wide partial"])
def test_out_rows_ptx_interleaves_each_chunks_even_and_odd_dims_into_rows(kind):
    """``out_rows_ptx`` run for every register of one chunk's two output blocks as the WGMMA
    layout's would hold them: rows row0 + r, dims 128c + 2j and + 1 hold even[r, j] and
    odd[r, j] (as bf16, or as f32 for ``_wide``'s split partials); rows past ``heads`` are
    never written (the buffer ends there). O^T blocks [DB, m] (a register: (j, r) and (j, r +
    1)), or ``_wide``'s O blocks [64, DB] (a register: (r, j) and (r, j + 1))."""
    wide, partial = kind != "transposed", kind == "wide partial"
    heads, row0, chunk = (100, 64, 3) if wide else (20, 16, 2)
    fmt = K.row_format(heads, wide=wide)
    rng = np.random.default_rng(5)
    values_of = (lambda x: x.astype(np.float32)) if partial else O.round_bf16
    even, odd = (values_of(rng.normal(size=(fmt.m, P.DB))) for _ in range(2))
    mem = ptx_sim.Memory()
    dtype = "<f4" if partial else "<u2"
    out = mem.add("out", np.zeros((heads, 512), dtype), "global")
    text = W.out_rows_ptx(fmt, chunk, partial) if wide else P.out_rows_ptx(fmt, chunk)
    step = (1, 2) if wide else (2, 1)  # the register's second value: column j + 1, or row r + 1
    for r, j in itertools.product(range(0, fmt.m, step[0]), range(0, P.DB, step[1])):
        r1, j1 = r + step[0] - 1, j + step[1] - 1
        pairs = [even[r, j], even[r1, j1], odd[r, j], odd[r1, j1]]
        values = {f"${4 + i}": float(v) for i, v in enumerate(pairs)}
        place = {"$1": r, "$2": j} if wide else {"$1": j, "$2": r}
        ptx_sim.run(text, {"$0": out, **place, "$3": row0, **values}, memory=mem)
    got = mem.array("out", dtype, (heads, 512))
    got = got.astype(np.float64) if partial else O.bf16_bits_to_f64(got)
    mine = heads - row0
    np.testing.assert_array_equal(got[row0:, 128 * chunk : 128 * chunk + 128 : 2], even[:mine])
    np.testing.assert_array_equal(got[row0:, 128 * chunk + 1 : 128 * chunk + 128 : 2], odd[:mine])
    untouched = np.ones_like(got, bool)
    untouched[row0:, 128 * chunk : 128 * chunk + 128] = False
    assert not got[untouched].any()


def test_ptx_sim_refuses_a_misaligned_vector_access():
    """A vector store must be aligned to its whole size, as on the GPU, so that the kernels'
    vector stores run on ``ptx_sim`` only at addresses the hardware takes."""
    mem = ptx_sim.Memory()
    out = mem.add("out", np.zeros(16, np.uint8), "global")
    store = "st.global.v2.b32 [$0], {$1, $2};"
    ptx_sim.run(store, {"$0": out + 8, "$1": 1, "$2": 2}, memory=mem)
    np.testing.assert_array_equal(mem.array("out", "<u4"), [0, 0, 1, 2])
    with pytest.raises(AssertionError, match="8-byte access at .* is not aligned"):
        ptx_sim.run(store, {"$0": out + 4, "$1": 3, "$2": 4}, memory=mem)


def test_unpermute_out_inverts_the_block_order():
    o = np.arange(2 * 512, dtype=np.float32).reshape(2, 512)
    permuted = np.concatenate(
        [o[:, 128 * c + p : 128 * c + 128 : 2] for c in range(P.CHUNKS) for p in range(2)], axis=1
    )
    np.testing.assert_array_equal(np.asarray(P.unpermute_out(jnp.asarray(permuted))), o)


@pytest.mark.parametrize("value", [0, 0xFF800000])
@pytest.mark.parametrize("words", [16, 32])
def test_init_ptx_fills_the_first_words_of_a_buffer(words, value):
    """Thread 0 alone (``init_ptx`` given a buffer, ``words`` and ``value``, run on
    ``ptx_sim``) sets the first ``words`` words: zeroes the float16 formats' q maxima
    (``q_max_ptx`` takes maxima into them), or -inf for UltraQuant's running max (the K
    warpgroups pass it on), and nothing past them."""
    mem = ptx_sim.Memory()
    operands = {"$0": 0, "$1": mem.add("buffer", np.full(64, 0xABABABAB, "<u4"), "shared")}
    ptx_sim.run(P.init_ptx(0, None, "$1", words, value), operands, lanes=4, memory=mem)
    got = mem.array("buffer", "<u4")
    assert (got[:words] == value).all() and (got[words:] == 0xABABABAB).all()


@pytest.mark.parametrize(
    "lane, pair, x, limit, expect",
    [
        (None, None, None, None, 0),  # every value at or below its limit
        (77, 2, np.nextafter(np.float32(5), np.float32(6)), 5.0, 1),  # one value just above
        (0, 0, -1e30, -np.inf, 1),  # a finite score over a running max still at -inf
        (127, 3, -np.inf, -np.inf, 0),  # a masked key (-inf) over -inf: not above
        (5, 1, np.nan, 0.0, 0),  # NaN is above nothing
    ],
)
def test_vote_ptx_ors_every_lanes_comparisons(lane, pair, x, limit, expect):
    """``vote_ptx`` (whether some score of a K warpgroup's tile passes the running max by the
    rescale slack) run on ``ptx_sim`` by 128 lanes of 4 (value, limit) pairs, values at or
    below their limits (some equal) but for the one given: every lane gets ``expect``."""
    rng = np.random.default_rng(0)
    lanes = []
    for i in range(128):
        limits = rng.normal(size=4).astype(np.float32)
        values = limits - np.float32(rng.integers(0, 2, size=4))  # equal, or 1 below
        if i == lane:
            values[pair], limits[pair] = x, limit
        ops = {f"${2 * k + 1}": float(values[k]) for k in range(4)}
        lanes.append(ops | {f"${2 * k + 2}": float(limits[k]) for k in range(4)})
    regs, _ = ptx_sim.run(P.vote_ptx(4, P.VOTE_BARRIER), lanes, memory=ptx_sim.Memory())
    assert [r["$0"] for r in regs] == [expect] * 128


@pytest.mark.parametrize("rows_e", [None, (0, 14, -10, 64)])
@pytest.mark.parametrize("scale", [1e37, -1e37, 0.3, -0.3, 0.0, 1e-45])
def test_the_softmax_scales_after_the_max_at_any_finite_scale(scale, rows_e):
    """The consumers' online softmax (``softmax_step``, ``lse_of``) over two tiles of scores
    ~2, some keys masked, one key of 30 in the second and of -30 in the first, against
    float64: at +-1e37 the largest scaled score, 3e38, overflows float32 in log2 units (and
    the lse is still finite), the weights are finite (one-hot); at 0 and at a subnormal scale
    (|scale| clamped to float32's smallest normal) a masked key weighs 0, not NaN.
    ``rows_e`` None: the scores times ``score_factors``' sign, its scalar magnitude after the
    max (UltraQuant's ``consume_k``; the bf16 latent formats' scores, q times the sign, are
    the same values). Else ``consume``'s float16 decode: q times the sign and each row's 2^e,
    the magnitude of scale 2^-e per row after the max (at +-1e37 and e = -10 past float32's
    max: clamped), the lse of the max times 2^-e at |scale|."""
    rng = np.random.default_rng(1)
    m, d = 4, 3
    raw = (2 * rng.normal(size=(2, P.T, m))).astype(np.float32)
    visible = rng.random(size=(2, P.T, 1)) > 0.2
    raw[0, 7], raw[1, 5], visible[0, 7], visible[1, 5] = -30, 30, True, True
    v = rng.normal(size=(2, P.T, d)).astype(np.float32)
    log2_scale = np.float32(scale) * np.float32(P.LOG2E)
    sign, mag = P.score_factors(log2_scale)
    scores, unscale, lse_mag = raw, np.float32(1), mag
    if rows_e is not None:  # q staged times the sign and 2^e per row (exact)
        unscale = np.float32(2.0) ** -np.asarray(rows_e, np.float32)
        scores, sign = raw * (np.sign(log2_scale) / unscale), np.float32(1)
        mag = P.magnitude(jnp.float32(log2_scale) * unscale)  # may pass float32: clamped

    def by_row(x):
        return jnp.broadcast_to(x, (P.T, m))

    m_run, l_run = jnp.full((m,), -jnp.inf), jnp.zeros((m,))  # ``softmax_start``'s
    acc = jnp.zeros((d, m))
    for t in range(2):
        sc = jnp.where(visible[t], scores[t] * sign, -jnp.inf)
        m_new = jnp.maximum(m_run, sc.max(axis=0))
        alpha, p = P.softmax_step(sc, m_run, m_new, by_row, mag)
        pv = jnp.matmul(v[t].T, p, precision="highest")  # not TF32 on a GPU
        l_run, acc, m_run = l_run * alpha + p.sum(axis=0), acc * alpha + pv, m_new
    lse = P.lse_of(m_run * unscale, l_run, l_run != 0, lse_mag)
    logits = np.where(visible, np.float64(np.float32(scale)) * raw, -np.inf).reshape(-1, m)
    want_lse = np.logaddexp.reduce(logits, axis=0)
    w = np.exp(logits - want_lse)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)
    want = np.einsum("km,kd->dm", w, v.reshape(-1, d).astype(np.float64))
    np.testing.assert_allclose(np.asarray(acc / l_run), want, rtol=1e-5, atol=1e-6)


def test_signed_q_carries_the_scales_sign():
    """``signed_q``: the latent formats' q times the score scale's sign, exactly (their
    kernels take only |scale|): a static positive scale leaves q as it is (no XLA op), a
    negative one negates it, 0 zeroes it, and a traced scale does the same."""
    q = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 576)), jnp.bfloat16)
    assert signed_q(q, np.float32(0.5)) is q
    for scale, want in [(-0.5, -q), (0.0, jnp.zeros_like(q)), (np.float32(-3), -q)]:
        np.testing.assert_array_equal(signed_q(q, scale), want)
        np.testing.assert_array_equal(jax.jit(signed_q)(q, jnp.float32(scale)), want)
    np.testing.assert_array_equal(jax.jit(signed_q)(q, jnp.float32(2)), q)


def test_named_barriers_are_distinct_and_past_mosaic_gpus():
    """Our named barriers (the producer's, the consumers', the K and V consumers', each K
    warpgroup's vote) differ from each other and from Mosaic GPU's own: 0 and 1 + warpgroup
    (five warpgroups at most)."""
    ids = [P.PRODUCER_BARRIER, P.CONSUMER_BARRIER, P.ALL_CONSUMERS_BARRIER]
    ids += [P.VOTE_BARRIER + c for c in range(P.CONSUMERS)]
    assert len(set(ids)) == len(ids) and min(ids) > 1 + 4 and max(ids) < 16


@pytest.mark.parametrize("align", [P.T, 128])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_work_ptx_covers_each_list_once_in_aligned_splits(splits, align):
    """Thread 0's work entry (``init_ptx`` with a ``SplitRule``, run on ``ptx_sim``) for each
    list and split: the splits tile [start, start + length) in order, cut at multiples of
    ``align``, with indptr clipped to [0, nnz] (a decreasing entry makes an empty list); each
    entry also carries its split's start within the list and the list's length; the entries
    are ``work_lists``'s (the rule of the paged kernel's XLA-made entries); only indptr[g] and
    indptr[g + 1] are read."""
    nnz = 1000
    indptr = np.array([0, 0, 130, 129, 700, 2000, 900, -5], np.int32)
    lists = len(indptr) - 1
    text = P.init_ptx(0, P.SplitRule(nnz, splits, align))
    work = np.zeros((lists, splits, 4), np.int32)
    for g, s in itertools.product(range(lists), range(splits)):
        mem = ptx_sim.Memory()
        operands = {"$0": 0, "$3": g, "$4": s}
        operands["$1"] = mem.add("indptr", indptr[g : g + 2].astype("<i4"), "global") - 4 * g
        operands["$2"] = mem.add("work", np.full(4, -99, "<i4"), "shared")
        ptx_sim.run(text, operands, lanes=2, memory=mem)
        work[g, s] = mem.array("work", "<i4")
    for r in range(lists):
        start = min(max(indptr[r], 0), nnz)
        end = min(max(indptr[r + 1], start), nnz)
        pos = start
        for s in range(splits):
            first, length, lo, total = work[r, s]
            assert total == end - start and lo == pos - start
            assert length >= 0 and (length == 0 or first == pos)
            if s < splits - 1 and work[r, s + 1, 1]:
                assert length % align == 0
            pos += length
        assert pos == end, (r, work[r])
    start = np.clip(indptr[:-1], 0, nnz)
    length = np.clip(indptr[1:], start, nnz) - start
    xla = np.asarray(P.work_lists(jnp.asarray(start), jnp.asarray(length), splits, align))
    np.testing.assert_array_equal(work, xla[..., :4])


@pytest.mark.parametrize("consumers", sorted({f.consumers for f in FORMATS.values()}))
def test_register_split_fits_the_launch_allocation(consumers):
    """``setmaxnreg`` takes multiples of 8 in [24, 256], and the warpgroups together may hold
    no more than the CTA got at launch (ptxas: 65536 over ``.maxntid`` threads, rounded down
    to 8 each)."""
    threads = 128 * (consumers + 1)
    regs = P.consumer_registers(consumers)
    for r in (regs, P.PRODUCER_REGISTERS):
        assert r % 8 == 0 and 24 <= r <= 256
    held = 128 * (consumers * regs + P.PRODUCER_REGISTERS)
    assert held <= 65536 // threads // 8 * 8 * threads
    assert regs == {2: 232, 4: 104}[consumers]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_stages_fit_shared_memory(name):
    """Two row stages fit beside the rest: one alone would leave the producer no room to run
    ahead of the consumers."""
    assert 2 <= P.stages_for(FORMATS[name]) <= P.MAX_STAGES


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_staged_rows_are_bank_conflict_free(name):
    """The consumers read uint16 words (4 bytes per thread) of 8 consecutive staged rows at one
    column, 16 bytes per row: with a pitch of 4 mod 8 words (and 16-byte aligned) they fall on
    32 distinct banks. UltraQuant reads uint32 words (8 bytes per thread), 32 bytes per row,
    a half warp's 4 rows at a time: a pitch of 8 mod 32 words."""
    fmt = FORMATS[name]
    assert fmt.pitch % 16 == 0 and fmt.pitch >= fmt.row_bytes and fmt.row_bytes % 16 == 0
    rows, words = (4, 8) if fmt.fp4 else (8, 4)
    banks = {(row * fmt.pitch // 4 + word) % 32 for row in range(rows) for word in range(words)}
    assert len(banks) == 32


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_gather_ptx_copies_each_scale_word_once(name):
    fmt = FORMATS[name]
    stride = 8 * fmt.row_bytes if fmt.fp4 else fmt.row_bytes
    text = P.gather_ptx(fmt, 1024, stride)
    assert f"mul.wide.u32 dst, lane, {fmt.pitch};" in text
    assert f"mul.wide.s32 src, k0, {stride};" in text  # 64-bit byte offsets: caches past 4 GiB
    if fmt.lane_copies:  # two lanes per row, each its even or its odd 16-byte chunks
        chunks = fmt.row_bytes // 16
        copies = re.findall(r"cp\.async\.cg\.shared\.global \[cd\+(\d+)\], \[cs\+(\d+)\]", text)
        assert copies == [(str(32 * i), str(32 * i)) for i in range(-(-chunks // 2))]
        assert text.count("ld.shared.s32 k, [ia];") == 1  # one row index per lane
        assert f"mul.wide.s32 cs, k, {stride};" in text and "cp.async.bulk" not in text
    else:
        assert f"[src], {fmt.row_bytes}, [$3]" in text
    copied = [
        int(x)
        for x in re.findall(r"cp\.async\.ca\.shared\.global \[st\+\d+\], \[src\+(\d+)\]", text)
    ]
    assert copied == list(fmt.scale_words)
    assert ("cp.async.mbarrier.arrive" in text) == bool(fmt.scale_words)


def test_tma_boxes_where_pages_tile_the_tiles():
    """UltraQuant's rows come as TMA boxes of a page (or of 64 keys of a larger page) where
    pages of 16 tokens or more tile the 64-key tiles or are tiled by them, and a 288-byte box
    fits in a row of the KV heads' slots; else the producer's lanes copy them."""
    sizes = (8, 16, 32, 48, 64, 96, 128, 256)
    assert [U.tile_rows(bs, 2 * 272) for bs in sizes] == [0, 16, 32, 0, 64, 0, 64, 64]
    assert [U.tile_rows(16, row) for row in (272, 288, 8 * 272)] == [0, 16, 16]
    assert U.row_format(8, 64, 8 * 272).tile_rows == 64 and U.row_format(8, 64).tile_rows == 0
    text = P.gather_ptx(U.row_format(8, 64, 8 * 272), 64 * 10, 8 * 272)
    assert "cp.async.cg" not in text and "cp.async.bulk" not in text  # no row copies


def test_paged_gather_reads_the_block_table_itself():
    """UltraQuant's producer turns positions into slots from the block table (page = position
    / block size, masked outside [0, num_blocks)): no slot list is built."""
    text = P.gather_ptx(U.row_format(8, 48), 48 * 10, 2 * 272)
    for line in ("div.u32 page, pos, 48;", "rem.u32 off, pos, 48;", "@ok setp.lt.s32 ok, key, 10;"):
        assert line in text
    assert "mad.lo.s32 key, key, 48, off;" in text
    assert "add.u64 src, src, head;" in text  # the CTA's KV head within the token's row


def _run_gather(fmt, cache, table, *, length, position=0, head=0):
    """Runs the producer's PTX (``gather_ptx``) for every tile of a key list of ``length``
    keys on ``ptx_sim``: ``table`` is the list (``fmt.page_size`` 0) or the request's
    block-table row, ``position`` the split's first key position (paged), ``head`` the byte
    offset of the CTA's slot in a row. The list is its own buffer, so that a read past it
    fails. Yields per tile: the staged rows [T, row_bytes], ids [T], scale words [words, T]."""
    rows, stride = cache.shape
    text = P.gather_ptx(fmt, rows, stride)
    words = len(fmt.scale_words)
    mem = ptx_sim.Memory()
    bases = {
        "$0": mem.add("cache", cache, "global"),
        "$1": mem.add("list", np.asarray(table, "<i4"), "global"),
        "$6": mem.add("zero", P.masked_row(fmt), "global"),
        "$7": mem.add("ring", np.zeros(2 * P.T, "<i4"), "shared"),
        "$3": mem.add("bar", np.zeros(8, np.uint8), "shared"),
    }
    for t in range(-(-length // P.T)):
        garbage = {"raw": P.T * fmt.pitch, "ids": 4 * P.T, "sc": 4 * words * P.T}
        staged = {
            k: mem.add(f"{k}{t}", np.full(n, 0xAB, np.uint8), "shared") for k, n in garbage.items()
        }
        operands = dict(bases, **{"$2": staged["raw"], "$4": staged["ids"]})
        operands |= {"$5": length - t * P.T, "$8": t}
        if not fmt.page_size:
            operands["$1"] = bases["$1"] + 4 * t * P.T  # the tile's slice of the list
        extra = 9 + bool(words)  # gather_ptx's numbering: the scales' SMEM, head, position
        if words:
            operands["$9"] = staged["sc"]
        if fmt.fp4:
            operands[f"${extra}"] = head
        operands[f"${extra + fmt.fp4}"] = position + t * P.T
        _, barriers = ptx_sim.run(text, operands, lanes=128, memory=mem)
        assert list(barriers) == [bases["$3"]] and barriers[bases["$3"]].complete, barriers
        raw = mem.array(f"raw{t}", np.uint8, (P.T, fmt.pitch))[:, : fmt.row_bytes]
        ids = mem.array(f"ids{t}", "<i4")
        yield raw, ids, mem.array(f"sc{t}", "<u4", (words, P.T))


def _check_staged(fmt, cache, slots, head, staged):
    """``staged`` (``_run_gather``'s tile) against the expected slots [T] (-1: masked); with
    ``fmt.tile_rows`` the rows are TMA boxes (``_copy_tile``), not the PTX's: only the ids and
    the scale words."""
    raw, ids, sc = staged
    np.testing.assert_array_equal(ids, slots)
    for j, slot in enumerate(slots):
        want = cache[slot, head : head + fmt.row_bytes] if slot >= 0 else P.masked_row(fmt)
        if not fmt.tile_rows:
            np.testing.assert_array_equal(raw[j], want, err_msg=f"row {j}")
        for i, offset in enumerate(fmt.scale_words):
            word = want[offset : offset + 4].view("<u4")[0]
            assert sc[i, j] == word, (j, i)


@pytest.mark.parametrize("lane_copies", [False, True])
@pytest.mark.parametrize("name", ["sparse_mla", "mla_decode", "causal, 32 rows"])
def test_gather_ptx_stages_each_listed_row_and_masks_the_rest(name, lane_copies):
    """The producer's PTX run lane by lane (``ptx_sim``) over a 150-key list of valid, -1 and
    out-of-range indices, three tiles: each staged row is the listed cache row or zeros, the
    ids are the index or -1, the scale words are the row's, each tile's mbarrier completes,
    and nothing outside the cache, the list and the zero row is read."""
    fmt = FORMATS[name]._replace(lane_copies=lane_copies)
    rng = np.random.default_rng(0)
    rows = 300
    cache = rng.integers(0, 256, (rows, fmt.row_bytes), np.uint8)
    keys = rng.integers(0, rows, 150)
    keys[rng.choice(150, 30, replace=False)] = rng.choice([-1, -7, rows, rows + 5, 2**31 - 1], 30)
    for t, staged in enumerate(_run_gather(fmt, cache, keys, length=len(keys))):
        tile = np.full(P.T, -1)
        part = keys[t * P.T : (t + 1) * P.T]
        tile[: len(part)] = np.where((part >= 0) & (part < rows), part, -1)
        _check_staged(fmt, cache, tile, 0, staged)


@pytest.mark.parametrize("copies", ["bulk", "lanes", "tiles"])
@pytest.mark.parametrize("name", ["ultraquant", "ultraquant, 32 rows"])
def test_paged_gather_ptx_resolves_the_block_table(name, copies):
    """UltraQuant's producer PTX run lane by lane from a split starting at position 64: lane j
    of a tile stages slot table[p // block] * block + p % block (p its position) of the CTA's
    KV head, or zeros where the entry is outside [0, pages); only the table row is read. With
    TMA boxes (``tiles``) the lanes stage the ids and scale words and copy no row."""
    fmt = FORMATS[name]._replace(lane_copies=copies != "bulk")
    if copies == "tiles":
        fmt = fmt._replace(tile_rows=min(fmt.page_size, P.T))
    block, pages, heads, hb = fmt.page_size, 12, 3, 1
    rng = np.random.default_rng(1)
    cache = rng.integers(0, 256, (pages * block, heads * fmt.row_bytes), np.uint8)
    width = -(-(64 + 150) // block)
    table = rng.permutation(pages)[:width] if width <= pages else rng.integers(0, pages, width)
    table[rng.choice(width, 2, replace=False)] = [-1, pages]
    length = min(150, width * block - 64)
    head = hb * fmt.row_bytes
    staged = _run_gather(fmt, cache, table, length=length, position=64, head=head)
    for t, tile_staged in enumerate(staged):
        pos = 64 + t * P.T + np.arange(P.T)
        entry = table[np.minimum(pos // block, width - 1)]
        live = (np.arange(P.T) < length - t * P.T) & (entry >= 0) & (entry < pages)
        slots = np.where(live, entry * block + pos % block, -1)
        _check_staged(fmt, cache, slots, head, tile_staged)


def _lowered_text(n_q, h, rows, topk, implementation="mosaic"):
    args = (
        jax.ShapeDtypeStruct((n_q, h, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows, 656), jnp.uint8),
        jax.ShapeDtypeStruct((n_q * topk,), jnp.int32),
        jax.ShapeDtypeStruct((n_q + 1,), jnp.int32),
    )
    fn = jax.jit(lambda *a: jsm.sparse_mla(*a, implementation=implementation, return_lse=True))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("sm90", [True, False])
@pytest.mark.parametrize("n_q,h", [(1, 16), (4, 2), (128, 128)])
def test_none_lowers_to_mosaic_on_hopper_and_to_pallas_past_it(monkeypatch, sm90, n_q, h):
    """implementation=None for CUDA, whatever q's shape: the Mosaic GPU kernel on a Hopper GPU,
    the Pallas (Triton) one on a later GPU, which has no sm_90a wgmma."""
    monkeypatch.setattr(_platform, "cuda_is_sm90", lambda: sm90)
    text = _lowered_text(n_q, h, 500, 64, implementation=None)
    assert ("@mosaic_gpu" in text) == sm90
    assert ("__gpu$xla.gpu.triton" in text) == (not sm90)


@pytest.mark.parametrize("h", [1, 16, 17, 32, 64, 128])
def test_cuda_lowering_hands_the_cache_itself_to_the_kernel(h):
    """One Mosaic GPU custom call per op call, whose cache operand is the argument itself (no
    view, pad or copy of it), for any head count (16 heads per CTA)."""
    text = _lowered_text(3, h, 5000, 200)
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    assert len(calls) == 1, text[:2000]
    assert calls[0].split(",")[0].strip() == "%arg1"


def test_cuda_lowering_of_a_cache_over_4_gib_has_no_copy_of_it():
    """Past 2^32 bytes (and past 2^31 records' bytes) the kernel still reads the cache in place:
    its byte offsets are 64-bit (``mul.wide`` in the gather)."""
    rows = 2**32 // 656 + 10
    text = _lowered_text(2, 16, rows, 64)
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    assert calls and calls[0].split(",")[0].strip() == "%arg1"


def test_more_than_2_31_records_is_refused_by_name():
    args = (
        jax.ShapeDtypeStruct((1, 16, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((2**31, 656), jnp.uint8),
        jax.ShapeDtypeStruct((64,), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
    )
    fn = jax.jit(lambda *a: K.sparse_mla_mosaic(*a, 0.1))
    with pytest.raises(NotImplementedError, match="int32 record indices"):
        fn.trace(*args)


@pytest.mark.parametrize("implementation", ["mosaic", None])
def test_vmap_runs_the_kernel_once_per_batch_element(implementation):
    """Under vmap, "mosaic" and None (the Mosaic kernel on Hopper) both lower for CUDA to one
    Mosaic GPU call inside a loop over the batch (the kernel's own vmap rule; it has no
    batched grid)."""
    args = (
        jax.ShapeDtypeStruct((2, 128, 16, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1000, 656), jnp.uint8),
        jax.ShapeDtypeStruct((2, 128 * 64), jnp.int32),
        jax.ShapeDtypeStruct((2, 129), jnp.int32),
    )
    fn = jax.vmap(
        lambda q, kv, i, p: jsm.sparse_mla(q, kv, i, p, implementation=implementation),
        (0, None, 0, 0),
    )
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "stablehlo.while" in text


_DECODE_OPS = {
    "mla_decode": functools.partial(jsm.mla_decode, return_lse=True),
    "mla_decode_partials": functools.partial(jsm.mla_decode_partials, num_splits=3),
}


def _decode_lowered_text(op, b, qlen, h, tokens, n, implementation="mosaic", dtype=jnp.uint8):
    args = (
        jax.ShapeDtypeStruct((b * qlen, h, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, 576), dtype),
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct((b + 1,), jnp.int32),
    )
    fn = jax.jit(functools.partial(_DECODE_OPS[op], qlen=qlen, implementation=implementation))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("sm90", [True, False])
@pytest.mark.parametrize("qlen,h", [(1, 16), (2, 8), (2, 12), (2, 16), (4, 16), (1, 128)])
@pytest.mark.parametrize("op", sorted(_DECODE_OPS))
def test_decode_none_lowers_to_mosaic_on_hopper(monkeypatch, sm90, op, qlen, h):
    """implementation=None for CUDA: the Mosaic GPU kernel on a Hopper GPU for requests of any
    row count (qlen * H: one CTA of 16 or 32 rows, or several), the Pallas (Triton) one on a
    later GPU."""
    monkeypatch.setattr(_platform, "cuda_is_sm90", lambda: sm90)
    text = _decode_lowered_text(op, 3, qlen, h, 4000, 900, implementation=None)
    assert ("@mosaic_gpu" in text) == sm90
    assert ("__gpu$xla.gpu.triton" in text) == (not sm90)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("qlen,h", [(1, 16), (1, 128), (2, 12), (4, 3)])
@pytest.mark.parametrize("op", sorted(_DECODE_OPS))
def test_decode_cuda_lowering_hands_the_cache_itself_to_the_kernel(op, qlen, h, dtype):
    """One Mosaic GPU call per op call, whose cache operand is the argument itself (a float8
    cache through a same-width bitcast only), for rows of any count (qlen * H, 16 or 32 per
    CTA)."""
    text = _decode_lowered_text(op, 3, qlen, h, 4000, 900, dtype=dtype)
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    assert len(calls) == 1, text[:2000]
    operand = calls[0].split(",")[0].strip()
    if dtype == jnp.uint8:
        assert operand == "%arg1"
    else:
        cast = rf"{operand} = stablehlo\.bitcast_convert %arg1 : \(tensor<4000x576xf8E4M3FN>\)"
        assert re.search(cast + r" -> tensor<4000x576xui8>", text), text[:2000]


def _ops_beside_the_kernel(text: str) -> list[str]:
    """The stablehlo ops of a lowering other than the Mosaic GPU call, the shape-only ops
    (reshape, a transpose or broadcast that XLA makes a bitcast, a slice), the platform
    switch and constants; a broadcast of a scalar (a traced scale) is kept."""
    ops = re.findall(r"= (?:\"?)stablehlo\.(\w+)", text)
    scalars = re.findall(r"stablehlo\.broadcast_in_dim %\w+, dims = \[\] ", text)
    shape_only = {"custom_call", "reshape", "transpose", "broadcast_in_dim", "slice", "case"}
    return [op for op in ops if op not in shape_only | {"constant"}] + ["scalar broadcast"] * len(
        scalars
    )


@pytest.mark.parametrize("n_q,h", [(128, 16), (128, 128), (128, 20)])
def test_a_one_split_sparse_call_is_the_kernel_alone(n_q, h):
    """With one split (enough rows to fill the GPU) a ``sparse_mla`` call lowers to the Mosaic
    GPU call and shape-only ops: q, indptr and the output reach and leave the kernel as they
    are, and the scales and the masked-key row are constants (no arithmetic, pad, concatenate
    or iota around it)."""
    text = _lowered_text(n_q, h, 5000, 2048)
    assert len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text)) == 1
    assert _ops_beside_the_kernel(text) == [], text[:3000]


@pytest.mark.parametrize("qlen", [1, 2])
def test_a_one_split_decode_call_is_the_kernel_alone(qlen):
    """Likewise ``mla_decode`` with one split (128 requests): the kernel and shape-only ops,
    the causal row positions constants."""
    text = _decode_lowered_text("mla_decode", 128, qlen, 12, 128 * 4096, 128 * 4096)
    assert len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text)) == 1
    assert _ops_beside_the_kernel(text) == [], text[:3000]


def test_decode_vmap_runs_the_kernel_once_per_batch_element():
    args = (
        jax.ShapeDtypeStruct((2, 4, 16, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1000, 576), jnp.uint8),
        jax.ShapeDtypeStruct((2, 900), jnp.int32),
        jax.ShapeDtypeStruct((2, 5), jnp.int32),
    )
    fn = jax.vmap(
        lambda q, kv, i, p: jsm.mla_decode(q, kv, i, p, implementation="mosaic"), (0, None, 0, 0)
    )
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "stablehlo.while" in text


# ---------------------------------------------------------------------------------------------
# ultraquant_decode
# ---------------------------------------------------------------------------------------------


def _operand_dim(k: int, n: int, j: int) -> int:
    """The dim ``_fp4_operand``'s docstring puts in column j of operand n of slice k: nibble
    n % 4 + 4 (j % 2) of uint32 word 2 (j // 2) + n // 4 (nibble i of word w: dim 8w + i)."""
    return 128 * k + 8 * (2 * (j // 2) + n // 4) + n % 4 + 4 * (j % 2)


@pytest.mark.parametrize("pieces", [1, EXACT_Q_PIECES])
def test_fp4_q_orders_each_piece_as_the_operands_and_stacks_the_pieces(pieces):
    m, hbs = 16, 2
    x = np.random.default_rng(0).normal(size=(1, pieces, hbs * m - 3, 256))
    q = np.asarray(P.fp4_q(jnp.asarray(x, jnp.float32), hbs, m))
    assert q.shape == (1, hbs, P.FP4_SLICES, pieces * m, P.FP4_WORDS)
    rows = np.concatenate([x, np.zeros((1, pieces, 3, 256))], axis=2).astype(np.float32)
    for piece in range(pieces):
        for k in range(2):
            for n in range(8):
                dims = [_operand_dim(k, n, j) for j in range(P.FP4_WORDS)]
                got = q[0, :, 8 * k + n, piece * m : (piece + 1) * m].reshape(hbs * m, -1)
                np.testing.assert_array_equal(got, rows[0, piece][:, dims])


def test_unpermute_fp4_inverts_the_v_operand_order():
    """O^T row 128k + 16n + j holds V operand n's column j of slice k."""
    operand_order = np.zeros(256)
    for k in range(2):
        for n in range(8):
            for j in range(16):
                operand_order[128 * k + 16 * n + j] = _operand_dim(k, n, j)
    natural = np.asarray(P.unpermute_fp4(jnp.asarray(operand_order[None, None])))[0, 0]
    np.testing.assert_array_equal(natural, np.arange(256))


def _run_fp4_ptx(text: str, word: int) -> list[float]:
    """``_FP4_PTX`` on one uint32 word with the scale pair 1.0, 1.0 -> the two bf16 results
    (bf16 subnormals kept, as the GPU's ``mul.rn.bf16x2``)."""
    (regs,), _ = ptx_sim.run(text, {"$1": word, "$2": 0x3F803F80})
    return ptx_sim.bf16_pair(regs["$0"])


def test_q_scale_is_each_rows_own_and_puts_its_largest_q_below_float16s_limit():
    """A float16 format's q exponents (``q_max_ptx``, ``q_rows_ptx``'s scaling, the kernel's
    ``q_unscale``) for rows whose largest |values| span 0 to 2^127, infinity and NaN: each row's
    word holds its largest |bf16| bits, its e is the math's (e = 14 - floor(log2 max), at most
    64), 2^-e undoes it, the row's largest value is staged as float16 times 2^e, finite, and a
    row's scale does not depend on any other row's values."""
    maxima = [0.0, 2.0**-60, 2.0**-50, 1.0, 1.5, -3.0, 65504.0, 2.0**127, 2.0**-100, 7.0]
    maxima += [float("inf"), float("nan"), 2.0**20, -(2.0**-20), 0.25, 3.0]
    fmt = D.row_format(1, 16)
    q = np.zeros((16, 576), np.float32)
    for r, top in enumerate(maxima):
        q[r, 100], q[r, 560], q[r, 3] = top, top / 4, -top / 3  # dim 100: block 0, column 50
    bits = O.f32_to_bf16_bits(q)
    mem = _stage_q(fmt, bits, 0)
    words = mem.array("q_max", np.uint32)[:16]
    np.testing.assert_array_equal(words, (bits & 0x7FFF).max(axis=1))
    e = _q_scale(bits)
    np.testing.assert_array_equal(np.asarray(P.q_exponent(words)), e)
    np.testing.assert_array_equal(np.asarray(P.q_unscale(words)), (2.0**-e).astype(np.float32))
    staged = _unswizzle(mem.array("lat", np.uint8), 16).view(np.float16)[0, :, 50]
    exact = O.bf16_bits_to_f64(bits[:, 100]).astype(np.float32)
    for r, top in enumerate(maxima):
        if math.isfinite(top):
            assert staged[r] == np.float16(exact[r] * np.float32(2.0 ** e[r])), r
            assert abs(float(staged[r])) < 2.0**15, r


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("parity", [0, 1])
def test_fp8_ptx_is_the_e4m3_value_of_each_words_byte(parity, dtype):
    """Every pair of e4m3 codes at byte ``parity`` of two uint16 words (one register), the
    other bytes random, through ``_fp8_ptx``'s instructions: the codes' values (NaN for NaN),
    the first word's in the low half, as bf16 or float16 pairs."""
    text = P._fp8_ptx(parity, dtype)
    rng = np.random.default_rng(parity)
    others = rng.integers(0, 256, (256, 256, 2))
    for lo, hi in itertools.product(range(256), repeat=2):
        other = [int(x) << 8 * (1 - parity) for x in others[lo, hi]]
        word = (lo << 8 * parity | other[0]) | (hi << 8 * parity | other[1]) << 16
        (regs,), _ = ptx_sim.run(text, {"$1": word})
        if dtype == jnp.float16:
            got = [float(x) for x in np.array([regs["$0"]], np.uint32).view(np.float16)]
        else:
            got = ptx_sim.bf16_pair(regs["$0"])
        for code, value in zip((lo, hi), got, strict=True):
            want = O.E4M3_TABLE[code]
            assert value == want or (math.isnan(want) and math.isnan(value)), (code, value)
            assert math.copysign(1, value) == math.copysign(1, want) or math.isnan(want)


@pytest.mark.parametrize("scale", [2.0**-13, 1.0, 2.0**7, 0.3])
@pytest.mark.parametrize("parity", [0, 1])
def test_scaled_fp8_ptx_rounds_each_code_times_its_scale_once(parity, scale):
    """``_fp8_ptx(..., scaled=True)`` (``_wide``'s K and V): every e4m3 code at byte
    ``parity``, beside a random code, times the float32 scale in $2, rounded to bf16 once:
    exactly the product for the writer's power-of-two scales (0.3: its float32 product
    rounded to bf16)."""
    text = P._fp8_ptx(parity, jnp.bfloat16, scaled=True)
    bits = int(np.array(scale, np.float32).view(np.uint32))
    rng = np.random.default_rng(parity)
    for lo in range(256):
        hi = int(rng.integers(0, 256))
        word = lo << 8 * parity | hi << (16 + 8 * parity)
        (regs,), _ = ptx_sim.run(text, {"$1": word, "$2": bits})
        for code, value in zip((lo, hi), ptx_sim.bf16_pair(regs["$0"]), strict=True):
            product = np.float32(O.E4M3_TABLE[code]) * np.float32(scale)
            want = float(O.round_bf16(np.array([product], np.float64))[0])
            if scale != 0.3 and math.isfinite(want):
                assert want == O.E4M3_TABLE[code] * scale, code
            assert value == want or (math.isnan(want) and math.isnan(value)), (code, value)


def test_wide_kernel_refuses_unfinished_partials_by_name():
    """The 64-head kernel writes rows in the natural dim order: asked for the O^T partials a
    caller merges itself (``finished=False``), it raises rather than write another layout."""
    fmt = K.row_format(128, wide=True)
    args = (
        jax.ShapeDtypeStruct((1000, 656), jnp.uint8),
        jax.ShapeDtypeStruct((64,), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((1, 128, 576), jnp.bfloat16),
    )

    def call(kv, idx, indptr, q):
        lists = (indptr, P.SplitRule(64, 2, P.T))
        return attention(fmt, kv, idx, lists, q, 0.1, 1.0, finished=False)

    with pytest.raises(NotImplementedError, match="writes finished latent rows"):
        jax.eval_shape(call, *args)


@pytest.mark.parametrize(
    "n_q, h, topk, wide",
    [
        (128, 128, 2048, True),
        (128, 64, 2048, True),
        (3, 40, 64, True),
        (34, 64, 2048, True),
        (17, 128, 2048, True),
        (16, 128, 2048, False),
        (1, 128, 2048, False),
        (16, 32, 64, False),
    ],
)
def test_wide_kernel_past_32_heads_but_at_few_rows_with_splits(n_q, h, topk, wide):
    """Past 32 heads ``sparse_mla`` runs ``_wide``'s 64-head CTAs from ``WIDE_MIN_ROWS`` query
    rows on (their key lists split where the grid needs it) or where they fill the GPU without
    splits, else the 32-row kernel's splits; either way one Mosaic GPU call whose SMEM fits
    (lowering checks it)."""
    assert K.uses_wide(n_q, h, n_q * topk) == wide
    text = _lowered_text(n_q, h, 5000, topk)
    assert len(re.findall(r"stablehlo\.custom_call @mosaic_gpu", text)) == 1


@pytest.mark.parametrize("nibble", range(4))
def test_fp4_ptx_is_the_e2m1_values_times_2_to_the_minus_6(nibble):
    """Every pair of codes at nibbles ``nibble`` and ``nibble`` + 4 of a word, the other
    nibbles random, through ``_fp4_ptx``'s instructions: sign and value * 2^-6 exactly."""
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    text = P._fp4_ptx(nibble)
    rng = np.random.default_rng(nibble)
    for lo, hi in itertools.product(range(16), repeat=2):
        keep = ~((0xF << 4 * nibble) | (0xF << 4 * nibble + 16)) & 0xFFFFFFFF
        word = int(rng.integers(0, 2**32)) & keep | lo << 4 * nibble | hi << 4 * nibble + 16
        for code, got in zip((lo, hi), _run_fp4_ptx(text, word), strict=True):
            want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7] * 2.0**-6
            assert got == want and math.copysign(1, got) == math.copysign(1, want), (code, got)


def test_ue8m0_ptx_is_each_columns_group_scale_in_both_halves():
    """``_UE8M0_PTX`` on every byte value at each of a word's 4 bytes (the others random):
    both bf16 halves are 2^(e - 127), as float32 bits e << 23 rounded to bf16 (0 at e = 0,
    infinity at e = 255)."""
    rng = np.random.default_rng(0)
    for byte, e in itertools.product(range(4), range(256)):
        word = int(rng.integers(0, 2**32)) & ~(0xFF << 8 * byte) | e << 8 * byte
        regs, _ = ptx_sim.run(P._UE8M0_PTX, {"$1": word, "$2": 8 * byte})
        want = float(np.array(e << 23, np.uint32).view(np.float32).astype(jnp.bfloat16))
        assert ptx_sim.bf16_pair(regs[0]["$0"]) == [want, want], (byte, e)


def _uq_lowered_text(b, hq, hk, slot_bytes=272, implementation="mosaic", blocks=40, **options):
    args = (
        jax.ShapeDtypeStruct((b, hq, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((blocks, 16, hk, slot_bytes), jnp.uint8),
        jax.ShapeDtypeStruct((b, 7), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )
    fn = functools.partial(jsm.ultraquant_decode, implementation=implementation, **options)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("hq", [8, 24])
@pytest.mark.parametrize("exact_q", [False, True])
def test_ultraquant_q_enters_as_one_bf16_piece_or_three_with_exact_q(exact_q, hq):
    """The kernel's q operand [B, Hk, FP4_SLICES, pieces * m, FP4_WORDS] bf16: the e4m3 q is
    one piece (m wgmma columns per K operand), ``exact_q``'s float32 q three; both lower."""
    m = U.row_format(hq, 16).m
    pieces, other = (EXACT_Q_PIECES, 1) if exact_q else (1, EXACT_Q_PIECES)
    assert U.row_format(hq, 16, exact_q=exact_q).q_pieces == pieces
    text = _uq_lowered_text(2, hq, 1, exact_q=exact_q)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1

    def operand(n):
        return f"tensor<2x1x{P.FP4_SLICES}x{n * m}x{P.FP4_WORDS}xbf16>"

    assert operand(pieces) in text and operand(other) not in text


def test_lowering_calls_no_deprecated_jax_api():
    """Lowering each kernel variant (``sparse_mla``; ``mla_decode`` at 16 and 32 rows, causal;
    ``ultraquant_decode``) raises no DeprecationWarning at a line of this package: jax 0.11
    deprecated ``plgpu.transpose_ref``, and such a warning announces a removal that would
    break the kernels. (jax 0.10 warns of nothing here; the check bites from jax 0.11.)"""
    package = os.path.dirname(jsm.__file__) + os.sep
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lowered_text(2, 16, 1000, 128)
        _decode_lowered_text("mla_decode", 2, 1, 16, 1000, 256)
        _decode_lowered_text("mla_decode", 2, 2, 12, 1000, 256)
        _uq_lowered_text(2, 8, 1)
    ours = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, DeprecationWarning) and w.filename.startswith(package)
    ]
    assert not ours, "\n".join(ours)


@pytest.mark.parametrize(
    "hq,hk,blocks", [(8, 1, 40), (16, 2, 40), (24, 1, 40), (2, 2, 40), (64, 8, 130_000)]
)
def test_ultraquant_cuda_lowering_hands_the_cache_itself_to_the_kernel(hq, hk, blocks):
    """One Mosaic GPU call whose cache operand is the argument reshaped and bitcast to uint32
    (views: one row of Hk slots per token, 4 bytes a word) and whose index operand is the
    block table itself: no slot list. Also past 4 GiB of cache (130,000 blocks of 16 tokens of
    8 slots: 4.2 GiB; the gather's byte offsets are 64-bit)."""
    text = _uq_lowered_text(3, hq, hk, blocks=blocks)
    calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    assert len(calls) == 1, text[:2000]
    cache, table = (x.strip() for x in calls[0].split(",")[:2])
    rows = f"{16 * blocks}x{68 * hk}"
    bitcast = rf"{cache} = stablehlo\.bitcast_convert (%\w+) : .* -> tensor<{rows}xui32>"
    words = re.search(bitcast, text)
    assert words, text[:2000]
    shape = rf"tensor<{rows}x4xui8>"
    assert re.search(rf"{words.group(1)} = stablehlo\.reshape %arg1 : .* -> {shape}", text)
    assert re.search(rf"{table} = stablehlo\.reshape %arg2 : .* -> tensor<21xi32>", text)


@pytest.mark.parametrize("sm90", [True, False])
@pytest.mark.parametrize("hq,hk,slot_bytes", [(8, 1, 272), (32, 1, 288), (33, 1, 272), (4, 2, 276)])
def test_ultraquant_none_lowers_to_mosaic_on_hopper_where_it_can(
    monkeypatch, sm90, hq, hk, slot_bytes
):
    """implementation=None for CUDA: the Mosaic GPU kernel on a Hopper GPU up to 32 query heads
    per KV head with slots a multiple of 16 bytes (its bulk copies), else the Pallas one."""
    monkeypatch.setattr(_platform, "cuda_is_sm90", lambda: sm90)
    text = _uq_lowered_text(2, hq, hk, slot_bytes, implementation=None)
    mosaic = sm90 and hq // hk <= 32 and slot_bytes % 16 == 0
    assert ("@mosaic_gpu" in text) == mosaic
    assert ("__gpu$xla.gpu.triton" in text) == (not mosaic)


@pytest.mark.parametrize(
    "hq,slot_bytes,why", [(33, 272, "at most 32 query heads"), (8, 276, "multiple of 16")]
)
def test_ultraquant_mosaic_refuses_what_it_cannot_run_by_name(hq, slot_bytes, why):
    with pytest.raises(NotImplementedError, match=why):
        _uq_lowered_text(2, hq, 1, slot_bytes)


def test_ultraquant_vmap_runs_the_kernel_once_per_batch_element():
    args = (
        jax.ShapeDtypeStruct((3, 2, 8, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((40, 16, 1, 272), jnp.uint8),
        jax.ShapeDtypeStruct((3, 2, 7), jnp.int32),
        jax.ShapeDtypeStruct((3, 2), jnp.int32),
    )
    fn = jax.vmap(
        lambda q, c, t, s: jsm.ultraquant_decode(q, c, t, s, implementation="mosaic"),
        (0, None, 0, 0),
    )
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "stablehlo.while" in text
