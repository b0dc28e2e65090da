"""Mosaic GPU (Hopper, sm_90a) ``sparse_mla`` over fp8_ds_mla records.

One CTA owns ``M`` = 16 query rows (heads; more heads take several CTAs, launched side by side
so that their gathers of the same records meet in L2) and one split of the row's key list,
walked in tiles of ``T`` = 64 keys. Three warpgroups:

* the producer gathers a tile into a ring of ``stages`` SMEM stages: lane j of its 128 threads
  takes index j of the tile and copies that 656-byte record into SMEM row j with one
  ``cp.async.bulk``, stores the index (-1 when masked) and copies the record's four scales
  with ``cp.async``; lane 0 then arms the stage's mbarrier with the tile's bytes. The indices of
  the next tile are prefetched into SMEM with ``cp.async`` too, so no global load waits on the
  producer's path. This is inline PTX: Mosaic GPU's own copy primitive makes all 128 threads
  arrive on the barrier for every copy and moves only multiples of 128 bytes;
* ``CONSUMERS`` = 2 consumers split each tile's latent dims: consumer c converts chunks 2c
  and 2c + 1 of K's fp8 codes to bf16 in registers (exact) and computes its part of the
  transposed scores S^T [keys, heads] = K Q^T on wgmma (K as the A operand, Q^T from swizzled
  SMEM; consumer 0 adds the rope); the parts are added through SMEM, in one order in every
  consumer (the same bits in each); consumer 0 runs the per-head max and sum of the f32
  online softmax and hands them to the others; each accumulates O^T [dims, heads] += V^T P^T
  for its 256 dims, V being the bf16 codes it stored to swizzled SMEM. Heads are wgmma's N
  dimension, so 16 heads cost 16 columns (FlashMLA pads them to 64 rows). One consumer alone
  left the SM idle between dependent instructions; two halve each one's registers and share
  the one bf16 V tile SMEM holds.

Numerics are the Pallas kernel's: the per-128-dim scales of a record multiply its partial
scores and P (rounded to bf16 after that product), never K or V, so every product is exact
and accumulation is f32.

Layout: a record's latent codes are read as uint16 words; word w holds latent dims 2w (low
byte) and 2w + 1 (high byte), so a 64-word column block of chunk c gives the 64 even and the
64 odd dims of that chunk. q's latent dims are permuted to that order (9 operand blocks of 64
dims: (chunk, parity), then the rope) and the output permuted back. The cache and the index
list reach the kernel as they are: no view, pad, gather or copy of either.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_sparse_mla._platform import by_platform
from jax_sparse_mla.formats import LATENT_DIM, RECORD_BYTES, ROPE_OFFSET, SCALES_OFFSET
from jax_sparse_mla.reference.attention import merge_partials
from jax_sparse_mla.reference.sparse_mla import no_keys

T = 64  # keys per tile (one SMEM stage; wgmma's M for the transposed scores)
DB = 64  # dims per operand block (128 bytes of bf16: one swizzled row)
CHUNKS = 4  # latent scale chunks of 128 dims
BLOCKS = 2 * CHUNKS + 1  # (chunk, parity) latent blocks, then the rope
WORDS = RECORD_BYTES // 2  # 328 uint16 words per record
ROPE_WORD = ROPE_OFFSET // 2  # 264
SMEM_BYTES = 227 * 1024  # an H200 CTA's shared memory
SMEM_SLACK = 12288  # barriers, reduction scratch and alignment, measured on the CUDA lowering
MAX_STAGES = 4
MIN_SPLIT_TILES = 2  # a split keeps at least this many tiles of an average row
TARGET_CTAS = 132  # one CTA per H200 SM at a time
LOG2E = math.log2(math.e)
WORK = 32  # int32 words per CTA work entry (Pallas copies move multiples of 128 bytes)
PRODUCER_BARRIER = 15  # a named barrier id that Mosaic GPU's own (1 + warpgroup) never takes
CONSUMER_BARRIER = 14  # the consumers' named barrier (128 * CONSUMERS threads), likewise free
M = 16  # heads per CTA
CONSUMERS = 2  # consumer warpgroups per CTA, each owning CHUNKS // CONSUMERS latent chunks
OWN = 2 * CHUNKS // CONSUMERS  # operand blocks (chunk, parity) per consumer: 4
PRODUCER_REGISTERS = 40


def consumer_registers() -> int:
    """Registers per consumer thread (``setmaxnreg``): the CTA's launch allocation (65536 per
    SM split evenly over its threads, in multiples of 8, as ptxas allots for ``.maxntid``) less
    the producer's, shared by the consumers. 232 with two consumers."""
    threads = 128 * (CONSUMERS + 1)
    launch = 65536 // threads // 8 * 8 * threads
    return (launch - 128 * PRODUCER_REGISTERS) // (128 * CONSUMERS) // 8 * 8


def stages_for() -> int:
    """Record stages that fit in SMEM beside q, P^T and V (bf16), and each consumer's partial
    scores and output staging (f32)."""
    fixed = (
        (BLOCKS * M * DB + CHUNKS * T * M + 2 * CHUNKS * T * DB) * 2
        + CONSUMERS * (DB * M + T * M) * 4
        + 2 * T * 4
        + SMEM_SLACK
    )
    return max(1, min(MAX_STAGES, (SMEM_BYTES - fixed) // (T * (RECORD_BYTES + 4 + 16))))


def _permute_q(q, m: int, hbs: int):
    """[G, H, 576] -> [G, hbs, BLOCKS, m, DB]: heads padded to hbs * m; blocks (chunk c,
    parity p) hold dims 128c + 2j + p, then the rope."""
    g, h, _ = q.shape
    m_pad = m * hbs
    q = jnp.pad(q, ((0, 0), (0, m_pad - h), (0, 0)))
    lat = q[..., :LATENT_DIM].reshape(g, m_pad, CHUNKS, DB, 2).transpose(0, 1, 2, 4, 3)
    blocks = jnp.concatenate([lat.reshape(g, m_pad, 2 * CHUNKS, DB), q[..., None, LATENT_DIM:]], 2)
    return blocks.reshape(g, hbs, m, BLOCKS, DB).transpose(0, 1, 3, 2, 4)


def _unpermute_out(o):
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
setp.lt.s32 act, lane, $6;
and.pred act, act, lead;
setp.eq.u32 first, $9, 0;
setp.ne.u32 later, $9, 0;
and.pred later, act, later;
and.pred first, act, first;
mul.wide.u32 a, lane, 4;
and.b32 slot, $9, 1;
mul.wide.u32 rg, slot, RING_SLOT;
add.u64 rg, rg, a;
add.u64 rg, rg, $8;
add.u64 sc, a, $1;
mov.s32 key, -1;
@first ld.global.nc.s32 key, [sc];
cp.async.wait_all;
@later ld.shared.s32 key, [rg];
setp.ge.s32 ok, key, 0;
@ok setp.lt.s32 ok, key, ROWS;
selp.s32 k0, key, 0, ok;
selp.s32 key, key, -1, ok;
mul.wide.s32 src, k0, RECORD;
add.u64 src, src, $0;
selp.b64 src, src, $7, ok;
mul.wide.u32 dst, lane, RECORD;
add.u64 dst, dst, $2;
@lead cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [dst], [src], RECORD, [$3];
add.u64 st, a, $4;
@lead st.shared.s32 [st], key;
add.u64 st, a, $5;
@lead cp.async.ca.shared.global [st], [src+SCALES], 4;
@lead cp.async.ca.shared.global [st+CHUNK_STRIDE], [src+SCALES4], 4;
@lead cp.async.ca.shared.global [st+CHUNK_STRIDE2], [src+SCALES8], 4;
@lead cp.async.ca.shared.global [st+CHUNK_STRIDE3], [src+SCALES12], 4;
@lead cp.async.mbarrier.arrive.shared::cta.b64 [$3];
sub.s32 rest, $6, TILE_KEYS;
setp.lt.s32 pre, lane, rest;
and.pred pre, pre, lead;
xor.b32 slot, slot, 1;
mul.wide.u32 nx, slot, RING_SLOT;
add.u64 nx, nx, a;
add.u64 nx, nx, $8;
@pre cp.async.ca.shared.global [nx], [sc+RING_SLOT], 4;
bar.sync PRODUCER_BARRIER, 128;
setp.eq.u32 lead, lane, 0;
@lead mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 st, [$3], TILE_BYTES;
}"""
for _name, _value in {
    "TILE_BYTES": T * RECORD_BYTES,
    "TILE_KEYS": T,
    "RECORD": RECORD_BYTES,
    "SCALES12": SCALES_OFFSET + 12,
    "SCALES8": SCALES_OFFSET + 8,
    "SCALES4": SCALES_OFFSET + 4,
    "SCALES": SCALES_OFFSET,
    "RING_SLOT": 4 * T,
    "CHUNK_STRIDE3": 12 * T,
    "CHUNK_STRIDE2": 8 * T,
    "CHUNK_STRIDE": 4 * T,
    "PRODUCER_BARRIER": PRODUCER_BARRIER,
}.items():
    _GATHER_PTX = _GATHER_PTX.replace(_name, str(_value))

_INIT_PTX = """{
.reg .pred lead;
.reg .b32 tid;
mov.u32 tid, %tid.x;
setp.eq.u32 lead, tid, 0;
INITS
fence.mbarrier_init.release.cluster;
bar.sync 0;
}"""


def _mgpu():
    """(plgpu, mgpu utils, ir, llvm, nvvm, arith): CUDA-only imports, made when tracing."""
    import jax.experimental.mosaic.gpu.utils as mgpu_utils  # noqa: PLC0415
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import arith, llvm, nvvm  # noqa: PLC0415

    return plgpu, mgpu_utils, ir, llvm, nvvm, arith


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


def _gather_tile(
    records_ref,
    idx_ref,
    raw_ref,
    bar_ref,
    ids_ref,
    sc_ref,
    zero_ref,
    ring_ref,
    remaining,
    t,
    rows: int,
):
    """Producer warpgroup, tile ``t`` of keys ``idx[:min(T, remaining)]``.

    Lane j < T: ``key = idx[j]`` (read from global memory on tile 0, else from slot t % 2 of
    ``ring``, where tile t - 1 prefetched it; -1 past ``remaining`` or outside [0, rows): such
    a key's record is never read; the all-zero record ``zero`` is copied in its place, so its
    K, V and scales are 0 and the tile's byte count is fixed); one ``cp.async.bulk`` of that
    record -> ``raw[j]`` completing on ``bar``; ``ids[j] = key``; ``sc[c, j]`` = the record's
    scale c, four 4-byte ``cp.async`` copies that ``bar`` also waits for
    (``cp.async.mbarrier.arrive``); then ``idx[T + j]`` -> ring slot (t + 1) % 2 with
    ``cp.async`` where tile t + 1 has key j (each lane reads back only what it copied, after
    ``cp.async.wait_all``). After a producer-wide barrier lane 0 arms ``bar`` with the tile's
    bytes, a release: the ids are visible to whoever acquires the completed phase.
    """
    plgpu, mgpu_utils, ir, llvm, _, _ = _mgpu()

    splat = plgpu.Layout.WG_SPLAT(shape=())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 8 + (splat, splat))
    def gather(ctx, records, idx, raw, bar, ids, sc, zero, ring, remaining, t):
        del ctx
        ptrs = [mgpu_utils.memref_ptr(r) for r in (records, idx, raw, bar, ids, sc)]
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [
                *ptrs,
                remaining.registers.item(),
                mgpu_utils.memref_ptr(zero),
                mgpu_utils.memref_ptr(ring),
                t.registers.item(),
            ],
            _GATHER_PTX.replace("ROWS", str(rows)),
            "l,l,l,l,l,l,r,l,l,r",
            has_side_effects=True,
        )

    refs = (records_ref, idx_ref, raw_ref, bar_ref, ids_ref, sc_ref, zero_ref, ring_ref)
    gather(*refs, remaining, t)


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


def _kernel(
    records_ref,
    q_ref,
    idx_ref,
    work_ref,
    scale_ref,
    zero_ref,
    o_ref,
    lse_ref,
    q_smem,
    raw,
    ids_smem,
    sc_smem,
    p_smem,
    v_smem,
    s_smem,
    ml_smem,
    o_smem,
    lse_smem,
    work_smem,
    scale_smem,
    ring_smem,
    rec_bars,
    setup,
    consumed,
):
    """One CTA: heads [hb * M, hb * M + M) of row group g, split ``split`` of its keys.

    Refs (GMEM): records [N, 656] uint8; q [G, HB, BLOCKS, M, DB] bf16; idx [nnz] int32 (a
    tile's slice may extend past nnz: entries past its key count are never read); work [G, S,
    WORK] int32 (first position in idx, key count, 0...); scale [64] f32 (sm_scale * log2 e);
    zero [656] uint8 (the record copied for a masked key); o [G, S, HB, 512, M] f32 (O^T,
    permuted dims); lse [G, S, HB, 64] f32 (log2 units in the first M entries; -inf for a head
    without keys).

    Warpgroups 0 .. CONSUMERS - 1 consume, warpgroup CONSUMERS produces. Consumer c converts,
    scores and accumulates only its own latent chunks (consumer 0 also the rope): the partial
    scores meet in SMEM (``s_smem``) and each consumer adds them in the same order; consumer 0
    alone runs the cross-warp softmax reductions (Mosaic GPU's reduction scratch is one per
    CTA) and hands the running max, then the sum, to the others (``ml_smem``); each
    accumulates O^T for its own dims.
    """
    plgpu = _mgpu()[0]
    hbs = q_ref.shape[1]
    g = jax.lax.div(jax.lax.axis_index("gh"), hbs)
    hb = jax.lax.rem(jax.lax.axis_index("gh"), hbs)
    split = jax.lax.axis_index("split")
    wg = jax.lax.axis_index("wg")
    stages = stages_for()
    wgmma = plgpu.Layout.WGMMA
    per_key = wgmma.reduce(1)  # one value per row of S^T (a key)
    per_head = wgmma.reduce(0)  # one value per column of S^T (a head)

    def by_key(v):  # [T] per-key values broadcast over the heads: [T, M]
        return jax.lax.broadcast_in_dim(v, (T, M), [0])

    def by_head(v, rows=T):  # [M] per-head values broadcast over rows: [rows, M]
        return jax.lax.broadcast_in_dim(v, (rows, M), [1])

    _init_barriers(rec_bars, stages)

    @pl.when(wg == 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[g, hb], q_smem, setup)
        plgpu.copy_gmem_to_smem(work_ref.at[g, split], work_smem, setup)
        plgpu.copy_gmem_to_smem(scale_ref, scale_smem, setup)

    plgpu.barrier_wait(setup)
    first = work_smem[0]
    length = work_smem[1]
    count = (length + T - 1) // T

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        @pl.loop(0, count)
        def _(t):
            stage = jax.lax.rem(t, stages)

            @pl.when(t >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[stage])

            _gather_tile(
                records_ref,
                idx_ref.at[pl.ds(first + t * T, T)],
                raw.at[stage],
                rec_bars.at[pl.ds(stage, 1)],
                ids_smem.at[stage],
                sc_smem.at[stage],
                zero_ref,
                ring_smem,
                length - t * T,
                t,
                records_ref.shape[0],
            )

    def consume(c: int):
        plgpu.set_max_registers(consumer_registers(), action="increase")
        scale = plgpu.load(scale_smem.at[pl.ds(0, M)], (), layout=per_head)
        blocks = range(OWN * c, OWN * (c + 1))
        chunks = range(OWN * c // 2, OWN * (c + 1) // 2)

        def codes(stage, b):
            """bf16 codes [T keys, DB dims] of latent block b = (chunk, parity), WGMMA layout."""
            w = plgpu.load(raw.at[stage, :, pl.ds(DB * (b // 2), DB)], (), layout=wgmma)
            byte = ((w >> (8 * (b % 2))) & 0xFF).astype(jnp.uint8)
            f8 = jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn)
            return f8.astype(jnp.float16).astype(jnp.bfloat16)  # both exact

        def scores(stage):
            """This consumer's unscaled S^T parts [T, M] f32: one per own chunk (+ the rope).

            Its bf16 K blocks also go to ``v_smem`` for P @ V. One wgmma wait for all.
            """

            def run(accs):
                for b in blocks:
                    k = codes(stage, b)
                    v_smem[b] = k
                    q_t = plgpu.transpose_ref(q_smem.at[b], (1, 0))
                    plgpu.wgmma(accs[b // 2 - chunks[0]], k, q_t)
                if c == 0:
                    rope = plgpu.load(raw.at[stage, :, pl.ds(ROPE_WORD, DB)], (), layout=wgmma)
                    rope = jax.lax.bitcast_convert_type(rope, jnp.bfloat16)
                    q_t = plgpu.transpose_ref(q_smem.at[BLOCKS - 1], (1, 0))
                    plgpu.wgmma(accs[len(chunks)], rope, q_t)
                return [a[...] for a in accs]

            n = len(chunks) + (c == 0)
            return pl.run_scoped(run, [plgpu.ACC((T, M), jnp.float32)] * n)

        def tile(t, carry):
            m_run, l_run, accs = carry
            stage = jax.lax.rem(t, stages)
            _wait(rec_bars.at[pl.ds(stage, 1)], jax.lax.rem(t // stages, 2))
            ids = plgpu.load(ids_smem.at[stage], (), layout=per_key)
            sc = [plgpu.load(sc_smem.at[stage, ch], (), layout=per_key) for ch in chunks]
            parts = scores(stage)
            plgpu.barrier_arrive(consumed.at[stage])  # this consumer's reads of it are done
            s = parts[len(chunks)] if c == 0 else None
            for i in range(len(chunks)):
                term = parts[i] * by_key(sc[i])
                s = term if s is None else s + term
            s_smem[c] = s
            _consumers_barrier()  # every partial score is in SMEM
            parts = [
                s if i == c else plgpu.load(s_smem.at[i], (), layout=wgmma)
                for i in range(CONSUMERS)
            ]
            s = functools.reduce(operator.add, parts)  # one order: the same bits in each
            s = jnp.where(by_key(ids) >= 0, s * by_head(scale), -jnp.inf)  # log2 units
            if c == 0:
                m_new = jnp.maximum(m_run, s.max(axis=0))
                ml_smem[pl.ds(0, M)] = m_new
            _consumers_barrier()  # the running max is in SMEM; every partial has been read
            if c != 0:
                m_new = plgpu.load(ml_smem.at[pl.ds(0, M)], (), layout=per_head)
            m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m_run - m_ref)
            p = jnp.exp2(s - by_head(m_ref))
            if c == 0:
                l_run = l_run * alpha + p.sum(axis=0)
            for i, ch in enumerate(chunks):
                p_smem[ch] = (p * by_key(sc[i])).astype(jnp.bfloat16)
            plgpu.commit_smem()  # P^T and V visible to wgmma

            def pv(acc_refs):
                for i, b in enumerate(blocks):
                    v_t = plgpu.transpose_ref(v_smem.at[b], (1, 0))
                    plgpu.wgmma(acc_refs[i], v_t, p_smem.at[b // 2])

            accs = pl.run_state(pv)(tuple(plgpu.ACC.init(a * by_head(alpha, DB)) for a in accs))
            return m_new, l_run, list(accs)

        m0 = plgpu.layout_cast(jnp.full((M,), -jnp.inf, jnp.float32), per_head)
        l0 = plgpu.layout_cast(jnp.full((M,), 0.0, jnp.float32), per_head)
        zero = plgpu.layout_cast(jnp.zeros((DB, M), jnp.float32), wgmma)
        m_run, l_run, accs = jax.lax.fori_loop(0, count, tile, (m0, l0, [zero] * OWN))
        if c == 0:
            ml_smem[pl.ds(DB, M)] = l_run
        _consumers_barrier()  # consumer 0's softmax sum is in SMEM
        if c != 0:
            l_run = plgpu.load(ml_smem.at[pl.ds(DB, M)], (), layout=per_head)
        has = l_run != 0
        inv_l = jnp.where(has, 1.0 / jnp.where(has, l_run, 1.0), 0.0)
        for b, acc in zip(blocks, accs, strict=True):
            o_smem[c] = acc * by_head(inv_l, DB)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[c], o_ref.at[g, split, hb, pl.ds(DB * b, DB)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.commit_smem()  # (a warpgroup barrier) o_smem[c] is free again for every thread
        if c == 0:
            lse_smem[pl.ds(0, M)] = jnp.where(
                has, m_run + jnp.log2(jnp.where(has, l_run, 1.0)), -jnp.inf
            )
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[g, split, hb])
        plgpu.wait_smem_to_gmem(0)

    for c in range(CONSUMERS):
        pl.when(wg == c)(functools.partial(consume, c))


def _scratch():
    """The SMEM buffers and barriers of one CTA, in ``_kernel``'s order."""
    plgpu = _mgpu()[0]
    stages = stages_for()
    pv_swizzle = plgpu.find_swizzle(M * 16, "rhs")  # one P^T row: M bf16

    def swizzled(shape, swizzle):
        transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
        return plgpu.SMEM(shape, jnp.bfloat16, transforms=transforms)

    return [
        swizzled((BLOCKS, M, DB), 128),
        plgpu.SMEM((stages, T, WORDS), jnp.uint16),
        plgpu.SMEM((stages, T), jnp.int32),
        plgpu.SMEM((stages, CHUNKS, T), jnp.float32),
        swizzled((CHUNKS, T, M), pv_swizzle),
        swizzled((2 * CHUNKS, T, DB), pv_swizzle),  # wgmma wants both operands' swizzles equal
        plgpu.SMEM((CONSUMERS, T, M), jnp.float32),  # each consumer's partial scores
        plgpu.SMEM((2 * DB,), jnp.float32),  # consumer 0's running max, then its softmax sum
        plgpu.SMEM((CONSUMERS, DB, M), jnp.float32),
        plgpu.SMEM((64,), jnp.float32),
        plgpu.SMEM((WORK,), jnp.int32),
        plgpu.SMEM((64,), jnp.float32),
        plgpu.SMEM((2, T), jnp.int32),  # the producer's index ring (tile t + 1 prefetched)
        plgpu.SMEM((stages,), jnp.int64),  # the record mbarriers (inline PTX)
        plgpu.Barrier(num_arrivals=3),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
    ]


def _work(idx, indptr, num_splits: int):
    """[G, S, WORK] int32: (first position in idx, key count, then 0s) of each split; a row's
    splits are cut at multiples of T. indptr entries are clipped to [0, nnz]."""
    nnz = idx.shape[0]
    start = jnp.clip(indptr[:-1], 0, nnz)
    length = jnp.clip(indptr[1:], start, nnz) - start
    per = T * ((length + T * num_splits - 1) // (T * num_splits))
    s = jnp.arange(num_splits, dtype=jnp.int32)[None, :]
    lo = jnp.minimum(s * per[:, None], length[:, None])
    hi = jnp.minimum(lo + per[:, None], length[:, None])
    work = jnp.stack([start[:, None] + lo, hi - lo], axis=-1).astype(jnp.int32)
    return jnp.pad(work, ((0, 0), (0, 0), (0, WORK - 2)))


def choose_splits(ctas: int, avg_tiles: float) -> int:
    """Splits per row so that the CTAs fill the GPU in one wave at most (a second, partial
    wave costs a whole tile walk), each split keeping at least MIN_SPLIT_TILES tiles of an
    average row."""
    want = TARGET_CTAS // max(ctas, 1)
    return int(max(1, min(want, avg_tiles // MIN_SPLIT_TILES)))


@jax.custom_batching.custom_vmap
def sparse_mla_mosaic(q, kv, idx, indptr, sm_scale):
    """Sparse MLA (the ``sparse_mla_xla`` contract) with the Mosaic GPU kernel (CUDA only).

    Under ``jax.vmap``: one call per batch element (``lax.map``; the kernel has no batched
    grid).

    Args:
      q: [n_q, H, 576] bf16; kv: [..., 656] uint8 records; idx [nnz] / indptr [n_q + 1] int32.
      sm_scale: float32 scalar.
    Returns:
      out [n_q, H, 512] bf16 and lse [n_q, H] float32.
    """
    return _sparse_mla_mosaic(q, kv, idx, indptr, sm_scale)


@sparse_mla_mosaic.def_vmap
def _vmap(axis_size, in_batched, *args):
    del axis_size
    batched = [a for a, b in zip(args, in_batched, strict=True) if b]

    def one(xs):
        it = iter(xs)
        return _sparse_mla_mosaic(
            *(next(it) if b else a for a, b in zip(args, in_batched, strict=True))
        )

    return jax.lax.map(one, batched), (True, True)


def _sparse_mla_mosaic(q, kv, idx, indptr, sm_scale):
    plgpu = _mgpu()[0]
    n_q, h, _ = q.shape
    records = kv.reshape(-1, RECORD_BYTES)
    rows, nnz = records.shape[0], idx.shape[0]
    if n_q == 0 or h == 0 or nnz == 0 or rows == 0:
        return no_keys(n_q, h)
    if rows >= 2**31:
        raise NotImplementedError("the Mosaic GPU sparse_mla reads int32 record indices")
    hbs = -(-h // M)
    splits = choose_splits(n_q * hbs, nnz / T / n_q)
    work = _work(idx, indptr, splits)
    scale = jnp.full((64,), jnp.float32(sm_scale) * LOG2E, jnp.float32)
    o_t, lse2 = plgpu.kernel(
        _kernel,
        out_type=(
            jax.ShapeDtypeStruct((n_q, splits, hbs, LATENT_DIM, M), jnp.float32),
            jax.ShapeDtypeStruct((n_q, splits, hbs, 64), jnp.float32),
        ),
        scratch_types=_scratch(),
        grid=(n_q * hbs, splits),  # a row's head blocks side by side: their gathers share L2
        grid_names=("gh", "split"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            unsafe_no_auto_barriers=True,  # the kernel places its own (see _kernel)
        ),
    )(records, _permute_q(q, M, hbs), idx, work, scale, jnp.zeros((RECORD_BYTES,), jnp.uint8))
    o = _unpermute_out(o_t.swapaxes(-1, -2).reshape(n_q, splits, hbs * M, LATENT_DIM)[:, :, :h])
    lse = lse2[..., :M].reshape(n_q, splits, hbs * M)[:, :, :h] / LOG2E
    if splits > 1:  # one split is already normalized (0 and -inf for a row without keys)
        o, lse = merge_partials(o, lse)
    else:
        o, lse = o[:, 0], lse[:, 0]
    return o.astype(jnp.bfloat16), lse


def _needs_cuda(*_):
    raise NotImplementedError(
        "jax_sparse_mla: implementation='mosaic' is a Mosaic GPU kernel for NVIDIA Hopper "
        "(sm_90a, inline PTX and wgmma) and has no interpret mode; use 'xla' or 'pallas' here, "
        "or lower for CUDA"
    )


def _off_cuda(q, kv, idx, indptr, sm_scale):
    """The non-CUDA branch: fails when run, naming the remedy (a CUDA lowering never holds it)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), no_keys(*q.shape[:2]))
    return jax.pure_callback(_needs_cuda, shapes, q, vmap_method="broadcast_all")


sparse_mla_mosaic_cuda = by_platform(default=_off_cuda, cuda=sparse_mla_mosaic)
"""``sparse_mla_mosaic`` where lowered for CUDA; elsewhere it fails when run, naming the remedy."""
