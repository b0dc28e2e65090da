"""The warp-specialized attention pipeline of the Mosaic GPU kernels (Hopper, sm_90a).

The Mosaic kernels (``sparse_mla`` over fp8_ds_mla records, ``mla_decode`` over the fp8 latent
cache, ``ultraquant_decode`` over 4-bit UltraQuant slots) run this one kernel body, told apart by
a ``RowFormat``; the text below describes the latent formats, ``_kernel``'s ``consume_k`` and
``consume_v`` what UltraQuant does differently (its own K and V of 256 dims, read as uint32
words); ``_wide`` runs
``sparse_mla``'s 64-head CTAs with this producer and consumers of their own. One CTA owns
``m`` = 16 or 32 query rows (heads, or a request's (position, head) rows) and one split of a
key list, walked in tiles of ``T`` = 64 keys. Three warpgroups (UltraQuant: five,
``RowFormat.kv_split``):

* the producer gathers a tile into a ring of SMEM stages: lane j of its 128 threads takes index
  j of the tile and copies that key's cache row into SMEM row j with one ``cp.async.bulk``
  (UltraQuant's 272-byte slots: lanes 2j and 2j + 1 copy row j in 16-byte ``cp.async``
  chunks, ``RowFormat.lane_copies``, or, where its pages tile the tiles, TMA boxes of a
  page's slots of the CTA's KV head, ``RowFormat.tile_rows``), stores the index (-1 when
  masked) and, for fp8_ds_mla, copies the record's four scales with ``cp.async``; lane 0
  then arms the stage's mbarrier with the tile's bytes. The indices of the next tile are
  prefetched into SMEM with ``cp.async`` too, so no global load waits on the producer's path.
  This is inline PTX: Mosaic GPU's own copy primitive makes all 128 threads arrive on the
  barrier for every copy and moves only multiples of 128 bytes (its TMA boxes are
  ``_copy_tile``'s);
* ``CONSUMERS`` = 2 consumers split each tile's latent dims: consumer c converts chunks 2c and
  2c + 1 of K's fp8 codes to bf16 (float16 for the decode) in registers (exact; inline PTX)
  and computes its part of the transposed scores S^T [keys, rows] = K Q^T on wgmma (K as the
  A operand, Q^T from swizzled SMEM; consumer 0 adds the rope); the parts are added through
  SMEM, in one order in every consumer (the same bits in each); consumer 0 runs the per-row max
  and sum of the f32 online softmax and hands them to the others; each accumulates O^T [dims,
  rows] += V^T P^T for its 256 dims, V being the converted codes it stored to swizzled SMEM,
  on wgmmas that run on into the next tile (``_kernel``).
  Rows are wgmma's N dimension, so 16 rows cost 16 columns. One consumer alone left the SM idle
  between dependent instructions; two halve each one's registers and share the one V tile SMEM
  holds. Four, of one chunk each
  (104 registers), were slower on the H200: 1.19x at ``mla_decode`` B=128 seq=32768 qlen=1,
  1.11x at ``sparse_mla`` n_q=128 H=16. Rows are wgmma's N, so 32 rows per CTA cost registers
  and SMEM (one fewer stage), not instructions: every CTA converts and multiplies each key's
  codes once for all its rows.

Numerics: scales multiply partial scores and P (rounded to bf16 after that product), never K or
V, so every product is exact and accumulation is f32. The decode formats, with one scale per
call, run float16 operands instead (``RowFormat.operand_dtype``): K's codes are exact in float16,
q is staged times a power of two that fits its range (``q_rows_ptx``), P rounds to float16.
The score scale (sm_scale, times k_scale for the decode; log2 e added) is applied after the
running max, so any finite scale gives finite weights: the max is of the scores as the wgmmas
give them, and the scale's magnitude multiplies each score less the max before exp2
(``magnitude``, ``softmax_step``: one multiply per score). The latent formats' q arrives times
the scale's sign (``_launch.attention``: exact), and the float16 decode's rows' magnitudes
carry the 2^-e of q's staging (exact); UltraQuant's K warpgroups multiply the scores by the
sign and the codes' 2^6 instead (``score_factors``).

Layout: a row's latent codes are read as uint16 words; word w holds latent dims 2w (low byte)
and 2w + 1 (high byte), so a 64-word column block of chunk c gives the 64 even and the 64 odd
dims of that chunk. The consumers stage q's rows in that order themselves (8 operand blocks of
64 dims, (chunk, parity): ``q_rows_ptx``) and write the finished output back in natural order
as bf16 (``out_rows_ptx``; split partials leave as O^T in f32 and ``unpermute_out`` orders
them). The cache, the index list, indptr and q reach the kernel as they are: no view, pad,
gather or copy of any.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jax_sparse_mla._platform import split_static
from jax_sparse_mla._unavailable import unavailable
from jax_sparse_mla.formats import LATENT_DIM, ROPE_DIM, UQ_HEAD_DIM, UQ_V_CODES
from jax_sparse_mla.kernels.fp4_operands import FP4_BIAS
from jax_sparse_mla.reference.attention import merge_partials

T = 64  # keys per tile (one SMEM stage; wgmma's M for the transposed scores)
DB = 64  # dims per operand block (128 bytes of bf16: one swizzled row)
CHUNKS = 4  # latent chunks of 128 dims (fp8_ds_mla's scale blocks)
LATENT_BLOCKS = 2 * CHUNKS  # (chunk, parity) operand blocks of the latent dims
CONSUMERS = 2  # consumer warpgroups per CTA, each owning CHUNKS // CONSUMERS latent chunks
SMEM_BYTES = 227 * 1024  # an H200 CTA's shared memory
SMEM_SLACK = 9216  # barriers, reduction scratch and alignment: Mosaic GPU's lowering took 7968
# bytes beyond the buffers of ``_scratch`` for sparse_mla's 32-row format (its error message
# names the total when it exceeds 227 KiB)
MAX_STAGES = 4
WIDE_ROWS = 64  # rows of a ``_wide`` CTA: wgmma's M
MIN_SPLIT_TILES = 2  # a split keeps at least this many tiles of an average row
TARGET_CTAS = 132  # one CTA per H200 SM at a time
LOG2E = math.log2(math.e)
WORK = 32  # int32 words per CTA work entry (Pallas copies move multiples of 128 bytes)
PRODUCER_BARRIER = 15  # a named barrier id that Mosaic GPU's own (1 + warpgroup) never takes
CONSUMER_BARRIER = 14  # the consumers' named barrier (128 * CONSUMERS threads), likewise free
ALL_CONSUMERS_BARRIER = 13  # ``kv_split``: the K and the V consumers together, likewise free
VOTE_BARRIER = 11  # ``kv_split``: K warpgroup c's vote (``_any_above``) takes 11 + c, likewise
# ``kv_split``: the running max stays until a scaled score passes it by this (log2 units; P <=
# 2^8, up to the rounding of the limit in the unscaled scores' units: below 2^16)
RESCALE_SLACK = 8.0
PRODUCER_REGISTERS = 40
MAX_ROWS = 2**31  # the gather's record indices are int32
FP4_WORDS = 16  # uint32 words of an UltraQuant slice: 128 dims, four 32-dim scale groups
FP4_SLICES = UQ_HEAD_DIM // FP4_WORDS  # K=16 operands of K (or V): 8 nibbles of 2 slices


class RowFormat(NamedTuple):
    """What the kernel body needs to know of one cache format (all static).

    row_bytes: bytes of one key's row (a multiple of 16: one ``cp.async.bulk``, or 16-byte
      chunks with ``lane_copies``).
    pitch: SMEM bytes per staged row: ``row_bytes`` or a little more, such that the words the
      consumers read of 8 rows at one column land on 32 distinct banks (pitch / 4 = 4 mod 8
      words for the uint16 reads, 8 mod 32 for ``fp4``'s 8-byte uint32 reads).
    scale_words: byte offsets in the row of 4-byte words the producer copies beside the row
      into ``sc[word, key]``: fp8_ds_mla's CHUNKS float32 chunk scales (factors of the chunk's
      partial scores and of P), UltraQuant's two words of K and two of V group-scale bytes; ()
      for one scale per call.
    rope_word: first uint16 word of the rope's 64 dims (no rope with ``fp4``).
    rope_fp8: the rope is 64 e4m3 codes (two 32-dim parity blocks), else 64 bf16 values.
    qlen: query positions per request; past 1 the rows are causal: row r (position r // H of
      ``qlen``) sees key positions j <= length - qlen + r // H, and V codes that are NaN are
      zeroed (a hidden NaN key must not reach a row; a visible one already made its score NaN).
    m: query rows per CTA: 16 or 32 (wgmma's N for the scores and the output), or
      ``WIDE_ROWS`` (``sparse_mla``'s heads as wgmma's M: ``_wide``).
    fp4: UltraQuant slots (``kv_split``'s consumers): 256-dim K and V of E2M1 codes; a cache row
      holds one slot of ``row_bytes`` per KV head and head block hb reads slot hb.
    page_size: 0 when ``idx`` lists cache rows; else the keys are a paged request's positions
      and ``idx`` holds block tables (``gather_ptx``), pages of ``page_size`` cache rows.
    heads: the latent formats' rows per group (a ``sparse_mla`` row's heads, a decode
      request's qlen * heads): q arrives as it is, [G, heads, 576] bf16, and the consumers
      stage it themselves (``q_rows_ptx``); with one split the finished output leaves as
      [G, heads, 512] bf16 rows (``out_rows_ptx``): no XLA kernel permutes either. 0 for
      UltraQuant (q as ``fp4_q``'s operands).
    lane_copies: the producer's 128 lanes copy the tile's rows in 16-byte ``cp.async``
      chunks, two lanes per row (``_lane_copies_ptx``), not one ``cp.async.bulk`` per row.
      Faster for UltraQuant's 272-byte slots on the H200 (``ultraquant_decode`` B=128
      seq=32768: 8702.7 -> 8279.7 us), slower for the 576- and 656-byte latent rows
      (``mla_decode`` B=128 seq=32768 qlen=1 955.6 -> 1011.9, ``sparse_mla`` n_q=128 H=16
      82.2 -> 90.0; one run, 2026-12-03).
    tile_rows: with ``lane_copies`` and pages that tile T (``fp4``), the rows of a TMA box: the
      producer copies its KV head's slots of the tile as T // ``tile_rows`` boxes [tile_rows,
      pitch / 4] uint32 of the cache viewed as uint32 rows, one per page or per T keys of a
      page (the box's pitch - row_bytes bytes past the slot come along, from the next KV head
      or past the row: zeros), completing on the stage's ``tile_bars``; its lanes copy only
      the ids and the scale words. 0: the lanes copy the rows.
    q_pieces: ``fp4`` only: bf16 pieces of the rotated q (``fp4_operands.q_pieces``): 1 for
      the op's e4m3 q, 3 for ``exact_q``'s float32 q; every K operand meets all of them in one
      wgmma of N = q_pieces * m.
    """

    row_bytes: int
    pitch: int
    scale_words: tuple[int, ...]
    rope_word: int
    rope_fp8: bool
    qlen: int = 1
    m: int = 16
    fp4: bool = False
    page_size: int = 0
    heads: int = 0
    lane_copies: bool = False
    tile_rows: int = 0
    q_pieces: int = 1

    @property
    def kv_split(self) -> bool:
        """UltraQuant (``fp4``) only, its consumers split by K and by V: warpgroups 0 ..
        CONSUMERS - 1 convert K and score, each every other tile over all dims with its own
        softmax, handing P and its alpha over through SMEM slot c, warpgroups CONSUMERS .. 2
        CONSUMERS - 1 convert V and accumulate O^T (``_kernel``'s ``consume_k`` and
        ``consume_v``). Twice the consumer warps to cover the conversions' latency: on the
        H200 ``ultraquant_decode`` B=128 seq=32768 went from 8233.3 to 7376.1 us (one run,
        2026-12-03; the K warpgroups then split each tile's dims and consumer 0 ran every
        softmax); alternating tiles, with the producer's two lanes per row, 7370.6 -> 6471.3
        us (one run, 2026-12-04)."""
        return self.fp4

    @property
    def consumers(self) -> int:
        """Consumer warpgroups: ``CONSUMERS``, or with ``kv_split`` (UltraQuant) that many
        converting K and as many converting V."""
        return 2 * CONSUMERS if self.kv_split else CONSUMERS

    @property
    def wide(self) -> bool:
        """Rows are wgmma's M (``_wide``'s kernel), not its N."""
        return self.m == WIDE_ROWS

    @property
    def causal(self) -> bool:
        return self.qlen > 1

    @property
    def chunk_scales(self) -> bool:
        """Per-chunk scales that multiply partial scores and P (fp8_ds_mla)."""
        return bool(self.scale_words) and not self.fp4

    @property
    def blocks(self) -> int:
        """CTAs per group (and split) of a latent format: its ``heads`` rows in blocks of m."""
        return -(-self.heads // self.m)

    @property
    def rope_blocks(self) -> int:
        """Rope operand blocks: two parity blocks of 32 dims (fp8), one of 64 (bf16), none."""
        return 0 if self.fp4 else 2 if self.rope_fp8 else 1

    @property
    def dims(self) -> int:
        """Output (V) dims: the latent's 512, or UltraQuant's 256."""
        return UQ_HEAD_DIM if self.fp4 else LATENT_DIM

    @property
    def out_blocks(self) -> int:
        """O^T blocks of DB dims (wgmma's M for P @ V), CONSUMERS * ``own_blocks``."""
        return self.dims // DB

    @property
    def own_blocks(self) -> int:
        """O^T blocks (and for the latent also K operand blocks) of one consumer."""
        return self.out_blocks // CONSUMERS

    @property
    def q_elems(self) -> int:
        """bf16 elements of one query row's operand in SMEM."""
        return self.q_pieces * UQ_HEAD_DIM if self.fp4 else LATENT_DIM + ROPE_DIM

    @property
    def operand_dtype(self):
        """The 16-bit float of the wgmma operands (q, K, P, V). float16 for the decode's one
        scale per call: its e4m3 codes are exact in float16 and convert in one ``cvt`` per pair
        (bfloat16 takes four more), and q takes a power-of-two scale to fit float16's range
        (``q_rows_ptx``). bfloat16 where per-key scales multiply P (fp8_ds_mla), whose range
        float16 lacks, and for UltraQuant's scaled E2M1 codes."""
        return jnp.bfloat16 if self.fp4 or self.chunk_scales else jnp.float16

    @property
    def p_blocks(self) -> int:
        """bf16 P^T blocks: one per latent chunk (each scaled by its chunk's scales), or one
        per consumer."""
        return CHUNKS if self.chunk_scales else CONSUMERS


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


def consumer_registers(consumers: int = CONSUMERS) -> int:
    """Registers per consumer thread (``setmaxnreg``) with ``consumers`` consumer warpgroups:
    the CTA's launch allocation (65536 per SM split evenly over its threads, in multiples of 8,
    as ptxas allots for ``.maxntid``) less the producer's, shared by the consumers. 232 with
    two consumers, 104 with four."""
    threads = 128 * (consumers + 1)
    launch = 65536 // threads // 8 * 8 * threads
    return (launch - 128 * PRODUCER_REGISTERS) // (128 * consumers) // 8 * 8


def rows_per_cta(rows: int) -> int:
    """``RowFormat.m`` for ``rows`` query rows that share their keys (a ``sparse_mla`` row's
    heads, a decode request's positions x heads, a KV head's query heads): 16 up to 16, else
    32, so that each CTA converts a key once for as many of them as its registers allow."""
    return 16 if rows <= 16 else 32


def stages_for(fmt: RowFormat) -> int:
    """Row stages that fit in SMEM beside q, P^T and V (bf16) and each consumer's partial
    scores (f32), which also stage its output after the walk."""
    m = fmt.m
    kv = (fmt.dims + ROPE_DIM * fmt.wide) * T  # ``_wide`` stores the rope's K block too
    p = 0 if fmt.wide else fmt.p_blocks * T * m  # ``_wide``'s P stays in registers
    fixed = (fmt.q_elems * m + p + kv) * 2 + CONSUMERS * T * m * 4 + 2 * T * 4 + SMEM_SLACK
    per_row = fmt.pitch + 4 + 4 * len(fmt.scale_words)
    return max(1, min(MAX_STAGES, (SMEM_BYTES - fixed) // (T * per_row)))


def unpermute_out(o):
    """[..., 512] in (chunk, parity, j) order -> natural latent order."""
    lead = o.shape[:-1]
    return o.reshape(*lead, CHUNKS, 2, DB).swapaxes(-1, -2).reshape(*lead, LATENT_DIM)


# An UltraQuant slice's dim 128k + 16p + 8a + 4e + b (nibble 4e + b of uint32 word 2p + a of
# slice k) is column 2p + e of K=16 operand n = 4a + b (``_fp4_operand``): the axes (k, p, a,
# e, b) of the natural order, taken as (k, a, b, p, e).
_FP4_ORDER = (0, 2, 4, 1, 3)


def fp4_q(pieces, hbs: int, m: int):
    """UltraQuant q operand: [G, count, R, 256] bf16 (``count`` pieces of the rotated q) ->
    [G, hbs, FP4_SLICES, count * m, FP4_WORDS] with rows padded to hbs * m: operand 8k + n
    holds the dims ``_fp4_operand`` puts in K operand n of slice k, for the m rows of each
    piece in turn (one wgmma of N = count * m scores every piece)."""
    g, count, r, _ = pieces.shape
    x = jnp.pad(pieces, ((0, 0), (0, 0), (0, m * hbs - r), (0, 0)))
    x = x.reshape(g, count, hbs, m, CONSUMERS, 8, 2, 2, 4)
    operand_axes, column_axes = _FP4_ORDER[:3], _FP4_ORDER[3:]  # (k, a, b) and (p, e)
    x = x.transpose(0, 2, *(4 + a for a in operand_axes), 1, 3, *(4 + a for a in column_axes))
    return x.reshape(g, hbs, FP4_SLICES, count * m, FP4_WORDS)


def unpermute_fp4(o):
    """[..., 256] in operand order (O^T row 128k + 16n + j: column j of V operand n of slice
    k) -> natural order."""
    lead = o.shape[:-1]
    o = o.reshape(*lead, CONSUMERS, 2, 4, 8, 2)
    natural = (len(lead) + _FP4_ORDER.index(axis) for axis in range(5))
    return o.transpose(*range(len(lead)), *natural).reshape(*lead, UQ_HEAD_DIM)


_GATHER_PTX = """{
.reg .pred lead, act, ok, first, later, pre;
.reg .b32 lane, slot;
.reg .s32 key, k0, rest;
.reg .b64 a, src, dst, st, sc, rg, nx;HEAD_REGLANE_REGS
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
INDEX_ADDRESS
mov.s32 key, -1;
@first ld.global.nc.s32 key, [sc];
WAIT_INDEX
@later ld.shared.s32 key, [rg];
KEY_CHECK
selp.s32 k0, key, 0, ok;
selp.s32 key, key, -1, ok;
mul.wide.s32 src, k0, ROW_STRIDE;
add.u64 src, src, $0;HEAD_SLOT
selp.b64 src, src, $6, ok;
mul.wide.u32 dst, lane, PITCH;
add.u64 dst, dst, $2;
ROW_COPY
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
@pre cp.async.ca.shared.global [nx], [NEXT_INDEX], 4;
INDEX_GROUP
bar.sync PRODUCER_BARRIER, 128;
ARM
}"""
_BULK_ROW_COPY = (
    "@lead cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes"
    " [dst], [src], ROW_BYTES, [$3];"
)
_BULK_ARM = """setp.eq.u32 lead, lane, 0;
@lead mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 st, [$3], TILE_BYTES;"""
# ``lane_copies``: lanes 2j and 2j + 1 copy row j of the tile, its even and its odd 16-byte
# chunks (chunk 2i + lane % 2 at copy i, so that the pair's two copies fill one 32-byte
# sector), the row found from ``ids`` (written before the barrier above; -1: the zero row):
# one index load and one address per lane and tile, then the copies at fixed offsets.
_LANE_REGS = """
.reg .pred live, even;
.reg .b32 row, half;
.reg .s32 k;
.reg .b64 ia, cs, co, cd;"""
_LANE_ROW = """shr.u32 row, lane, 1;
and.b32 half, lane, 1;
setp.eq.u32 even, half, 0;
mul.wide.u32 ia, row, 4;
add.u64 ia, ia, $4;
ld.shared.s32 k, [ia];
setp.ge.s32 live, k, 0;
mul.wide.s32 cs, k, ROW_STRIDE;
add.u64 cs, cs, $0;CHUNK_HEAD
selp.b64 cs, cs, $6, live;
mul.wide.u32 co, half, 16;
add.u64 cs, cs, co;
mul.wide.u32 cd, row, PITCH;
add.u64 cd, cd, $2;
add.u64 cd, cd, co;"""
_LANE_ARM = """cp.async.commit_group;
cp.async.mbarrier.arrive.shared::cta.b64 [$3];
bar.sync PRODUCER_BARRIER, 128;
setp.eq.u32 lead, lane, 0;
@lead mbarrier.arrive.release.cta.shared::cta.b64 st, [$3];"""


def _lane_copies_ptx(fmt: RowFormat) -> str:
    """Every lane's 16-byte ``cp.async`` copies of its half of a row (``RowFormat.lane_copies``:
    two lanes per row), then its ``cp.async.mbarrier.arrive``; lane 0 arrives once all have."""
    assert 2 * T == 128, "two producer lanes per row"
    if fmt.tile_rows:  # the rows come as TMA boxes (``produce``)
        return _LANE_ARM
    chunks = fmt.row_bytes // 16
    copies = [
        ("@even " if 2 * i + 1 == chunks else "")
        + f"cp.async.cg.shared.global [cd+{32 * i}], [cs+{32 * i}], 16;"
        for i in range(-(-chunks // 2))
    ]
    text = "\n".join([_LANE_ROW, *copies, _LANE_ARM])
    return text.replace("CHUNK_HEAD", "\nadd.u64 cs, cs, head;" * fmt.fp4)


def _scale_ptx(words: tuple[int, ...]) -> str:
    """Lane j copies its row's 4-byte words at byte offsets ``words`` to ``sc[i, j]``, and the
    stage's mbarrier waits for these copies too."""
    copies = (
        f"@lead cp.async.ca.shared.global [st+{4 * T * i}], [src+{offset}], 4;"
        for i, offset in enumerate(words)
    )
    return "\n".join(
        ["add.u64 st, a, $9;", *copies, "@lead cp.async.mbarrier.arrive.shared::cta.b64 [$3];"]
    )


_FLAT_INDEX = {
    "INDEX_ADDRESS": "add.u64 sc, a, $1;",
    "KEY_CHECK": "setp.ge.s32 ok, key, 0;\n@ok setp.lt.s32 ok, key, ROWS;",
    "NEXT_INDEX": "sc+RING_SLOT",
}
# Paged keys: lane j's key is position pos = POSITION + j of its request: page pos / PAGE_SIZE
# of the request's block-table row ($1), slot page * PAGE_SIZE + pos % PAGE_SIZE; a page
# outside [0, PAGES) masks the key. The ring holds the next tile's page entries.
_PAGED_INDEX = {
    "INDEX_ADDRESS": """add.u32 pos, POSITION, lane;
div.u32 page, pos, PAGE_SIZE;
rem.u32 off, pos, PAGE_SIZE;
mul.wide.u32 sc, page, 4;
add.u64 sc, sc, $1;
add.u32 page, pos, TILE_KEYS;
div.u32 page, page, PAGE_SIZE;
mul.wide.u32 next, page, 4;
add.u64 next, next, $1;""",
    "KEY_CHECK": """setp.ge.s32 ok, key, 0;
@ok setp.lt.s32 ok, key, PAGES;
mad.lo.s32 key, key, PAGE_SIZE, off;""",
    "NEXT_INDEX": "next",
}


def gather_ptx(fmt: RowFormat, rows: int, row_stride: int) -> str:
    """The producer's PTX for one tile (operands: see ``_gather_tile``); cache rows are
    ``row_stride`` bytes apart (``row_bytes`` but for UltraQuant's KV heads)."""
    scales = _scale_ptx(fmt.scale_words) if fmt.scale_words else ""
    text = _GATHER_PTX.replace("SCALE_COPIES", scales)
    if fmt.lane_copies:  # this tile's index copies are a group, its rows the next one
        text = text.replace("ROW_COPY\n", "").replace("ARM", _lane_copies_ptx(fmt))
        text = text.replace("LANE_REGS", _LANE_REGS)
        text = text.replace("INDEX_GROUP", "cp.async.commit_group;")
        wait = "cp.async.wait_group 1;"  # the index copies of the last tile, not its rows
    else:
        text = text.replace("ROW_COPY", _BULK_ROW_COPY).replace("ARM", _BULK_ARM)
        text = text.replace("LANE_REGS", "").replace("INDEX_GROUP\n", "")
        wait = "cp.async.wait_all;"
    text = text.replace("WAIT_INDEX", wait)
    extra = 9 + bool(fmt.scale_words)  # the first operand past the scales' SMEM
    head = f"\ncvt.u64.u32 head, ${extra};\nadd.u64 src, src, head;"
    regs = "\n.reg .b64 head;" * fmt.fp4
    if fmt.page_size:
        regs += "\n.reg .b32 pos, page, off;\n.reg .b64 next;"
    text = text.replace("HEAD_REG", regs)
    text = text.replace("HEAD_SLOT", head * fmt.fp4)
    for name, value in (_PAGED_INDEX if fmt.page_size else _FLAT_INDEX).items():
        text = text.replace(name, value)
    for name, value in {
        "POSITION": f"${extra + fmt.fp4}",
        "PAGE_SIZE": fmt.page_size,
        "PAGES": rows // max(fmt.page_size, 1),
        "TILE_BYTES": T * fmt.row_bytes,
        "TILE_KEYS": T,
        "ROW_BYTES": fmt.row_bytes,
        "ROW_STRIDE": row_stride,
        "PITCH": fmt.pitch,
        "RING_SLOT": 4 * T,
        "PRODUCER_BARRIER": PRODUCER_BARRIER,
        "ROWS": rows,
    }.items():
        text = text.replace(name, str(value))
    return text


class SplitRule(NamedTuple):
    """Key lists idx[indptr[i]:indptr[i + 1]] (entries clipped to [0, ``nnz``]) cut into
    ``splits`` splits at multiples of ``align`` by the kernel itself (``work_ptx``), the rule
    of ``work_lists``: no XLA kernel makes the work entries."""

    nnz: int
    splits: int
    align: int


# Thread 0 of the CTA: the work entry of split $4 of list $3 from indptr ($1) into SMEM ($2):
# ``work_lists``'s (first position in idx, key count, split start in the list, list length).
_WORK_PTX = """mov.s32 a, 0;
mov.s32 b, 0;
mul.wide.u32 ip, $3, 4;
add.u64 ip, ip, $1;
@lead ld.global.nc.s32 a, [ip];
@lead ld.global.nc.s32 b, [ip+4];
max.s32 start, a, 0;
min.s32 start, start, NNZ;
max.s32 b, b, start;
min.s32 b, b, NNZ;
sub.s32 len, b, start;
add.s32 per, len, SPAN_LESS_1;
div.s32 per, per, SPAN;
mul.lo.s32 per, per, ALIGN;
mul.lo.s32 lo, $4, per;
min.s32 lo, lo, len;
add.s32 a, lo, per;
min.s32 a, a, len;
sub.s32 a, a, lo;
add.s32 start, start, lo;
@lead st.shared.s32 [$2], start;
@lead st.shared.s32 [$2+4], a;
@lead st.shared.s32 [$2+8], lo;
@lead st.shared.s32 [$2+12], len;"""


def work_ptx(rule: SplitRule) -> str:
    """``_WORK_PTX`` for ``rule`` (its registers are declared in ``_INIT_PTX``)."""
    span = rule.align * rule.splits
    text = _WORK_PTX
    for name, value in {
        "SPAN_LESS_1": span - 1,
        "SPAN": span,
        "ALIGN": rule.align,
        "NNZ": rule.nnz,
    }.items():
        text = text.replace(name, str(value))
    return text


def rope_swizzle(fmt: RowFormat) -> int:
    """The swizzle (bytes per row) of the rope's operand blocks: one row of 64 bf16 (bf16 rope),
    or of 32 (fp8 rope: two parity blocks)."""
    return 2 * ROPE_DIM // fmt.rope_blocks


# A float16 format's q exponent for one row, from ``qe``, the largest |q| bf16 bit pattern of
# that row (``q_max_ptx``): e = 141 - its exponent field E, so that the row's max |q| * 2^e lies
# in [2^14, 2^15) (float16's largest finite value is 65504), at most 64 (an all-zero row; below
# 2^-50 a row keeps less headroom); ``up`` = 2^e as float32 bits. E = 255 (NaN, infinity) gives
# e = -114: 2^e and 2^-e are normal float32 for every E. ``q_exponent`` is the same rule in jnp.
_Q_EXPONENT_PTX = """shr.u32 qe, qe, 7;
mov.s32 t, 141;
sub.s32 qe, t, qe;
min.s32 qe, qe, 64;
add.s32 t, qe, 127;
shl.b32 up, t, 23;"""


def q_exponent(bits):
    """``_Q_EXPONENT_PTX``'s e (int32) of rows whose largest |q| bf16 bit patterns are ``bits``
    (uint32; jnp or the kernel's arrays)."""
    return jnp.minimum(141 - (bits >> 7).astype(jnp.int32), 64)


def q_unscale(bits):
    """2^-e (float32) for ``q_exponent``'s e: the factor of each row's scores."""
    return jax.lax.bitcast_convert_type((127 - q_exponent(bits)) << 23, jnp.float32)


def _q_rows(fmt: RowFormat, c: int) -> tuple[list[str], list[tuple], list[tuple]]:
    """The start of consumer ``c``'s q blocks (``q_rows_ptx`` and ``q_max_ptx``): registers,
    lane addresses and every load of its rows -> (PTX lines, latent pieces, rope pieces), a
    piece being (registers, first row, row step, byte offset, the lane's base address)."""
    m = fmt.m
    latent = [(f"x{k}", "rb", 4 * k, 512 * c, "gu") for k in range(m // 4)]
    rope = [(f"y{k}", "rr", 16 * k, 2 * LATENT_DIM, "gv") for k in range(m // 16)] if c == 0 else []
    pieces = latent + rope
    lines = [
        "{",
        ".reg .pred " + ", ".join(f"p{name}" for name, *_ in pieces) + ";",
        ".reg .b32 " + ", ".join(f"{name}_{i}" for name, *_ in pieces for i in range(4)) + ";",
        ".reg .b32 lane, u, v, rb, rr, ub, r, row, off, sw, e0, e1, o0, o1;",
        *[".reg .b32 qe, t, up, lo, hi, mx;"] * (fmt.operand_dtype == jnp.float16),
        ".reg .b64 gu, gv, ga, sa;",
        "mov.u32 lane, %tid.x;",
        "and.b32 lane, lane, 127;",
        "and.b32 u, lane, 31;",
        "shr.u32 rb, lane, 5;",
        "mul.wide.u32 gu, u, 16;",
        "add.u64 gu, gu, $0;",
        "and.b32 v, lane, 7;",  # the rope: 16 bytes at column 8 (l % 8) of row l // 8
        "shr.u32 rr, lane, 3;",
        "shl.b32 v, v, 4;",
        "cvt.u64.u32 gv, v;",
        "add.u64 gv, gv, $0;",
        "shr.u32 off, u, 4;",  # which of the consumer's two chunks
        f"mul.lo.s32 off, off, {256 * m};",  # its even block: 2 blocks of m rows of 128 bytes
        "and.b32 sw, u, 15;",
        "shl.b32 sw, sw, 3;",  # column 4 (u % 16): 8 bytes
        "add.u32 ub, off, sw;",
        f"add.u32 ub, ub, {512 * m * c};",  # blocks 4c ..: the consumer's first chunk
    ]
    for name, first, step, offset, base in pieces:  # row first + step (from $3 on): 16 bytes
        regs = ", ".join(f"{name}_{i}" for i in range(4))
        lines += [
            f"add.u32 row, {first}, {step};",
            "add.u32 row, row, $3;",
            f"setp.lt.u32 p{name}, row, {fmt.heads};",  # zeros past heads
            *(f"mov.b32 {name}_{i}, 0;" for i in range(4)),
            f"mul.wide.u32 ga, row, {2 * (LATENT_DIM + ROPE_DIM)};",
            f"add.u64 ga, ga, {base};",
            f"@p{name} ld.global.nc.v4.b32 {{{regs}}}, [ga+{offset}];",
        ]
    return lines, latent, rope


def _q_max_word(row: str) -> list[str]:
    """sa = the address of row ``row``'s word in $4, the rows' largest |q| (``q_max_ptx``)."""
    return ["shl.b32 off, " + row + ", 2;", "cvt.u64.u32 sa, off;", "add.u64 sa, sa, $4;"]


def q_max_ptx(fmt: RowFormat, c: int) -> str:
    """A float16 format's first pass over q (``RowFormat.operand_dtype``): consumer ``c`` loads
    the rows ``q_rows_ptx`` stages and, for each row it loaded, takes the largest |value| as a
    bf16 bit pattern (sign cleared; larger bits are larger magnitudes, NaN above infinity) into
    that row's word of $4 ([m] uint32, zeroed by ``init_ptx``) with ``red.shared.max``;
    operands as ``q_rows_ptx``'s. Each row gets its own scale, so no row's values (NaN and
    infinity included) move another's."""
    lines, latent, rope = _q_rows(fmt, c)
    for name, first, step, *_ in latent + rope:
        lines.append("mov.b32 mx, 0;")
        for i in range(4):
            lines += [f"and.b32 t, {name}_{i}, 0x7FFF7FFF;", "max.u16x2 mx, mx, t;"]
        lines += [
            "shr.u32 hi, mx, 16;",
            "and.b32 lo, mx, 0xFFFF;",
            "max.u32 mx, hi, lo;",
            f"add.u32 r, {first}, {step};",
            *_q_max_word("r"),
            "red.shared.max.u32 [sa], mx;",
        ]
    return "\n".join([*lines, "}"])


def q_rows_ptx(fmt: RowFormat, c: int) -> str:
    """Consumer ``c`` stages its latent chunks of q's rows (consumer 0 also the rope) from
    global memory into SMEM operand blocks (block 2c + p, column j: latent dim 128c + 2j + p,
    the order of a cache row's uint16 words), swizzled as the kernel's SMEM buffers are.
    Operands: $0 the group's q rows ([heads, 576] bf16), $1 ``q_lat`` ([8, m, 64],
    128-byte swizzle), $2 ``q_rope`` ([1, m, 64], likewise; fp8 rope: [2, m, 32], 64-byte
    swizzle, block p column j holding rope dim 2j + p), $3 the CTA's first row; float16 formats
    (``RowFormat.operand_dtype``): $4 the rows' words of ``q_max_ptx``. Rows past ``fmt.heads``
    are zeros. The blocks hold bf16 q, or float16 q * 2^e, e a row's own
    (``_Q_EXPONENT_PTX``: exact but for values under 2^-31 of the row's largest, which round to
    float16 subnormals).

    Lane l takes 8 dims (16 bytes, four uint32 words of dims 2w, 2w + 1) of its rows
    l // 32 + 4k: dims 256c + 8 (l % 32) of the row, which are words 4 (l % 16) .. + 3 of
    chunk 2c + (l % 32) // 16; their low halves (the even dims) go to that chunk's even block,
    their high halves to its odd block (``prmt``), 8 bytes each at column 4 (l % 16). A
    32-lane warp reads 512 contiguous bytes of one row. The rope: lane l takes 16 bytes of row
    l // 8 + 16k, at column 8 (l % 8) (bf16 rope), or split into the parity blocks at column
    4 (l % 8) (fp8 rope). Every load is issued before the first store, so that a thread waits
    for global memory once, not once per row. Swizzle (Mosaic GPU's, that of TMA and wgmma):
    byte offset o in a buffer of S-byte rows becomes o ^ (((o >> 7) % (S / 16)) << 4); each
    block starts at a multiple of 1024 bytes (S = 128) or 512 (S = 64), m being a multiple of
    8, so only the row moves the swizzle. Ends with ``fence.proxy.async`` so that wgmma sees
    the stores."""
    m = fmt.m
    half = fmt.operand_dtype == jnp.float16
    assert fmt.rope_fp8 or not half, "a float16 format's rope is split and scaled like the latent"
    lines, latent, rope = _q_rows(fmt, c)

    def at_row(buffer: str, row_bytes: int, column: str) -> list[str]:
        """sa = ``buffer`` + the swizzled offset of row r, byte ``column``."""
        return [
            f"mul.lo.s32 off, r, {row_bytes};",
            f"add.u32 off, off, {column};",
            "shr.u32 sw, off, 7;",
            f"and.b32 sw, sw, {row_bytes // 16 - 1};",
            "shl.b32 sw, sw, 4;",
            "xor.b32 off, off, sw;",
            "cvt.u64.u32 sa, off;",
            f"add.u64 sa, sa, {buffer};",
        ]

    def scaled(x: str) -> list[str]:
        """bf16 pair ``x`` -> the float16 pair of its values times 2^e (``up``)."""
        return [
            f"shl.b32 lo, {x}, 16;",
            f"and.b32 hi, {x}, 0xFFFF0000;",
            "mul.rn.f32 lo, lo, up;",
            "mul.rn.f32 hi, hi, up;",
            f"cvt.rn.f16x2.f32 {x}, hi, lo;",
        ]

    def split_to(name: str, buffer: str, row_bytes: int, column: str, odd: int) -> list[str]:
        """``name``_0..3's even halves to row r, byte ``column`` of ``buffer``, their odd halves
        ``odd`` bytes further."""
        a = [f"{name}_{i}" for i in range(4)]
        lines = [
            f"prmt.b32 e0, {a[0]}, {a[1]}, 0x5410;",
            f"prmt.b32 e1, {a[2]}, {a[3]}, 0x5410;",
            f"prmt.b32 o0, {a[0]}, {a[1]}, 0x7632;",
            f"prmt.b32 o1, {a[2]}, {a[3]}, 0x7632;",
        ]
        if half:  # row r's 2^e
            lines += [*_q_max_word("r"), "ld.shared.u32 qe, [sa];", *_Q_EXPONENT_PTX.splitlines()]
            lines += [line for x in ("e0", "e1", "o0", "o1") for line in scaled(x)]
        return [
            *lines,
            *at_row(buffer, row_bytes, column),
            "st.shared.v2.b32 [sa], {e0, e1};",
            f"st.shared.v2.b32 [sa+{odd}], {{o0, o1}};",
        ]

    for name, first, step, *_ in latent:
        lines += [f"add.u32 r, {first}, {step};", *split_to(name, "$1", 128, "ub", 128 * m)]
    for name, first, step, *_ in rope:
        lines.append(f"add.u32 r, {first}, {step};")
        if fmt.rope_fp8:  # column 4 (l % 8) of each 32-dim parity block: 8 bytes
            lines += ["shr.u32 u, v, 1;", *split_to(name, "$2", 64, "u", 64 * m)]
        else:
            regs = ", ".join(f"{name}_{i}" for i in range(4))
            lines += [*at_row("$2", 128, "v"), f"st.shared.v4.b32 [sa], {{{regs}}};"]
    return "\n".join([*lines, "fence.proxy.async.shared::cta;", "}"])


def out_rows_ptx(fmt: RowFormat, chunk: int) -> str:
    """One register of the WGMMA layout of latent chunk ``chunk``'s two O^T blocks -> two bf16
    pairs of the output rows ([heads, 512] bf16, $0): $1 the register's O^T row j (dims
    128 chunk + 2j, + 1), $2 its first column r (the CTA's rows r and r + 1, offset by $3),
    $4, $5 the even block's values at (j, r), (j, r + 1), $6, $7 the odd block's. Each row gets
    one 4-byte store (the even dim in the low half, as in memory), rows past ``fmt.heads``
    none; rounding is ``astype(bfloat16)``'s (round to nearest even)."""
    return "\n".join(
        [
            "{",
            ".reg .pred ok;",
            ".reg .b32 row, off, v;",
            ".reg .b64 a;",
            "add.u32 row, $3, $2;",
            f"mad.lo.s32 off, row, {LATENT_DIM // 2}, $1;",
            "shl.b32 off, off, 1;",
            f"add.u32 off, off, {128 * chunk};",
            "mul.wide.u32 a, off, 2;",
            "add.u64 a, a, $0;",
            f"setp.lt.u32 ok, row, {fmt.heads};",
            "cvt.rn.bf16x2.f32 v, $6, $4;",
            "@ok st.global.b32 [a], v;",
            "add.u32 row, row, 1;",
            f"setp.lt.u32 ok, row, {fmt.heads};",
            "cvt.rn.bf16x2.f32 v, $7, $5;",
            f"@ok st.global.b32 [a+{2 * LATENT_DIM}], v;",
            "}",
        ]
    )


_INIT_PTX = """{
.reg .pred lead;
.reg .b32 tid;
.reg .s32 a, b, start, len, per, lo;
.reg .b64 ip;
mov.u32 tid, %tid.x;
setp.eq.u32 lead, tid, 0;
INITS
WORK FILL
fence.mbarrier_init.release.cluster;
bar.sync 0;
}"""


def init_ptx(
    count: int, rule: SplitRule | None, fill: str | None = None, words: int = 0, value: int = 0
) -> str:
    """Thread 0 initializes ``count`` mbarriers at $0, given ``rule`` writes the CTA's work
    entry (``work_ptx``) and given ``fill`` (an operand) sets ``words`` words there to the
    uint32 ``value``; then the CTA syncs."""
    inits = "\n".join(f"@lead mbarrier.init.shared::cta.b64 [$0+{8 * i}], 1;" for i in range(count))
    text = _INIT_PTX.replace("INITS", inits)
    fills = "".join(f"\n@lead st.shared.u32 [{fill}+{4 * i}], {value};" for i in range(words))
    text = text.replace(" FILL", fills if fill else "")
    return text.replace("WORK", work_ptx(rule) if rule else "")


def _init_barriers(bars_ref, count: int, work=None, fill=None, words: int = 0, value: int = 0):
    """Thread 0 initializes ``count`` mbarriers (one arrival each), given ``work`` = (rule,
    indptr, work SMEM, list, split) writes the CTA's work entry (``work_ptx``) and given
    ``fill`` (an SMEM ref) sets its first ``words`` words to the uint32 ``value`` (0 unless
    given); then the whole CTA syncs."""
    plgpu, mgpu_utils, ir, llvm, _, _ = _mgpu()
    ref, splat = plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())
    rule, *work_args = work or (None,)
    refs = [] if fill is None else [fill]
    arg_types = (ref,) + (ref, ref, splat, splat) * bool(work) + (ref,) * len(refs)
    fill_operand = f"${1 + 4 * bool(work)}" if refs else None

    @plgpu.inline_mgpu(arg_types=arg_types)
    def init(ctx, bars, *args):
        del ctx
        ptr = mgpu_utils.memref_ptr
        operands = [ptr(bars)]
        if work:
            indptr, entry, group, split = args[:4]
            operands += [ptr(indptr), ptr(entry), group.registers.item(), split.registers.item()]
        operands += [ptr(x) for x in args[4 * bool(work) :]]
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            operands,
            init_ptx(count, rule, fill_operand, words, value),
            "l" + ",l,l,r,r" * bool(work) + ",l" * len(refs),
            has_side_effects=True,
        )

    init(bars_ref, *work_args, *refs)


def _gather_tile(fmt: RowFormat, refs, remaining, t, head=None, position=None):
    """Producer warpgroup, tile ``t`` of keys ``idx[:min(T, remaining)]``.

    ``refs`` = (cache, idx, raw, bar, ids, zero, ring[, sc]); ``cache`` [rows, stride] (uint8;
    ``fmt.fp4``'s as uint32 words) holds one row (``fmt.fp4``: one per KV head, ``head`` the
    byte offset of this CTA's). Lane j < T:
    ``key = idx[j]`` (read from global memory on tile 0, else from slot t % 2 of ``ring``, where
    tile t - 1 prefetched it; -1 past ``remaining`` or outside [0, rows): such a key's row is never
    read; the row ``zero`` (``masked_row``) is copied in its place, so its K, V and scales are 0 but
    one finite byte, and the tile's byte count is fixed); one ``cp.async.bulk`` of that row ->
    ``raw[j]`` (pitch ``fmt.pitch``) completing on ``bar``; ``ids[j] = key``; with
    ``fmt.scale_words``, ``sc[i, j]`` = the row's word i, 4-byte ``cp.async`` copies that ``bar``
    also waits for (``cp.async.mbarrier.arrive``); then ``idx[T + j]`` -> ring slot (t + 1) % 2 with
    ``cp.async`` where tile t + 1 has key j (each lane reads back only what it copied, after
    ``cp.async.wait_all``). After a producer-wide barrier lane 0 arms ``bar`` with the tile's bytes,
    a release: the ids are visible to whoever acquires the completed phase. With ``fmt.page_size``,
    ``idx`` is the request's block-table row and lane j's key is the slot of position ``position +
    j`` (``gather_ptx``); the ring holds pages. With ``fmt.lane_copies`` no lane copies a row
    whole: after that barrier lanes 2j and 2j + 1 copy row j in 16-byte chunks, the source row
    found from ``ids`` (``_lane_copies_ptx``), arrives on ``bar`` through
    ``cp.async.mbarrier.arrive``, and lane 0 arrives (no bytes expected) after a second barrier;
    the index copies wait with ``cp.async.wait_group 1`` (they are a group of their own), not for
    the last tile's rows. With ``fmt.tile_rows`` as well, the lanes copy no row chunks (the rows
    are ``_copy_tile``'s TMA boxes, on a barrier of their own).
    """
    plgpu, mgpu_utils, ir, llvm, _, _ = _mgpu()
    splat = plgpu.Layout.WG_SPLAT(shape=())
    ref = plgpu.RefType()
    scales = bool(fmt.scale_words)
    arg_types = (ref,) * 5 + (splat,) + (ref,) * 2 + (splat,) + (ref,) * scales
    arg_types += (splat,) * (fmt.fp4 + bool(fmt.page_size))
    rows, stride = refs[0].shape
    stride *= jnp.dtype(refs[0].dtype).itemsize  # bytes

    @plgpu.inline_mgpu(arg_types=arg_types)
    def gather(ctx, cache, idx, raw, bar, ids, remaining, zero, ring, t, *rest):
        del ctx
        ptr = mgpu_utils.memref_ptr
        sc, scalars = rest[:scales], rest[scales:]
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [
                *(ptr(r) for r in (cache, idx, raw, bar, ids)),
                remaining.registers.item(),
                ptr(zero),
                ptr(ring),
                t.registers.item(),
                *(ptr(r) for r in sc),
                *(x.registers.item() for x in scalars),
            ],
            gather_ptx(fmt, rows, stride),
            "l,l,l,l,l,r,l,l,r" + ",l" * scales + ",r" * len(scalars),
            has_side_effects=True,
        )

    scalars = [x for x in (head, position) if x is not None]
    gather(*refs[:5], remaining, *refs[5:7], t, *refs[7:], *scalars)


def _wait(bar_ref, parity):
    """Every thread of the warpgroup waits for (acquires) phase ``parity`` of the mbarrier."""
    plgpu, mgpu_utils, ir, _, nvvm, arith = _mgpu()

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())))
    def wait(ctx, bar, parity):
        del ctx
        ticks = arith.constant(ir.IntegerType.get_signless(32), 10_000_000)
        nvvm.mbarrier_try_wait_parity(mgpu_utils.memref_ptr(bar), parity.registers.item(), ticks)

    wait(bar_ref, parity)


def _consumers_barrier(barrier: int = CONSUMER_BARRIER, warpgroups: int = CONSUMERS):
    """``warpgroups`` consumer warpgroups meet at named barrier ``barrier``; their SMEM
    accesses before it precede those after."""
    plgpu, _, ir, llvm, _, _ = _mgpu()

    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [],
            f"bar.sync {barrier}, {128 * warpgroups};",
            "",
            has_side_effects=True,
        )

    sync()


def vote_ptx(pairs: int, barrier: int) -> str:
    """$0 = 1 if $(2i + 1) > $(2i + 2) (f32) for some i < ``pairs`` in any thread of the
    warpgroup, else 0: each thread ORs its comparisons (``setp.gt.or``), then ``bar.red.or.pred``
    on named barrier ``barrier`` (128 threads) ORs the warpgroup's."""
    tests = "".join(f"\nsetp.gt.or.f32 p, ${2 * i + 1}, ${2 * i + 2}, p;" for i in range(pairs))
    return f"""{{
.reg .pred p;
setp.ne.u32 p, 0, 0;{tests}
bar.red.or.pred p, {barrier}, 128, p;
selp.u32 $0, 1, 0, p;
}}"""


def _any_above(x, limit, barrier: int):
    """Whether any element of ``x`` exceeds ``limit`` (both f32 [T, m] in the WGMMA layout) in
    any thread of the warpgroup: a uint32 splat, 1 or 0 (``vote_ptx``: one barrier, where a
    max over the keys takes shuffles and a round trip through SMEM)."""
    plgpu, _, ir, llvm, _, arith = _mgpu()
    from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415

    wgmma = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct((), jnp.uint32, plgpu.Layout.WG_SPLAT(shape=()))

    @plgpu.inline_mgpu(arg_types=(wgmma, wgmma), return_type=out)
    def vote(ctx, x, limit):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        operands = []
        for reg, lim in zip(x.registers.flat, limit.registers.flat, strict=True):
            for i in range(ir.VectorType(reg.type).shape[0]):
                at = arith.constant(i32, i)
                operands += [llvm.extractelement(reg, at), llvm.extractelement(lim, at)]
        ptx = vote_ptx(len(operands) // 2, barrier)
        constraints = "=r" + ",f" * len(operands)
        bit = llvm.inline_asm(i32, operands, ptx, constraints, has_side_effects=True)
        return mgpu.FragmentedArray.splat(bit, (), is_signed=False)

    return vote(x, limit)


def _stage_q_rows(fmt: RowFormat, c: int, q_rows, q_lat, q_rope, row0, q_max):
    """Consumer ``c`` stages its part of q's rows ``q_rows`` [heads, 576] (GMEM) from row
    ``row0`` on into ``q_lat`` and ``q_rope`` (SMEM): ``q_rows_ptx``. float16 formats first
    take each row's largest |q| into ``q_max`` ([64] uint32 SMEM, ``q_max_ptx``; every consumer
    meets after it), from which the caller takes each row's 2^-e, a factor of its scale's
    magnitude (``q_unscale``); bf16 formats pass ``q_max`` None."""
    plgpu, mgpu_utils, ir, llvm, _, _ = _mgpu()
    splat = plgpu.Layout.WG_SPLAT(shape=())
    lat, rope = (plgpu.RefType(transforms=_swizzle_transforms(x)) for x in (128, rope_swizzle(fmt)))
    refs = [] if q_max is None else [q_max]
    arg_types = (plgpu.RefType(), lat, rope, splat) + (plgpu.RefType(),) * len(refs)

    def asm(ptx: str):
        @plgpu.inline_mgpu(arg_types=arg_types)
        def run(ctx, q_rows, q_lat, q_rope, row0, *q_max):
            del ctx
            ptr = mgpu_utils.memref_ptr
            llvm.inline_asm(
                ir.Type.parse("!llvm.void"),
                [ptr(q_rows), ptr(q_lat), ptr(q_rope), row0.registers.item(), *map(ptr, q_max)],
                ptx,
                "l,l,l,r" + ",l" * len(q_max),
                has_side_effects=True,
            )

        run(q_rows, q_lat, q_rope, row0, *refs)

    if q_max is not None:
        asm(q_max_ptx(fmt, c))
        _consumers_barrier()  # every consumer's maxima are in q_max
    asm(q_rows_ptx(fmt, c))


def _store_out_rows(fmt: RowFormat, chunk: int, even, odd, out_rows, row0, ptx=None):
    """O^T blocks ``even`` and ``odd`` [DB, m] f32 (WGMMA layout) of latent chunk ``chunk``
    -> bf16 dims 128 chunk .. + 127 of rows ``row0`` .. of ``out_rows`` [heads, 512] (GMEM):
    ``out_rows_ptx`` per register, at the (row, column) Mosaic GPU's layout gives it (or
    ``ptx`` with the same operands: ``_wide``'s O blocks [m, DB])."""
    plgpu, mgpu_utils, ir, llvm, _, arith = _mgpu()
    wgmma = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(wgmma, wgmma, plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())))
    def store(ctx, even, odd, out_rows, row0):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        text = ptx or out_rows_ptx(fmt, chunk)
        halves = [arith.constant(i32, k) for k in (0, 1)]
        places = even.layout.thread_idxs(even.shape)  # (row, column) of each register
        for e, o, place in zip(even.registers.flat, odd.registers.flat, places, strict=True):
            j, r = (arith.index_cast(i32, x) for x in place)
            values = [llvm.extractelement(x, k) for x in (e, o) for k in halves]
            llvm.inline_asm(
                ir.Type.parse("!llvm.void"),
                [mgpu_utils.memref_ptr(out_rows), j, r, row0.registers.item(), *values],
                text,
                "l,r,r,r,f,f,f,f",
                has_side_effects=True,
            )

    store(even, odd, out_rows, row0)


def _pairs_by_ptx(ptx: str, words, *extra, word: int | None = None, dtype=jnp.bfloat16):
    """``dtype`` (bf16 or float16) [words.shape] (WGMMA layout) from ``ptx`` run on each
    register of the WGMMA layout: $1 is the register of ``words`` as 32 bits (element ``word``
    of it where its registers hold two uint32), $2.. those of the arrays ``extra`` (same shape
    and layout; likewise), $0 the result's pair."""
    plgpu, _, ir, llvm, _, arith = _mgpu()
    from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415

    wgmma = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct(words.shape, dtype, wgmma)

    @plgpu.inline_mgpu(arg_types=(wgmma,) * (1 + len(extra)), return_type=out)
    def convert(ctx, words, *extra):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        half = ir.F16Type.get() if dtype == jnp.float16 else ir.BF16Type.get()
        pair = ir.VectorType.get([2], half)
        pick = None if word is None else arith.constant(i32, word)

        def as_i32(reg):  # a register of pairs, or element ``word`` of two uint32
            if ir.VectorType(reg.type).element_type == i32:
                return llvm.extractelement(reg, pick)
            return llvm.bitcast(i32, reg)

        regs = words.registers.copy()
        for idx, reg in np.ndenumerate(words.registers):
            operands = [as_i32(reg), *(as_i32(x.registers[idx]) for x in extra)]
            bits = llvm.inline_asm(i32, operands, ptx, "=r" + ",r" * len(operands))
            regs[idx] = llvm.bitcast(pair, bits)
        return mgpu.FragmentedArray(_registers=regs, _layout=words.layout, _is_signed=None)

    return convert(words, *extra)


# Byte ``parity`` of two adjacent uint16 words (one WGMMA register) -> a bf16 pair: ``prmt``
# puts the two e4m3 codes in the low 16 bits (selector 0x0020: bytes 0 and 2, the low bytes;
# 0x0031: bytes 1 and 3), ``cvt.rn.f16x2.e4m3x2`` makes them an f16 pair (the upper byte the
# upper half), two ``cvt.f32.f16`` widen them and ``cvt.rn.bf16x2.f32`` packs them (its first
# source the upper half). Every step is exact for e4m3 codes, NaN and subnormals included. The
# float16 formats stop at the f16 pair (``_FP8_F16_PTX``).
_FP8_F16_PTX = """{
.reg .b32 t;
.reg .b16 c, u;
prmt.b32 t, $1, 0, SELECT;
mov.b32 {c, u}, t;
cvt.rn.f16x2.e4m3x2 $0, c;
}"""
_FP8_PTX = """{
.reg .b32 t, h;
.reg .b16 c, u, hl, hh;
.reg .f32 f0, f1;
prmt.b32 t, $1, 0, SELECT;
mov.b32 {c, u}, t;
cvt.rn.f16x2.e4m3x2 h, c;
mov.b32 {hl, hh}, h;
cvt.f32.f16 f0, hl;
cvt.f32.f16 f1, hh;SCALE
cvt.rn.bf16x2.f32 $0, f1, f0;
}"""
# The scaled bf16 form (``_fp8_operand`` given scales): both values times the key's float32
# scale ($2's bits) before the one rounding to bf16: exact for power-of-two scales.
_FP8_SCALE = """
{
.reg .f32 s;
mov.b32 s, $2;
mul.rn.f32 f0, f0, s;
mul.rn.f32 f1, f1, s;
}"""


def _fp8_ptx(parity: int, dtype=jnp.bfloat16, scaled: bool = False) -> str:
    """``_FP8_PTX`` (``_FP8_F16_PTX`` for float16) for byte ``parity`` (0 low, 1 high) of each
    of the register's two words; ``scaled`` (bf16 only): times the scale in $2
    (``_FP8_SCALE``)."""
    text = _FP8_F16_PTX if dtype == jnp.float16 else _FP8_PTX
    text = text.replace("SCALE", _FP8_SCALE if scaled else "")
    return text.replace("SELECT", "0x0031" if parity else "0x0020")


def _fp8_operand(words, parity: int, dtype, scale=None):
    """Byte ``parity`` (0 low, 1 high) of uint16 words [T, n] (WGMMA layout) as the ``dtype``
    (bf16 or float16) values of those e4m3 codes [T, n] (WGMMA layout). A register of the WGMMA
    layout holds two adjacent columns of one row (Mosaic GPU's ``WGMMA_LAYOUT``: vectors of 2
    along the last axis), the same ones in ``words`` and in the result, so each 32-bit register
    of words becomes one register of pairs (``_FP8_PTX``: five instructions per pair, float16
    two). Written in PTX because jnp's casts (byte masks, then e4m3 -> f16 -> bf16) cost more:
    on the H200, ``mla_decode`` B=128 seq=32768 qlen=1 took 1214.9 us with them and 1070.9 us
    with the bf16 PTX, outputs unchanged (the shared suites pass). ``scale`` [T, n] uint32
    (the float32 bits of each key's scale, WGMMA layout; bf16 only): the values times it,
    rounded to bf16 once (exact for power-of-two scales)."""
    if scale is None:
        return _pairs_by_ptx(_fp8_ptx(parity, dtype), words, dtype=dtype)
    return _pairs_by_ptx(_fp8_ptx(parity, dtype, scaled=True), words, scale, word=0)


# E2M1 -> bf16 in bits: magnitude code m = (e1 e0 m0) as the bf16 bits m << 6 (exponent field
# e1 e0, mantissa's top bit m0) is the code's value times 2^-126 for every m (m = 1, 0.5, lands
# on the bf16 subnormal 2^-127, m = 0 on zero); the sign bit moves to bit 15, and a product with
# 2^120 (bf16 0x7B80) makes it value * 2^-6 (normal). Per half of a 32-bit register.
_FP4_PTX = """{
.reg .b32 m, sg, c;
MAG_SHIFT m, $1, MAG_BITS;
and.b32 m, m, 0x01C001C0;
shl.b32 sg, $1, SIGN_SHIFT;
and.b32 sg, sg, 0x80008000;
or.b32 m, m, sg;
mov.b32 c, 0x7B807B80;
mul.rn.bf16x2 m, m, c;
mul.rn.bf16x2 $0, m, $2;
}"""


def _fp4_ptx(nibble: int) -> str:
    """``_FP4_PTX`` for nibbles ``nibble`` (0..3) and ``nibble`` + 4 of a uint32 word: their
    magnitude bits (4 nibble .. 4 nibble + 2, and 16 higher) move to bits 6..8 (and 22..24),
    their sign bits to 15 (and 31)."""
    shift = 6 - 4 * nibble
    mag = ("shl.b32", shift) if shift >= 0 else ("shr.u32", -shift)
    return (
        _FP4_PTX.replace("MAG_SHIFT", mag[0])
        .replace("MAG_BITS", str(mag[1]))
        .replace("SIGN_SHIFT", str(12 - 4 * nibble))
    )


# UE8M0 byte -> bf16 pair in bits: byte $2 / 8 of the scale word $1 (``bfe``), e, as the bf16
# bits e << 7 in both halves (one ``mul.lo``): 2^(e - 127) for e in 1..254, 0 for e = 0 and
# infinity for e = 255, as the float32 bits e << 23 rounded to bf16 give.
_UE8M0_PTX = """{
.reg .b32 e;
bfe.u32 e, $1, $2, 8;
mul.lo.u32 $0, e, 0x00800080;
}"""


def _fp4_scales(sc_word, shift):
    """[T, FP4_WORDS] bf16 group scales (WGMMA layout) from each key's scale word (4 UE8M0
    bytes) broadcast over the columns and each column's bit offset of its group's byte, both
    [T, FP4_WORDS] uint32 (WGMMA layout; a register's two columns share their group)."""
    return _pairs_by_ptx(_UE8M0_PTX, sc_word, shift, word=0)


def _fp4_operand(words, scale, n: int):
    """UltraQuant K=16 operand ``n`` (0..7) of a slice: words [T, FP4_WORDS] uint32 (E2M1
    codes, nibble i of a word at bits 4i) and scale [T, FP4_WORDS] bf16 (a column's group
    scale), both in the WGMMA layout -> [T, FP4_WORDS] bf16 in the WGMMA layout.

    Each register of the WGMMA layout holds two adjacent columns 2p, 2p + 1 (p = 0..7) of one
    row (Mosaic GPU's ``WGMMA_LAYOUT``: vectors of 2 along the last axis), and a register
    index names the same row and columns in ``words`` and ``scale``; here both come from one
    word, the one at column 2p + n // 4: nibbles n % 4 (column
    2p) and n % 4 + 4 (column 2p + 1), so operand n, column j holds nibble n % 4 + 4 (j % 2)
    of word 2 (j // 2) + n // 4 (``fp4_q`` orders q to match). Per register, in PTX
    (``_fp4_ptx``): the two codes become bf16 bits (value * 2^-126, see ``_FP4_PTX``), one
    ``mul.rn.bf16x2`` by 2^120 and one by the scale (powers of two: exact). Eight instructions
    per register where two ``prmt`` byte tables took twelve: ``ultraquant_decode`` B=128
    seq=32768 Hk=8 G=8 went from 10171.9 to 8782.0 us on the H200 (one run, both packages)."""
    return _pairs_by_ptx(_fp4_ptx(n % 4), words, scale, word=n // 4)


def softmax_start(m: int, layout):
    """The online softmax's running max and sum before the first tile: [m] f32 each, in
    ``layout`` (a row's value)."""
    plgpu = _mgpu()[0]
    m0 = plgpu.layout_cast(jnp.full((m,), -jnp.inf, jnp.float32), layout)
    l0 = plgpu.layout_cast(jnp.full((m,), 0.0, jnp.float32), layout)
    return m0, l0


def _finite_max(m):
    """The running max ``m`` [m] as the exponents' reference: 0 where no key was seen yet."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def magnitude(scale):
    """|``scale``| f32 (a score scale in log2 units, signed: a scalar, or [m] one per row)
    clamped to float32's normal range, so that a masked -inf score gives 0, never 0 x -inf:
    the factor of the scores less their running max (``softmax_step``)."""
    f32 = np.finfo(np.float32)
    return jnp.clip(jnp.abs(scale), f32.tiny, f32.max)


def score_factors(scale, bias=1.0):
    """(sign, mag) f32 of the call's score scale ``scale`` (log2 units, signed; a scalar, the
    same for every row: one register, not one per row) for UltraQuant's K warpgroups
    (``consume_k``): they take the running max of the scores times ``sign`` (sign(scale) *
    ``bias``, a power of two or 0: exact) and multiply by ``mag`` (``magnitude``) only after
    subtracting it (``softmax_step``): any finite scale gives finite weights."""
    return jnp.sign(scale) * bias, magnitude(scale)


def rebase(m_old, m_new, mag):
    """[m] factors moving sums (or accumulators) on the running max ``m_old`` to ``m_new``
    (unscaled scores; ``mag`` their scale's ``magnitude``, a scalar or [m]): 0 from -inf."""
    return jnp.exp2((m_old - _finite_max(m_new)) * mag)


def softmax_step(sc, m_run, m_new, by_row, mag):
    """alpha [m] (the old accumulators' factor) and P f32 for the masked unscaled scores
    ``sc`` (S^T [T, m] or S [m, T]) moving the running max from ``m_run`` to ``m_new``: P =
    2^(``mag`` (sc - max)), ``mag`` the scale's ``magnitude`` (a scalar, or [m] one per row)
    applied after the max is subtracted (one multiply per score); ``by_row`` broadcasts [m]
    values over ``sc``'s shape."""
    row_mag = by_row(mag) if jnp.ndim(mag) else mag
    return rebase(m_run, m_new, mag), jnp.exp2((sc - by_row(_finite_max(m_new))) * row_mag)


def out_factor(out_scale, l_run):
    """Whether each row had keys, and its output's factor: ``out_scale`` / the sum, or 0."""
    has = l_run != 0
    return has, jnp.where(has, out_scale / jnp.where(has, l_run, 1.0), 0.0)


def lse_of(m_run, l_run, has, mag):
    """Rows' lse [m] f32: natural log of the sum ``l_run`` on the running max ``m_run`` of the
    unscaled scores, ``mag`` their scale's ``magnitude`` in log2 units (the scale's sign is
    in the scores); -inf without keys (not ``has``), +-inf where |sm_scale| ``m_run``
    overflows float32, as the exact path's (``mag`` leaves log2 units before it meets
    ``m_run``)."""
    log_sum = jnp.log2(jnp.where(has, l_run, 1.0)) * (1 / LOG2E)
    return jnp.where(has, m_run * (mag * (1 / LOG2E)) + log_sum, -jnp.inf)


def write_lse(lse_smem, lse_dst, m_run, l_run, has, mag):
    """Rows' lse (``lse_of``) through ``lse_smem`` [m] f32 to ``lse_dst`` (GMEM)."""
    plgpu = _mgpu()[0]
    lse_smem[...] = lse_of(m_run, l_run, has, mag)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_dst)


def produce(fmt: RowFormat, s: dict, inputs, groups: int, walk, hb, hbs: int):
    """The producer warpgroup: tile t of the CTA's keys into stage t % stages once the
    consumers freed it (``_gather_tile``). ``inputs`` = (cache, idx, zero) as ``_kernel`` takes
    them, ``groups`` the groups of the call (a paged request's block-table row is idx's
    ``1 / groups``), ``walk`` = (first position in idx, key count, split start, tiles), ``hb`` /
    ``hbs`` this CTA's row block and their count (UltraQuant: KV head and heads)."""
    plgpu = _mgpu()[0]
    cache, idx_ref, zero = inputs
    first, length, lo, count = walk
    stages = stages_for(fmt)
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    @pl.loop(0, count)
    def _(t):
        stage = jax.lax.rem(t, stages)

        @pl.when(t >= stages)
        def _():
            plgpu.barrier_wait(s["consumed"].at[stage])

        if fmt.page_size:  # the request's block-table row (first - lo: its list start)
            width = idx_ref.shape[0] // groups
            keys, position = idx_ref.at[pl.ds(first - lo, width)], lo + t * T
        else:
            keys, position = idx_ref.at[pl.ds(first + t * T, T)], None
        stage_refs = [
            cache,
            keys,
            s["raw"].at[stage],
            s["rec_bars"].at[pl.ds(stage, 1)],
            s["ids"].at[stage],
            zero,
            s["ring"],
        ]
        if fmt.scale_words:
            stage_refs.append(s["sc"].at[stage])
        words = cache.shape[1] // hbs  # this KV head's slot, from word hb * words of a row
        head = hb * words * jnp.dtype(cache.dtype).itemsize if fmt.fp4 else None
        _gather_tile(fmt, stage_refs, length - t * T, t, head, position)
        if fmt.tile_rows:
            _copy_tile(fmt, cache, s, stage, hb * words)


def _copy_tile(fmt: RowFormat, cache, s: dict, stage, word):
    """``fmt.tile_rows``: the tile's slots of one KV head (from uint32 ``word`` of the cache's
    [N, W] uint32 rows) into ``raw[stage]`` as T // tile_rows TMA boxes [tile_rows, pitch / 4],
    box i from the cache row of key i * tile_rows (``ids``, written by the lanes before their
    barrier; a page tiles T or T tiles a page, so the box's keys are consecutive rows); a
    masked key's box starts at row N: wholly out of bounds, it arrives as zeros."""
    plgpu = _mgpu()[0]
    rows, width = cache.shape[0], fmt.pitch // 4
    for i in range(T // fmt.tile_rows):
        row = s["ids"][stage, i * fmt.tile_rows]
        row = jnp.where(row >= 0, row, rows)
        plgpu.copy_gmem_to_smem(
            cache.at[pl.ds(row, fmt.tile_rows), pl.ds(word, width)],
            s["raw"].at[stage, pl.ds(i * fmt.tile_rows, fmt.tile_rows)],
            s["tile_bars"].at[stage],
        )


def _kernel(*refs, fmt: RowFormat, rule: SplitRule | None, **smem):
    """One CTA: rows [hb * m, hb * m + m) of group g, split ``split`` of its keys (m =
    ``fmt.m``).

    Inputs (GMEM): cache [N, row_bytes] uint8 (``fmt.fp4``: [N, HB * slot_bytes / 4] uint32);
    idx [nnz] int32 (a tile's slice may extend past nnz: entries past its key count are never
    read); zero [row_bytes] uint8 (the row copied for
    a masked key, ``masked_row``); q [G, heads, 576] bf16 rows (``fmt.fp4``: ``fp4_q``'s
    operands, copied by TMA); the lists: work [G, S, WORK] int32 (first position in idx, key
    count, first key position of the split within its group's list, the list's length, 0...),
    or with ``rule`` indptr [G + 1] int32, from which thread 0 makes the CTA's entry; scale
    [128] f32 (the score scale in log2 units, then the output scale); causal only: rowpos [HB,
    64] int32 (each row's query position), iota [64] int32. Outputs: o [G, S, HB, dims, m] f32
    (O^T, permuted dims) or, finished with one split, [G, heads, 512] bf16 rows; lse [G, S, HB,
    m] f32 (natural log, as the ops return it, so that with one split no XLA kernel slices or
    scales it; -inf for a row without keys). ``smem``: ``_scratch``'s buffers and barriers.

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

    Overlap: a tile's P @ V wgmmas run on into the next tile (the O^T accumulators live across
    the loop): through its barrier wait and index loads and the first K block's load and
    conversion, up to the first store to ``v``, which waits for them. On the H200 (jax 0.11.2)
    this took ``mla_decode`` B=128 seq=32768 from 999.7 to 966.3 us at qlen=1 and from 1752.6
    to 1706.5 at qlen=2, ``sparse_mla`` n_q=128 H=128 from 458.7 to 428.9 us. Holding every K
    block until its scores' wgmmas were issued, to overlap more, made ptxas serialize the
    wgmmas (its C7514 note) and the 16-row decode 1.23x slower. UltraQuant's wait placed after
    its K wgmmas drew the same note (its time unchanged), so UltraQuant waits before them.
    """
    plgpu = _mgpu()[0]
    m = fmt.m
    cache, idx_ref, zero, q_ref, lists_ref, scale_ref, *causal_refs, o_ref, lse_ref = refs
    s = smem
    hbs = lse_ref.shape[2]  # row blocks per group: ``attention`` sized the grid by them
    out_rows = len(o_ref.shape) == 3  # finished bf16 rows [G, heads, 512] (one split)
    g = jax.lax.div(jax.lax.axis_index("gh"), hbs)
    hb = jax.lax.rem(jax.lax.axis_index("gh"), hbs)
    split = jax.lax.axis_index("split")
    wg = jax.lax.axis_index("wg")
    stages = stages_for(fmt)
    chunk_scales = fmt.chunk_scales
    dtype = fmt.operand_dtype
    wgmma = plgpu.Layout.WGMMA
    per_key = wgmma.reduce(1)  # one value per row of S^T (a key)
    per_row = wgmma.reduce(0)  # one value per column of S^T (a query row)

    def by_key(v, n=m):  # [T] per-key values broadcast over the rows: [T, n]
        return jax.lax.broadcast_in_dim(v, (T, n), [0])

    def by_cols(v):  # [FP4_WORDS] per-column values broadcast over the keys
        return jax.lax.broadcast_in_dim(v, (T, FP4_WORDS), [1])

    def by_row(v, n=T):  # [m] per-row values broadcast: [n, m]
        return jax.lax.broadcast_in_dim(v, (n, m), [1])

    work = rule and (rule, lists_ref, s["work"], g, split)
    if fmt.kv_split:  # the K warpgroups' running max starts at -inf (float32 bits)
        _init_barriers(s["rec_bars"], stages, work, s["ml"], m, 0xFF800000)
    else:
        _init_barriers(s["rec_bars"], stages, work, s.get("q_max"), m)
    setup = [(q_ref.at[g, hb], s["q_lat"])] if fmt.fp4 else []
    if rule is None:
        setup.append((lists_ref.at[g, split], s["work"]))
    setup.append((scale_ref, s["scale"]))
    if fmt.causal:
        setup += [(causal_refs[0].at[hb], s["rowpos"]), (causal_refs[1], s["iota"])]
    assert len(setup) == _setup_copies(fmt, rule)

    @pl.when(wg == 0)
    def _():
        for src, dst in setup:
            plgpu.copy_gmem_to_smem(src, dst, s["setup"])

    plgpu.barrier_wait(s["setup"])
    first, length, lo, total = (s["work"][i] for i in range(4))
    count = (length + T - 1) // T

    walk = (first, length, lo, count)
    pl.when(wg == fmt.consumers)(
        functools.partial(produce, fmt, s, (cache, idx_ref, zero), q_ref.shape[0], walk, hb, hbs)
    )

    def wait_stage(stage, t):
        """Waits for tile t in ``stage``: its ids and scales (and rows), with
        ``fmt.tile_rows`` its TMA boxes too (every other tile for a K warpgroup: with an even
        stage count it still sees every phase of the stages it waits on)."""
        _wait(s["rec_bars"].at[pl.ds(stage, 1)], jax.lax.rem(t // stages, 2))
        if fmt.tile_rows:
            plgpu.barrier_wait(s["tile_bars"].at[stage])

    def fp4_shift():
        """[T, FP4_WORDS] uint32: each column's bit offset of its group's UE8M0 byte in a
        scale word (byte i: group 4c + i of consumer c's slice)."""
        column = plgpu.layout_cast(jax.lax.iota(jnp.uint32, FP4_WORDS), per_row)
        return by_cols(column // 4 * 8)

    def fp4_slice(stage, first_word, scale_word, shift):
        """UltraQuant: words [T, FP4_WORDS] uint32 of the staged rows from ``first_word`` and
        their groups' scales [T, FP4_WORDS] bf16 (from scale word ``scale_word``). The words
        are loaded as uint32 (8-byte aligned ``ld.shared``): V's codes start 8 bytes past a
        16-byte boundary, which Mosaic GPU's 16-bit loads (``ldmatrix``) fault on. Evidence:
        the first H200 run loaded uint16 words and failed with CUDA_ERROR_MISALIGNED_ADDRESS;
        its PTX (MOSAIC_GPU_DUMP_PTX) showed ``ldmatrix.sync.aligned.m8n8.x4`` for those
        loads, and loading V's words at K's (16-byte aligned) columns ran. Mosaic GPU refuses
        uint32 loads with bank conflicts, hence the 288-byte pitch (``ultraquant.PITCH``)."""
        words = load(s["raw"].at[stage, :, pl.ds(first_word, FP4_WORDS)], wgmma)
        sc_word = load(s["sc"].at[stage, scale_word], per_key)
        return words, _fp4_scales(by_key(sc_word, FP4_WORDS), shift)

    def fp4_k_scores(stage, c, acc, shift, bounded=False):
        """Slice c of K's codes (words 16c .. 16c + 15: scale groups 4c .. 4c + 3) against
        the stacked q pieces into ``acc`` [T, q_pieces * m], one wgmma per nibble; with
        ``bounded``, at most 8 wgmmas (their register operands) in flight."""
        words, scale = fp4_slice(stage, FP4_WORDS * c, c, shift)
        for n in range(8):
            k = _fp4_operand(words, scale, n)
            if bounded:
                plgpu.wgmma_wait(7)
            plgpu.wgmma(acc, k, s["q_lat"].at[8 * c + n].transpose((1, 0)))

    def fp4_v_store(stage, c, shift):
        """Slice c of V's codes as bf16 into ``v``: nibble n to block 2c + n // 4, columns
        16 (n % 4) .. 16 (n % 4) + 15."""
        words, scale = fp4_slice(stage, UQ_V_CODES // 4 + FP4_WORDS * c, CONSUMERS + c, shift)
        for n in range(8):
            cols = pl.ds(FP4_WORDS * (n % 4), FP4_WORDS)
            s["v"][2 * c + n // 4, :, cols] = _fp4_operand(words, scale, n)

    def store_o_t(c, blocks, accs, inv_l):
        """The O^T accumulators [DB, m] f32 of ``blocks`` times ``inv_l`` to ``o``, each
        staged through ``s[c]``."""
        for b, acc in zip(blocks, accs, strict=True):
            s["s"][c] = acc * by_row(inv_l, DB)  # its last read was before the last barrier
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s["s"].at[c], o_ref.at[g, split, hb, pl.ds(DB * b, DB)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.commit_smem()  # (a warpgroup barrier) s[c] is free again for every thread

    def store_lse(m_run, l_run, has, mag):
        """Rows' lse to ``lse`` (``write_lse``)."""
        write_lse(s["lse"].at[pl.ds(0, m)], lse_ref.at[g, split, hb], m_run, l_run, has, mag)

    def consume(c: int):
        plgpu.set_max_registers(consumer_registers(), action="increase")
        q_args = (q_ref.at[g], s["q_lat"], s["q_rope"], hb * m, s.get("q_max"))
        _stage_q_rows(fmt, c, *q_args)
        plgpu.commit_smem()  # q visible to this warpgroup's wgmmas

        def unscale():  # float16 formats: 2^-e [m], each row of q was staged times its 2^e
            return q_unscale(load(s["q_max"].at[pl.ds(0, m)], per_row))

        # q came times the scale's sign (``attention``): the max is of the raw scores, and the
        # magnitude times each row's 2^-e multiplies after it (``softmax_step``). Clamped past
        # float32's max it still takes every score below the max to 0, as the exact product
        # does (float16 q times e4m3 K: raw scores are multiples of 2^-33)
        mag = magnitude(s["scale"][0] * unscale() if "q_max" in s else s["scale"][0])
        out_scale = load(s["scale"].at[pl.ds(DB, m)], per_row)
        if fmt.causal:
            bound = total - fmt.qlen + load(s["rowpos"].at[pl.ds(0, m)], per_row)
            iota = load(s["iota"], per_key)
        own = fmt.own_blocks
        blocks = range(own * c, own * (c + 1))
        chunks = range(own * c // 2, own * (c + 1) // 2)
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
                    if b % 2 == 0:  # one load of the chunk's words serves both parities
                        w = load(s["raw"].at[stage, :, pl.ds(DB * (b // 2), DB)], wgmma)
                    k = _fp8_operand(w, b % 2, dtype)
                    if b == blocks[0]:  # the last tile's P @ V ran on until here: ``v`` is read
                        plgpu.wgmma_wait(0)
                    s["v"][b] = jnp.where(jnp.isnan(k), 0, k) if fmt.causal else k
                    q_t = s["q_lat"].at[b].transpose((1, 0))
                    plgpu.wgmma(accs[acc_of(b)], k, q_t)
                    if m > 16:  # at most two K blocks' registers live (see ``_kernel``)
                        plgpu.wgmma_wait(1)
                if c == 0:
                    width = ROPE_DIM // fmt.rope_blocks
                    w = load(s["raw"].at[stage, :, pl.ds(fmt.rope_word, width)], wgmma)
                    for r in range(fmt.rope_blocks):
                        if fmt.rope_fp8:
                            k = _fp8_operand(w, r, dtype)
                        else:
                            k = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
                        q_t = s["q_rope"].at[r].transpose((1, 0))
                        plgpu.wgmma(accs[n_acc - 1], k, q_t)
                return [a[...] for a in accs]

            return pl.run_scoped(run, [plgpu.ACC((T, m), jnp.float32)] * n_acc)

        def tile(t, carry, acc_refs):
            m_run, l_run = carry
            stage = jax.lax.rem(t, stages)
            wait_stage(stage, t)
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
            sc_t = jnp.where(visible, sc_t, -jnp.inf)  # unscaled, signed by q
            if c == 0:
                m_new = jnp.maximum(m_run, sc_t.max(axis=0))
                s["ml"][pl.ds(0, m)] = m_new
            _consumers_barrier()  # the running max is in SMEM; every partial has been read
            if c != 0:
                m_new = load(s["ml"].at[pl.ds(0, m)], per_row)
            alpha, p = softmax_step(sc_t, m_run, m_new, by_row, mag)
            if c == 0:
                l_run = l_run * alpha + p.sum(axis=0)
            if chunk_scales:
                for i, ch in enumerate(chunks):
                    s["p"][ch] = (p * by_key(sc[i])).astype(dtype)
            else:
                s["p"][c] = p.astype(dtype)
            plgpu.commit_smem()  # P^T and V visible to wgmma
            for i, b in enumerate(blocks):  # P @ V runs on into the next tile (``scores``)
                acc = acc_refs[i]  # complete: ``scores`` waited for every wgmma
                acc[...] = plgpu.wgmma_accumulator_load(acc, wait_n=None) * by_row(alpha, DB)
                v_t = s["v"].at[b].transpose((1, 0))
                plgpu.wgmma(acc, v_t, s["p"].at[p_block(b)])
            return m_new, l_run

        def all_tiles(acc_refs):
            step = functools.partial(tile, acc_refs=acc_refs)
            m_run, l_run = jax.lax.fori_loop(0, count, step, softmax_start(m, per_row))
            return m_run, l_run, [a[...] for a in acc_refs]

        m_run, l_run, accs = pl.run_scoped(all_tiles, [plgpu.ACC((DB, m), jnp.float32)] * own)
        if c == 0:
            s["ml"][pl.ds(DB, m)] = l_run
        _consumers_barrier()  # consumer 0's softmax sum is in SMEM
        if c != 0:
            l_run = load(s["ml"].at[pl.ds(DB, m)], per_row)
        has, inv_l = out_factor(out_scale, l_run)
        if out_rows:  # each chunk's even and odd blocks, interleaved into bf16 rows
            for i in range(0, own, 2):
                even, odd = (accs[k] * by_row(inv_l, DB) for k in (i, i + 1))
                _store_out_rows(fmt, blocks[i] // 2, even, odd, o_ref.at[g], hb * m)
        else:
            store_o_t(c, blocks, accs, inv_l)
        if c == 0:
            if "q_max" in s:  # the lse of the max times its row's 2^-e (exact) at |scale|:
                # a row's magnitude |scale| 2^-e may pass float32's max (then clamped)
                m_run, mag = m_run * unscale(), magnitude(s["scale"][0])
            store_lse(m_run, l_run, has, mag)
        plgpu.wait_smem_to_gmem(0)

    def consume_k(c: int):
        """``kv_split``: K warpgroup c scores every other tile (t = c mod 2) over all of K's
        dims and runs the online softmax on it, so that the two K warpgroups exchange no
        partial scores. The running max passes from tile t - 1 to tile t through ``ml`` with
        the turn (``turn``) and moves only when a score of the tile passes it by
        ``RESCALE_SLACK`` (``_any_above``: one barrier; P then stays <= 2^8 (below 2^16 with
        the limit's rounding in the unscaled scores' units, ``score_factors``), and the output,
        normalized by the sum, does not depend on the max used); Mosaic GPU's cross-warp
        reductions, whose SMEM scratch is one per CTA, run only while a warpgroup holds it.
        Each keeps its sums per thread ([T, m], on the max of its latest tile) and reduces
        them once after the walk; the warpgroup whose turn comes last adds both. P^T and alpha
        go to the V warpgroups in slot c (``p_full``) once they freed it (``p_free``)."""
        plgpu.set_max_registers(consumer_registers(fmt.consumers), action="increase")
        sign, mag = score_factors(s["scale"][0], FP4_BIAS)
        # RESCALE_SLACK in the unscaled scores' units (float32's max at most: -inf + it is -inf)
        slack = jnp.minimum(RESCALE_SLACK / mag, np.finfo(np.float32).max)
        shift = fp4_shift()

        def take_turn(t):  # tile (or final sum) t waits for t - 1 to pass the turn
            @pl.when(t >= 1)
            def _():
                plgpu.barrier_wait(s["turn"].at[c])

        def tile(i, carry):
            m_own, l_acc = carry  # the max of this warpgroup's latest tile, its sums' base
            t = 2 * i + c
            stage = jax.lax.rem(t, stages)
            wait_stage(stage, t)
            ids = load(s["ids"].at[stage], per_key)

            def run(acc):
                for k in range(CONSUMERS):
                    fp4_k_scores(stage, k, acc, shift, bounded=k > 0)
                pieces = acc[...]  # [T, q_pieces * m]
                score = pieces[:, :m]
                for i in range(1, fmt.q_pieces):
                    score = score + pieces[:, i * m : (i + 1) * m]
                return score

            sc_t = pl.run_scoped(run, plgpu.ACC((T, fmt.q_pieces * m), jnp.float32))
            plgpu.barrier_arrive(s["consumed"].at[stage])
            visible = by_key(ids) >= 0
            sc_t = jnp.where(visible, sc_t * sign, -jnp.inf)  # the codes' 2^-6 undone
            take_turn(t)
            m_run = load(s["ml"].at[pl.ds(0, m)], per_row)  # after tile t - 1 (-inf at init)
            # the vote's barrier orders every thread's load before the store
            limit = by_row(m_run + slack)
            grows = _any_above(sc_t, limit, VOTE_BARRIER + c)

            @pl.when(grows != 0)
            def _():
                s["ml"][pl.ds(0, m)] = jnp.maximum(m_run, sc_t.max(axis=0))
                plgpu.commit_smem()  # (a warpgroup barrier) the store precedes every load

            m_new = load(s["ml"].at[pl.ds(0, m)], per_row)
            plgpu.barrier_arrive(s["turn"].at[1 - c])
            alpha, p = softmax_step(sc_t, m_run, m_new, by_row, mag)
            l_acc = l_acc * by_row(rebase(m_own, m_new, mag)) + p

            @pl.when(i >= 1)
            def _():
                plgpu.barrier_wait(s["p_free"].at[c])  # tile t - 2's P @ V is done

            s["p"].at[c][...] = p.astype(dtype)
            s["alpha"].at[c][pl.ds(0, m)] = alpha
            plgpu.commit_smem()  # P^T visible to the V warpgroups' wgmmas
            plgpu.barrier_arrive(s["p_full"].at[c])
            return m_new, l_acc

        zeros = plgpu.layout_cast(jnp.zeros((T, m), jnp.float32), wgmma)
        mine = (count - c + 1) // 2  # tiles c, c + 2, .. below count
        m_own, l_acc = jax.lax.fori_loop(0, mine, tile, (softmax_start(m, per_row)[0], zeros))
        turn = 2 * mine + c  # this warpgroup's next turn: count or count + 1
        take_turn(turn)
        l_own = l_acc.sum(axis=0)

        @pl.when(turn == count)
        def _():
            s["sums"][pl.ds(0, m)] = m_own
            s["sums"][pl.ds(DB // 2, m)] = l_own

        plgpu.barrier_arrive(s["turn"].at[1 - c])

        @pl.when(turn > count)  # the other warpgroup's max and sums are in ``sums``
        def _():
            m_other = load(s["sums"].at[pl.ds(0, m)], per_row)
            l_other = load(s["sums"].at[pl.ds(DB // 2, m)], per_row)
            m_run = jnp.maximum(m_own, m_other)
            l_run = l_own * rebase(m_own, m_run, mag) + l_other * rebase(m_other, m_run, mag)
            s["ml"][pl.ds(DB, m)] = l_run
            store_lse(m_run, l_run, l_run != 0, mag)

        _consumers_barrier(ALL_CONSUMERS_BARRIER, fmt.consumers)  # the sum is in SMEM
        plgpu.wait_smem_to_gmem(0)

    def consume_v(c: int):
        """``kv_split``: V warpgroup c converts slice c of each tile's V into ``v`` and
        accumulates O^T for its dims against the P^T of slot t % 2, frees the slot once that
        wgmma is done, and writes its O^T after the walk."""
        plgpu.set_max_registers(consumer_registers(fmt.consumers), action="increase")
        out_scale = load(s["scale"].at[pl.ds(DB, m)], per_row)
        shift = fp4_shift()
        own = fmt.own_blocks
        blocks = range(own * c, own * (c + 1))

        def all_tiles(acc_refs):
            @pl.loop(0, count)
            def _(t):
                stage = jax.lax.rem(t, stages)
                wait_stage(stage, t)
                plgpu.wgmma_wait(0)  # tile t - 1's P @ V has read ``v`` and its P^T slot

                @pl.when(t >= 1)
                def _():
                    plgpu.barrier_arrive(s["p_free"].at[jax.lax.rem(t + 1, 2)])

                fp4_v_store(stage, c, shift)
                plgpu.barrier_arrive(s["consumed"].at[stage])
                slot = jax.lax.rem(t, 2)
                plgpu.barrier_wait(s["p_full"].at[slot])
                alpha = load(s["alpha"].at[slot, pl.ds(0, m)], per_row)
                plgpu.commit_smem()  # V visible to wgmma
                for i, b in enumerate(blocks):
                    acc = acc_refs[i]
                    acc[...] = plgpu.wgmma_accumulator_load(acc, wait_n=None) * by_row(alpha, DB)
                    plgpu.wgmma(acc, s["v"].at[b].transpose((1, 0)), s["p"].at[slot])

            return [a[...] for a in acc_refs]

        accs = pl.run_scoped(all_tiles, [plgpu.ACC((DB, m), jnp.float32)] * own)
        _consumers_barrier(ALL_CONSUMERS_BARRIER, fmt.consumers)  # consumer 0's sum is in SMEM
        l_run = load(s["ml"].at[pl.ds(DB, m)], per_row)
        store_o_t(c, blocks, accs, out_factor(out_scale, l_run)[1])
        plgpu.wait_smem_to_gmem(0)

    for c in range(CONSUMERS):
        if fmt.kv_split:
            pl.when(wg == c)(functools.partial(consume_k, c))
            pl.when(wg == CONSUMERS + c)(functools.partial(consume_v, c))
        else:
            pl.when(wg == c)(functools.partial(consume, c))


def _swizzle_transforms(swizzle: int) -> tuple:
    """The SMEM transforms of a bf16 operand buffer with ``swizzle``-byte rows: 8-row tiles,
    swizzled as TMA and wgmma read them."""
    plgpu = _mgpu()[0]
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _setup_copies(fmt: RowFormat, rule: SplitRule | None) -> int:
    """The TMA copies that fill SMEM before the walk: UltraQuant's q operands (the latent
    formats' q the consumers stage), the work entry (unless the kernel makes it by ``rule``),
    the scales, and the causal formats' row positions and iota."""
    return fmt.fp4 + (rule is None) + 1 + 2 * fmt.causal


def _scratch(fmt: RowFormat, rule: SplitRule | None) -> dict:
    """The SMEM buffers and barriers of one CTA (``_kernel``'s ``smem``)."""
    plgpu = _mgpu()[0]
    m, stages = fmt.m, stages_for(fmt)
    pv_swizzle = plgpu.find_swizzle(m * 16, "rhs")  # one P^T row: m bf16
    if fmt.fp4:  # ``fp4_v_store`` stores V in 16-column slices
        pv_swizzle = min(pv_swizzle, 2 * FP4_WORDS)

    def swizzled(shape, swizzle):
        return plgpu.SMEM(shape, fmt.operand_dtype, transforms=_swizzle_transforms(swizzle))

    def f32(shape):
        """f32 [.., n, m] read and written in the WGMMA layout: rows of 64 bytes (m = 16) are
        bank-conflict free as they are, rows of 128 bytes (m = 32) need the 128-byte swizzle."""
        if 4 * m < 128:
            return plgpu.SMEM(shape, jnp.float32)
        transforms = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
        return plgpu.SMEM(shape, jnp.float32, transforms=transforms)

    word = 4 if fmt.fp4 else 2  # the rows are read as uint32 (``fp4_slice``) or uint16 words
    if fmt.fp4:  # the q pieces' K=16 operands (``fp4_q``)
        q_lat = swizzled((FP4_SLICES, fmt.q_pieces * m, FP4_WORDS), 2 * FP4_WORDS)
    else:
        q_lat = swizzled((LATENT_BLOCKS, m, DB), 128)
    scratch = {
        "q_lat": q_lat,
        "raw": plgpu.SMEM((stages, T, fmt.pitch // word), jnp.dtype(f"uint{8 * word}")),
        "ids": plgpu.SMEM((stages, T), jnp.int32),
        "p": swizzled((fmt.p_blocks, T, m), pv_swizzle),
        "v": swizzled((fmt.out_blocks, T, DB), pv_swizzle),  # wgmma wants both swizzles equal
        "s": f32((CONSUMERS, T, m)),  # each consumer's partial scores, then its O^T blocks
        "ml": plgpu.SMEM((2 * DB,), jnp.float32),  # consumer 0's running max, then its sum
        "lse": plgpu.SMEM((64,), jnp.float32),
        "work": plgpu.SMEM((WORK,), jnp.int32),
        "scale": plgpu.SMEM((2 * DB,), jnp.float32),
        "ring": plgpu.SMEM((2, T), jnp.int32),  # the producer's index ring (tile t + 1)
        "rec_bars": plgpu.SMEM((stages,), jnp.int64),  # the row mbarriers (inline PTX)
        "setup": plgpu.Barrier(num_arrivals=_setup_copies(fmt, rule)),
        # every consumer frees a stage, but of ``kv_split``'s K warpgroups only the tile's
        "consumed": plgpu.Barrier(
            num_arrivals=CONSUMERS + 1 if fmt.kv_split else fmt.consumers, num_barriers=stages
        ),
    }
    if fmt.tile_rows:  # the TMA boxes of a stage (``_copy_tile``)
        assert stages % 2 == 0, "the K warpgroups wait on every other tile"
        scratch["tile_bars"] = plgpu.Barrier(num_arrivals=T // fmt.tile_rows, num_barriers=stages)
    if fmt.kv_split:  # P^T (``p``'s two blocks) and alpha handed from K to V, two slots
        scratch["alpha"] = plgpu.SMEM((2, 32), jnp.float32)
        scratch["p_full"] = plgpu.Barrier(num_arrivals=1, num_barriers=2)
        scratch["p_free"] = plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=2)
        scratch["turn"] = plgpu.Barrier(num_arrivals=1, num_barriers=2)  # K warpgroup c's
        scratch["sums"] = plgpu.SMEM((DB,), jnp.float32)  # the first finisher's max and sums
    if fmt.operand_dtype == jnp.float16:  # q's largest |bf16| bits (``q_max_ptx``)
        scratch["q_max"] = plgpu.SMEM((64,), jnp.uint32)
    if fmt.rope_blocks:
        width = ROPE_DIM // fmt.rope_blocks
        scratch["q_rope"] = swizzled((fmt.rope_blocks, m, width), rope_swizzle(fmt))
    if fmt.scale_words:
        dtype = jnp.uint32 if fmt.fp4 else jnp.float32  # scale bytes, or float32 scales
        scratch["sc"] = plgpu.SMEM((stages, len(fmt.scale_words), T), dtype)
    if fmt.causal:
        scratch["rowpos"] = plgpu.SMEM((64,), jnp.int32)
        scratch["iota"] = plgpu.SMEM((64,), jnp.int32)
    return scratch


def work_lists(start, length, num_splits: int, align: int):
    """[G, S, WORK] int32: (first position in idx, key count, split start within the group's
    list, the list's length, then 0s) of each split of the lists idx[start:start + length]
    ([G] int32 each); a list's splits are cut at multiples of ``align`` (a multiple of T)."""
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


def masked_row(fmt: RowFormat) -> np.ndarray:
    """[row_bytes] uint8, the row the producer copies for a masked key: zeros but its last
    byte, 1. All zeros, XLA would make it a broadcast kernel on every call; this stays a
    constant. That byte is a finite value in every format (a rope bit, an fp8 code, an E2M1
    code or scale byte), and a masked key's P is exactly 0, so its V adds nothing."""
    row = np.zeros(fmt.row_bytes, np.uint8)
    row[-1] = 1
    return row


def merge_splits(o, lse):
    """Per-split o [G, S, R, 512] f32 and lse [G, S, R] -> out [G, R, 512] bf16 and lse [G, R]:
    the splits merged in float32; one split is already normalized (0 and -inf for a row
    without keys)."""
    if o.shape[1] > 1:
        o, lse = merge_partials(o, lse)
    else:
        o, lse = o[:, 0], lse[:, 0]
    return o.astype(jnp.bfloat16), lse


def as_f32(x):
    """A scale as float32: a numpy scalar where ``x`` is a number (it stays static through
    ``per_element_vmap``), else a 0-d jax array."""
    if isinstance(x, (int, float, np.number)):
        return np.float32(x)
    return jnp.asarray(x, jnp.float32)


def per_element_vmap(fn):
    """``fn(*args)`` under ``jax.vmap`` as one call per batch element (``lax.map``): the
    kernel has no batched grid. Python and numpy scalars among ``args`` stay static (closed
    over, never traced), so that the kernel's scales made of them are XLA constants."""

    @functools.wraps(fn)
    def call(*args):
        operands, merge = split_static(args)

        def traced_fn(*traced):
            return fn(*merge(traced))

        wrapped = jax.custom_batching.custom_vmap(traced_fn)

        @wrapped.def_vmap
        def _vmap(axis_size, in_batched, *traced):
            del axis_size
            batched = [a for a, b in zip(traced, in_batched, strict=True) if b]

            def one(xs):
                it = iter(xs)
                return traced_fn(
                    *(next(it) if b else a for a, b in zip(traced, in_batched, strict=True))
                )

            out = jax.lax.map(one, batched)
            return out, jax.tree.map(lambda _: True, out)

        return wrapped(*operands)

    return call


NEEDS_CUDA = (
    "jax_sparse_mla: implementation='mosaic' is a Mosaic GPU kernel for NVIDIA Hopper "
    "(sm_90a, inline PTX and wgmma; CUDA only) and has no interpret mode; use 'xla' or 'pallas' "
    "here, or lower for CUDA"
)


def fail_off_cuda(shapes, operand):
    """The non-CUDA branch of a Mosaic kernel: fails when lowered, naming the remedy (a CUDA
    lowering never holds it). ``shapes``: the outputs' ShapeDtypeStructs."""
    return unavailable(NEEDS_CUDA, shapes, operand)
