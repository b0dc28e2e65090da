"""gfx950 (MI355) FlyDSL kernels of ``ultraquant_decode``: HD256 paged decode + partition reduce.

The cache layout is the UltraQuant slot of ``docs/formats.md``; the op's contract is
``ultraquant_decode``'s docstring (``docs/semantics.md``). ``jax_sparse_mla.emulation.ultraquant``
reproduces the arithmetic below in jnp; keep the two in step.

Decode (``ultraquant_decode``, one compiled variant per G in {6, 8, 16} x block size in
{16, 32, 64, 128, 256}): grid (num_seqs, num_kv_heads, num_partitions), one 64-lane wave per
workgroup; workgroup (s, h, p) attends the G query heads h*G .. h*G+G-1 of request s over the
keys of partition p and writes one partial.

1. q rotation (in registers): lane L owns query row L>>3 and the 32 consecutive dims
   c*32 .. c*32+31, c = L&7. f32 Walsh-Hadamard butterflies (a+b, a-b) over strides 1, 2, 4,
   8, 16 inside the lane, then 32, 64, 128 through ds_swizzle (xor 1, 2, 4 of c); times 1/16
   (exact); clamped to [-448, 448]; rounded to e4m3fn by cvt_pk_fp8_f32 (round to nearest
   even; the instruction itself does not saturate: overflow gives NaN, hence the clamp);
   stored as bytes to its LDS row at byte dest(d) = (d&0x8F)|((d>>2)&0x10)|((d<<1)&0x60).
   Rows G..15 of the 16-row MFMA tile are zero. G=16 runs the lane map twice. dest is where
   the QK MFMA's e4m3 B operand needs rotated dim d = 128h + k (k < 128: its K index in MFMA
   h) when lane group g reads the 32 contiguous bytes 128h + 32g .. +31: in the 8-bit operand
   layout (step 2) byte j < 16 of lane group g is K 16g + j and byte 16 + j is K 64 + 16g + j,
   so K index k sits at byte 32*((k>>4)&3) + 16*(k>>6) + (k&15), which is dest(k). The
   permutation belongs to q alone: K is stored in natural rotated order.
2. QK: per 16-token tile, two scaled MFMAs v_mfma_scale_f32_16x16x128_f8f6f4 (A = the K FP4
   codes as ``ultraquant_store`` writes them, natural rotated order, loaded from memory
   straight into the operand: lane l holds token l&15, rotated dims 128h + 32(l>>4) .. +31 =
   32-group 4h + (l>>4); B = the e4m3 q; scale_a = that group's UE8M0 byte, scale_b = 0x7F = 1),
   f32 accumulation: raw = sum_d fp4_d * 2^(e_g - 127) * q8_d over the rotated dims d. Score
   s = raw * sign (exact; sign = -1 where sm_scale's sign bit is set, else 1); -inf for a
   token >= seq_len or in a block-table entry outside [0, num_blocks). sm_scale itself enters
   only after the running max is subtracted (step 3), so any finite sm_scale gives finite
   weights: mag = max(|sm_scale|, 2^-126) (so that a masked -inf never meets a 0 scale) and
   c = f32(mag * log2e) (float32's max where that overflows), once per wave
   (``_score_scale``).
   Operand layout assumed: the scaled MFMA lays out each operand by its own bit width. A 4-bit
   (e2m1) operand holds 32 contiguous K values 32g .. 32g+31 in lane group g (bytes 0-15, low
   nibble first); an 8-bit (e4m3) operand holds bytes 0-15 at K 16g .. and bytes 16-31 at
   K 64+16g .. (the layout sparse_mla and mla_decode use for both operands); the E8M0 scale of
   lane group g covers K 32g .. 32g+31. Evidence, three independent sources:
   - AMD's ROCm blog "Matrix Core Programming on AMD CDNA3 and CDNA4 architecture"
     (https://rocm.blogs.amd.com/software-tools-optimization/matrix-cores-cdna/README.html,
     source ROCm/rocm-blogs blogs/software-tools-optimization/matrix-cores-cdna/README.md):
     its scaled-MFMA operand tables (32x32x64) give an FP8 lane 16 bytes at K 16(l/32) .. and
     16 bytes 32 K further, "valid only if both input matrices A and B have FP8 type", and an
     FP4 lane 32 contiguous K values 32(l/32) ..;
   - FlyDSL's working mixed FP8 x FP4 MoE GEMM (ROCm/FlyDSL kernels/mega_moe/gemm_util.py):
     one MFMA_Scale(16, 16, 128, e4m3 A, e2m1 B) whose FP8 A is loaded per lane as
     "16@K + 16@K+64" and whose FP4 B is 16 contiguous bytes per lane;
   - AMD's ISA emulator (rocjitsu in ROCm/rocm-systems, amdgpu/shared/mma/layout.h) locates each
     operand of the scaled f8f6f4 MFMA by its own element width: sub-byte formats pack
     contiguously, only 8-bit elements use the two-chunk layout.
   No machine of this project ran it: tests/test_gfx950.py::test_mfma_operand_layouts_e2m1_e4m3
   checks it on an MI355 with the probe kernel (probe.py), and tests/test_emulation_ultraquant.py
   ::test_kernel_layout models this MFMA operand by operand on the CPU.
3. Online softmax per 16-token tile and query row, f32, on the signed unscaled scores:
   M' = max(M, max_t s_t); alpha = exp2((M - M') * c) (1 while M = -inf);
   p_t = exp2((s_t - M') * c) (0 while M' = -inf); tile sum ((p0+p1)+p2)+p3 per 4-token
   group g, then (S0+S1)+(S2+S3); L' = L * alpha + tile sum; exp2 is v_exp_f32. (c replaces
   the log2e multiply of an exp2 argument, sign the sm_scale multiply of a score: the same
   operations per score as scaling first; the g8_bs16 ISA has 1931 VALU instructions, 1923
   before.)
4. PV: V = fp4 * 2^(e - 127) as bf16 (v_cvt_scalef32_pk_bf16_fp4, exact) stored row-major to
   LDS, read back transposed with ds_read_b64_tr_b16 (within each 16-lane row, lane t element
   k = lane 4k + t//4's element t%4: AMD's documented semantics, probe.py; an MI355 checks it
   by tests/test_gfx950.py::test_ds_read_b64_tr_b16_lane_map); P rounded to bf16 (RNE);
   O' = O * alpha + mfma_f32_16x16x16_bf16(V^T, P) (f32 accumulation).
5. Partial p: o = bf16(O * f32(1 / L)) (L = 0 -> divisor 1, o = 0), max_logit = f32(M * mag)
   (the largest scaled logit, natural-log units; -inf for a partition without keys, +-inf
   where |sm_scale M| >= 2^128), exp_sum = L (f32).

Partitioning: partition p owns the 128-token tile-groups p, p+P, p+2P, ... of the request
(KV_COMPUTE_BLOCK = 128, like the reference); a tile-group is N_TILES = 8 tiles of TILE = 16
tokens. Each tile's block comes from its absolute position (block_tables[s, t // block_size]),
so every block size 16..256 works, also when a tile-group lies inside one 256-token block.
The tile's K/V come through a buffer descriptor whose 64-bit base is the tile's first slot
(cache + ((block * block_size + offset) * Hk + h) * slot_bytes, so caches over 4 GiB work)
and whose range covers exactly the tile's valid tokens: loads of masked tokens (past seq_len,
or an invalid block-table entry, which is never dereferenced) return 0 without touching
memory, so their V is 0 and garbage never meets a 0 probability. Block-table entries and
seq_lens are read with scalar (s_buffer_load) loads: they are uniform across the wave.

Reduce (``ultraquant_reduce``, one variant): grid (num_seqs, num_q_heads), one wave; lane l
owns dims 4l .. 4l+3. M = max_p max_logit_p; w_p = exp2(d_p * log2e) * exp_sum_p with
d_p = 0 where max_logit_p = M (also both -inf, or both +inf: partitions whose max logit
overflowed weigh by their sums alone, the others 0) and max_logit_p - M elsewhere; W = sum_p
w_p and acc = sum_p w_p * o_p in partition order; out = bf16(acc * f32(1 / W)), 0 when W = 0
(no key in the request).

LDS (decode): 12800 bytes: [0, 4096) the e4m3 q tile (16 rows x 256 B, written once, read as
the QK B operands each tile), [4096, 12800) the bf16 V tile (16 tokens x 544 B: 512 B + 32 B
of row padding, so each 16-lane transposed read hits distinct banks). Design occupancy: 3
waves per SIMD. LDS allows exactly that (12 one-wave workgroups per CU: LDS-bound, by
design) and the registers are budgeted to match (waves_per_eu 3: at most 168 VGPRs; the variants
use 154-164 VGPRs, no AGPR, 46-48 SGPRs, no spill, no scratch). The next
tile's loads are issued before the current tile's math (prefetch depth 1); empty volatile asm
"pins" of each tile's inputs and of each group of 4 PV results are ordering points that keep
the compiler from overlapping tiles, which would not fit the register budget. The reduce uses
no LDS (8 waves per SIMD).

Launch ABI (``flyc.compile`` packed args: per tensor &data_ptr then &layout{int32 shape[1]},
each scalar by pointer, then &stream). Tensors are flat 1-D buffers:

decode  out_parts  bf16 [B*Hk*P*G*256]  partial o, row ((s*Hk + h)*P + p)*G + g
        max_logits f32  [B*Hk*P*G]      same row order
        exp_sums   f32  [B*Hk*P*G]
        q          bf16                 element s*stride_q_seq + head*stride_q_head + d
        cache      u8   [num_blocks*block_size*Hk*slot_bytes] (addressed from its base pointer
                                        in 64 bits; the layout shape is not read)
        block_tables i32 [B*max_blocks_per_seq]
        seq_lens   i32  [B]
        num_seqs, num_kv_heads, slot_bytes, num_blocks, max_blocks_per_seq, num_partitions,
        stride_q_seq, stride_q_head: int32; sm_scale: float32.
        grid (num_seqs, num_kv_heads, num_partitions), block (64, 1, 1).
reduce  out        bf16 [B*Hq*256]
        out_parts, max_logits, exp_sums as written by decode
        num_seqs, num_kv_heads, query_group_size, num_partitions: int32.
        grid (num_seqs, num_kv_heads * query_group_size), block (64, 1, 1).

Preconditions: slot_bytes >= 272 and a multiple of 4; 16 * num_kv_heads * slot_bytes < 2^31;
max_blocks_per_seq * block_size < 2^31; num_seqs * num_q_heads * num_partitions < 2^31 (row
indices in int32; every buffer base is then offset in 64 bits, so no buffer size limit).
seq_lens is clamped to [0, max_blocks_per_seq * block_size]; sm_scale is any finite f32.

Decisions of this kernel (where the reference design it started from, a gfx950 kernel outside
this repository, is silent or differs): TILE 16, N_TILES 8 and the LDS
layout above; the reference's centroid table is dropped (nothing reads it); q is always rotated in
the kernel (no pre-rotated q path) and kept in LDS as e4m3 bytes rather than bf16 (the same
values: e4m3 is a subset of bf16); K goes from memory straight into the MFMA operand
registers (the reference stages it through LDS: same operands, no LDS round trip); every
partition runs all of its tile-groups (no compile-time tile-groups-per-partition cap); the
haircut clamps to +-448 before cvt_pk_fp8_f32 (saturation instead of NaN); stores of MFMA
rows >= G fall outside their buffer descriptor's range and are dropped (no branch).
"""

import dataclasses
import math

import flydsl.compiler as flyc
import flydsl.expr as fx
import torch
from flydsl._mlir import ir
from flydsl._mlir.dialects import llvm
from flydsl._mlir.dialects import rocdl as mlir_rocdl
from flydsl.expr import const_expr, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T

from jax_sparse_mla.kernels.gfx950._primitives import (
    LOG2E,
    as_ir,
    bf16_pair,
    buffer_rsrc,
    compiler_fence,
    exp2,
    fp8x4,
    mfma_scaled,
    pin,
)
from jax_sparse_mla.kernels.gfx950.configs import ULTRAQUANT_BLOCK_SIZES as BLOCK_SIZES
from jax_sparse_mla.kernels.gfx950.configs import ULTRAQUANT_GROUP_SIZES as GROUP_SIZES
from jax_sparse_mla.kernels.gfx950.configs import (
    ULTRAQUANT_THREADS,
    ULTRAQUANT_TILE,
    ULTRAQUANT_TILE_GROUP,
)

HEAD_DIM = 256
WAVE = 64
THREADS = ULTRAQUANT_THREADS  # per workgroup: one wave (both kernels assume it)
TILE = ULTRAQUANT_TILE  # tokens per QK / PV MFMA step
TILE_GROUP = ULTRAQUANT_TILE_GROUP  # KV_COMPUTE_BLOCK: tokens per partition work item
N_TILES = TILE_GROUP // TILE
PV_GROUP = 4  # PV MFMAs per group of transposed V reads

# UltraQuant slot layout (bytes).
K_CODES, K_SCALES, V_CODES, V_SCALES = 0, 128, 136, 264

Q_ROW_BYTES = HEAD_DIM  # e4m3 q row in LDS
V_ROW_BYTES = 2 * HEAD_DIM + 32  # bf16 V row in LDS, padded
V_TILE = 16 * Q_ROW_BYTES  # LDS byte offset of the V tile (after the q tile)
LDS_BYTES = V_TILE + TILE * V_ROW_BYTES  # 4096 + 8704 = 12800
LDS_PER_CU = 160 * 1024
SIMDS_PER_CU = 4
MAX_WAVES_PER_SIMD = 8
# LDS-bound: 12 one-wave workgroups per CU -> 3 waves per SIMD (register budget 168 VGPRs).
DECODE_WAVES_PER_SIMD = LDS_PER_CU // LDS_BYTES // SIMDS_PER_CU

FP8_MAX = 448.0
NEG_INF = float("-inf")
SIGN_BIT = -(2**31)  # float32 bits (as int32): the sign, 1.0, the smallest normal (2^-126)
ONE_BITS, TINY_BITS = 0x3F800000, 0x00800000
F32_MAX = (2.0 - 2.0**-23) * 2.0**127


@fx.struct
class _DecodeLds:
    buf: fx.Array[fx.Int32, LDS_BYTES // 4, 16]


# ---------------------------------------------------------------------------------------------
# Small code-generation helpers (trace-time Python; no data-dependent control flow)
# ---------------------------------------------------------------------------------------------


def _tensor_ptr(tensor) -> ir.Value:
    """!llvm.ptr<1> to the first element of a tensor argument."""
    return fx.get_iter(tensor).llvm_ptr


def _byte_offset(ptr: ir.Value, offset) -> ir.Value:
    """``ptr + offset`` bytes; ``offset`` is 64-bit (or a Python int)."""
    return llvm.GEPOp(ptr.type, ptr, [as_ir(fx.Int64(offset))], [-(2**31)], T.i8, None).result


def _load(rsrc: ir.Value, offset, dwords: int):
    """Buffer load of ``dwords`` 32-bit words at a per-lane byte offset (i32 or vector)."""
    ty = T.i32 if dwords == 1 else T.vec(dwords, T.i32)
    value = rocdl.raw_ptr_buffer_load(ty, rsrc, as_ir(fx.Int32(offset)), as_ir(fx.Int32(0)), 0)
    return fx.Int32(value) if dwords == 1 else fx.Vector(value)


def _store(rsrc: ir.Value, offset, value) -> None:
    """Buffer store of a 32/64/128-bit value at a per-lane byte offset."""
    mlir_rocdl.RawPtrBufferStoreOp(as_ir(value), rsrc, as_ir(fx.Int32(offset)), as_ir(fx.Int32(0)))


def _scalar_load(rsrc: ir.Value, offset) -> fx.Int32:
    """Wave-uniform 32-bit load through the scalar cache (s_buffer_load_dword)."""
    i128 = ir.IntegerType.get_signless(128)
    as_v4 = llvm.bitcast(T.vec(4, T.i32), llvm.ptrtoint(i128, rsrc))
    value = llvm.call_intrinsic(
        T.i32,
        "llvm.amdgcn.s.buffer.load.i32",
        [as_v4, as_ir(fx.Int32(offset)), as_ir(fx.Int32(0))],
        [],
        [],
    )
    return fx.Int32(value)


def _lds_ptr(base: ir.Value, offset) -> ir.Value:
    """!llvm.ptr<3> at ``base + offset`` bytes (i32 offset)."""
    return llvm.GEPOp(base.type, base, [as_ir(fx.Int32(offset))], [-(2**31)], T.i8, None).result


def _lds_load(base: ir.Value, offset, ty: ir.Type, align: int) -> ir.Value:
    """LDS load of one value of type ``ty``."""
    return llvm.LoadOp(ty, _lds_ptr(base, offset), alignment=align).result


def _lds_store(base: ir.Value, offset, value, align: int) -> None:
    """LDS store of one value."""
    llvm.StoreOp(as_ir(value), _lds_ptr(base, offset), alignment=align)


def _lds_fence() -> None:
    """Keep the compiler from moving LDS accesses across this point (``compiler_fence``, which
    does not rely on how the ``sched_barrier`` / ``s_waitcnt`` intrinsics are declared) and wait
    for the wave's outstanding LDS operations (cross-lane exchange through LDS; one wave per
    workgroup, so no ``s_barrier``)."""
    compiler_fence()
    rocdl.sched_barrier(0)
    rocdl.s_waitcnt(lgkmcnt=0)
    rocdl.sched_barrier(0)
    compiler_fence()


def _words(vec, n: int) -> list:
    """The n 32-bit words of a vector as DSL Int32 values."""
    return [fx.Int32(vec[i]) for i in range(n)]


def _vector_i32(words: list) -> fx.Vector:
    """vector<n x i32> from DSL Int32 values."""
    return fx.Vector.from_elements(words, dtype=fx.Int32)


def _pow2_of_byte(byte: fx.Int32) -> fx.Float32:
    """UE8M0 byte e -> f32 2^(e - 127) (byte 0 -> +0.0, the zero-group / masked value)."""
    return (byte << 23).bitcast(fx.Float32)


def _occupancy_attrs(waves_per_simd: int) -> dict:
    """Kernel attributes: one-wave workgroups, register budget for ``waves_per_simd``."""
    return {
        "rocdl.waves_per_eu": waves_per_simd,
        "rocdl.flat_work_group_size": f"{WAVE},{WAVE}",
    }


def _score_scale(sm_scale: fx.Float32) -> tuple:
    """(sign, mag, c) f32 of the launch's sm_scale (step 2): the scores are raw * sign (+-1
    with sm_scale's sign bit), mag = max(|sm_scale|, 2^-126) scales the partial's max logit,
    c = mag * log2e (at most float32's max) multiplies a score less the running max inside
    exp2. sign and mag are bit operations on the scalar argument (SALU, no VGPR; the integer
    max keeps a NaN's bits, which sort above every finite value's), c one VALU product."""
    bits = sm_scale.bitcast(fx.Int32)
    sign = ((bits & SIGN_BIT) | ONE_BITS).bitcast(fx.Float32)
    mag = fx.max(bits & ~SIGN_BIT, TINY_BITS).bitcast(fx.Float32)
    c = mag * LOG2E
    return sign, mag, (c > F32_MAX).select(fx.Float32(F32_MAX), c)


def _pin_all(values):
    """``pin`` over a (nested) list / tuple of values."""
    if isinstance(values, (list, tuple)):
        return type(values)(_pin_all(v) for v in values)
    return pin(values)


def _fmax(a: fx.Float32, b: fx.Float32) -> fx.Float32:
    """NaN-propagating f32 maximum."""
    return fx.max(a, b)


# ---------------------------------------------------------------------------------------------
# Lane layouts: pure bit / integer arithmetic on Python ints or DSL Int32 values (the kernel
# calls them; tests/test_emulation_ultraquant.py::test_kernel_layout evaluates them on numpy)
# ---------------------------------------------------------------------------------------------


def _dest_base(chunk):
    """dest(c*32 + t) - t for t < 16: the LDS byte of a lane's first 16 rotated dims."""
    return ((chunk & 2) << 3) | ((chunk & 1) << 6) | ((chunk & 4) << 5)


def _q_store_offset(row, chunk):
    """LDS byte of rotated dims 32*chunk .. +15 of q row ``row`` (dims +16 .. +31 at +32)."""
    return row * Q_ROW_BYTES + _dest_base(chunk)


def _q_operand_offset(lane, h: int):
    """LDS byte of lane l's B operand of QK MFMA h: q row l&15, bytes 128h + 32*(l>>4) .. +31
    (32 e4m3; which rotated dims they hold: see _dest_base)."""
    return (lane & 15) * Q_ROW_BYTES + (lane >> 4) * 32 + h * 128


def _tile_block_column(tile_start, block_size: int):
    """Block-table column of the block holding the tile that starts at token ``tile_start``."""
    return tile_start >> int(math.log2(block_size))


def _tile_block_offset(tile_start, block_size: int):
    """Slot of the tile's first token in its block (a 16-token tile never straddles blocks)."""
    return tile_start & (block_size - 1)


def _k_lane_group(lane):
    """MFMA lane group of lane l (l>>4): its K codes / scales are 32-groups 4h + (l>>4) of QK
    MFMA h, and its scores are tokens 4*(l>>4) .. +3 of the tile."""
    return lane >> 4


def _v_lane_token_chunk(lane) -> tuple:
    """(token, 64-dim chunk) of the V codes lane l loads and dequantizes: (l>>2, l&3)."""
    return lane >> 2, lane & 3


def _k_lane_offset(lane, stride_pos):
    """Tile-relative byte of lane l's K codes for QK MFMA 0 (A operand, see _k_codes_offset):
    token l&15 (slots are ``stride_pos`` bytes apart), code bytes 16*(l>>4) .. +15."""
    return (lane & 15) * stride_pos + (lane >> 4) * 16


def _k_codes_offset(k_off, h: int):
    """Byte of the A operand of QK MFMA h: 32 FP4 codes = rotated K dims 128h + 32*(l>>4) ..
    +31 of token l&15 (``k_off`` from _k_lane_offset)."""
    return k_off + K_CODES + 64 * h


def _k_scale_lane_offset(lane, stride_pos):
    """Tile-relative byte of token l&15's 8 K scale bytes (2 words: groups 0-3, 4-7)."""
    return (lane & 15) * stride_pos + K_SCALES


def _k_scale_shift(k_group):
    """Bit shift of the scale byte of group 4h + k_group in K scale word h (k_group = l>>4)."""
    return k_group * 8


def _score_first_token(tile_start, k_group):
    """Token of score element 0 of a lane in lane group k_group (elements e: token + e)."""
    return tile_start + k_group * 4


def _v_lane_offset(lane, stride_pos):
    """Tile-relative byte of lane l's V codes (half 0; see _v_codes_offset): token l>>2,
    code bytes 32*(l&3) .. +31 = dims 64*(l&3) .. +63."""
    return (lane >> 2) * stride_pos + (lane & 3) * 32


def _v_codes_offset(v_off, hf: int):
    """Byte of half hf (16 bytes: dims 64*chunk + 32hf .. +31) of a lane's V codes."""
    return v_off + V_CODES + 16 * hf


def _v_scale_lane_offset(lane, stride_pos):
    """Tile-relative byte of the V scale word holding groups 2*(l&3) and 2*(l&3)+1 (token l>>2)."""
    return (lane >> 2) * stride_pos + V_SCALES + ((lane & 3) >> 1) * 4


def _v_scale_shift(chunk, hf: int):
    """Bit shift of the scale byte of V group 2*chunk + hf in its scale word."""
    return ((chunk * 2 + hf) & 3) * 8


def _v_stage_offset(tok, chunk, hf: int, w: int):
    """LDS byte of V dims 64*chunk + 32hf + 8w .. +7 (bf16) of tile token tok (row-major)."""
    return V_TILE + tok * V_ROW_BYTES + (chunk * 64 + hf * 32 + w * 8) * 2


def _v_read_offset(lane, h: int):
    """LDS byte of lane l's ds_read_b64_tr_b16 for PV MFMA h: token l>>2, dims
    16h + 4*(l&3) .. +3; the transpose gives lane 16g+i dim 16h+i of tokens 4g .. 4g+3."""
    return V_TILE + (lane >> 2) * V_ROW_BYTES + (lane & 3) * 8 + h * 32


def _out_lane_offset(lane):
    """Byte (in the partial's G x 256 bf16 rows) of lane l's PV MFMA 0 result: q row l&15,
    dims 4*(l>>4) .. +3 (see _out_offset)."""
    return (lane & 15) * (2 * HEAD_DIM) + (lane >> 4) * 8


def _out_offset(row_off, h: int):
    """Byte of PV MFMA h's result (dims 16h + 4*(l>>4) .. +3; ``row_off`` from
    _out_lane_offset)."""
    return row_off + h * 32


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------


def _hadamard_32(v: list) -> list:
    """Butterfly stages of strides 1, 2, 4, 8, 16 over a lane's 32 consecutive dims."""
    for s in range(5):
        st = 1 << s
        out = list(v)
        for i in range(32):
            if i & st == 0:
                out[i] = v[i] + v[i + st]
                out[i + st] = v[i] - v[i + st]
        v = out
    return v


def _hadamard_across_lanes(v: list, chunk: fx.Int32) -> list:
    """Butterfly stages of strides 32, 64, 128: partner lane = lane xor k (k = 1, 2, 4, within
    the 8 lanes of a row) through ds_swizzle; the upper half computes partner - mine."""
    for s in range(3):
        k = 1 << s
        pattern = as_ir(fx.Int32((k << 10) | 0x1F))  # bitmask mode: and 0x1F, or 0, xor k
        sign = ((chunk & k) != 0).select(fx.Float32(-1.0), fx.Float32(1.0))
        out = []
        for x in v:
            partner = fx.Int32(mlir_rocdl.ds_swizzle(T.i32, as_ir(x.bitcast(fx.Int32)), pattern))
            out.append(x * sign + partner.bitcast(fx.Float32))
        v = out
    return v


def _e4m3_words(v: list) -> list:
    """32 f32 -> 8 words of e4m3 bytes: x / 16 clamped to +-448, cvt_pk_fp8_f32 (RNE)."""
    scaled = [fx.min(fx.max(x * (1.0 / 16.0), -FP8_MAX), FP8_MAX) for x in v]
    return [fp8x4(scaled[i : i + 4]) for i in range(0, 32, 4)]


def _stage_rotated_q(lds, q_rsrc, lane, group_size: int, stride_q_head) -> None:
    """Loads, rotates and haircuts the G query rows and stores them (permuted e4m3) to LDS rows
    0..G-1; rows G..15 get zeros."""
    row_in_pass = lane >> 3
    chunk = lane & 7
    for p in range_constexpr((group_size + 7) // 8):
        row = row_in_pass + p * 8
        active = row < group_size
        offset = (active.select(row, 0) * stride_q_head + chunk * 32) * 2
        vals = []
        for j in range_constexpr(4):
            for w in _words(_load(q_rsrc, offset + j * 16, 4), 4):
                vals.extend(bf16_pair(w))
        vals = [active.select(x, fx.Float32(0.0)) for x in vals]
        words = _e4m3_words(_hadamard_across_lanes(_hadamard_32(vals), chunk))
        dst = _q_store_offset(row, chunk)
        _lds_store(lds, dst, _vector_i32(words[:4]), 16)
        _lds_store(lds, dst + 32, _vector_i32(words[4:]), 16)
    if group_size <= 8:
        zeros = _vector_i32([fx.Int32(0)] * 4)
        dst = (row_in_pass + 8) * Q_ROW_BYTES + chunk * 32
        _lds_store(lds, dst, zeros, 16)
        _lds_store(lds, dst + 16, zeros, 16)


def _q_operands(lds, lane) -> list:
    """The two B operands (vector<8 x i32>, 32 e4m3 each) of the QK MFMAs: q row lane&15,
    LDS bytes 128h + 32*(lane>>4) .. +31 (rotated dims 128h + 16(lane>>4) .. +15 and
    128h + 64 + 16(lane>>4) .. +15)."""
    return [
        fx.Vector(_lds_load(lds, _q_operand_offset(lane, h), T.vec(8, T.i32), 16)) for h in range(2)
    ]


def _tile_loads(tile_start, ctx: dict) -> tuple:
    """Issues the loads of one 16-token tile; returns (K operands, K scale words, V words,
    V scale word, mask limit). Tokens past ``limit`` (and every token of an invalid block) read
    0."""
    seq_len, block_size = ctx["seq_len"], ctx["block_size"]
    in_seq = tile_start < seq_len
    column = in_seq.select(_tile_block_column(tile_start, block_size), 0)
    block = _scalar_load(ctx["bt_rsrc"], column * 4)
    valid = in_seq & (block >= 0) & (block < ctx["num_blocks"])
    n_valid = valid.select(fx.min(seq_len - tile_start, TILE), 0)
    first_slot = fx.Int64(valid.select(block, 0)) * block_size + fx.Int64(
        _tile_block_offset(tile_start, block_size)
    )
    base = _byte_offset(ctx["cache"], first_slot * fx.Int64(ctx["stride_pos"]) + ctx["head_off"])
    rsrc = buffer_rsrc(base, fx.Int64(n_valid * ctx["stride_pos"]))
    k_off, v_off = ctx["k_off"], ctx["v_off"]
    k_ops = [_load(rsrc, _k_codes_offset(k_off, h), 4) for h in range(2)]
    k_scales = _words(_load(rsrc, ctx["ks_off"], 2), 2)
    v_words = [_words(_load(rsrc, _v_codes_offset(v_off, hf), 4), 4) for hf in range(2)]
    v_scale = _load(rsrc, ctx["vs_off"], 1)
    limit = valid.select(seq_len, 0)
    return k_ops, k_scales, v_words, v_scale, limit


def _qk_scores(k_ops, k_scales, q_ops, k_group) -> fx.Vector:
    """Raw scores of the tile: lane l gets tokens 4*(l>>4)+e, q row l&15 (f32x4)."""
    acc = fx.Vector.filled(4, 0.0, fx.Float32)
    shift = _k_scale_shift(k_group)
    for h in range(2):
        scale = (k_scales[h] >> shift) & 0xFF
        acc = mfma_scaled(k_ops[h], q_ops[h], acc, scale, 0x7F, a_format=4)
    return acc


def _row_reduce(x: fx.Float32, combine) -> fx.Float32:
    """Combines the 4 lanes of a query row (lanes l, l^16, l^32, l^48)."""
    x = combine(x, x.shuffle_xor(16, WAVE))
    return combine(x, x.shuffle_xor(32, WAVE))


def _stage_v(lds, v_words, v_scale, tok, chunk) -> None:
    """Dequantizes this lane's 64 V dims (token tok, dims 64*chunk ..) to bf16 and stores them
    to the LDS V tile (row-major, V_ROW_BYTES per token)."""
    for hf in range(2):
        byte = (v_scale >> _v_scale_shift(chunk, hf)) & 0xFF
        scale = as_ir(_pow2_of_byte(byte))
        for w in range(4):
            pairs = [
                llvm.bitcast(
                    T.i32,
                    mlir_rocdl.cvt_scalef32_pk_bf16_fp4(
                        T.vec(2, T.bf16), as_ir(v_words[hf][w]), scale, sel
                    ),
                )
                for sel in range(4)
            ]
            offset = _v_stage_offset(tok, chunk, hf, w)
            _lds_store(lds, offset, _vector_i32([fx.Int32(p) for p in pairs]), 16)


def _pv(lds, lane, p_op, acc_pv: list) -> list:
    """acc_pv[h] += V^T[16h .. 16h+15, tile] @ P through ds_read_b64_tr_b16 + bf16 MFMA, in
    groups of PV_GROUP chunks (each group's results pinned before the next group's reads, so
    at most PV_GROUP transposed operands are live)."""
    out = []
    for h0 in range(0, HEAD_DIM // 16, PV_GROUP):
        group = []
        for h in range(h0, h0 + PV_GROUP):
            ptr = _lds_ptr(lds, _v_read_offset(lane, h))
            v_op = mlir_rocdl.ds_read_tr16_b64(T.vec(4, T.i16), ptr).result
            group.append(
                fx.Vector(rocdl.mfma_f32_16x16x16bf16_1k(T.f32x4, [v_op, as_ir(p_op), acc_pv[h]]))
            )
        out.extend(_pin_all(group))
    return out


def _build_decode(group_size: int, block_size: int):
    """The decode kernel and its launch function for one (G, block size)."""
    assert group_size in GROUP_SIZES and block_size in BLOCK_SIZES

    @flyc.kernel(known_block_size=(THREADS, 1, 1))
    def ultraquant_decode_kernel(
        out_parts: fx.Tensor,
        max_logits: fx.Tensor,
        exp_sums: fx.Tensor,
        q: fx.Tensor,
        cache: fx.Tensor,
        block_tables: fx.Tensor,
        seq_lens: fx.Tensor,
        num_kv_heads: fx.Int32,
        slot_bytes: fx.Int32,
        num_blocks: fx.Int32,
        max_blocks_per_seq: fx.Int32,
        num_partitions: fx.Int32,
        stride_q_seq: fx.Int32,
        stride_q_head: fx.Int32,
        sm_scale: fx.Float32,
    ):
        lane = fx.Int32(gpu.thread_idx.x)
        seq = fx.Int32(gpu.block_idx.x)
        kv_head = fx.Int32(gpu.block_idx.y)
        part = fx.Int32(gpu.block_idx.z)
        lds = fx.SharedAllocator().allocate(_DecodeLds).peek().buf.ptr.llvm_ptr

        # ---- q: rotate, haircut, permute into LDS rows 0..15 ----
        q_first = fx.Int64(seq) * fx.Int64(stride_q_seq) + fx.Int64(
            kv_head * group_size
        ) * fx.Int64(stride_q_head)
        q_rsrc = buffer_rsrc(_byte_offset(_tensor_ptr(q), q_first * 2))
        _stage_rotated_q(lds, q_rsrc, lane, group_size, stride_q_head)
        _lds_fence()

        # ---- per-request scalars and per-lane offsets ----
        sl_rsrc = buffer_rsrc(_tensor_ptr(seq_lens))
        capacity = max_blocks_per_seq * block_size
        seq_len = fx.max(fx.min(_scalar_load(sl_rsrc, seq * 4), capacity), 0)
        stride_pos = num_kv_heads * slot_bytes
        k_group = _k_lane_group(lane)
        v_token, v_chunk = _v_lane_token_chunk(lane)
        bt_first = fx.Int64(seq) * fx.Int64(max_blocks_per_seq) * 4
        ctx = {
            "seq_len": seq_len,
            "block_size": block_size,
            "num_blocks": num_blocks,
            "stride_pos": stride_pos,
            "cache": _tensor_ptr(cache),
            "head_off": fx.Int64(kv_head * slot_bytes),
            "bt_rsrc": buffer_rsrc(_byte_offset(_tensor_ptr(block_tables), bt_first)),
            "k_off": _k_lane_offset(lane, stride_pos),
            "ks_off": _k_scale_lane_offset(lane, stride_pos),
            "v_off": _v_lane_offset(lane, stride_pos),
            "vs_off": _v_scale_lane_offset(lane, stride_pos),
        }

        sign, mag, c = _score_scale(sm_scale)

        # ---- partition p: tile-groups p, p + P, ... ----
        n_groups = (seq_len + (TILE_GROUP - 1)) >> 7
        avail = n_groups - part
        trip = (avail > 0).select((avail + num_partitions - 1) // num_partitions, 0)
        zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
        init = [fx.Float32(NEG_INF), fx.Float32(0.0)] + [zero4] * (HEAD_DIM // 16)
        results = init
        for it, state in range(0, trip, 1, init=init):
            run_max = fx.Float32(state[0])
            run_sum = fx.Float32(state[1])
            acc_pv = [fx.Vector(v) for v in state[2:]]
            group_start = (part + fx.Int32(it) * num_partitions) * TILE_GROUP
            pending = [_tile_loads(group_start, ctx)]
            for n in range_constexpr(N_TILES):
                k_ops, k_scales, v_words, v_scale, limit = pending.pop(0)
                k_ops, k_scales, v_words, v_scale = _pin_all((k_ops, k_scales, v_words, v_scale))
                if const_expr(n + 1 < N_TILES):  # prefetch the next tile
                    pending.append(_tile_loads(group_start + (n + 1) * TILE, ctx))
                rocdl.sched_barrier(0)  # tile n's math after tile n+1's loads
                raw = _qk_scores(k_ops, k_scales, _q_operands(lds, lane), k_group)
                first_tok = _score_first_token(group_start + n * TILE, k_group)
                scores = [
                    (first_tok + e < limit).select(fx.Float32(raw[e]) * sign, NEG_INF)
                    for e in range(4)
                ]
                tile_max = _row_reduce(
                    _fmax(_fmax(scores[0], scores[1]), _fmax(scores[2], scores[3])), _fmax
                )
                new_max = _fmax(run_max, tile_max)
                seen = run_max > NEG_INF
                alpha = exp2(seen.select(run_max - new_max, 0.0) * c)
                live = new_max > NEG_INF
                probs = [exp2(live.select(s - new_max, NEG_INF) * c) for s in scores]
                tile_sum = _row_reduce(
                    ((probs[0] + probs[1]) + probs[2]) + probs[3], lambda a, b: a + b
                )
                run_sum = run_sum * alpha + tile_sum
                run_max = new_max
                alpha4 = fx.Vector.from_elements([alpha] * 4, dtype=fx.Float32)
                acc_pv = [a * alpha4 for a in acc_pv]
                # overwrites the V tile the previous tile's PV read (other lanes): a wave's LDS
                # operations run in order, and the compiler may not reorder them either
                compiler_fence()
                _stage_v(lds, v_words, v_scale, v_token, v_chunk)
                _lds_fence()
                p_op = fx.Vector.from_elements(probs, dtype=fx.Float32).to(fx.BFloat16)
                acc_pv = _pv(lds, lane, p_op.bitcast(fx.Int16), acc_pv)
            results = yield [run_max, run_sum] + acc_pv

        # ---- partial: o normalized by its own sum, max logit, exp sum ----
        run_max = fx.Float32(results[0])
        run_sum = fx.Float32(results[1])
        acc_pv = [fx.Vector(v) for v in results[2:]]
        inv = fx.Float32(1.0) / (run_sum > 0.0).select(run_sum, fx.Float32(1.0))
        inv4 = fx.Vector.from_elements([inv] * 4, dtype=fx.Float32)
        first_row = ((seq * num_kv_heads + kv_head) * num_partitions + part) * group_size
        # Lanes of rows >= G (and, for max/sum, of 4-token groups > 0) store out of range.
        o_rsrc = buffer_rsrc(
            _byte_offset(_tensor_ptr(out_parts), fx.Int64(first_row) * (2 * HEAD_DIM)),
            group_size * 2 * HEAD_DIM,
        )
        row_off = _out_lane_offset(lane)
        for h in range_constexpr(HEAD_DIM // 16):
            o = (acc_pv[h] * inv4).to(fx.BFloat16)
            _store(o_rsrc, _out_offset(row_off, h), o.bitcast(fx.Int32))
        for tensor, value in ((max_logits, run_max * mag), (exp_sums, run_sum)):
            rsrc = buffer_rsrc(
                _byte_offset(_tensor_ptr(tensor), fx.Int64(first_row) * 4), group_size * 4
            )
            _store(rsrc, lane * 4, value)

    @flyc.jit
    def launch(
        out_parts: fx.Tensor,
        max_logits: fx.Tensor,
        exp_sums: fx.Tensor,
        q: fx.Tensor,
        cache: fx.Tensor,
        block_tables: fx.Tensor,
        seq_lens: fx.Tensor,
        num_seqs: fx.Int32,
        num_kv_heads: fx.Int32,
        slot_bytes: fx.Int32,
        num_blocks: fx.Int32,
        max_blocks_per_seq: fx.Int32,
        num_partitions: fx.Int32,
        stride_q_seq: fx.Int32,
        stride_q_head: fx.Int32,
        sm_scale: fx.Float32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008
    ):
        ultraquant_decode_kernel(
            out_parts,
            max_logits,
            exp_sums,
            q,
            cache,
            block_tables,
            seq_lens,
            num_kv_heads,
            slot_bytes,
            num_blocks,
            max_blocks_per_seq,
            num_partitions,
            stride_q_seq,
            stride_q_head,
            sm_scale,
            value_attrs=_occupancy_attrs(DECODE_WAVES_PER_SIMD),
        ).launch(
            grid=(num_seqs, num_kv_heads, num_partitions), block=(THREADS, 1, 1), stream=stream
        )

    return launch


# ---------------------------------------------------------------------------------------------
# Reduce
# ---------------------------------------------------------------------------------------------


def _build_reduce():
    """The partition reduce kernel and its launch function."""

    @flyc.kernel(known_block_size=(THREADS, 1, 1))
    def ultraquant_reduce_kernel(
        out: fx.Tensor,
        out_parts: fx.Tensor,
        max_logits: fx.Tensor,
        exp_sums: fx.Tensor,
        num_kv_heads: fx.Int32,
        query_group_size: fx.Int32,
        num_partitions: fx.Int32,
    ):
        lane = fx.Int32(gpu.thread_idx.x)
        seq = fx.Int32(gpu.block_idx.x)
        head = fx.Int32(gpu.block_idx.y)
        kv_head = head // query_group_size
        g = head - kv_head * query_group_size
        # Row of partition p: ((seq * Hk + kv_head) * P + p) * G + g.
        first_row = (seq * num_kv_heads + kv_head) * num_partitions * query_group_size + g
        ml_rsrc = buffer_rsrc(_byte_offset(_tensor_ptr(max_logits), fx.Int64(first_row) * 4))
        es_rsrc = buffer_rsrc(_byte_offset(_tensor_ptr(exp_sums), fx.Int64(first_row) * 4))
        o_rsrc = buffer_rsrc(
            _byte_offset(_tensor_ptr(out_parts), fx.Int64(first_row) * (2 * HEAD_DIM))
        )
        row_stride = query_group_size * 4

        top = fx.Float32(NEG_INF)
        for p, state in range(0, num_partitions, 1, init=[top]):
            ml = _scalar_load(ml_rsrc, fx.Int32(p) * row_stride).bitcast(fx.Float32)
            top_res = yield [_fmax(fx.Float32(state[0]), ml)]
        top = fx.Float32(top_res)  # a single loop-carried value comes back unwrapped

        init = [fx.Float32(0.0)] + [fx.Float32(0.0)] * 4
        for p, state in range(0, num_partitions, 1, init=init):
            p = fx.Int32(p)
            ml = _scalar_load(ml_rsrc, p * row_stride).bitcast(fx.Float32)
            es = _scalar_load(es_rsrc, p * row_stride).bitcast(fx.Float32)
            w = exp2((ml == top).select(fx.Float32(0.0), ml - top) * LOG2E) * es
            o = _words(_load(o_rsrc, p * (row_stride * HEAD_DIM // 2) + lane * 8, 2), 2)
            vals = [x for word in o for x in bf16_pair(word)]
            acc = [fx.Float32(state[1 + i]) + w * vals[i] for i in range(4)]
            acc_res = yield [fx.Float32(state[0]) + w] + acc
        total = fx.Float32(acc_res[0])
        has = total != 0.0
        inv = fx.Float32(1.0) / has.select(total, fx.Float32(1.0))
        vals = [has.select(fx.Float32(acc_res[1 + i]) * inv, fx.Float32(0.0)) for i in range(4)]
        packed = fx.Vector.from_elements(vals, dtype=fx.Float32).to(fx.BFloat16)
        num_q_heads = num_kv_heads * query_group_size
        out_first = (fx.Int64(seq) * fx.Int64(num_q_heads) + fx.Int64(head)) * (2 * HEAD_DIM)
        out_rsrc = buffer_rsrc(_byte_offset(_tensor_ptr(out), out_first))
        _store(out_rsrc, lane * 8, packed.bitcast(fx.Int32))

    @flyc.jit
    def launch(
        out: fx.Tensor,
        out_parts: fx.Tensor,
        max_logits: fx.Tensor,
        exp_sums: fx.Tensor,
        num_seqs: fx.Int32,
        num_kv_heads: fx.Int32,
        query_group_size: fx.Int32,
        num_partitions: fx.Int32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008
    ):
        ultraquant_reduce_kernel(
            out,
            out_parts,
            max_logits,
            exp_sums,
            num_kv_heads,
            query_group_size,
            num_partitions,
            value_attrs=_occupancy_attrs(MAX_WAVES_PER_SIMD),
        ).launch(
            grid=(num_seqs, num_kv_heads * query_group_size), block=(THREADS, 1, 1), stream=stream
        )

    return launch


# ---------------------------------------------------------------------------------------------
# Build interface
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One compiled kernel variant."""

    kernel: str  # "ultraquant_decode" or "ultraquant_reduce"
    query_group_size: int = 0  # G (decode only)
    block_size: int = 0  # tokens per cache block (decode only)

    @property
    def symbol(self) -> str:
        """C symbol of the exported entry point."""
        if self.kernel == "ultraquant_reduce":
            return "jsm_ultraquant_reduce"
        return f"jsm_ultraquant_decode_g{self.query_group_size}_bs{self.block_size}"

    @property
    def design_waves_per_simd(self) -> int:
        """Decode: LDS-bound at 3 (12 one-wave workgroups per CU). Reduce: 8 (no LDS)."""
        if self.kernel == "ultraquant_reduce":
            return MAX_WAVES_PER_SIMD
        return DECODE_WAVES_PER_SIMD


CONFIGS: tuple = tuple(
    Config("ultraquant_decode", g, bs) for g in GROUP_SIZES for bs in BLOCK_SIZES
) + (Config("ultraquant_reduce"),)


def compile_config(config: Config):
    """Compiles one variant (for gfx950 when FLYDSL_GPU_ARCH=gfx950) from small CPU tensors."""
    u8, i32, f32, bf16 = torch.uint8, torch.int32, torch.float32, torch.bfloat16
    b, hk, p = 1, 1, 1
    if config.kernel == "ultraquant_reduce":
        g = 8
        parts = torch.zeros(b * hk * p * g * HEAD_DIM, dtype=bf16)
        stats = torch.zeros(b * hk * p * g, dtype=f32)
        out = torch.zeros(b * hk * g * HEAD_DIM, dtype=bf16)
        return flyc.compile(_build_reduce(), out, parts, stats, stats.clone(), b, hk, g, p)
    g, bs, slot, num_blocks, max_blocks = config.query_group_size, config.block_size, 272, 1, 1
    parts = torch.zeros(b * hk * p * g * HEAD_DIM, dtype=bf16)
    stats = torch.zeros(b * hk * p * g, dtype=f32)
    q = torch.zeros(b * hk * g * HEAD_DIM, dtype=bf16)
    cache = torch.zeros(num_blocks * bs * hk * slot, dtype=u8)
    block_tables = torch.zeros(b * max_blocks, dtype=i32)
    seq_lens = torch.zeros(b, dtype=i32)
    tensors = (parts, stats, stats.clone(), q, cache, block_tables, seq_lens)
    scalars = (b, hk, slot, num_blocks, max_blocks, p, hk * g * HEAD_DIM, HEAD_DIM, 1.0 / 16.0)
    return flyc.compile(_build_decode(g, bs), *tensors, *scalars)
