"""The warp-specialized attention pipeline of the Mosaic GPU kernels (Hopper, sm_90a).

Both Mosaic kernels (``sparse_mla`` over fp8_ds_mla records, ``mla_decode`` over the fp8 latent
cache) run this one kernel body, told apart by a ``RowFormat``. One CTA owns ``m`` = 16 or 32
query rows (heads, or a request's (position, head) rows) and one split of a key list, walked in
tiles of ``T`` = 64 keys. Three warpgroups:

* the producer gathers a tile into a ring of SMEM stages: lane j of its 128 threads takes index
  j of the tile and copies that key's cache row into SMEM row j with one ``cp.async.bulk``,
  stores the index (-1 when masked) and, for fp8_ds_mla, copies the record's four scales with
  ``cp.async``; lane 0 then arms the stage's mbarrier with the tile's bytes. The indices of the
  next tile are prefetched into SMEM with ``cp.async`` too, so no global load waits on the
  producer's path. This is inline PTX: Mosaic GPU's own copy primitive makes all 128 threads
  arrive on the barrier for every copy and moves only multiples of 128 bytes;
* ``CONSUMERS`` = 2 consumers split each tile's latent dims: consumer c converts chunks 2c and
  2c + 1 of K's fp8 codes to bf16 in registers (exact) and computes its part of the transposed
  scores S^T [keys, rows] = K Q^T on wgmma (K as the A operand, Q^T from swizzled SMEM;
  consumer 0 adds the rope); the parts are added through SMEM, in one order in every consumer
  (the same bits in each); consumer 0 runs the per-row max and sum of the f32 online softmax
  and hands them to the others; each accumulates O^T [dims, rows] += V^T P^T for its 256 dims,
  V being the bf16 codes it stored to swizzled SMEM. Rows are wgmma's N dimension, so 16 rows
  cost 16 columns. One consumer alone left the SM idle between dependent instructions; two
  halve each one's registers and share the one bf16 V tile SMEM holds. Rows are wgmma's N, so
32 rows per CTA cost registers and SMEM (one fewer stage), not instructions: every CTA
converts and multiplies each key's codes once for all its rows.

Numerics: scales multiply partial scores and P (rounded to bf16 after that product), never K or
V, so every product is exact and accumulation is f32.

Layout: a row's latent codes are read as uint16 words; word w holds latent dims 2w (low byte)
and 2w + 1 (high byte), so a 64-word column block of chunk c gives the 64 even and the 64 odd
dims of that chunk. q's latent dims are permuted to that order (8 operand blocks of 64 dims,
(chunk, parity)) and the output permuted back. The cache and the index list reach the kernel
as they are: no view, pad, gather or copy of either.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_sparse_mla.formats import LATENT_DIM, ROPE_DIM
from jax_sparse_mla.reference.attention import merge_partials

T = 64  # keys per tile (one SMEM stage; wgmma's M for the transposed scores)
DB = 64  # dims per operand block (128 bytes of bf16: one swizzled row)
CHUNKS = 4  # latent chunks of 128 dims (fp8_ds_mla's scale blocks)
LATENT_BLOCKS = 2 * CHUNKS  # (chunk, parity) operand blocks of the latent dims
CONSUMERS = 2  # consumer warpgroups per CTA, each owning CHUNKS // CONSUMERS latent chunks
OWN = LATENT_BLOCKS // CONSUMERS  # operand blocks (chunk, parity) per consumer: 4
SMEM_BYTES = 227 * 1024  # an H200 CTA's shared memory
SMEM_SLACK = 12288  # barriers, reduction scratch and alignment, measured on the CUDA lowering
MAX_STAGES = 4
MIN_SPLIT_TILES = 2  # a split keeps at least this many tiles of an average row
TARGET_CTAS = 132  # one CTA per H200 SM at a time
LOG2E = math.log2(math.e)
WORK = 32  # int32 words per CTA work entry (Pallas copies move multiples of 128 bytes)
PRODUCER_BARRIER = 15  # a named barrier id that Mosaic GPU's own (1 + warpgroup) never takes
CONSUMER_BARRIER = 14  # the consumers' named barrier (128 * CONSUMERS threads), likewise free
PRODUCER_REGISTERS = 40
MAX_ROWS = 2**31  # the gather's record indices are int32


class RowFormat(NamedTuple):
    """What the kernel body needs to know of one cache format (all static).

    row_bytes: bytes of one key's row in the cache (one ``cp.async.bulk``, a multiple of 16).
    pitch: SMEM bytes per staged row: ``row_bytes`` or a little more, such that 8 rows' 16-byte
      slices at one column land on 32 distinct banks (pitch / 4 = 4 mod 8 words).
    scales_offset: byte offset of the row's CHUNKS float32 scales (per-chunk dequantization, a
      factor of the chunk's partial scores and of P), or None: one scale per call.
    rope_word: first uint16 word of the rope's 64 dims.
    rope_fp8: the rope is 64 e4m3 codes (two 32-dim parity blocks), else 64 bf16 values.
    qlen: query positions per request; past 1 the rows are causal: row r (position r // H of
      ``qlen``) sees key positions j <= length - qlen + r // H, and V codes that are NaN are
      zeroed (a hidden NaN key must not reach a row; a visible one already made its score NaN).
    m: query rows per CTA, 16 or 32 (wgmma's N for the scores and the output).
    """

    row_bytes: int
    pitch: int
    scales_offset: int | None
    rope_word: int
    rope_fp8: bool
    qlen: int = 1
    m: int = 16

    @property
    def causal(self) -> bool:
        return self.qlen > 1

    @property
    def rope_blocks(self) -> int:
        """Rope operand blocks: two parity blocks of 32 dims (fp8), or one of 64 (bf16)."""
        return 2 if self.rope_fp8 else 1

    @property
    def p_blocks(self) -> int:
        """bf16 P^T blocks: one per latent chunk (each scaled by its chunk's scales), or one
        per consumer."""
        return CHUNKS if self.scales_offset is not None else CONSUMERS


def _mgpu():
    """(plgpu, mgpu utils, ir, llvm, nvvm, arith): CUDA-only imports, made when tracing."""
    import jax.experimental.mosaic.gpu.utils as mgpu_utils  # noqa: PLC0415
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import arith, llvm, nvvm  # noqa: PLC0415

    return plgpu, mgpu_utils, ir, llvm, nvvm, arith


@functools.cache
def _load_needs_index() -> bool:
    """jax 0.10's ``plgpu.load`` requires an index argument; jax >= 0.11 deprecates it."""
    params = inspect.signature(_mgpu()[0].load).parameters
    return params["idx"].default is inspect.Parameter.empty


def load(ref, layout):
    """The whole of SMEM view ``ref`` in registers with ``layout`` (the view is indexed with
    ``.at``, never through ``plgpu.load``'s index argument)."""
    plgpu = _mgpu()[0]
    if _load_needs_index():
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def consumer_registers() -> int:
    """Registers per consumer thread (``setmaxnreg``): the CTA's launch allocation (65536 per
    SM split evenly over its threads, in multiples of 8, as ptxas allots for ``.maxntid``) less
    the producer's, shared by the consumers. 232 with two consumers."""
    threads = 128 * (CONSUMERS + 1)
    launch = 65536 // threads // 8 * 8 * threads
    return (launch - 128 * PRODUCER_REGISTERS) // (128 * CONSUMERS) // 8 * 8


def stages_for(fmt: RowFormat) -> int:
    """Row stages that fit in SMEM beside q, P^T and V (bf16), and each consumer's partial
    scores and output staging (f32)."""
    m = fmt.m
    fixed = (
        ((LATENT_BLOCKS * DB + ROPE_DIM) * m + fmt.p_blocks * T * m + LATENT_BLOCKS * T * DB) * 2
        + CONSUMERS * (DB * m + T * m) * 4
        + 2 * T * 4
        + SMEM_SLACK
    )
    per_row = fmt.pitch + 4 + (4 * CHUNKS if fmt.scales_offset is not None else 0)
    return max(1, min(MAX_STAGES, (SMEM_BYTES - fixed) // (T * per_row)))


def row_blocks(fmt: RowFormat, heads: int) -> int:
    """CTAs per query row or decode request (and split): its qlen * heads rows in blocks of
    ``fmt.m``."""
    return -(-(fmt.qlen * heads) // fmt.m)


def permute_latent(rows, hbs: int, m: int):
    """[G, R, 512] -> [G, hbs, LATENT_BLOCKS, m, DB]: rows padded to hbs * m; block 2c + p
    holds dims 128c + 2j + p (the order of a row's uint16 words)."""
    g, r, _ = rows.shape
    rows = jnp.pad(rows, ((0, 0), (0, m * hbs - r), (0, 0)))
    lat = rows.reshape(g, hbs, m, CHUNKS, DB, 2).transpose(0, 1, 3, 5, 2, 4)
    return lat.reshape(g, hbs, LATENT_BLOCKS, m, DB)


def unpermute_out(o):
    """[..., 512] in (chunk, parity, j) order -> natural latent order."""
    lead = o.shape[:-1]
    return o.reshape(*lead, CHUNKS, 2, DB).swapaxes(-1, -2).reshape(*lead, LATENT_DIM)


_GATHER_PTX = """{
.reg .pred lead, act, ok, first, later, pre;
.reg .b32 lane, slot;
.reg .s32 key, k0, rest;
.reg .b64 a, src, dst, st, sc, rg, nx;
mov.u32 lane, %tid.x;
and.b32 lane, lane, 127;
setp.lt.u32 lead, lane, TILE_KEYS;
setp.lt.s32 act, lane, $5;
and.pred act, act, lead;
setp.eq.u32 first, $8, 0;
setp.ne.u32 later, $8, 0;
and.pred later, act, later;
and.pred first, act, first;
mul.wide.u32 a, lane, 4;
and.b32 slot, $8, 1;
mul.wide.u32 rg, slot, RING_SLOT;
add.u64 rg, rg, a;
add.u64 rg, rg, $7;
add.u64 sc, a, $1;
mov.s32 key, -1;
@first ld.global.nc.s32 key, [sc];
cp.async.wait_all;
@later ld.shared.s32 key, [rg];
setp.ge.s32 ok, key, 0;
@ok setp.lt.s32 ok, key, ROWS;
selp.s32 k0, key, 0, ok;
selp.s32 key, key, -1, ok;
mul.wide.s32 src, k0, ROW_BYTES;
add.u64 src, src, $0;
selp.b64 src, src, $6, ok;
mul.wide.u32 dst, lane, PITCH;
add.u64 dst, dst, $2;
@lead cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [dst], [src], ROW_BYTES, [$3];
add.u64 st, a, $4;
@lead st.shared.s32 [st], key;
SCALE_COPIES
sub.s32 rest, $5, TILE_KEYS;
setp.lt.s32 pre, lane, rest;
and.pred pre, pre, lead;
xor.b32 slot, slot, 1;
mul.wide.u32 nx, slot, RING_SLOT;
add.u64 nx, nx, a;
add.u64 nx, nx, $7;
@pre cp.async.ca.shared.global [nx], [sc+RING_SLOT], 4;
bar.sync PRODUCER_BARRIER, 128;
setp.eq.u32 lead, lane, 0;
@lead mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 st, [$3], TILE_BYTES;
}"""


def _scale_ptx(offset: int) -> str:
    """Lane j copies its row's CHUNKS float32 scales (at byte ``offset``) to ``sc[c, j]``, and
    the stage's mbarrier waits for these copies too."""
    copies = (
        f"@lead cp.async.ca.shared.global [st+{4 * T * c}], [src+{offset + 4 * c}], 4;"
        for c in range(CHUNKS)
    )
    return "\n".join(
        ["add.u64 st, a, $9;", *copies, "@lead cp.async.mbarrier.arrive.shared::cta.b64 [$3];"]
    )


def gather_ptx(fmt: RowFormat, rows: int) -> str:
    """The producer's PTX for one tile (operands: see ``_gather_tile``)."""
    scales = "" if fmt.scales_offset is None else _scale_ptx(fmt.scales_offset)
    text = _GATHER_PTX.replace("SCALE_COPIES", scales)
    for name, value in {
        "TILE_BYTES": T * fmt.row_bytes,
        "TILE_KEYS": T,
        "ROW_BYTES": fmt.row_bytes,
        "PITCH": fmt.pitch,
        "RING_SLOT": 4 * T,
        "PRODUCER_BARRIER": PRODUCER_BARRIER,
        "ROWS": rows,
    }.items():
        text = text.replace(name, str(value))
    return text


_INIT_PTX = """{
.reg .pred lead;
.reg .b32 tid;
mov.u32 tid, %tid.x;
setp.eq.u32 lead, tid, 0;
INITS
fence.mbarrier_init.release.cluster;
bar.sync 0;
}"""


def _init_barriers(bars_ref, count: int):
    """Thread 0 initializes ``count`` mbarriers (one arrival each); then the whole CTA syncs."""
    plgpu, mgpu_utils, ir, llvm, _, _ = _mgpu()

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def init(ctx, bars):
        del ctx
        inits = "\n".join(
            f"@lead mbarrier.init.shared::cta.b64 [$0+{8 * i}], 1;" for i in range(count)
        )
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [mgpu_utils.memref_ptr(bars)],
            _INIT_PTX.replace("INITS", inits),
            "l",
            has_side_effects=True,
        )

    init(bars_ref)


def _gather_tile(fmt: RowFormat, refs, remaining, t, rows: int):
    """Producer warpgroup, tile ``t`` of keys ``idx[:min(T, remaining)]``.

    ``refs`` = (cache, idx, raw, bar, ids, zero, ring[, sc]). Lane j < T: ``key = idx[j]``
    (read from global memory on tile 0, else from slot t % 2 of ``ring``, where tile t - 1
    prefetched it; -1 past ``remaining`` or outside [0, rows): such a key's row is never read;
    the all-zero row ``zero`` is copied in its place, so its K, V and scales are 0 and the
    tile's byte count is fixed); one ``cp.async.bulk`` of that row -> ``raw[j]`` (pitch
    ``fmt.pitch``) completing on ``bar``; ``ids[j] = key``; with per-chunk scales ``sc[c, j]`` =
    the row's scale c, four 4-byte ``cp.async`` copies that ``bar`` also waits for
    (``cp.async.mbarrier.arrive``); then ``idx[T + j]`` -> ring slot (t + 1) % 2 with
    ``cp.async`` where tile t + 1 has key j (each lane reads back only what it copied, after
    ``cp.async.wait_all``). After a producer-wide barrier lane 0 arms ``bar`` with the tile's
    bytes, a release: the ids are visible to whoever acquires the completed phase.
    """
    plgpu, mgpu_utils, ir, llvm, _, _ = _mgpu()
    splat = plgpu.Layout.WG_SPLAT(shape=())
    ref = plgpu.RefType()
    scales = fmt.scales_offset is not None
    arg_types = (ref,) * 5 + (splat,) + (ref,) * 2 + (splat,) + (ref,) * scales

    @plgpu.inline_mgpu(arg_types=arg_types)
    def gather(ctx, cache, idx, raw, bar, ids, remaining, zero, ring, t, *sc):
        del ctx
        ptr = mgpu_utils.memref_ptr
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [
                *(ptr(r) for r in (cache, idx, raw, bar, ids)),
                remaining.registers.item(),
                ptr(zero),
                ptr(ring),
                t.registers.item(),
                *(ptr(r) for r in sc),
            ],
            gather_ptx(fmt, rows),
            "l,l,l,l,l,r,l,l,r" + ",l" * scales,
            has_side_effects=True,
        )

    cache, idx, raw, bar, ids, zero, ring, *sc = refs
    gather(cache, idx, raw, bar, ids, remaining, zero, ring, t, *sc)


def _wait(bar_ref, parity):
    """Every thread of the warpgroup waits for (acquires) phase ``parity`` of the mbarrier."""
    plgpu, mgpu_utils, ir, _, nvvm, arith = _mgpu()

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())))
    def wait(ctx, bar, parity):
        del ctx
        ticks = arith.constant(ir.IntegerType.get_signless(32), 10_000_000)
        nvvm.mbarrier_try_wait_parity(mgpu_utils.memref_ptr(bar), parity.registers.item(), ticks)

    wait(bar_ref, parity)


def _consumers_barrier():
    """The consumer warpgroups meet; their SMEM accesses before it precede those after."""
    plgpu, _, ir, llvm, _, _ = _mgpu()

    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [],
            f"bar.sync {CONSUMER_BARRIER}, {128 * CONSUMERS};",
            "",
            has_side_effects=True,
        )

    sync()


def _to_bf16(codes):
    """uint8 e4m3 codes -> bf16 values (through f16; both conversions exact)."""
    f8 = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    return f8.astype(jnp.float16).astype(jnp.bfloat16)


def _byte(words, parity: int):
    """Byte ``parity`` (0 low, 1 high) of uint16 words, as uint8."""
    return ((words >> (8 * parity)) & 0xFF).astype(jnp.uint8)


def _kernel(*refs, fmt: RowFormat, **smem):
    """One CTA: rows [hb * m, hb * m + m) of group g, split ``split`` of its keys (m =
    ``fmt.m``).

    Inputs (GMEM): cache [N, row_bytes] uint8; idx [nnz] int32 (a tile's slice may extend past
    nnz: entries past its key count are never read); zero [row_bytes] uint8 (the row copied for
    a masked key); q_lat [G, HB, LATENT_BLOCKS, m, DB] bf16; q_rope [G, HB, rope_blocks, m,
    64 / rope_blocks] bf16; work [G, S, WORK] int32 (first position in idx, key count, first
    key position of the split within its group's list, the list's length, 0...); scale [128]
    f32 (the score scale in log2 units, then the output scale); causal only: rowpos [HB, 64]
    int32 (each row's query position), iota [64] int32. Outputs: o [G, S, HB, 512, m] f32
    (O^T, permuted dims); lse [G, S, HB, 64] f32 (log2 units in the first m entries; -inf for
    a row without keys). ``smem``: ``_scratch``'s buffers and barriers.

    Warpgroups 0 .. CONSUMERS - 1 consume, warpgroup CONSUMERS produces. Consumer c converts,
    scores and accumulates only its own latent chunks (consumer 0 also the rope): the partial
    scores meet in SMEM (``s``) and each consumer adds them in the same order; consumer 0 alone
    runs the cross-warp softmax reductions (Mosaic GPU's reduction scratch is one per CTA) and
    hands the running max, then the sum, to the others (``ml``); each accumulates O^T for its
    own dims.

    Registers: a K block in registers is wgmma's A operand until that wgmma completes. At 32
    rows (twice the accumulators) ptxas spilled 156 bytes (332 causal) per thread with all of a
    consumer's K blocks in flight, so each waits for the one before it: 8 (168) bytes, and
    1.10x (1.05x causal) faster on the H200. At 16 rows nothing spills and the wgmmas queue.
    """
    plgpu = _mgpu()[0]
    m = fmt.m
    cache, idx_ref, zero, q_lat, q_rope, work_ref, scale_ref, *causal_refs, o_ref, lse_ref = refs
    s = smem
    hbs = q_lat.shape[1]
    g = jax.lax.div(jax.lax.axis_index("gh"), hbs)
    hb = jax.lax.rem(jax.lax.axis_index("gh"), hbs)
    split = jax.lax.axis_index("split")
    wg = jax.lax.axis_index("wg")
    stages = stages_for(fmt)
    chunk_scales = fmt.scales_offset is not None
    wgmma = plgpu.Layout.WGMMA
    per_key = wgmma.reduce(1)  # one value per row of S^T (a key)
    per_row = wgmma.reduce(0)  # one value per column of S^T (a query row)

    def by_key(v):  # [T] per-key values broadcast over the rows: [T, m]
        return jax.lax.broadcast_in_dim(v, (T, m), [0])

    def by_row(v, n=T):  # [m] per-row values broadcast: [n, m]
        return jax.lax.broadcast_in_dim(v, (n, m), [1])

    _init_barriers(s["rec_bars"], stages)
    setup = [(q_lat.at[g, hb], s["q_lat"]), (q_rope.at[g, hb], s["q_rope"])]
    setup += [(work_ref.at[g, split], s["work"]), (scale_ref, s["scale"])]
    if fmt.causal:
        setup += [(causal_refs[0].at[hb], s["rowpos"]), (causal_refs[1], s["iota"])]

    @pl.when(wg == 0)
    def _():
        for src, dst in setup:
            plgpu.copy_gmem_to_smem(src, dst, s["setup"])

    plgpu.barrier_wait(s["setup"])
    first, length, lo, total = (s["work"][i] for i in range(4))
    count = (length + T - 1) // T

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        @pl.loop(0, count)
        def _(t):
            stage = jax.lax.rem(t, stages)

            @pl.when(t >= stages)
            def _():
                plgpu.barrier_wait(s["consumed"].at[stage])

            stage_refs = [
                cache,
                idx_ref.at[pl.ds(first + t * T, T)],
                s["raw"].at[stage],
                s["rec_bars"].at[pl.ds(stage, 1)],
                s["ids"].at[stage],
                zero,
                s["ring"],
            ]
            if chunk_scales:
                stage_refs.append(s["sc"].at[stage])
            _gather_tile(fmt, stage_refs, length - t * T, t, cache.shape[0])

    def consume(c: int):
        plgpu.set_max_registers(consumer_registers(), action="increase")
        score_scale = load(s["scale"].at[pl.ds(0, m)], per_row)
        out_scale = load(s["scale"].at[pl.ds(DB, m)], per_row)
        if fmt.causal:
            bound = total - fmt.qlen + load(s["rowpos"].at[pl.ds(0, m)], per_row)
            iota = load(s["iota"], per_key)
        blocks = range(OWN * c, OWN * (c + 1))
        chunks = range(OWN * c // 2, OWN * (c + 1) // 2)
        # accumulators of the scores: one per own chunk, then the rope's (scaled chunks), or one
        n_acc = len(chunks) + (c == 0) if chunk_scales else 1

        def acc_of(b):
            return b // 2 - chunks[0] if chunk_scales else 0

        def p_block(b):
            return b // 2 if chunk_scales else c

        def scores(stage):
            """This consumer's unscaled S^T parts [T, m] f32 (``n_acc`` of them). Its bf16 K
            blocks also go to ``v`` for P @ V. One wgmma wait for all."""

            def run(accs):
                for b in blocks:
                    w = load(s["raw"].at[stage, :, pl.ds(DB * (b // 2), DB)], wgmma)
                    k = _to_bf16(_byte(w, b % 2))
                    s["v"][b] = jnp.where(jnp.isnan(k), 0, k) if fmt.causal else k
                    q_t = plgpu.transpose_ref(s["q_lat"].at[b], (1, 0))
                    plgpu.wgmma(accs[acc_of(b)], k, q_t)
                    if m > 16:  # at most two K blocks' registers live (see ``_kernel``)
                        plgpu.wgmma_wait(1)
                if c == 0:
                    width = ROPE_DIM // fmt.rope_blocks
                    w = load(s["raw"].at[stage, :, pl.ds(fmt.rope_word, width)], wgmma)
                    for r in range(fmt.rope_blocks):
                        if fmt.rope_fp8:
                            k = _to_bf16(_byte(w, r))
                        else:
                            k = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
                        q_t = plgpu.transpose_ref(s["q_rope"].at[r], (1, 0))
                        plgpu.wgmma(accs[n_acc - 1], k, q_t)
                return [a[...] for a in accs]

            return pl.run_scoped(run, [plgpu.ACC((T, m), jnp.float32)] * n_acc)

        def tile(t, carry):
            m_run, l_run, accs = carry
            stage = jax.lax.rem(t, stages)
            _wait(s["rec_bars"].at[pl.ds(stage, 1)], jax.lax.rem(t // stages, 2))
            ids = load(s["ids"].at[stage], per_key)
            if chunk_scales:
                sc = [load(s["sc"].at[stage, ch], per_key) for ch in chunks]
            parts = scores(stage)
            plgpu.barrier_arrive(s["consumed"].at[stage])  # this consumer's reads of it are done
            if chunk_scales:
                mine = parts[len(chunks)] if c == 0 else None
                for i in range(len(chunks)):
                    term = parts[i] * by_key(sc[i])
                    mine = term if mine is None else mine + term
            else:
                (mine,) = parts
            s["s"][c] = mine
            _consumers_barrier()  # every partial score is in SMEM
            parts = [mine if i == c else load(s["s"].at[i], wgmma) for i in range(CONSUMERS)]
            sc_t = functools.reduce(operator.add, parts)  # one order: the same bits in each
            visible = by_key(ids) >= 0
            if fmt.causal:
                visible = visible & (by_key(iota + (lo + t * T)) <= by_row(bound))
            sc_t = jnp.where(visible, sc_t * by_row(score_scale), -jnp.inf)  # log2 units
            if c == 0:
                m_new = jnp.maximum(m_run, sc_t.max(axis=0))
                s["ml"][pl.ds(0, m)] = m_new
            _consumers_barrier()  # the running max is in SMEM; every partial has been read
            if c != 0:
                m_new = load(s["ml"].at[pl.ds(0, m)], per_row)
            m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_run - m_ref)
            p = jnp.exp2(sc_t - by_row(m_ref))
            if c == 0:
                l_run = l_run * alpha + p.sum(axis=0)
            if chunk_scales:
                for i, ch in enumerate(chunks):
                    s["p"][ch] = (p * by_key(sc[i])).astype(jnp.bfloat16)
            else:
                s["p"][c] = p.astype(jnp.bfloat16)
            plgpu.commit_smem()  # P^T and V visible to wgmma

            def pv(acc_refs):
                for i, b in enumerate(blocks):
                    v_t = plgpu.transpose_ref(s["v"].at[b], (1, 0))
                    plgpu.wgmma(acc_refs[i], v_t, s["p"].at[p_block(b)])

            accs = pl.run_state(pv)(tuple(plgpu.ACC.init(a * by_row(alpha, DB)) for a in accs))
            return m_new, l_run, list(accs)

        m0 = plgpu.layout_cast(jnp.full((m,), -jnp.inf, jnp.float32), per_row)
        l0 = plgpu.layout_cast(jnp.full((m,), 0.0, jnp.float32), per_row)
        zero_acc = plgpu.layout_cast(jnp.zeros((DB, m), jnp.float32), wgmma)
        m_run, l_run, accs = jax.lax.fori_loop(0, count, tile, (m0, l0, [zero_acc] * OWN))
        if c == 0:
            s["ml"][pl.ds(DB, m)] = l_run
        _consumers_barrier()  # consumer 0's softmax sum is in SMEM
        if c != 0:
            l_run = load(s["ml"].at[pl.ds(DB, m)], per_row)
        has = l_run != 0
        inv_l = jnp.where(has, out_scale / jnp.where(has, l_run, 1.0), 0.0)
        for b, acc in zip(blocks, accs, strict=True):
            s["o"][c] = acc * by_row(inv_l, DB)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s["o"].at[c], o_ref.at[g, split, hb, pl.ds(DB * b, DB)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.commit_smem()  # (a warpgroup barrier) o[c] is free again for every thread
        if c == 0:
            s["lse"][pl.ds(0, m)] = jnp.where(
                has, m_run + jnp.log2(jnp.where(has, l_run, 1.0)), -jnp.inf
            )
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s["lse"], lse_ref.at[g, split, hb])
        plgpu.wait_smem_to_gmem(0)

    for c in range(CONSUMERS):
        pl.when(wg == c)(functools.partial(consume, c))


def _scratch(fmt: RowFormat) -> dict:
    """The SMEM buffers and barriers of one CTA (``_kernel``'s ``smem``)."""
    plgpu = _mgpu()[0]
    m, stages = fmt.m, stages_for(fmt)
    pv_swizzle = plgpu.find_swizzle(m * 16, "rhs")  # one P^T row: m bf16
    rope_width = ROPE_DIM // fmt.rope_blocks

    def swizzled(shape, swizzle):
        transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
        return plgpu.SMEM(shape, jnp.bfloat16, transforms=transforms)

    def f32(shape):
        """f32 [.., n, m] read and written in the WGMMA layout: rows of 64 bytes (m = 16) are
        bank-conflict free as they are, rows of 128 bytes (m = 32) need the 128-byte swizzle."""
        if 4 * m < 128:
            return plgpu.SMEM(shape, jnp.float32)
        transforms = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
        return plgpu.SMEM(shape, jnp.float32, transforms=transforms)

    setup_copies = 4 + 2 * fmt.causal
    scratch = {
        "q_lat": swizzled((LATENT_BLOCKS, m, DB), 128),
        "q_rope": swizzled((fmt.rope_blocks, m, rope_width), 2 * rope_width),
        "raw": plgpu.SMEM((stages, T, fmt.pitch // 2), jnp.uint16),
        "ids": plgpu.SMEM((stages, T), jnp.int32),
        "p": swizzled((fmt.p_blocks, T, m), pv_swizzle),
        "v": swizzled((LATENT_BLOCKS, T, DB), pv_swizzle),  # wgmma wants both swizzles equal
        "s": f32((CONSUMERS, T, m)),  # each consumer's partial scores
        "ml": plgpu.SMEM((2 * DB,), jnp.float32),  # consumer 0's running max, then its sum
        "o": f32((CONSUMERS, DB, m)),
        "lse": plgpu.SMEM((64,), jnp.float32),
        "work": plgpu.SMEM((WORK,), jnp.int32),
        "scale": plgpu.SMEM((2 * DB,), jnp.float32),
        "ring": plgpu.SMEM((2, T), jnp.int32),  # the producer's index ring (tile t + 1)
        "rec_bars": plgpu.SMEM((stages,), jnp.int64),  # the row mbarriers (inline PTX)
        "setup": plgpu.Barrier(num_arrivals=setup_copies),
        "consumed": plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
    }
    if fmt.scales_offset is not None:
        scratch["sc"] = plgpu.SMEM((stages, CHUNKS, T), jnp.float32)
    if fmt.causal:
        scratch["rowpos"] = plgpu.SMEM((64,), jnp.int32)
        scratch["iota"] = plgpu.SMEM((64,), jnp.int32)
    return scratch


def work(indptr, nnz: int, num_splits: int, align: int):
    """[G, S, WORK] int32: (first position in idx, key count, split start within the group's
    list, the list's length, then 0s) of each split; a list's splits are cut at multiples of
    ``align`` (a multiple of T). indptr entries are clipped to [0, nnz]."""
    start = jnp.clip(indptr[:-1], 0, nnz)
    length = jnp.clip(indptr[1:], start, nnz) - start
    per = align * ((length + align * num_splits - 1) // (align * num_splits))
    s = jnp.arange(num_splits, dtype=jnp.int32)[None, :]
    lo = jnp.minimum(s * per[:, None], length[:, None])
    hi = jnp.minimum(lo + per[:, None], length[:, None])
    full = jnp.broadcast_to(length[:, None], lo.shape)
    entries = jnp.stack([start[:, None] + lo, hi - lo, lo, full], axis=-1).astype(jnp.int32)
    return jnp.pad(entries, ((0, 0), (0, 0), (0, WORK - 4)))


def choose_splits(ctas: int, avg_tiles: float) -> int:
    """Splits per list so that the CTAs fill the GPU in one wave at most (a second, partial
    wave costs a whole tile walk), each split keeping at least MIN_SPLIT_TILES tiles of an
    average list."""
    want = TARGET_CTAS // max(ctas, 1)
    return int(max(1, min(want, avg_tiles // MIN_SPLIT_TILES)))


def attention(
    fmt: RowFormat, cache, idx, work_entries, q_lat, q_rope, score_scale, out_scale, positions=None
):
    """Runs the kernel: ``cache`` [N, row_bytes] uint8, ``idx`` [nnz] int32, ``work_entries``
    [G, S, WORK] (``work``), ``q_lat`` [G, HB, LATENT_BLOCKS, m, DB] and ``q_rope`` [G, HB,
    rope_blocks, m, 64 / rope_blocks] bf16, scalar scales (the score scale in natural units);
    causal formats: ``positions`` [HB * m] int32, each row's query position in [0, qlen).

    Returns o [G, S, HB * m, 512] f32 (natural dim order, each split normalized by its own sum
    and times ``out_scale``) and lse [G, S, HB * m] f32 (natural log; -inf without keys).
    """
    plgpu = _mgpu()[0]
    m = fmt.m
    if cache.shape[0] >= MAX_ROWS:
        raise NotImplementedError("the Mosaic GPU kernels read int32 record indices")
    g, splits, hbs = q_lat.shape[0], work_entries.shape[1], q_lat.shape[1]
    scale = jnp.concatenate(
        [
            jnp.full((DB,), jnp.asarray(score_scale, jnp.float32) * LOG2E, jnp.float32),
            jnp.full((DB,), jnp.asarray(out_scale, jnp.float32), jnp.float32),
        ]
    )
    inputs = [cache, idx, jnp.zeros((fmt.row_bytes,), jnp.uint8), q_lat, q_rope]
    inputs += [work_entries, scale]
    if fmt.causal:
        rowpos = jnp.pad(positions.reshape(hbs, m), ((0, 0), (0, 64 - m)))
        inputs += [rowpos.astype(jnp.int32), jnp.arange(64, dtype=jnp.int32)]
    o_t, lse2 = plgpu.kernel(
        functools.partial(_kernel, fmt=fmt),
        out_type=(
            jax.ShapeDtypeStruct((g, splits, hbs, LATENT_DIM, m), jnp.float32),
            jax.ShapeDtypeStruct((g, splits, hbs, 64), jnp.float32),
        ),
        scratch_types=_scratch(fmt),
        grid=(g * hbs, splits),  # a group's row blocks side by side: their gathers share L2
        grid_names=("gh", "split"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            unsafe_no_auto_barriers=True,  # the kernel places its own (see _kernel)
        ),
    )(*inputs)
    o = unpermute_out(o_t.swapaxes(-1, -2).reshape(g, splits, hbs * m, LATENT_DIM))
    return o, lse2[..., :m].reshape(g, splits, hbs * m) / LOG2E


def merge_splits(o, lse):
    """Per-split o [G, S, R, 512] f32 and lse [G, S, R] -> out [G, R, 512] bf16 and lse [G, R]:
    the splits merged in float32; one split is already normalized (0 and -inf for a row
    without keys)."""
    if o.shape[1] > 1:
        o, lse = merge_partials(o, lse)
    else:
        o, lse = o[:, 0], lse[:, 0]
    return o.astype(jnp.bfloat16), lse


def per_element_vmap(fn):
    """``fn(*arrays)`` under ``jax.vmap`` as one call per batch element (``lax.map``): the
    kernel has no batched grid."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _vmap(axis_size, in_batched, *args):
        del axis_size
        batched = [a for a, b in zip(args, in_batched, strict=True) if b]

        def one(xs):
            it = iter(xs)
            return fn(*(next(it) if b else a for a, b in zip(args, in_batched, strict=True)))

        out = jax.lax.map(one, batched)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped


def needs_cuda(*_):
    raise NotImplementedError(
        "jax_sparse_mla: implementation='mosaic' is a Mosaic GPU kernel for NVIDIA Hopper "
        "(sm_90a, inline PTX and wgmma) and has no interpret mode; use 'xla' or 'pallas' here, "
        "or lower for CUDA"
    )


def fail_off_cuda(shapes, operand):
    """The non-CUDA branch of a Mosaic kernel: fails when run, naming the remedy (a CUDA
    lowering never holds it). ``shapes``: the outputs' ShapeDtypeStructs."""
    return jax.pure_callback(needs_cuda, shapes, operand, vmap_method="broadcast_all")
