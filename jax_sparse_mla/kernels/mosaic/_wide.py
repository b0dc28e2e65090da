"""``sparse_mla`` with 64 heads per CTA as wgmma's M (Hopper, sm_90a).

``_pipeline``'s kernel puts a CTA's 16 or 32 heads on wgmma's N and scores S^T = K Q^T with K
converted in registers as the A operand. Past 32 heads that converts every record once per
32 heads and issues the softmax and P @ V for few columns per instruction; at 128 heads it
stayed near 170 TFLOP/s on the H200. Here a CTA owns ``WIDE_ROWS`` = 64 heads of one query
row and one split of its key list, as FlashMLA's SM90 kernel does, and the heads are wgmma's
M:

* the producer is ``_pipeline``'s (``produce``): a record per lane with ``cp.async.bulk``, its
  four scales with ``cp.async``, into one stage (two do not fit beside the bf16 K tile);
* consumer c (two warpgroups) converts latent chunks 2c and 2c + 1 of each record, times the
  record's chunk scale (``_fp8_operand`` with scales: one rounding to bf16, exact for the
  writer's power-of-two scales), into its own blocks of the bf16 K tile ``kv`` (consumer 0
  also copies the bf16 rope into block 8); it scores its partial S [64 heads, 64 keys] =
  q K^T over those dims on wgmma (q and K both from swizzled SMEM), and the two partials meet
  in SMEM: each consumer adds them in the same order, so both hold the same S and run the
  same f32 online softmax (its reductions run along wgmma's N, inside each warp: no
  cross-warp scratch);
* each accumulates O [64 heads, 256 dims] += P V for the dims it converted, P (bf16) in
  registers as wgmma's A operand and V the same ``kv`` blocks, on wgmmas that run on into the
  next tile until its first store to ``kv``. A consumer reads only the ``kv`` blocks it
  writes; the partial scores are their one exchange (two barriers per tile).

Numerics differ from ``_pipeline``'s in where the chunk scales go: into K and V here (products
of bf16 values, f32 accumulation), onto the partial scores and P there; P rounds to bf16
unscaled. A scale that is not a power of two makes K and V round once (relative 2^-9).

With one split the kernel writes the finished bf16 rows (8-byte stores of four dims: two
4-byte ones wrote each 32-byte sector in halves and cost 3% of the H200's time at n_q=1024
H=128) and the lse (natural log) itself; with more, each split's f32 rows (normalized by its
own sum, the dims in their natural order: one 16-byte store per register pair) and lse, which
``merge_splits`` combines.

The consumers bound it, not the producer, and their conversion is about a tenth of their time.
A CTA pair sharing the conversion was slower, and so was a lazy rescale of O (docs/h200.md,
"What bounds the 64-head kernel").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_sparse_mla.formats import LATENT_DIM, ROPE_DIM
from jax_sparse_mla.kernels.mosaic._pipeline import (
    CHUNKS,
    CONSUMERS,
    DB,
    LATENT_BLOCKS,
    WORK,
    RowFormat,
    SplitRule,
    T,
    _consumers_barrier,
    _fp8_operand,
    _init_barriers,
    _mgpu,
    _stage_q_rows,
    _store_out_rows,
    _swizzle_transforms,
    _wait,
    consumer_registers,
    load,
    magnitude,
    out_factor,
    produce,
    softmax_start,
    softmax_step,
    stages_for,
    write_lse,
)

ROPE_BLOCK = LATENT_BLOCKS  # ``kv``'s block of the rope's 64 bf16 dims


def out_rows_ptx(fmt: RowFormat, chunk: int, partial: bool = False) -> str:
    """One register of the WGMMA layout of latent chunk ``chunk``'s two O blocks [64 heads,
    DB] -> four values of output row $3 + $1 ($0: [rows, 512], bf16 finished rows or, given
    ``partial``, f32 split partials): $2 the register's first column j (dims 128 chunk + 2j
    .. + 3), $4, $5 the even block's values at (r, j), (r, j + 1), $6, $7 the odd block's; rows
    past ``fmt.heads`` none. bf16 rounds to nearest even (``astype(bfloat16)``). One store of
    the four values: 8 bytes of bf16 or 16 of f32 (j is even, so the four dims start at a
    multiple of either), so that a warp's store covers whole 32-byte sectors of its 8 rows."""
    size = 4 if partial else 2
    store = (
        ["@ok st.global.v4.f32 [a], {$4, $6, $5, $7};"]
        if partial
        else [
            "cvt.rn.bf16x2.f32 lo, $6, $4;",
            "cvt.rn.bf16x2.f32 hi, $7, $5;",
            "@ok st.global.v2.b32 [a], {lo, hi};",
        ]
    )
    return "\n".join(
        [
            "{",
            ".reg .pred ok;",
            ".reg .b32 row, off, lo, hi;",
            ".reg .b64 a;",
            "add.u32 row, $3, $1;",
            "shl.b32 off, $2, 1;",
            f"mad.lo.s32 off, row, {LATENT_DIM}, off;",
            f"add.u32 off, off, {128 * chunk};",
            f"mul.wide.u32 a, off, {size};",
            "add.u64 a, a, $0;",
            f"setp.lt.u32 ok, row, {fmt.heads};",
            *store,
            "}",
        ]
    )


def kernel(*refs, fmt: RowFormat, rule: SplitRule, **smem):
    """One CTA: heads [hb * 64, hb * 64 + 64) of query row g, split ``split`` of its keys.

    Inputs (GMEM) as ``_pipeline._kernel``'s with ``rule``: records [N, 656] uint8, idx [nnz]
    int32, zero [656] uint8 (``masked_row``), q [G, heads, 576] bf16, indptr [G + 1] int32,
    scale [128] f32 (the score scale in log2 units, then the output scale). Outputs: o [G,
    heads, 512] bf16 (one split), or [G, S, HB * 64, 512] f32 (each split normalized by its own
    sum; rows past ``heads`` unwritten); lse [G, S, HB, 64] f32 (natural log; -inf for a row
    without keys).
    """
    plgpu = _mgpu()[0]
    m = fmt.m
    cache, idx_ref, zero, q_ref, indptr, scale_ref, o_ref, lse_ref = refs
    s = smem
    hbs = lse_ref.shape[2]
    g = jax.lax.div(jax.lax.axis_index("gh"), hbs)
    hb = jax.lax.rem(jax.lax.axis_index("gh"), hbs)
    split = jax.lax.axis_index("split")
    partial = o_ref.dtype == jnp.float32  # split partials, not finished rows
    o_rows = o_ref.at[g, split] if partial else o_ref.at[g]
    wg = jax.lax.axis_index("wg")
    stages = stages_for(fmt)
    wgmma = plgpu.Layout.WGMMA
    per_row = wgmma.reduce(1)  # one value per row: a head of S, a key of a K block
    per_key = wgmma.reduce(0)  # one value per column of S (a key)

    def by_head(v, n=T):  # [m] per-head values broadcast over n columns
        return jax.lax.broadcast_in_dim(v, (m, n), [0])

    _init_barriers(s["rec_bars"], stages, (rule, indptr, s["work"], g, split))

    @pl.when(wg == 0)
    def _():
        plgpu.copy_gmem_to_smem(scale_ref, s["scale"], s["setup"])

    plgpu.barrier_wait(s["setup"])
    first, length, lo = (s["work"][i] for i in range(3))
    count = (length + T - 1) // T
    walk = (first, length, lo, count)
    pl.when(wg == CONSUMERS)(
        functools.partial(produce, fmt, s, (cache, idx_ref, zero), q_ref.shape[0], walk, hb, hbs)
    )

    def consume(c: int):
        plgpu.set_max_registers(consumer_registers(), action="increase")
        _stage_q_rows(fmt, c, q_ref.at[g], s["q_lat"], s["q_rope"], hb * m, None)
        plgpu.commit_smem()  # q visible to this warpgroup's wgmmas
        mag = magnitude(s["scale"][0])  # q came times the scale's sign (``attention``)
        out_scale = load(s["scale"].at[pl.ds(DB, m)], per_row)
        own = fmt.own_blocks  # (chunk, parity) blocks: those of chunks 2c and 2c + 1
        blocks = range(own * c, own * (c + 1))

        def convert(stage):
            """This consumer's blocks of the staged records, converted times their chunk's
            scales, into ``kv`` (consumer 0 also the rope's); then the stage is free."""
            scale_bits = [load(s["sc"].at[stage, b // 2], per_row) for b in blocks[::2]]
            for b in blocks:
                if b % 2 == 0:  # one load of the chunk's words serves both parities
                    w = load(s["raw"].at[stage, :, pl.ds(DB * (b // 2), DB)], wgmma)
                    bits = scale_bits[(b - blocks[0]) // 2]
                    sc = jax.lax.broadcast_in_dim(bits, (T, DB), [0])
                k = _fp8_operand(w, b % 2, jnp.bfloat16, sc)
                if b == blocks[0]:  # the last tile's P @ V ran on until here
                    plgpu.wgmma_wait(0)
                s["kv"][b] = k
            if c == 0:
                w = load(s["raw"].at[stage, :, pl.ds(fmt.rope_word, ROPE_DIM)], wgmma)
                s["kv"][ROPE_BLOCK] = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
            plgpu.barrier_arrive(s["consumed"].at[stage])  # its reads of the stage are done
            plgpu.commit_smem()  # ``kv`` visible to wgmma

        def scores():
            """This consumer's partial S [m, T] f32 over its blocks of ``kv`` (and the rope):
            its accumulator is allocated only now, after the conversion's registers."""

            def run(acc):
                for b in blocks:
                    plgpu.wgmma(acc, s["q_lat"].at[b], s["kv"].at[b].transpose((1, 0)))
                if c == 0:
                    k_t = s["kv"].at[ROPE_BLOCK].transpose((1, 0))
                    plgpu.wgmma(acc, s["q_rope"].at[0], k_t)
                return acc[...]

            return pl.run_scoped(run, plgpu.ACC((m, T), jnp.float32))

        def tile(t, carry, acc_refs):
            m_run, l_run = carry
            stage = jax.lax.rem(t, stages)
            _wait(s["rec_bars"].at[pl.ds(stage, 1)], jax.lax.rem(t // stages, 2))
            ids = load(s["ids"].at[stage], per_key)
            convert(stage)
            mine = scores()
            s["s"][c] = mine
            _consumers_barrier()  # both partial scores are in SMEM
            parts = [mine if i == c else load(s["s"].at[i], wgmma) for i in range(CONSUMERS)]
            _consumers_barrier()  # both have been read: the next tile may overwrite them
            visible = jax.lax.broadcast_in_dim(ids, (m, T), [1]) >= 0
            sc = jnp.where(visible, parts[0] + parts[1], -jnp.inf)  # unscaled
            m_new = jnp.maximum(m_run, sc.max(axis=1))
            alpha, p = softmax_step(sc, m_run, m_new, by_head, mag)
            l_run = l_run * alpha + p.sum(axis=1)
            p16 = p.astype(jnp.bfloat16)
            for i, b in enumerate(blocks):  # P @ V runs on into the next tile (``scores``)
                acc = acc_refs[i]
                acc[...] = plgpu.wgmma_accumulator_load(acc, wait_n=None) * by_head(alpha, DB)
                plgpu.wgmma(acc, p16, s["kv"].at[b])
            return m_new, l_run

        def all_tiles(acc_refs):
            step = functools.partial(tile, acc_refs=acc_refs)
            m_run, l_run = jax.lax.fori_loop(0, count, step, softmax_start(m, per_row))
            return m_run, l_run, [a[...] for a in acc_refs]

        accs_shape = [plgpu.ACC((m, DB), jnp.float32)] * len(blocks)
        m_run, l_run, accs = pl.run_scoped(all_tiles, accs_shape)
        has, inv_l = out_factor(out_scale, l_run)
        for i in range(0, len(blocks), 2):  # each chunk's even and odd blocks: bf16 rows
            even, odd = (accs[k] * by_head(inv_l, DB) for k in (i, i + 1))
            chunk = blocks[i] // 2
            ptx = out_rows_ptx(fmt, chunk, partial)
            _store_out_rows(fmt, chunk, even, odd, o_rows, hb * m, ptx)
        if c == 0:
            write_lse(s["lse"], lse_ref.at[g, split, hb], m_run, l_run, has, mag)
            plgpu.wait_smem_to_gmem(0)

    for c in range(CONSUMERS):
        pl.when(wg == c)(functools.partial(consume, c))


def scratch(fmt: RowFormat, rule: SplitRule) -> dict:
    """The SMEM buffers and barriers of one CTA (``kernel``'s ``smem``)."""
    del rule
    plgpu = _mgpu()[0]
    m, stages = fmt.m, stages_for(fmt)

    def swizzled(shape):
        return plgpu.SMEM(shape, jnp.bfloat16, transforms=_swizzle_transforms(128))

    f32_tiles = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    return {
        "q_lat": swizzled((LATENT_BLOCKS, m, DB)),
        "q_rope": swizzled((1, m, ROPE_DIM)),
        "kv": swizzled((LATENT_BLOCKS + 1, T, DB)),  # K's bf16 blocks, then the rope's
        "s": plgpu.SMEM((CONSUMERS, m, T), jnp.float32, transforms=f32_tiles),
        "raw": plgpu.SMEM((stages, T, fmt.pitch // 2), jnp.uint16),
        "ids": plgpu.SMEM((stages, T), jnp.int32),
        "sc": plgpu.SMEM((stages, CHUNKS, T), jnp.uint32),  # the scales' float32 bits
        "lse": plgpu.SMEM((m,), jnp.float32),
        "work": plgpu.SMEM((WORK,), jnp.int32),
        "scale": plgpu.SMEM((2 * DB,), jnp.float32),
        "ring": plgpu.SMEM((2, T), jnp.int32),
        "rec_bars": plgpu.SMEM((stages,), jnp.int64),
        "setup": plgpu.Barrier(num_arrivals=1),
        "consumed": plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
    }
