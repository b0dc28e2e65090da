"""gfx950 (MI355) FlyDSL kernels of ``mla_decode``: split-KV partials and their combine.

``jax_sparse_mla.emulation.mla_decode`` mirrors this arithmetic in jax (its docstring states the
kernel-vs-emulation bound). Symbols: ``jsm_mla_decode_partials_q{1,2,4}`` and
``jsm_mla_decode_combine`` (the 128-row ``jsm_mla_decode_partials_m128``: ``mla_decode_m128.py``).

Partials: request ``r``'s key positions ``j < seq_len = max(indptr[r+1] - indptr[r], 0)`` (key
``kv_indices[indptr[r] + j]``) are cut into splits ``[s c, min((s + 1) c, seq_len))``,
``c = 128 ceil(seq_len / (128 S))``. For each (request, split, query row) the kernel writes the
split's softmax-normalized output (bf16) and natural-log LSE (f32; -inf and o = 0 without a
visible key). Arithmetic, exactly (f32 unless said otherwise, ``c2 = (sm_scale k_scale) log2 e``,
``sg = -1`` if ``c2 < 0`` else 1, ``a = c2 sg = |c2|``):

* q split per query row (576 dims): ``e`` = exponent bits of ``max|q|``; ``s = max(e - 7, 6)``
  (E8M0); ``x = q 2^(127-s)`` (exact, in (-256, 256); subnormal q included);
  ``hi = e4m3(x)``, ``lo = e4m3((x - hi) 32)`` (RNE, OCP e4m3fn).
* Scores: ``S = sum_d code_d (hi_d 2^(s-127) + lo_d 2^(s-132))`` by 9 scaled fp8 MFMAs
  16x16x128 per 16-key tile (the raw K codes with E8M0 scale 1 as A, q's hi and lo with their
  E8M0 scales as B: each MFMA pairs 64 dims with their hi and their lo), f32 accumulation;
  ``t = S sg`` (exact; the scaled score ``S c2 = t a`` is never formed). A key is masked
  (``t = -inf``, ``P = 0``) when its position is outside the split, its index position outside
  ``[0, n_indices)``, its index outside ``[0, tokens)``, or it is causally hidden (query
  position ``i`` sees ``j <= seq_len - qlen + i``).
* Online softmax per 128-key block, the scale applied after the max (any finite sm_scale, also
  0 or negative, gives finite weights): ``m' = max(m, block max t)`` (``m = -inf`` at first),
  ``alpha = exp2((m - m') a)`` (0 while ``m = -inf``), ``P = exp2((t - m') a + 8)``
  (``<= 2^8``; 0 for a masked key), ``l' = l alpha + sum P``,
  ``O' = O alpha + sum_k (hi_k + lo_k / 32) V_k`` with
  ``hi = e4m3(P)``, ``lo = e4m3((P - hi) 32)`` and V the raw e4m3 codes (fp8 MFMAs, lo with
  E8M0 scale 2^-5, f32 accumulation). k_scale enters through ``a``, v_scale at the end.
* ``o = bf16(O (v_scale / l))`` (RNE), ``lse = (m a + (log2 l - 8)) ln 2`` (+-inf where it
  overflows float32); ``l == 0``: o = 0, -inf.
  ``exp2`` / ``log2`` are the hardware ``v_exp_f32`` / ``v_log_f32``.
* Causal rule: a key hidden from query position ``i`` contributes nothing to row ``i``, whatever
  its bytes hold. Its score is replaced (a select: a NaN K code never reaches a hidden row),
  but all 16 rows of a CTA share one V operand, and ``P = 0`` times a NaN V code in the PV MFMA
  would still be NaN. Only the boundary keys ``j = seq_len - qlen + 1 .. seq_len - 1`` (qlen - 1
  of them) are hidden from some row and seen by another, so before a block's PV wave ``w``
  zeroes the NaN codes (``code & 0x7F == 0x7F``) of every boundary key in the block among its
  latents ``[64w, 64w + 64)`` in the slot (after the block's QK). Zeros add exact zeros, so no
  other value changes. A row that sees such a key still gets NaN: V is the first 512 codes of
  K, so the key's score is NaN, hence its P, l and every element of o; ``l`` NaN counts as a
  visible key (``l != 0``), so o and the LSE are NaN, not the empty split's 0 / -inf. (A masked
  key is never read; its slot row holds zeros or the bytes of a key two blocks earlier of the
  same split, which every row sees: a NaN there has made those rows NaN already.)

Work decomposition: a 512-thread CTA (8 waves) per (head group, split, request): 16 query rows
(row ``n``: head ``hg * 16 / qlen + n // qlen``, position ``n % qlen``). Per 128-key block, wave
``w`` owns keys ``[16w, 16w + 16)``: it DMAs their K rows (``global_load_lds``, 64-bit
addresses; a masked key is never read, its slot keeps finite bytes: the slots are zeroed first)
into the other of two LDS slots one block ahead, computes their scores ``S^T = K Q^T``, and the
block's row max goes through LDS; P's hi and lo go to LDS; then wave ``w`` accumulates latents
``[64w, 64w + 64)`` over the whole block: ``O^T += V^T P^T``, V^T read straight from the slot by
``ds_read_b64_tr_b8`` (assumed semantics: within each 16-lane row, destination lane ``t`` byte
``k`` is source lane ``2k + t // 8``'s byte ``t % 8``: AMD's documented semantics, probe.py; an
MI355 checks it by ``tests/test_gfx950.py::test_ds_read_b64_tr_b8_lane_map``). At the end l is
summed over the waves. Index reads go through a buffer descriptor sized to ``kv_indices``.
Prologue order: block 0's index entry is loaded, the slots zeroed, block 0's DMA issued, and
only then q loaded and split, so the first gather is in flight during q's loads (vmcnt counts
loads in order, so q's first use waits for the DMA too: the two latencies overlap, q's
arithmetic does not; ``tests/test_isa.py`` checks that nothing waits for q before the DMA).

LDS (bytes, static, 152576 in all, so one CTA per CU): two K slots ``[128 keys][576 B]`` at 0 and
73728 (16-B chunk ``c`` of key ``k`` stored at chunk ``c ^ ((k >> 2) & 3)``), P ``[hi, lo]
[16 rows][144 B]`` (keys at bytes 0..127) at 147456, row maxima / final l ``[16 rows][8 waves]``
f32 at 152064. Design occupancy: 2 waves per SIMD (8 waves per CU; ``waves_per_eu`` 2).

Synchronization: three ``s_barrier`` per block (top: this block's DMA landed, after the row
maxima, after P), each ``lds_barrier`` (``_primitives``): an explicit ``s_waitcnt lgkmcnt(0)``
(plus ``vmcnt(0)`` at the top and in the epilogue), and compiler fences that keep every LDS
access on its side. Not a workgroup fence: its release would also drain the next block's DMA,
in flight across the row-maxima and P barriers (``lds_barrier`` says why, with the evidence).
The DMA's LDS writes carry their own alias scope, so the compiler does not wait for the next
block's DMA before this block's LDS accesses either. ``tests/test_isa.py`` checks the waits in
the ISA: ``lgkmcnt(0)`` before every ``s_barrier``, no ``vmcnt`` wait at the two mid-block
ones. The CTAs of one (split, request) run on one XCD (block ids ``8 k + x`` go to XCD ``x``:
round-robin dispatch assumed), so a split's K rows come from HBM once per XCD L2 and are
requested ``G`` times from it.

All heads in one CTA: where ``configs.mla_decode_rows`` picks it (qlen 1, H a multiple of 128,
and its CTAs fill the CUs with splits of at least 2048 keys) the handler launches
``mla_decode_m128.py``'s 128-row kernel instead, which requests each K row once per (request,
split) rather than ``H / 16`` times (64-key softmax blocks, q's QK steps 5..8 in
LDS, P in registers; its docstring and docs/mi355.md have the numbers). These 16-row kernels
serve every other call. Why not 128 rows with q's hi and lo all in VGPRs: 8 waves give 256
unified VGPRs per lane, which must hold O (16 rows x 512 f32 = 128), q's hi and lo (72) and the
block's scores (32); compiled prototypes of that loop (not kept) took 256 VGPRs and spilled 28
to 111 (128- or 64-key blocks, q's lo from LDS, scheduling barriers per tile), and 4 waves of 32
rows at 1 wave per SIMD 512 (half AGPRs), spilling 735 to 1177. The peer kernel serving 128
heads per CTA (FlyDSL's ``mla_fwd_decode_m16x8_fp8_fp8``: 8 waves, one CTA per CU, 64-key
blocks) takes an fp8 q: 36 VGPRs, not 72.

Relative to the reference design it started from (a gfx950 MLA decode kernel outside this
repository): no warp specialization (WSPEC: every wave does the QK of its 16 keys and
the PV of its 64 latents each block), a block's DMA is issued at once at the top of the block
before (not spread over it) and waited for at once, q is split from global memory per lane
(not staged in LDS), the index stream is read per lane (no LDS index staging), and q's
power-of-two scale rides in the MFMA's E8M0 scales (the reference scales q by ``2^k`` and runs the
unscaled MFMA; the products are the same).

Partials launch ABI (``launch(*tensors, *scalars, stream)``; packed ``void **args``: per tensor
``&data_ptr`` then ``&layout`` (an int32 shape, unused), then each scalar by pointer, then
``&stream``). Tensors are flat 1-D, contiguous:

0. ``q``: bf16 ``[B * qlen, H, 576]``.   1. ``kv``: uint8 e4m3fn codes ``[tokens, 576]``
   (64-bit addressing; may exceed 4 GiB).   2. ``kv_indices``: int32 ``[n_indices]``.
3. ``kv_indptr``: int32 ``[B + 1]``.   4. ``o_parts``: bf16 ``[B * qlen, S, H, 512]``.
5. ``lse_parts``: f32 ``[B * qlen, S, H]``.

Scalars: ``num_requests`` B, ``num_heads`` H, ``num_splits`` S, ``n_indices``, ``tokens``
(int32, all >= 0, B, H, S >= 1), ``k_scale``, ``v_scale``, ``sm_scale`` (f32). Grid
``(8 G ceil(B S / 8), 1, 1)`` with ``G = ceil(H qlen / 16)`` head groups, block ``(512, 1, 1)``.
Preconditions: ``n_indices < 2^29``, ``kv_indptr`` entries in ``[0, 2^30)``, the unscaled
scores ``|S| < 2^126`` (so ``t - m'`` is finite) and ``c2`` finite (any finite ``sm_scale``
whose product with ``k_scale log2 e`` stays below 2^128).

Combine launch ABI: tensors ``o_parts`` bf16 ``[n, S, H, 512]``, ``lse_parts`` f32 ``[n, S, H]``,
``out`` bf16 ``[n, H, 512]``, ``lse`` f32 ``[n, H]``; scalars ``num_rows`` (= n H),
``num_heads`` H, ``num_splits`` S (int32, >= 1). Grid ``(ceil(n H / 4), 1, 1)``, block
``(256, 1, 1)``: wave ``w`` of CTA ``b`` merges row ``4b + w``, lane ``L`` dims
``[8L, 8L + 8)``: ``m = max_s lse_s``, ``w_s = exp2((lse_s - m) log2 e)`` (``m = +inf``, an
lse past float32's range: ``w_s = [lse_s = +inf]``),
``o = bf16(sum_s (w_s > 0 ? w_s o_s : 0) / sum_s w_s)`` (sums left to right),
``lse = m + log2(sum w) ln 2``; all -inf: o = 0, lse = -inf. Design occupancy 8 waves per SIMD.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
import torch
from flydsl._mlir import ir
from flydsl._mlir.dialects import llvm
from flydsl.expr import range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from jax_sparse_mla.kernels.gfx950._primitives import (
    LN2,
    LOG2E,
    as_ir,
    base_address,
    bf16_pair,
    buffer_rsrc,
    cat,
    compiler_fence,
    exp2,
    f32,
    fmax,
    global_ptr,
    group_max,
    group_sum,
    i32,
    lds_barrier,
    lds_ptr,
    load_global,
    load_lds,
    log2,
    mfma_scaled,
    permlane_swap,
    pin,
    split_fp8,
    store_global,
    store_lds,
    uniform,
    xcd_grid_x,
    xcd_work_item,
)
from jax_sparse_mla.kernels.gfx950.configs import (
    MLA_DECODE_BLOCK,
    MLA_DECODE_COMBINE_THREADS,
    MLA_DECODE_PARTIALS_THREADS,
    MLA_DECODE_ROWS,
)
from jax_sparse_mla.kernels.gfx950.configs import MLA_DECODE_QLENS as QLENS

KV_DIM = 576  # K = all 576 codes of a row; V = its first 512
LATENT = 512
BLOCK = MLA_DECODE_BLOCK  # keys per block
ROWS = MLA_DECODE_ROWS  # query rows per CTA
THREADS = MLA_DECODE_PARTIALS_THREADS
WAVES = THREADS // 64  # 8
TILE = BLOCK // WAVES  # keys per wave per block
QK_STEPS = KV_DIM // 64  # MFMAs per tile: each pairs 64 dims with q's hi and lo
LAT_TILES = LATENT // WAVES // 16  # 16-latent output tiles per wave

SLOT_BYTES = BLOCK * KV_DIM  # 73728
LDS_P = 2 * SLOT_BYTES  # P [hi, lo][16 rows][P_ROW]
P_ROW = BLOCK + 16  # padded row of P bytes
P_LO = ROWS * P_ROW
LDS_MAX = LDS_P + 2 * P_LO  # f32 [16 rows][8 waves]
LDS_BYTES = LDS_MAX + ROWS * WAVES * 4

P_SHIFT = 8.0  # P = exp2((t - m) |c2| + 8) <= 2^8
NEG_INF = float("-inf")  # masked score t; the running max before the first visible key
E8M0_ONE = 127
Q_SCALE_MIN = 6  # smallest hi E8M0 byte (the lo one, s - 5, stays >= 1)
LO_SHIFT = 5  # lo = e4m3(residual * 2^5) (split_fp8), E8M0 scale of the lo operand: byte - 5
PARTIALS_WAVES_PER_EU = 2
COMBINE_WAVES = MLA_DECODE_COMBINE_THREADS // 64  # 4: one merged row per wave
COMBINE_WAVES_PER_EU = 8


@dataclasses.dataclass(frozen=True)
class Config:
    """One compiled kernel: the partials for ``qlen`` query positions a request, or the combine."""

    kernel: str  # "mla_decode_partials" or "mla_decode_combine"
    qlen: int = 0  # partials only: 1, 2 or 4 (16 / qlen heads per CTA)

    @property
    def symbol(self) -> str:
        suffix = f"_q{self.qlen}" if self.kernel == "mla_decode_partials" else ""
        return f"jsm_{self.kernel}{suffix}"

    @property
    def design_waves_per_simd(self) -> int:
        if self.kernel == "mla_decode_partials":
            return PARTIALS_WAVES_PER_EU
        return COMBINE_WAVES_PER_EU


CONFIGS: tuple[Config, ...] = tuple(Config("mla_decode_partials", q) for q in QLENS) + (
    Config("mla_decode_combine"),
)


# ---------------------------------------------------------------------------------------------
# Small device helpers (straight-line code)
# ---------------------------------------------------------------------------------------------


def _dma_scope():
    """Alias-scope list naming the K-slot DMA: ``alias_scopes`` of the DMA, ``noalias_scopes``
    of every other LDS access. Without it the compiler waits for all in-flight DMA before any
    LDS access; the kernel orders DMA and reads itself (vmcnt wait + barrier per block)."""
    domain = '#llvm.alias_scope_domain<id = "jsm.mla_decode.lds">'
    return ir.Attribute.parse(f'[#llvm.alias_scope<id = "jsm.kv_dma", domain = {domain}>]')


def _load_lds(addr, words: int, elem: ir.Type | None = None) -> Vec:
    """``load_lds`` outside the DMA's alias scope (``_dma_scope``)."""
    return load_lds(addr, words, elem, noalias_scopes=_dma_scope())


def _store_lds(addr, value, align: int) -> None:
    """``store_lds`` outside the DMA's alias scope (``_dma_scope``)."""
    store_lds(addr, value, align, noalias_scopes=_dma_scope())


def split_blocks(iptr, req, split, num_splits, n_indices, tokens, block: int) -> tuple:
    """Request ``req``'s first position in kv_indices and seq_len (``kv_indptr`` ``iptr``), the
    key positions ``[lo, hi)`` of split ``split`` (whole 128s: the partials contract) and its
    count of ``block``-key blocks (a power of two; 0 without indices or tokens)."""
    bounds = load_global(base_address(iptr) + fx.Int64(req) * 4, 2, align=4)
    start = uniform(bounds[0])
    seq_len = fx.max(uniform(bounds[1]) - start, fx.Int32(0))
    per = BLOCK * num_splits
    chunk = ((seq_len + (per - 1)) // per) * BLOCK
    lo = split * chunk
    hi = fx.min(lo + chunk, seq_len)
    nb = (fx.max(hi - lo, fx.Int32(0)) + (block - 1)) >> (block.bit_length() - 1)
    nb = ((n_indices > 0) & (tokens > 0)).select(nb, fx.Int32(0))
    return start, seq_len, lo, hi, nb


def score_scale(sm_scale, k_scale) -> tuple:
    """(``sg``, ``|c2|``): ``c2 = (sm_scale k_scale) log2 e`` and its sign (module
    docstring); the scores' running max is taken on ``t = S sg``, ``|c2|`` applied after."""
    c2 = (sm_scale * k_scale) * LOG2E
    sg = (c2 < 0.0).select(fx.Float32(-1.0), fx.Float32(1.0))
    return sg, c2 * sg


def dma_16(src, dst) -> None:
    """16 bytes of each lane's global address ``src`` -> LDS at ``dst`` (wave-uniform: lane
    ``L`` writes ``dst + 16 L``), in the DMA's alias scope (``_dma_scope``)."""
    rocdl.global_load_lds(global_ptr(src), lds_ptr(uniform(dst)), 16, 0, alias_scopes=_dma_scope())


def zero_slots(lds0, tid, slot_bytes: int) -> None:
    """Zeroes both K slots of ``slot_bytes`` each from ``lds0`` (a masked key's slot row then
    holds finite bytes), then a barrier."""
    zero4 = Vec.filled(4, 0, fx.Int32)
    for i in range_constexpr(2 * slot_bytes // (16 * THREADS)):
        _store_lds(lds0 + (i * THREADS + tid) * 16, zero4, 16)
    lds_barrier()


def _q_operands(q_lane, row_ok, g) -> tuple:
    """The q split of this lane's query row: the B operands of the 9 QK steps and their E8M0.

    Lane (row, group g) holds dims ``64 s + 32 (g & 1) + [0, 32)`` of the row's hi (g < 2) or
    lo (g >= 2) for step s, bytes in dim order; ``q_lane`` is the byte address of dim
    ``32 (g & 1)`` of the row. The scale is ``s`` for even g (hi), ``s - 5`` for odd g (lo).
    Two passes over the row (the max exponent, then the split one step at a time, re-loading
    with volatile loads) keep the prologue's registers few.
    """

    def step_words(s, volatile: bool) -> list:
        """The 16 dwords (32 bf16, dim order) of step s; zeros for a row beyond the heads."""
        out = []
        for k in range_constexpr(4):
            ptr = global_ptr(q_lane + (64 * s + 8 * k) * 2)
            v = Vec(llvm.LoadOp(T.vec(4, T.i32), ptr, alignment=16, volatile_=volatile).result)
            out += [row_ok.select(i32(v[e]), fx.Int32(0)) for e in range(4)]
        return out

    expo = fx.Int32(0)
    for s in range_constexpr(QK_STEPS):
        for d in step_words(s, False):
            expo = fx.max(expo, fx.max((d >> 7) & 0xFF, (d >> 23) & 0xFF))
    # the other half of the row: lane group g ^ 1
    pa, pb = permlane_swap(rocdl.permlane16_swap, expo)
    q_s = fx.max(fx.max(pa, pb) - 7, fx.Int32(Q_SCALE_MIN))
    inv = ((254 - q_s) << 23).bitcast(fx.Float32)
    take_hi = g < 2
    ops = []
    for s in range_constexpr(QK_STEPS):
        words = step_words(s, True)
        op_words = []
        for k in range_constexpr(8):
            x = []
            for d in words[2 * k : 2 * k + 2]:
                x += [v * inv for v in bf16_pair(d)]
            hw, lw = split_fp8(x)
            op_words.append(pin(take_hi.select(hw, lw)))
        ops.append(Vec.from_elements(op_words, fx.Int32))
    return ops, ((g & 1) == 0).select(q_s, q_s - LO_SHIFT)


def _k_offsets(w, t, g) -> list:
    """Slot byte offsets of lane (t, g)'s two 16-B halves of QK step 0's A operand (+64 per
    step): key ``16w + t``, logical chunks ``2 (g & 1)`` and ``2 (g & 1) + 1`` (swizzled)."""
    row = (TILE * w + t) * KV_DIM
    return [row + _swizzle(t, 2 * (g & 1) + h) * 16 for h in range(2)]


def _v_offset(w, t, g, jt, r):
    """Slot byte offset of lane (t, g)'s ``ds_read_b64_tr_b8`` r (0..3) of latent tile jt.

    The 16-lane row g reads keys ``32 g + 8 r + [0, 8)`` (lane t: key ``32 g + 8 r + t // 2``,
    bytes ``8 (t & 1) + [0, 8)``) of the 16 latents ``64 w + 16 jt + [0, 16)``, so lane t gets
    latent ``64 w + 16 jt + t`` of those 8 keys: A operand bytes ``8 r + [0, 8)`` = keys
    ``32 g + 8 r + [0, 8)``. The chunk swizzle of key ``k`` XORs chunk ``4 w + jt`` with
    ``(k >> 2) & 3 = 2 (r & 1) + t // 8``: a compile-time part and a per-lane +-16 B.
    """
    jj = jt ^ (2 * (r & 1))
    sign = -1 if jj & 1 else 1
    row = (32 * g + (t >> 1)) * KV_DIM + 8 * KV_DIM * r
    return row + 64 * w + 16 * jj + sign * 16 * (t >> 3) + 8 * (t & 1)


def _p_write_offset(w, t, g):
    """Byte offset (in P's hi rows) of row t's P of keys ``16w + 4g + [0, 4)``."""
    return t * P_ROW + w * TILE + 4 * g


def _p_read_offset(t, g):
    """Byte offset of row t's P of keys ``32g + [0, 32)``: the B operand of the PV MFMAs."""
    return t * P_ROW + 32 * g


def _dma_lanes(lane) -> tuple:
    """For DMA instruction i of a wave (LDS bytes ``1024 i + [0, 1024)`` of its 16-key tile):
    the byte index of the lane holding this lane's key (a ``ds_bpermute`` source) and the byte
    offset of the key row's chunk this lane copies (its LDS chunk, unswizzled)."""
    chunks = KV_DIM // 16
    src, off = [], []
    for i in range_constexpr(TILE * KV_DIM // 1024):
        p = 64 * i + lane
        key = p // chunks
        src.append(key * 4)
        off.append(_swizzle(key, p % chunks) * 16)
    return src, off


def _tr8(addr) -> Vec:
    """ds_read_b64_tr_b8: 8 bytes, transposed within each 16-lane row (module docstring)."""
    op = rocdl.ds_read_tr8_b64(T.vec(2, T.i32), lds_ptr(addr), noalias_scopes=_dma_scope())
    return Vec(op.result)


def _zero_nan_v(slot, kk, w, g) -> None:
    """Zeroes the NaN codes of slot key ``kk`` among the V latents ``64 w + 16 jt + 4 g +
    [0, 4)`` (jt < 4) of lane group g (module docstring, causal rule). The 16 lanes of a group
    write the same bytes."""
    for jt in range_constexpr(LAT_TILES):
        addr = slot + kk * KV_DIM + _swizzle(kk, 4 * w + jt) * 16 + 4 * g
        x = i32(_load_lds(addr, 1)[0])
        nan = (((x & 0x7F7F7F7F) + 0x01010101) >> 7) & 0x01010101  # 1 per NaN byte
        _store_lds(addr, x & ((nan * 0xFF) ^ fx.Int32(-1)), 4)


def _swizzle(key, chunk):
    """LDS 16-B chunk of logical chunk ``chunk`` of slot key ``key``: low 2 bits XOR (key>>2)&3."""
    return chunk ^ ((key >> 2) & 3)


# ---------------------------------------------------------------------------------------------
# Partials kernel
# ---------------------------------------------------------------------------------------------


def partials_launcher(partials_kernel, heads_per_cta: int):
    """The ``flyc.jit`` launcher of a partials kernel serving ``heads_per_cta`` heads per CTA
    (the partials launch ABI of the module docstring; grid ``8 G ceil(B S / 8)``, ``G =
    ceil(H / heads_per_cta)``); ``mla_decode_m128.py``'s kernel shares it."""

    @flyc.jit
    def launch(
        Q: fx.Tensor,
        KV: fx.Tensor,
        IDX: fx.Tensor,
        IPTR: fx.Tensor,
        OP: fx.Tensor,
        LP: fx.Tensor,
        num_requests: fx.Int32,
        num_heads: fx.Int32,
        num_splits: fx.Int32,
        n_indices: fx.Int32,
        tokens: fx.Int32,
        k_scale: fx.Float32,
        v_scale: fx.Float32,
        sm_scale: fx.Float32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008
    ):
        groups = (num_heads + (heads_per_cta - 1)) // heads_per_cta
        grid_x = xcd_grid_x(num_requests * num_splits, groups)
        partials_kernel(
            Q,
            KV,
            IDX,
            IPTR,
            OP,
            LP,
            num_requests,
            num_heads,
            num_splits,
            n_indices,
            tokens,
            k_scale,
            v_scale,
            sm_scale,
        ).launch(grid=(grid_x, 1, 1), block=(THREADS, 1, 1), stream=stream)

    launch.compile_hints = {"waves_per_eu": PARTIALS_WAVES_PER_EU, "fast_fp_math": False}
    return launch


def build_partials_launcher(qlen: int):
    """The ``flyc.jit`` launcher of the partials kernel for ``qlen`` (module docstring: ABI)."""
    if qlen not in QLENS:
        raise ValueError(f"qlen must be one of {QLENS}, got {qlen}")
    heads_per_cta = ROWS // qlen

    @fx.struct
    class Smem:
        raw: fx.Array[fx.Uint8, LDS_BYTES, 16]

    @flyc.kernel(name=Config("mla_decode_partials", qlen).symbol, known_block_size=[THREADS, 1, 1])
    def partials_kernel(
        Q: fx.Tensor,
        KV: fx.Tensor,
        IDX: fx.Tensor,
        IPTR: fx.Tensor,
        OP: fx.Tensor,
        LP: fx.Tensor,
        num_requests: fx.Int32,
        num_heads: fx.Int32,
        num_splits: fx.Int32,
        n_indices: fx.Int32,
        tokens: fx.Int32,
        k_scale: fx.Float32,
        v_scale: fx.Float32,
        sm_scale: fx.Float32,
    ):
        tid = fx.Int32(fx.thread_idx.x)
        w = uniform(tid >> 6)
        lane = tid & 63
        t = lane & 15  # QK: key of the wave's tile; S, P, O: query row
        g = lane >> 4  # lane group

        # ---- work item (request x split) and head group: G consecutive CTAs of one XCD
        groups = (num_heads + (heads_per_cta - 1)) // heads_per_cta
        item, hg = (uniform(x) for x in xcd_work_item(fx.Int32(fx.block_idx.x), groups))
        if item < num_requests * num_splits:
            req = item // num_splits
            split = item - req * num_splits

            q_base, kv_base, idx_base = base_address(Q), base_address(KV), base_address(IDX)
            op_base, lp_base = base_address(OP), base_address(LP)
            lds = fx.SharedAllocator().allocate(Smem).peek()
            lds0 = uniform(fx.ptrtoint(lds.raw.ptr))

            # ---- the split's key positions [lo, hi) and its block count
            args = (num_splits, n_indices, tokens, BLOCK)
            start, seq_len, lo, hi, nb = split_blocks(IPTR, req, split, *args)
            idx_rsrc = buffer_rsrc(global_ptr(idx_base), fx.Int64(n_indices) * 4)

            # ---- this lane's query row n = t: head and position, causal bound
            head = hg * heads_per_cta + t // qlen
            pos_i = t % qlen
            row_ok = head < num_heads
            bound = seq_len - qlen + pos_i
            qrow = req * qlen + pos_i
            q_lane = (
                q_base
                + (
                    fx.Int64(qrow * num_heads + fx.min(head, num_heads - 1)) * KV_DIM
                    + fx.Int64(32 * (g & 1))
                )
                * 2
            )
            sg, ac2 = score_scale(sm_scale, k_scale)

            # ---- per-lane LDS addresses, relative to a slot (or to lds0)
            k_rd = _k_offsets(w, t, g)
            p_wr = lds0 + LDS_P + _p_write_offset(w, t, g)
            p_rd = lds0 + LDS_P + _p_read_offset(t, g)
            mx_wr = lds0 + LDS_MAX + t * (WAVES * 4) + 4 * w
            mx_rd = lds0 + LDS_MAX + t * (WAVES * 4)
            dma_from, dma_chunk = _dma_lanes(lane)

            def load_index(blk):
                """Raw kv_indices entry of this lane's key (16w + t) of block blk."""
                pos = start + lo + blk * BLOCK + w * TILE + t
                v = rocdl.raw_ptr_buffer_load(
                    T.i32, idx_rsrc, as_ir(pos * 4), as_ir(fx.Int32(0)), aux=0
                )
                return i32(v)

            def check_index(raw, blk):
                """The key's cache row, or -1 when it is masked."""
                j = lo + blk * BLOCK + w * TILE + t
                pos = start + j
                ok = (j < hi) & (pos >= 0) & (pos < n_indices)
                ok = ok & (fx.Uint32(as_ir(raw)) < fx.Uint32(as_ir(tokens)))
                return ok.select(raw, fx.Int32(-1))

            def dma(key, blk):
                """K rows of this wave's 16 keys of block blk -> its slot (masked keys skipped).

                Every lane first fetches the cache row of the key it copies for each of the 9
                DMA instructions (``ds_bpermute`` from the lane that loaded the index), all
                before the first DMA (pinned: not sunk next to their branches), so the
                exchanges overlap.
                """
                dst = lds0 + (blk & 1) * SLOT_BYTES + w * (TILE * KV_DIM)
                rows = [pin(i32(rocdl.ds_bpermute(T.i32, src, key))) for src in dma_from]
                for i in range_constexpr(len(rows)):
                    if rows[i] >= 0:
                        src = kv_base + fx.Int64(rows[i]) * KV_DIM + fx.Int64(dma_chunk[i])
                        dma_16(src, dst + 1024 * i)

            # Zero both slots (a masked key's slot then holds finite bytes), then block 0's DMA,
            # then q's split: the first gather is in flight while q is loaded and split.
            raw_cur = load_index(0)
            zero_slots(lds0, tid, SLOT_BYTES)
            key_cur = check_index(raw_cur, 0)
            dma(key_cur, 0)
            raw_next = load_index(1)
            q_ops, q_scale_b = _q_operands(q_lane, row_ok, g)

            m_run = fx.Float32(NEG_INF)
            l_run = fx.Float32(0.0)
            o_acc = [Vec.filled(4, 0.0, fx.Float32) for _ in range(LAT_TILES)]
            for blk_i in range(nb):
                blk = fx.Int32(blk_i)
                slot = lds0 + (blk & 1) * SLOT_BYTES
                # Block blk's K rows (own DMA) and the next indices have landed; every wave's
                # DMA is visible and every wave is done with the other slot.
                lds_barrier(vm=True)
                key_next = check_index(raw_next, blk + 1)
                dma(key_next, blk + 1)
                raw_next = load_index(blk + 2)
                # bit k: key 16w + k of the block is unmasked
                live = fx.Int32(fx.Int64(rocdl.ballot(T.i64, as_ir(key_cur >= 0))))

                # ---- S^T = K Q^T: lane (row t, group g) gets keys 16w + 4g + r
                acc = Vec.filled(4, 0.0, fx.Float32)
                for s in range_constexpr(QK_STEPS):
                    ka = cat(
                        _load_lds(slot + k_rd[0] + 64 * s, 4), _load_lds(slot + k_rd[1] + 64 * s, 4)
                    )
                    acc = mfma_scaled(ka, q_ops[s], acc, E8M0_ONE, q_scale_b)
                sl, vl = [], []
                for r in range_constexpr(4):
                    kpos = lo + blk * BLOCK + w * TILE + 4 * g + r
                    vis = (((live >> (4 * g + r)) & 1) != 0) & (kpos <= bound)
                    sl.append(vis.select(f32(acc[r]) * sg, fx.Float32(NEG_INF)))
                    vl.append(vis)
                tmax = fmax(fmax(sl[0], sl[1]), fmax(sl[2], sl[3]))
                _store_lds(mx_wr, group_max(tmax), 4)
                lds_barrier()

                # ---- online softmax over the block's maxima of all waves
                mx = [_load_lds(mx_rd + 16 * k, 4, T.f32) for k in range(2)]
                m_new = m_run
                for k in range_constexpr(WAVES):
                    m_new = fmax(m_new, mx[k // 4][k % 4])
                alpha = (m_run == NEG_INF).select(fx.Float32(0.0), exp2((m_run - m_new) * ac2))
                pl = [
                    v.select(exp2((x - m_new) * ac2 + P_SHIFT), fx.Float32(0.0))
                    for x, v in zip(sl, vl, strict=True)
                ]
                l_run = l_run * alpha + ((pl[0] + pl[1]) + (pl[2] + pl[3]))
                m_run = m_new
                o_acc = [
                    Vec.from_elements([f32(v[k]) * alpha for k in range(4)], fx.Float32)
                    for v in o_acc
                ]
                p_hi, p_lo = split_fp8(pl)
                _store_lds(p_wr, p_hi, 4)
                _store_lds(p_wr + P_LO, p_lo, 4)
                lds_barrier()

                # ---- causal boundary keys seq_len - qlen + 1 + u in the block: NaN V zeroed
                for u in range_constexpr(qlen - 1):
                    kk = seq_len - (qlen - 1) + u - (lo + blk * BLOCK)
                    if (kk >= 0) & (kk < BLOCK):
                        _zero_nan_v(slot, kk, w, g)
                # the zeroed bytes are read by other lanes of this wave: LDS keeps a wave's
                # operations in order, the compiler must too
                compiler_fence()
                rocdl.sched_barrier(0)

                # ---- O^T += V^T P^T over the block; lane group g: keys 32g + [0, 32)
                b_hi = cat(_load_lds(p_rd, 4), _load_lds(p_rd + 16, 4))
                b_lo = cat(_load_lds(p_rd + P_LO, 4), _load_lds(p_rd + P_LO + 16, 4))
                for jt in range_constexpr(LAT_TILES):
                    va = None
                    for r in range_constexpr(4):
                        part = _tr8(slot + _v_offset(w, t, g, jt, r))
                        va = part if va is None else cat(va, part)
                    o_acc[jt] = mfma_scaled(va, b_hi, o_acc[jt], E8M0_ONE, E8M0_ONE)
                    o_acc[jt] = mfma_scaled(va, b_lo, o_acc[jt], E8M0_ONE, E8M0_ONE - LO_SHIFT)
                key_cur = key_next

            # ---- epilogue: l over the waves, o = O v_scale / l, lse
            _store_lds(mx_wr, group_sum(l_run), 4)
            lds_barrier(vm=True)
            lv = [_load_lds(mx_rd + 16 * k, 4, T.f32) for k in range(2)]
            l_tot = f32(lv[0][0])
            for k in range_constexpr(1, WAVES):
                l_tot = l_tot + f32(lv[k // 4][k % 4])
            has_l = l_tot != 0.0  # NaN included: a seen NaN key (causal rule)
            scale = has_l.select(v_scale / l_tot, fx.Float32(0.0))
            out_row = (fx.Int64(qrow) * fx.Int64(num_splits) + fx.Int64(split)) * fx.Int64(
                num_heads
            ) + fx.Int64(fx.min(head, num_heads - 1))
            o_lane = op_base + (out_row * LATENT + fx.Int64(w * 64 + 4 * g)) * 2
            res = [
                Vec.from_elements([f32(v[k]) * scale for k in range(4)], fx.Float32).to(fx.BFloat16)
                for v in o_acc
            ]
            if row_ok:
                for jt in range_constexpr(LAT_TILES):
                    store_global(o_lane + 32 * jt, res[jt].bitcast(fx.Int32), 8)
            lse = has_l.select(
                (m_run * ac2 + (log2(has_l.select(l_tot, fx.Float32(1.0))) - P_SHIFT)) * LN2,
                fx.Float32(float("-inf")),
            )
            if row_ok & (w == 0) & (g == 0):
                store_global(lp_base + out_row * 4, lse, 4)

    return partials_launcher(partials_kernel, heads_per_cta)


# ---------------------------------------------------------------------------------------------
# Combine kernel
# ---------------------------------------------------------------------------------------------


def build_combine_launcher():
    """The ``flyc.jit`` launcher of the combine kernel (module docstring: ABI)."""

    symbol = Config("mla_decode_combine").symbol

    @flyc.kernel(name=symbol, known_block_size=[64 * COMBINE_WAVES, 1, 1])
    def combine_kernel(
        OP: fx.Tensor,
        LP: fx.Tensor,
        OUT: fx.Tensor,
        LOUT: fx.Tensor,
        num_rows: fx.Int32,
        num_heads: fx.Int32,
        num_splits: fx.Int32,
    ):
        tid = fx.Int32(fx.thread_idx.x)
        row = uniform(fx.Int32(fx.block_idx.x) * COMBINE_WAVES + (tid >> 6))
        lane = tid & 63
        if row < num_rows:
            n_i = row // num_heads
            head = row - n_i * num_heads
            first = fx.Int64(n_i) * fx.Int64(num_splits) * fx.Int64(num_heads) + fx.Int64(head)
            lse_at = base_address(LP) + first * 4
            o_at = base_address(OP) + (first * LATENT + fx.Int64(8 * lane)) * 2
            stride = fx.Int64(num_heads)
            m = fx.Float32(float("-inf"))
            for s in range(num_splits):
                m = fmax(m, load_global(lse_at + fx.Int64(s) * stride * 4, 1, T.f32)[0])
            empty = m == float("-inf")
            over = m == float("inf")
            m_ref = empty.select(fx.Float32(0.0), m)
            acc = [fx.Float32(0.0)] * 8
            total = fx.Float32(0.0)
            for s in range(num_splits):
                lse_s = f32(load_global(lse_at + fx.Int64(s) * stride * 4, 1, T.f32)[0])
                w_s = over.select(
                    (lse_s == float("inf")).select(fx.Float32(1.0), fx.Float32(0.0)),
                    exp2((lse_s - m_ref) * LOG2E),
                )
                o_s = load_global(o_at + fx.Int64(s) * stride * (LATENT * 2), 4)
                o_s = o_s.bitcast(fx.BFloat16).to(fx.Float32)
                live = w_s > 0.0
                terms = [live.select(f32(x) * w_s, fx.Float32(0.0)) for x in o_s]
                acc = [a + x for a, x in zip(acc, terms, strict=True)]
                total = total + w_s
            total_safe = empty.select(fx.Float32(1.0), total)
            res = Vec.from_elements(
                [empty.select(fx.Float32(0.0), a / total_safe) for a in acc], fx.Float32
            )
            out_row = fx.Int64(row)
            store_global(
                base_address(OUT) + (out_row * LATENT + fx.Int64(8 * lane)) * 2,
                res.to(fx.BFloat16).bitcast(fx.Int32),
                16,
            )
            lse = empty.select(fx.Float32(float("-inf")), m_ref + log2(total_safe) * LN2)
            if lane == 0:
                store_global(base_address(LOUT) + out_row * 4, lse, 4)

    @flyc.jit
    def launch(
        OP: fx.Tensor,
        LP: fx.Tensor,
        OUT: fx.Tensor,
        LOUT: fx.Tensor,
        num_rows: fx.Int32,
        num_heads: fx.Int32,
        num_splits: fx.Int32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008
    ):
        combine_kernel(OP, LP, OUT, LOUT, num_rows, num_heads, num_splits).launch(
            grid=((num_rows + (COMBINE_WAVES - 1)) // COMBINE_WAVES, 1, 1),
            block=(64 * COMBINE_WAVES, 1, 1),
            stream=stream,
        )

    launch.compile_hints = {"waves_per_eu": COMBINE_WAVES_PER_EU, "fast_fp_math": False}
    return launch


def compile_config(config: Config):
    """Compiles one configuration from small CPU example tensors (no launch)."""
    if config.kernel == "mla_decode_combine":
        n, s, h = 2, 3, 4
        op = torch.zeros(n * s * h * LATENT, dtype=torch.bfloat16)
        lp = torch.zeros(n * s * h, dtype=torch.float32)
        out = torch.zeros(n * h * LATENT, dtype=torch.bfloat16)
        lout = torch.zeros(n * h, dtype=torch.float32)
        return flyc.compile(build_combine_launcher(), op, lp, out, lout, n * h, h, s)
    b, h, s, tokens, n_idx = 2, 16, 2, 8, 8
    rows = b * config.qlen
    q = torch.zeros(rows * h * KV_DIM, dtype=torch.bfloat16)
    kv = torch.zeros(tokens * KV_DIM, dtype=torch.uint8)
    idx = torch.zeros(n_idx, dtype=torch.int32)
    indptr = torch.zeros(b + 1, dtype=torch.int32)
    op = torch.zeros(rows * s * h * LATENT, dtype=torch.bfloat16)
    lp = torch.zeros(rows * s * h, dtype=torch.float32)
    scalars = (b, h, s, n_idx, tokens, 1.0, 1.0, KV_DIM**-0.5)
    return flyc.compile(build_partials_launcher(config.qlen), q, kv, idx, indptr, op, lp, *scalars)
