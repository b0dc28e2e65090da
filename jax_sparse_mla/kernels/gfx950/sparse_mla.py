"""gfx950 (MI355) FlyDSL kernel: sparse MLA forward over fp8_ds_mla records (docs/formats.md).

For query row ``r`` and head ``h`` the kernel computes ``softmax_k(sm_scale q[r, h]·K_k) @ V_k``
over one split of the row's keys ``k = idx[p]``, ``p in [indptr[r], indptr[r + 1])``, with
K = latent ‖ rope (576) and V = latent (512) read from 656-byte records (512 e4m3fn codes | 4
f32 per-128 scales | 64 bf16 rope), and the split's natural-log LSE. With one split (S = 1)
that is the result; with S > 1 the bf16 partials and f32 LSEs go to the combine kernel
(``mla_decode.py``'s ``jsm_mla_decode_combine``). ``jax_sparse_mla.emulation.sparse_mla``
mirrors this arithmetic in jax.

Arithmetic, exactly (all f32 unless said otherwise; ``L = f32(log2 e)``):

* Positions: ``[b, e)`` with ``b, e = clamp(indptr[r], indptr[r + 1], 0, nnz)`` (so ``e >= b``);
  split ``s`` of ``S`` covers ``[b + lo, b + hi)``, ``lo = min(s c, e - b)``,
  ``hi = min(lo + c, e - b)``, ``c = 64 ceil((e - b) / (64 S))`` (whole 64-key chunks; the
  last splits short or empty). A key is masked when its position is outside the split or its
  entry is outside ``[0, kv_rows)`` (one unsigned compare). Tiles of 128 positions from the
  split's start; the tiles after its last unmasked entry are skipped (a scan of its indices,
  so -1 padding costs no tile), which changes no arithmetic.
* Q, per (head, 128-dim block j of the latent): ``e = exponent bits of max|q|``,
  ``s_hi = max(e - 7, 6)`` (E8M0, so ``max|q| * 2^(127 - s_hi)`` is in [128, 256)),
  ``x = q * 2^(127 - s_hi)``, ``hi = e4m3(x)``, ``lo = e4m3((x - hi) * 32)`` (RNE, OCP e4m3fn),
  ``s_lo = s_hi - 5``. For bf16 q with ``|x| >= 2^-7`` this split is exact: ``hi + lo/32 = x``.
* Scores: ``S = sum_j (hi_j·code_j 2^(s_hi-127) + lo_j·code_j 2^(s_lo-127)) 2^(E_j-127)
  + q_rope·k_rope`` (scaled fp8 MFMA 16x16x128 with the record scale's exponent bits ``E_j`` as
  E8M0 scale_a, bf16 MFMA for the rope; f32 accumulation); ``t = S * sign`` (exact; ``sign =
  -1`` for ``sm_scale < 0``, else 1), masked keys ``t = -inf``. The scale enters only after
  the running max is subtracted, so every finite sm_scale (0, negative, or one whose
  ``sm_scale S`` overflows f32) gives finite weights.
* Online softmax per 128-token tile, ``w(x) = exp2(((x - m_ref) |sm_scale|) L)``:
  ``m' = max(m, max_tile t)`` (``m = -inf`` at first), ``m_ref = m'`` (0 while every key is
  masked), ``alpha = w(m)`` (0 for ``m = -inf``), ``P = w(t) 2^8`` (0 for ``t = -inf``; so
  ``P <= 2^8``), ``l' = l alpha + sum P``, ``O' = O alpha + sum P' V`` where
  ``P' = f16(P * sv)`` and ``sv`` is the record's f32 scale of the output dims' block, clamped
  to f32 bits [1, 2^7] (a larger scale is the documented, inexact clamp), and V the raw e4m3
  codes (exact in f16; f16 MFMA, f32 accumulation).
* ``o = bf16(O * (1 / l))`` (RNE), 0 when ``l == 0``; ``lse = ((m |sm_scale|) L + log2 l - 8)
  ln 2`` (+inf only where the exact LSE is past f32's range), -inf when ``l == 0``.
  ``exp2`` / ``log2`` are the hardware ``v_exp_f32`` / ``v_log_f32``; no product above is
  contracted into an FMA (the ISA has none there).
* S > 1: o and lse per split go to ``o_parts`` [n_q, S, H, 512] bf16 and ``lse_parts``
  [n_q, S, H]; the combine writes ``bf16(sum_s w_s o_s / sum_s w_s)``, ``w_s = exp2((lse_s -
  max lse) L)``. Its price in accuracy: one more bf16 rounding, of each partial (at most
  2^-8 of ``|o_s|``; their weighted mean is at most 2^-8 of ``sum_s w_s |o_s| / sum w``, so
  about doubling the final rounding's 2^-8 ``|o|`` unless the splits' outputs cancel), and the
  combine's f32 weights (a few 2^-24 relative). ``emulation/bounds.py``'s ``sparse_mla_bound``
  carries each partial's bound through the combine.

Work decomposition: a 4-wave (256-thread) workgroup per (row, split, group of 16 heads). The
split count S is fixed at trace time from the static shapes (``ffi.calls.default_sparse_splits``,
``gfx950_model.sparse_mla_splits``): ``S = max(1, min(ceil(nnz / n_q / 64), ceil(CUs / (n_q
G))))``, G = ceil(H / 16): the GPU is filled while every split keeps at least a 64-key chunk of
the mean row. Work item ``i`` (row ``n_q - 1 - i // S``: long causal tails start first, split
``i % S``) runs as G workgroups ``8 (G k + hg) + x`` for ``i = 8 k + x``: block ids go to the 8
XCDs round-robin (block id mod 8 = XCD, assumed, as ``mla_decode.py`` assumes), so the G
head-group workgroups of one (row, split) run on one XCD at about the same time: HBM serves each
record of the split about once and the other G - 1 requests hit that XCD's L2. Requests are G x
the minimum (the stated bound; ``gfx950_model``), HBM traffic about 1x. Grid
``8 G ceil(n_q S / 8)``: the items past ``n_q S`` have no keys and store nothing.

Why not all heads in one workgroup (one request per record): 128 heads of q and O per CU would
need, at this kernel's layout (per 16 heads and lane: 64 VGPRs of q hi / lo, 8 of rope, 32 of
O), 832 VGPRs per lane at 4 waves (512 is the most) or all 16 waves of a CU at 208 each before
any score, P or address register, with one workgroup per CU and no second one to hide the
gather; staging q in LDS instead takes 128 x 576 x 2 = 144 KiB of the 160 KiB beside the 64 KiB
tile. The XCD-local head groups get the HBM traffic to about 1x without that.

Per tile, wave ``w`` computes the scores of tokens ``[32w, 32w + 32)`` for all heads, the tile
max goes through LDS, and wave ``w`` accumulates output dims ``[128w, 128w + 128)`` (one record
scale block, so its V scale folds into P') over all 128 tokens. The latent tile reaches LDS by
``global_load_lds`` DMA from 64-bit per-lane record addresses (wave ``w`` loads latent bytes
``[128w, 128w + 128)`` of every token, right after its own PV reads of the previous tile);
scale and rope words are plain 64-bit global loads one tile ahead, index entries two tiles
ahead; V is read with ``ds_read_b64_tr_b8`` (assumed semantics: within each 16-lane row,
destination lane ``t`` byte ``k`` is source lane ``2k + t // 8``'s byte ``t % 8``: AMD's
documented semantics, probe.py; an MI355 checks it by
``tests/test_gfx950.py::test_ds_read_b64_tr_b8_lane_map``). Masked keys are never read: their
DMA lanes are switched off (the tile keeps zeros from the prologue or an earlier valid record,
multiplied by ``P' = 0``) and their scale / rope loads read the query's own row. Index reads
go through a buffer descriptor over ``idx[split start:nnz]``, so a tail tile never reads past
``idx``. A split of 64 keys runs one tile whose second half is masked (no bytes, half the MFMA
work idle); going to 64-key tiles would halve that but every lane map and the 4-wave split of
the tile's tokens with it.

The first gather leaves as early as the data allows: q's words and tile 0's index entries are
loaded together, tile 0's DMA is issued as soon as the entries land, and q is split (its
maxima and fp8 conversions) while that DMA is in flight (``tests/test_isa.py`` checks that
nothing waits for q's words before the entries are loaded; loading q, taking its maxima, then
the entries, as before, paid one memory latency more before the first gather).

Prefetch, and what a second tile buffer would cost: the next tile's DMA is issued midway
through this tile's PV (each wave refills its own column block after its last read of it) and
waited for at the next tile's top; a double-buffered 128-key tile would issue it a whole tile
earlier but add 65536 B to the 76160 B (H = 16): 141696 B, one workgroup per CU instead of two,
and the second workgroup is what overlaps one workgroup's gather with another's MFMAs today
(at decode shapes a split is 1 to 3 tiles, so a workgroup's first gather, which no buffer
hides, is most of its wait). Kept single-buffered.

Assumed MFMA operand layouts (lane ``16 G + i`` holds row i of A and column i of B): the scaled
fp8 16x16x128 takes bytes 0-15 at K ``16 G + [0, 16)`` and 16-31 at ``64 + 16 G + [0, 16)``,
the E8M0 scale of K group ``K // 32`` from lane ``16 (K // 32) + i``; the bf16 / f16 16x16x32
take elements ``8 G + [0, 8)``; result lane ``16 G + j`` holds rows ``4 G + [0, 4)`` of column
j. Every lane address map is a module-level integer helper (``_q_dim`` .. ``_pv_at``), which
``tests/test_emulation_sparse_mla.py::test_kernel_layout`` runs through one tile; the block-id
map and the splits (``_primitives.xcd_work_item``, ``configs.sparse_mla_split_range``,
``_primitives.xcd_grid_x``) are checked by
``test_work_items_and_splits``.

LDS (bytes; the small regions first, so that every offset fits a DS immediate): f32 record
scale words [wave][block][32 tokens] at 0; tile maxima, then the final l, [16 heads][4 waves] at
2048; a 32-B sink for the P stores of heads >= H at 2304; f32 P [wave][lane group][H][8 keys] at
2336; at the next 128-B boundary the latent tile, 4 column blocks of [128 tokens][128 B] in
which 16-B chunk ``c`` of token ``t`` sits at chunk ``c ^ f(t)``,
``f(t) = ((t >> 1) & 7) ^ (((t >> 4) & 1) << 1)``. 76160 B at H = 16: two workgroups fit a CU's
160 KiB at every H. Design occupancy: 2 waves per SIMD (``waves_per_eu`` 2, so
<= 256 VGPR + AGPR per lane; every configuration compiles to 249-250 VGPRs, no AGPR, no
spill, no scratch).

Launch ABI (``launch(*tensors, *scalars, stream)``; the packed ``void **args`` holds per tensor
``&data_ptr`` then ``&layout`` (an int32 shape, unused), then each scalar by pointer, then
``&stream``). Tensors are flat 1-D buffers:

0. ``q``: bf16; row ``r`` head ``h`` at element ``r * q_row_stride + h * q_head_stride``, 576
   dims (512 latent ‖ 64 rope); 16-byte aligned, strides multiples of 8.
1. ``kv``: uint8 records, record ``i`` at byte ``656 i`` (64-bit addressing, may exceed 4 GiB).
2. ``idx``: int32 ``[nnz]``.
3. ``indptr``: int32 ``[n_q + 1]`` for the launch's rows.
4. ``out``: bf16; split ``s`` of row ``r``, head ``h`` at ``(r S + s) * out_row_stride +
   h * out_head_stride``, 512 dims (``[n_q, S, H, 512]``).
5. ``lse``: f32; split ``s`` of row ``r``, head ``h`` at ``(r S + s) * lse_row_stride + h``
   (not written by the ``_l0`` configurations, which serve S = 1 without LSE only).

Scalars, in order: ``n_q`` (int32, rows, > 0), ``nnz`` (int32), ``kv_rows`` (int32, number of
records, clamped to 2^31 - 1), ``num_splits`` S (int32, >= 1), ``head_groups`` G (int32,
>= 1: workgroup head group ``hg`` serves heads ``hg H + [0, H)`` of the launch's q / out /
lse), ``q_row_stride``, ``q_head_stride``, ``out_row_stride``, ``out_head_stride``,
``lse_row_stride`` (int32, elements), ``sm_scale`` (f32). Grid ``(8 G ceil(n_q S / 8), 1,
1)``, block ``(256, 1, 1)``, static LDS. The handler launches configuration h16 once for the
``H // 16`` full head groups and, for ``H % 16`` more heads, that configuration once with
``q``, ``out`` and ``lse`` offset by its first head (the full tensors' strides, the same CSR
and cache); the groups' arithmetic is independent.

Details decided here (where the reference design it started from, a gfx950 kernel outside this
repository, is silent or differs): ``s_hi >= 6`` (the reference clamps at 1 and leaves the lo
scale ``s_hi - 5`` undefined below 6); masked keys switch their DMA lanes off and read scale /
rope from the query row (the reference reads record 0, whose garbage could turn ``0 x NaN`` into
NaN); P goes through LDS once as f32 and each wave applies its own block's V scale (the
reference stores four f16 copies, 16 KiB at H = 16, one workgroup per CU); ``l == 0`` (not ``l
<= 0``) marks a row without keys, so NaN propagates; the CSR slice is clamped to ``[0, nnz]``;
``sm_scale`` (not ``sm_scale log2 e``), an LSE row stride and 64-bit q / out addressing are
launch arguments; the scale is applied after the running max.
Preconditions the host does not check: record scales are powers of two (the kernel takes their
exponent as the E8M0 scale) and <= 2^7 (else V is clamped); q is finite and ``|q·K| < 2^127``
(differences of scores stay finite); a row holds < 2^30 entries.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
import torch
from flydsl.expr import const_expr, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from jax_sparse_mla.kernels.gfx950._primitives import (
    BUFFER_NO_LIMIT,
    LN2,
    LOG2E,
    as_ir,
    base_address,
    buffer_rsrc,
    cat,
    exp2,
    f32,
    fmax,
    global_ptr,
    group_max,
    group_sum,
    i32,
    lds_ptr,
    load_global,
    load_lds,
    log2,
    mfma_scaled,
    permlane_swap,
    split_fp8,
    store_global,
    store_lds,
    uniform,
    xcd_grid_x,
    xcd_work_item,
)
from jax_sparse_mla.kernels.gfx950.configs import (
    SPARSE_MLA_HEADS,
    SPARSE_MLA_RETURN_LSE,
    SPARSE_MLA_THREADS,
    sparse_mla_split_range,
)
from jax_sparse_mla.kernels.gfx950.configs import SPARSE_MLA_MAX_HEADS as MAX_HEADS

RECORD_BYTES = 656
TILE = 128  # tokens per tile
THREADS = SPARSE_MLA_THREADS  # 4 waves of 64
SCALE_OFF = 512  # record byte offsets
ROPE_OFF = 528
Q_DIM = 576

# LDS regions (bytes); the small ones first, so their offsets fit DS immediates.
LDS_SCALES = 0  # f32 scale words [wave][block][32 tokens]
LDS_MAX = LDS_SCALES + 4 * 4 * 32 * 4  # f32 [16 heads][4 waves]
LDS_SINK = LDS_MAX + MAX_HEADS * 4 * 4  # P stores of heads >= H
LDS_P = LDS_SINK + 32  # f32 P [wave][lane group][H][8 tokens], then the latent tile
LATENT_BYTES = 4 * TILE * 128  # 4 column blocks of [128 tokens][128 B]

P_SHIFT = 8.0  # P = 2^8 exp2(...) <= 2^8, and the LSE takes the 8 off again
P_SCALE = 2.0**P_SHIFT
NEG_INF = float("-inf")  # masked score
SCALE_CAP_BITS = 0x43000000  # f32 bits of 2^7
WAVES_PER_EU = 2


@dataclasses.dataclass(frozen=True)
class Config:
    """One compiled variant of the kernel."""

    kernel: str = "sparse_mla"
    num_heads: int = MAX_HEADS
    return_lse: bool = True

    @property
    def symbol(self) -> str:
        return f"jsm_{self.kernel}_h{self.num_heads}_l{int(self.return_lse)}"

    @property
    def design_waves_per_simd(self) -> int:
        return WAVES_PER_EU

    @property
    def lds_latent(self) -> int:
        """Offset of the latent tile (after P, 128-byte aligned)."""
        return -(-(LDS_P + 4 * 4 * self.num_heads * 32) // 128) * 128

    @property
    def lds_bytes(self) -> int:
        return self.lds_latent + LATENT_BYTES


CONFIGS: tuple[Config, ...] = tuple(
    Config(num_heads=heads, return_lse=lse)
    for heads in SPARSE_MLA_HEADS
    for lse in SPARSE_MLA_RETURN_LSE
)


# ---------------------------------------------------------------------------------------------
# Small device helpers (straight-line code; control flow lives in the kernel body)
# ---------------------------------------------------------------------------------------------


def _weight(t, m_ref, scale) -> fx.Float32:
    """``exp2(((t - m_ref) |sm_scale|) log2 e)``: finite for every finite sm_scale."""
    return exp2(((t - m_ref) * scale) * LOG2E)


def _e8m0_scale(amax) -> tuple:
    """E8M0 byte ``s = max(exponent(amax) - 7, 6)`` and the f32 ``2^(127 - s)``."""
    e = (f32(amax).bitcast(fx.Int32) >> 23) & 0xFF
    s = fx.max(e - 7, fx.Int32(6))
    return s, ((254 - s) << 23).bitcast(fx.Float32)


def _split_q(vals, inv) -> tuple:
    """x = vals * inv -> (hi words, lo words): hi = e4m3(x), lo = e4m3((x - hi) * 32)."""
    x = [f32(v) * inv for v in vals]
    words = [split_fp8(x[i : i + 4]) for i in range(0, len(x), 4)]
    return [hi for hi, _ in words], [lo for _, lo in words]


def _fp8x8_to_f16(words) -> Vec:
    """8 e4m3fn codes (2 i32) -> 8 f16, exact."""
    one = as_ir(fx.Float32(1.0))
    parts = [
        Vec(rocdl.cvt_scalef32_pk_f16_fp8(T.vec(2, T.f16), as_ir(words[k]), one, hi))
        for k in range(2)
        for hi in (False, True)
    ]
    return cat(cat(parts[0], parts[1]), cat(parts[2], parts[3]))


def _mfma_bf16(a, b, acc) -> Vec:
    a, b = Vec(a).bitcast(fx.BFloat16), Vec(b).bitcast(fx.BFloat16)
    return Vec(rocdl.mfma_f32_16x16x32_bf16(T.vec(4, T.f32), [a, b, acc]))


def _mfma_f16(a, b, acc) -> Vec:
    return Vec(rocdl.mfma_f32_16x16x32_f16(T.vec(4, T.f32), [a, b, acc]))


def _pv_mfma(o: list, d0: int, va: list, pp: list) -> None:
    """O^T chunks d0..d0 + 3 += V^T P'^T over the tile's 4 key groups (in place)."""
    for i in range(4):
        for kk in range(4):
            o[d0 + i] = _mfma_f16(_fp8x8_to_f16(va[i][kk]), pp[kk], o[d0 + i])


def _swizzle(tok):
    """16-B chunk swizzle of a token row in a latent column block."""
    return ((tok >> 1) & 7) ^ (((tok >> 4) & 1) << 1)


# ---------------------------------------------------------------------------------------------
# Lane address maps: pure bit / integer arithmetic on Python ints (the layout test) or on the
# kernel's values. ``at`` is the address an offset is relative to (0 in the test).
# ---------------------------------------------------------------------------------------------


def _q_dim(g, j, half):
    """First latent dim of bytes ``16 half + [0, 16)`` of lane group g's q operand (B) of QK
    step ``blk = j``: block ``2 half + g // 2``, 16-dim chunk ``2 j + (g & 1)``."""
    return (2 * half + (g >> 1)) * 128 + (2 * j + (g & 1)) * 16


def _q_rope_dim(g, i):
    """First of the 8 q dims of lane group g's B operand of rope MFMA i (bf16 16x16x32)."""
    return 512 + 32 * i + 8 * g


def _rope_byte(g, i):
    """Record byte of the 8 rope values of lane group g's A operand of rope MFMA i."""
    return ROPE_OFF + 64 * i + 16 * g


def _scale_byte(g):
    """Record byte of lane group g's scale word: the f32 scale of latent block g."""
    return SCALE_OFF + 4 * g


def _qk_pos(at, w, t, s):
    """Tile position (from ``at``) of lane row t's QK key in sub-tile s of wave w."""
    return at + w * 32 + 16 * s + t


def _dma_pos(at, lane, hh):
    """Tile position (from ``at``) of the DMA key that lane holds in half hh (``ds_bpermute``
    source of DMA instructions ``8 hh + [0, 8)``)."""
    return at + 64 * hh + lane


def _dma_src_lane(lane, j):
    """``ds_bpermute`` byte address of the lane holding the key of DMA instruction ``j (mod 8)``
    of this lane: lane ``8 j + lane // 8``, i.e. token ``8 j + lane // 8`` of the half."""
    return (lane >> 3) * 4 + 32 * j


def _dma_chunk(w, lane, j):
    """Record byte offset this lane copies in DMA instruction ``j (mod 4)`` of wave w: latent
    block w, chunk ``(lane & 7) ^ f(token)`` (the swizzle of token ``8 j + lane // 8``)."""
    return w * 128 + ((lane & 7) ^ (4 * (j & 1) + (lane >> 4)) ^ (2 * ((j >> 1) & 1))) * 16


def _dma_dst(at, w, j):
    """LDS address (``at`` = the latent tile) of DMA instruction j of wave w; the hardware
    writes lane L's 16 B at ``+ 16 L`` (tokens ``8 j + [0, 8)`` of column block w)."""
    return at + w * 16384 + j * 1024


def _k_rows(at, w, t, g) -> list:
    """[blk] LDS offsets (``at`` = latent tile offset) of lane (t, g)'s first 16 B of QK
    sub-tile 0's A operand for q step blk: token ``32 w + t``, column block ``g // 2``,
    chunk ``(g & 1) + 2 blk`` (swizzled); the second 16 B sit 2 column blocks on."""
    tok = w * 32 + t
    return [
        at + (g >> 1) * 16384 + tok * 128 + (((g & 1) + 2 * blk) ^ _swizzle(tok)) * 16
        for blk in range(4)
    ]


def _k_slice(at, k_rd, j) -> tuple:
    """Addresses of the two 16-B halves of QK step ``j = 4 s + blk``'s A operand. Sub-tile
    s = 1 (tokens + 16) flips bit 1 of the swizzle: it reads ``k_rd[blk ^ 1] + 2048``."""
    ka = at + k_rd[(j % 4) ^ (j // 4)] + 2048 * (j // 4)
    return ka, ka + 32768


def _v_rows(at, w, t, g) -> list:
    """[dc] LDS offsets (``at`` = latent tile offset) of lane (t, g)'s ``ds_read_b64_tr_b8``
    of dim chunk dc (dims ``128 w + 16 dc + [0, 16)``) for PV operand kk = 0: bytes
    ``8 (t & 1) + [0, 8)`` of token ``32 (g >> 1) + 16 (i >> 2) + 8 (g & 1) + (i & 3)``,
    ``i = t >> 1``."""
    i_v = t >> 1
    tok = (g >> 1) * 32 + (i_v >> 2) * 16 + (g & 1) * 8 + (i_v & 3)
    return [
        at + w * 16384 + tok * 128 + ((dc ^ _swizzle(tok)) * 16) + (t & 1) * 8 for dc in range(8)
    ]


def _v_read(at, v_rd, dc, kk):
    """tr8 address of dim chunk dc for PV operand ``kk = 2 hf + sub`` (tokens + 4 sub + 64 hf):
    sub flips bit 1 of the swizzle (``v_rd[dc ^ 2] + 512``)."""
    hf, sub = kk // 2, kk % 2
    return at + v_rd[dc ^ (2 * sub)] + (512 * sub + 8192 * hf)


def _ks_write(at, w, t, g):
    """Scale word store of lane (t, g) of wave w, sub-tile 0 (+ 64 for s = 1): f32
    ``[wave][block g][32 tokens]``, token ``t`` (+ 16 s) of the wave's 32."""
    return at + LDS_SCALES + ((w * 4 + g) * 32 + t) * 4


def _mask_read(at, w, g):
    """Scale words (block 0) of lane group g's S rows in wave w: keys ``16 s + 4 g + [0, 4)`` at
    ``+ 64 s``; 0 marks a masked key."""
    return at + LDS_SCALES + (w * 4 * 32 + 4 * g) * 4


def _sv_read(at, w, g):
    """V scale words (block w) of PV operand 0's keys ``8 (g & 1) + [0, 4)`` of wave ``g // 2``'s
    32 tokens; see ``_pv_at`` for the other operands and keys."""
    return at + LDS_SCALES + (((g >> 1) * 4 + w) * 32 + 8 * (g & 1)) * 4


def _p_write(at, w, t, g, heads):
    """P store of head t, lane group g of wave w: f32 ``[wave][group][heads][8 tokens]``, the
    tokens ``32 w + 16 s + 4 g + [0, 4)`` at ``+ 16 s``."""
    return at + LDS_P + ((w * 4 + g) * heads + t) * 32


def _p_rows(g, heads):
    """First P row (8 f32 of one head) of lane group g's PV operand 0: the keys of (wave
    ``g // 2``, group ``2 (g & 1)``), head 0; see ``_pv_at``."""
    return ((g >> 1) * 4 + 2 * (g & 1)) * heads


def _p_read(at, rows, h):
    """P read of head h for PV operand 0 (``rows = _p_rows(g, heads)``)."""
    return at + LDS_P + (rows + h) * 32


def _pv_at(p_rd, sv_rd, kk, s, heads) -> tuple:
    """P and V scale words 4 s + [0, 4) of PV operand ``kk = 2 hf + sub``: the keys of wave
    ``2 hf + g // 2``, group ``2 (g & 1) + sub``, sub-tile s."""
    hf, sub = kk // 2, kk % 2
    return p_rd + ((8 * hf + sub) * heads * 32 + 16 * s), sv_rd + (1024 * hf + 16 * sub + 64 * s)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def build_launcher(config: Config):
    """The ``flyc.jit`` launcher of one configuration (see the module docstring for its ABI)."""
    H = config.num_heads
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"num_heads must be in [1, {MAX_HEADS}], got {H}")
    return_lse = config.return_lse
    lds_latent = config.lds_latent

    @fx.struct
    class Smem:
        raw: fx.Array[fx.Uint8, config.lds_bytes, 16]

    @flyc.kernel(name=config.symbol, known_block_size=[THREADS, 1, 1])
    def sparse_mla_kernel(
        Q: fx.Tensor,
        KV: fx.Tensor,
        IDX: fx.Tensor,
        IPTR: fx.Tensor,
        OUT: fx.Tensor,
        LSE: fx.Tensor,
        n_q: fx.Int32,
        nnz: fx.Int32,
        kv_rows: fx.Int32,
        num_splits: fx.Int32,
        head_groups: fx.Int32,
        q_row_stride: fx.Int32,
        q_head_stride: fx.Int32,
        out_row_stride: fx.Int32,
        out_head_stride: fx.Int32,
        lse_row_stride: fx.Int32,
        sm_scale: fx.Float32,
    ):
        tid = fx.Int32(fx.thread_idx.x)
        w = uniform(tid >> 6)
        lane = tid & 63
        t = lane & 15  # QK: token row of the sub-tile; S / P / O: head
        g = lane >> 4  # lane group
        item, hg = xcd_work_item(fx.Int32(fx.block_idx.x), head_groups)
        item_ok = item < n_q * num_splits
        item = fx.min(item, n_q * num_splits - 1)
        row_item = item // num_splits
        split = uniform(item - row_item * num_splits)
        qi = uniform(n_q - 1 - row_item)  # long rows first
        out_i = qi * num_splits + split  # row of out / lse: [n_q, S, ...]
        # scores t = sign(sm_scale) S; scaled by |sm_scale| log2 e only after the max is off
        sign = (sm_scale < 0.0).select(fx.Float32(-1.0), fx.Float32(1.0))
        scale = abs(sm_scale)

        q_base, kv_base, idx_base = base_address(Q), base_address(KV), base_address(IDX)
        ip_base, out_base, lse_base = base_address(IPTR), base_address(OUT), base_address(LSE)
        lds = fx.SharedAllocator().allocate(Smem).peek()
        base = uniform(fx.ptrtoint(lds.raw.ptr))

        # ---- this split's slice of the row's CSR slice (clamped to [0, nnz]); no keys for a
        # work item past the last (the grid's rounding to whole XCD rounds)
        bounds = load_global(ip_base + fx.Int64(qi) * 4, 2, align=4)
        row_beg = fx.min(fx.max(uniform(bounds[0]), fx.Int32(0)), nnz)
        row_len = fx.min(fx.max(uniform(bounds[1]), row_beg), nnz) - row_beg
        s_lo, s_hi = sparse_mla_split_range(row_len, split, num_splits, fx.min)
        r_beg = row_beg + s_lo
        r_len = item_ok.select(s_hi - s_lo, fx.Int32(0))
        idx_rsrc = buffer_rsrc(
            global_ptr(idx_base + fx.Int64(r_beg) * 4),
            fx.min(fx.Int64(nnz - r_beg) * 4, fx.Int64(BUFFER_NO_LIMIT)),
        )

        def load_idx(p, ty):
            """Entries at row positions p.. as ``ty`` (i32 or a vector; 0 past idx's end)."""
            return rocdl.raw_ptr_buffer_load(ty, idx_rsrc, as_ir(p * 4), as_ir(fx.Int32(0)), aux=0)

        def entry_ok(ix, p):
            """Position p of the row holds an unmasked entry ix."""
            return (p < r_len) & (fx.Uint32(as_ir(ix)) < fx.Uint32(as_ir(kv_rows)))

        # ---- tile count: up to the last unmasked entry
        last = fx.Int32(0)
        for sc in range((r_len + 255) >> 8):
            p0 = fx.Int32(sc) * 256 + lane * 4
            v = Vec(load_idx(p0, T.vec(4, T.i32)))
            for j in range_constexpr(4):
                last = entry_ok(i32(v[j]), p0 + j).select(p0 + j + 1, last)
        for sh in (1, 2, 4, 8, 16, 32):
            last = fx.max(last, last.shuffle_xor(sh, 64))
        nt = uniform((last + (TILE - 1)) >> 7)

        # ---- Q's words first (its split waits for them after tile 0's DMA is issued, so the
        # first gather is in flight while q is split): lane (head t, group g) loads latent
        # blocks g // 2 (qa) and 2 + g // 2 (qb), 16 dims each per block, and 16 rope dims
        h_ok = t < H
        h = hg * H + h_ok.select(t, fx.Int32(0))  # head of the launch's q / out / lse
        q_lane = q_base + (fx.Int64(qi) * fx.Int64(q_row_stride) + fx.Int64(h * q_head_stride)) * 2
        q_words = [
            [
                load_global(q_lane + fx.Int64(_q_dim(g, j, half) + 8 * k) * 2, 4)
                for j in range(4)
                for k in range(2)
            ]
            for half in range(2)
        ]
        q_rope = [load_global(q_lane + _q_rope_dim(g, i) * 2, 4) for i in range(2)]

        # ---- per-lane LDS addresses. Sub-tile s = 1 (keys + 16) and PV half sub = 1 (keys + 4)
        # flip bit 1 of the chunk swizzle, so they reuse the s = 0 / sub = 0 addresses of a
        # chunk index ^ 2 plus an immediate offset.
        k_rd = _k_rows(lds_latent, w, t, g)
        v_rd = _v_rows(lds_latent, w, t, g)
        dma_src_lane = [_dma_src_lane(lane, j) for j in range(8)]
        dma_chunk = [_dma_chunk(w, lane, j) for j in range(4)]
        ks_wr = _ks_write(base, w, t, g)
        mask_rd = _mask_read(base, w, g)
        mx_wr = base + LDS_MAX + (t * 4 + w) * 4
        mx_rd = base + LDS_MAX + t * 16
        p_wr = h_ok.select(_p_write(base, w, t, g, H), base + LDS_SINK)
        p_rd = _p_read(base, _p_rows(g, H), h_ok.select(t, H - 1))
        sv_rd = _sv_read(base, w, g)

        def qk_pos(tb) -> list:
            """Row positions of this lane's QK key rows (sub-tiles s = 0, 1) in tile tb."""
            return [_qk_pos(tb, w, t, s) for s in range(2)]

        def dma_pos(tb) -> list:
            """Row positions whose keys this lane holds for the DMA (lane, 64 + lane)."""
            return [_dma_pos(tb, lane, hh) for hh in range(2)]

        def load_raw(pos) -> list:
            """The idx entries at row positions pos (unchecked; see keys)."""
            return [i32(load_idx(p, T.i32)) for p in pos]

        def keys(raw, pos) -> list:
            """Records of the entries raw at positions pos, -1 for a masked key."""
            return [
                entry_ok(ix, p).select(ix, fx.Int32(-1)) for ix, p in zip(raw, pos, strict=True)
            ]

        def side_loads(recs) -> list:
            """Scale word of block g and rope dims [32i + 8g, +8) of the QK rows' records."""
            out = []
            for s in range_constexpr(2):
                ix = recs[s]
                row = (ix >= 0).select(kv_base + fx.Int64(ix) * RECORD_BYTES, q_lane)
                out.append(load_global(row + fx.Int64(_scale_byte(g)), 1))
                for i in range_constexpr(2):
                    out.append(load_global(row + fx.Int64(_rope_byte(g, i)), 4))
            return out

        def dma(recs) -> None:
            """Latent bytes [128w, 128w + 128) of the tile's 128 keys into column block w."""
            tok_keys = [  # all exchanges first: their latencies overlap
                i32(rocdl.ds_bpermute(T.i32, dma_src_lane[j % 8], recs[j // 8])) for j in range(16)
            ]
            for j in range_constexpr(16):
                ix = tok_keys[j]
                if ix >= 0:
                    src = kv_base + fx.Int64(ix) * RECORD_BYTES + fx.Int64(dma_chunk[j % 4])
                    dst = _dma_dst(base + lds_latent, w, j)
                    rocdl.global_load_lds(global_ptr(src), lds_ptr(uniform(dst)), 16, 0)

        # Zero this wave's column block: a masked key's slot keeps finite bytes.
        zero4 = Vec.filled(4, 0, fx.Int32)
        for j in range_constexpr(16):
            store_lds(_dma_dst(base + lds_latent, w, j) + lane * 16, zero4, 16)
        rocdl.s_waitcnt(lgkmcnt=0)

        # Prologue: tile 0 latent (DMA) and side words; raw entries of tile 1. The loop keeps
        # its index loads one tile ahead of their checks, so no wait lands inside a tile.
        tile0 = fx.Int32(0)
        keys_q0 = keys(load_raw(qk_pos(tile0)), qk_pos(tile0))
        dma(keys(load_raw(dma_pos(tile0)), dma_pos(tile0)))
        side0 = side_loads(keys_q0)
        tile1 = fx.Int32(TILE)

        # ---- Q's split: latent blocks g // 2 and 2 + g // 2 as fp8 hi/lo
        qa, qb = [], []
        for words, dst in zip(q_words, (qa, qb), strict=True):
            for v in words:
                vf = v.bitcast(fx.BFloat16).to(fx.Float32)
                dst += [h_ok.select(f32(vf[e]), fx.Float32(0.0)) for e in range(8)]
        amax = []
        for vals in (qa, qb):
            a = fx.Float32(0.0)
            for x in vals:
                a = fmax(a, abs(x))
            swapped = permlane_swap(rocdl.permlane16_swap, a.bitcast(fx.Int32))
            p0, p1 = (p.bitcast(fx.Float32) for p in swapped)
            amax.append(fmax(p0, p1))  # blocks g // 2 and 2 + g // 2
        other = []
        for a in amax:
            swapped = permlane_swap(rocdl.permlane32_swap, a.bitcast(fx.Int32))
            p0, p1 = (p.bitcast(fx.Float32) for p in swapped)
            other.append((g >= 2).select(p0, p1))  # the value of lane group g ^ 2
        mine = (g == 0).select(
            amax[0], (g == 1).select(other[0], (g == 2).select(other[1], amax[1]))
        )
        _, inv_a = _e8m0_scale(amax[0])
        _, inv_b = _e8m0_scale(amax[1])
        q_hi, q_lo = [], []
        for j in range_constexpr(4):
            ha, la = _split_q(qa[16 * j : 16 * j + 16], inv_a)
            hb, lb = _split_q(qb[16 * j : 16 * j + 16], inv_b)
            q_hi.append(Vec.from_elements(ha + hb, fx.Int32))
            q_lo.append(Vec.from_elements(la + lb, fx.Int32))
        qs_hi, _ = _e8m0_scale(mine)
        qs_lo = qs_hi - 5

        state = [fx.Float32(NEG_INF), fx.Float32(0.0)]
        state += [Vec.filled(4, 0.0, fx.Float32) for _ in range(8)]
        state += load_raw(qk_pos(tile1)) + load_raw(dma_pos(tile1)) + side0 + keys_q0
        init = [as_ir(x) for x in state]

        for tile, st in range(0, nt, 1, init=init):
            m_old, l_old = f32(st[0]), f32(st[1])
            o = [Vec(st[2 + i]) for i in range(8)]
            raw_q_next = [i32(st[10 + i]) for i in range(2)]
            raw_d_next = [i32(st[12 + i]) for i in range(2)]
            side = [Vec(st[14 + i]) for i in range(6)]
            keys_q = [i32(st[20 + i]) for i in range(2)]
            tb = fx.Int32(tile) * TILE

            # This tile's latent (own DMA), its side words and the next tile's entries have
            # landed; every wave's DMA is visible. gpu.barrier is a workgroup fence pair around
            # s_barrier (no LDS access moves across it; its release waits lgkmcnt(0), and for
            # the DMA, drained here anyway: no DMA is in flight at any barrier of this kernel).
            # lgkmcnt(0) is explicit as at the other barriers (nothing is outstanding here, so
            # the compiler would otherwise drop the fence's wait).
            rocdl.s_waitcnt(vmcnt=0, lgkmcnt=0)
            gpu.barrier()
            keys_q_next = keys(raw_q_next, qk_pos(tb + TILE))
            keys_d_next = keys(raw_d_next, dma_pos(tb + TILE))
            raw_q_next2 = load_raw(qk_pos(tb + 2 * TILE))
            raw_d_next2 = load_raw(dma_pos(tb + 2 * TILE))

            # ---- QK: A = 16 key rows from LDS, B = Q^T -> S^T; lane (head t, g): keys 4g + r
            def k_slice(j) -> Vec:
                """A operand of QK step j = 4 s + blk: 32 B of the lane's key row."""
                lo, hi = _k_slice(base, k_rd, j)
                return cat(load_lds(lo, 4), load_lds(hi, 4))

            sacc = [Vec.filled(4, 0.0, fx.Float32) for _ in range(2)]
            e8 = [(i32(side[3 * s][0]) >> 23) & 0xFF for s in range(2)]
            kt_next = k_slice(0)
            for j in range_constexpr(8):  # each slice read one step ahead of its MFMAs
                s, blk = j // 4, j % 4
                kt = kt_next
                if const_expr(j < 7):
                    kt_next = k_slice(j + 1)
                rocdl.sched_barrier(0)
                acc = mfma_scaled(kt, q_hi[blk], sacc[s], e8[s], qs_hi)
                sacc[s] = mfma_scaled(kt, q_lo[blk], acc, e8[s], qs_lo)
            for s in range_constexpr(2):
                for i in range_constexpr(2):
                    sacc[s] = _mfma_bf16(side[3 * s + 1 + i], q_rope[i], sacc[s])

            # Scale words of the QK rows' keys for every block: 0 marks a masked key, else
            # the f32 bits clamped to [1, 2^7].
            for s in range_constexpr(2):
                sw = fx.min(fx.max(i32(side[3 * s][0]), fx.Int32(1)), fx.Int32(SCALE_CAP_BITS))
                sw = (keys_q[s] >= 0).select(sw, fx.Int32(0))
                store_lds(ks_wr + 64 * s, sw, 4)
            sl = []
            tmax = fx.Float32(NEG_INF)
            for s in range_constexpr(2):
                live = load_lds(mask_rd + 64 * s, 4)
                for r in range_constexpr(4):
                    x = f32(sacc[s][r]) * sign
                    x = (i32(live[r]) != 0).select(x, fx.Float32(NEG_INF))
                    sl.append(x)
                    tmax = fmax(tmax, x)
            store_lds(mx_wr, group_max(tmax), 4)
            rocdl.s_waitcnt(lgkmcnt=0)
            gpu.barrier()

            # ---- online softmax (all 4 waves' maxima)
            mx = load_lds(mx_rd, 4, T.f32)
            m_new = m_old
            for k in range_constexpr(4):
                m_new = fmax(m_new, mx[k])
            m_ref = (m_new == NEG_INF).select(fx.Float32(0.0), m_new)
            alpha = (m_old == NEG_INF).select(fx.Float32(0.0), _weight(m_old, m_ref, scale))
            pl = [
                (x == NEG_INF).select(fx.Float32(0.0), _weight(x, m_ref, scale) * P_SCALE)
                for x in sl
            ]
            psum = fx.Float32(0.0)
            for x in pl:
                psum = psum + x
            l_new = l_old * alpha + psum
            o = [Vec.from_elements([f32(v[k]) * alpha for k in range(4)], fx.Float32) for v in o]
            for s in range_constexpr(2):
                store_lds(p_wr + 16 * s, Vec.from_elements(pl[4 * s : 4 * s + 4], fx.Float32), 16)
            rocdl.s_waitcnt(lgkmcnt=0)
            gpu.barrier()

            side_next = side_loads(keys_q_next)

            # ---- PV for dims [128w, 128w + 128): O^T += V^T P'^T, P' = f16(P * scale_w)
            pp = []
            for kk in range_constexpr(4):
                vals = []
                for s in range_constexpr(2):
                    p_at, sv_at = _pv_at(p_rd, sv_rd, kk, s, H)
                    pv = load_lds(p_at, 4, T.f32)
                    sv = load_lds(sv_at, 4)
                    vals += [f32(pv[r]) * i32(sv[r]).bitcast(fx.Float32) for r in range(4)]
                pp.append(Vec.from_elements(vals, fx.Float32).to(fx.Float16))

            def v_reads(d0) -> list:
                """tr8 reads of chunks d0..d0 + 3: [chunk][kk] -> 2 i32 (8 keys of dim t)."""
                res = []
                for dc in range_constexpr(d0, d0 + 4):
                    parts = []
                    for kk in range_constexpr(4):
                        addr = _v_read(base, v_rd, dc, kk)
                        tr = rocdl.ds_read_tr8_b64(T.vec(2, T.i32), lds_ptr(addr))
                        parts.append(Vec(tr.result))
                    res.append(parts)
                return res

            va = v_reads(0)
            _pv_mfma(o, 0, va, pp)
            va = v_reads(4)
            # Column block w is read only by this wave's PV: refill it with the next tile.
            rocdl.s_waitcnt(lgkmcnt=0)
            dma(keys_d_next)
            _pv_mfma(o, 4, va, pp)

            fin = yield [m_new, l_new] + o + raw_q_next2 + raw_d_next2 + side_next + keys_q_next

        # ---- epilogue: l over the 4 waves, normalize, store bf16 for h < H
        rocdl.s_waitcnt(vmcnt=0)
        store_lds(mx_wr, group_sum(f32(fin[1])), 4)
        rocdl.s_waitcnt(lgkmcnt=0)
        gpu.barrier()
        lv = load_lds(mx_rd, 4, T.f32)
        l_tot = (f32(lv[0]) + f32(lv[1])) + (f32(lv[2]) + f32(lv[3]))
        has_l = l_tot != 0.0
        inv_l = has_l.select(1.0 / l_tot, fx.Float32(0.0))
        o_row = fx.Int64(out_i) * fx.Int64(out_row_stride)
        o_lane = out_base + (o_row + fx.Int64(h * out_head_stride + w * 128 + 4 * g)) * 2
        res = [
            Vec.from_elements([f32(Vec(fin[2 + dc])[k]) * inv_l for k in range(4)], fx.Float32)
            for dc in range(8)
        ]
        if item_ok & h_ok:
            for dc in range_constexpr(8):
                store_global(o_lane + 32 * dc, res[dc].to(fx.BFloat16), 8)
        if const_expr(return_lse):
            m_fin = (f32(fin[0]) * scale) * LOG2E
            lse2 = m_fin + log2(has_l.select(l_tot, fx.Float32(1.0))) - P_SHIFT
            lse = has_l.select(lse2 * LN2, fx.Float32(float("-inf")))
            lse_at = lse_base + (fx.Int64(out_i) * fx.Int64(lse_row_stride) + fx.Int64(h)) * 4
            if item_ok & h_ok & (w == 0) & (g == 0):
                store_global(lse_at, lse, 4)

    @flyc.jit
    def launch(
        Q: fx.Tensor,
        KV: fx.Tensor,
        IDX: fx.Tensor,
        IPTR: fx.Tensor,
        OUT: fx.Tensor,
        LSE: fx.Tensor,
        n_q: fx.Int32,
        nnz: fx.Int32,
        kv_rows: fx.Int32,
        num_splits: fx.Int32,
        head_groups: fx.Int32,
        q_row_stride: fx.Int32,
        q_head_stride: fx.Int32,
        out_row_stride: fx.Int32,
        out_head_stride: fx.Int32,
        lse_row_stride: fx.Int32,
        sm_scale: fx.Float32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008
    ):
        sparse_mla_kernel(
            Q,
            KV,
            IDX,
            IPTR,
            OUT,
            LSE,
            n_q,
            nnz,
            kv_rows,
            num_splits,
            head_groups,
            q_row_stride,
            q_head_stride,
            out_row_stride,
            out_head_stride,
            lse_row_stride,
            sm_scale,
        ).launch(
            grid=(xcd_grid_x(n_q * num_splits, head_groups), 1, 1),
            block=(THREADS, 1, 1),
            stream=stream,
        )

    launch.compile_hints = {"waves_per_eu": WAVES_PER_EU, "fast_fp_math": False}
    return launch


def compile_config(config: Config):
    """Compiles one configuration from small CPU example tensors (no launch)."""
    h = config.num_heads
    n_q = 2
    q = torch.zeros(n_q * h * Q_DIM, dtype=torch.bfloat16)
    kv = torch.zeros(4 * RECORD_BYTES, dtype=torch.uint8)
    idx = torch.zeros(8, dtype=torch.int32)
    indptr = torch.zeros(n_q + 1, dtype=torch.int32)
    out = torch.zeros(n_q * h * 512, dtype=torch.bfloat16)
    lse = torch.zeros(n_q * h, dtype=torch.float32)
    scalars = (n_q, 8, 4, 1, 1, h * Q_DIM, Q_DIM, h * 512, 512, h, 576**-0.5)
    return flyc.compile(build_launcher(config), q, kv, idx, indptr, out, lse, *scalars)
