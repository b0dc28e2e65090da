"""gfx950 (MI355) ``mla_decode`` partials with all 128 heads of a request in one CTA (qlen 1).

Launched where ``configs.mla_decode_rows`` picks it (qlen 1, H a positive multiple of 128, and
its CTAs fill the CUs with splits of at least 2048 keys of the mean request, or one split; the
FFI call's ``cta_rows`` attribute carries the choice, the handler checks the shape); other
calls run the 16-row kernels of ``mla_decode.py`` (at H = 16 a 128-row CTA would waste 7/8 of
its MFMAs; at small batches it would need 8x the splits, and their partials, to fill the
CUs). Its point: every K tile of a (request, split) is requested from L2 once for 128 heads
(the 16-row kernels request it ``H / 16`` times), like FlyDSL's public
``mla_fwd_decode_m16x8_fp8_fp8`` (8 waves, one CTA per CU, 64-key blocks), which however takes
an fp8 q; this kernel keeps the bf16-faithful q split into e4m3 hi + lo.
Never run on an MI355: compiled on the CPU, its launches recorded, its lane mappings run in
numpy (``tests/test_mla_decode_m128.py::test_kernel_layout``), its arithmetic mirrored by
``jax_sparse_mla.emulation.mla_decode`` (64-key blocks where this kernel serves the call).

Arithmetic: exactly ``mla_decode.py``'s (its module docstring: q split, scores by scaled MFMAs,
masking, ``P = exp2((t - m') a + 8)`` split into e4m3 hi + lo, ``o = bf16(O (v_scale / l))``,
the LSE, the splits ``c = 128 ceil(seq_len / (128 S))`` and the partials ABI) except the online
softmax block: 64 keys instead of 128 (the running max, alpha and the f32 sums change at
64-key boundaries; ``configs.mla_decode_softmax_block``, which the emulation and its bound
follow). qlen 1 only (row ``n`` = head ``128 hg + n``): the causal rule's V zeroing (qlen > 1) is
not designed here. ``l`` is summed per lane over its keys, then over the 4 lane groups at the end.

Work decomposition: a 512-thread CTA (8 waves) per (group of 128 heads, split, request), the
grid and work-item order of ``mla_decode.py`` with ``G = ceil(H / 128)``. Wave ``w`` owns rows
``[16 w, 16 w + 16)`` over every key of a 64-key block, so the row max, ``l`` and P stay in the
wave: one ``s_barrier`` per block (its K rows landed; the other slot is free). Per block:

* DMA: wave ``w`` copies keys ``[8 w, 8 w + 8)`` of the next block (4608 B: 4 full
  ``global_load_lds`` of 1024 B and one of lanes 0..31), cache rows by ``ds_bpermute`` from
  the lane that read the key's index (lane ``k`` reads key ``k``'s, one block ahead).
* QK, steps outer: ``for s < 9: qop = q step s (VGPRs if s < 5, else LDS); for kt < 4:
  acc[kt] = mfma_scaled(K[kt, s], qop, acc[kt])`` with a ``sched_barrier`` after each step (an
  LDS q operand is live for one step). Lane (row ``t``, group ``g``) gets keys
  ``16 kt + 4 g + r``; A and B operands and scales as ``mla_decode.py``'s QK (A lane (t, g):
  key ``16 kt + t``, dims ``64 s + 32 (g & 1) + [0, 32)``; B: q's hi at g < 2, lo at g >= 2).
* Softmax in the wave: the row max over the 16 own scores, then over the 4 lane groups
  (``group_max``).
* P^T operand in registers: per key tile, ``split_fp8`` gives this lane's hi and lo words
  (byte ``r``: key ``16 kt + 4 g + r``); ``v_permlane32_swap(hi, lo)`` (LLVM's
  ``llvm.amdgcn.permlane32.swap``: rows 2 and 3 of the first operand are swapped with rows 0
  and 1 of the second; the first result is the first operand's; no MI355 probe checks this
  direction, the other kernels swap a value with itself; on an MI355 the self-check's cases of
  this configuration would catch the other direction: P's hi and lo would meet other keys' V
  or the other scale, o far outside the emulation's bound, ``tests/test_mla_decode_m128.py``)
  leaves lane group ``g < 2`` with hi of keys ``16 kt + 4 g + r`` and of
  ``16 kt + 4 (g + 2) + r`` and group ``g >= 2`` with the lo of the same keys. So operand
  byte ``b`` of lane group g holds key ``16 kt + 4 ((g & 1) + 2 h) + r`` (``h = b // 16``,
  ``kt = b % 16 // 4``, ``r = b % 4``): hi where g < 2 and lo where g >= 2, the QK's B
  convention, so the E8M0 scale per lane is ``E8M0_ONE`` for even g and ``E8M0_ONE - 5`` for
  odd g.
* PV: one scaled MFMA 16x16x128 per 16-latent tile (32 tiles, all 512 latents of the wave's
  16 rows: O = 128 VGPRs): A = V^T by four ``ds_read_b64_tr_b8`` (``mla_decode.py``'s stated
  semantics), read ``r`` by source lane ``t`` fetching key
  ``32 (r & 1) + 16 (t >> 3) + 8 (r >> 1) + 4 (g & 1) + ((t >> 1) & 3)``, latents
  ``16 jt + 8 (t & 1) + [0, 8)``: destination byte ``8 r + k`` is the key of B's byte
  ``8 r + k`` (above). The slot's chunk swizzle of such a key is ``2 (r >> 1) + (g & 1)``.
  Lane (row t, group g) ends with latents ``16 jt + 4 g + [0, 4)``.

LDS (bytes, static, 139264, one CTA per CU): two K slots ``[64 keys][576 B]`` at 0 and 36864
(``mla_decode.py``'s 16-B chunk swizzle), then q's QK steps 5..8: ``[4 steps][512 lanes]
[32 B]`` at 73728, each lane's own B operands (written and read by the same lane: no
barrier). Registers (per lane, 2 waves per SIMD: 256): O 128, q's steps 0..4 40, the 4 score
accumulators 16, the P operand 8; measured (FlyDSL 0.5, gfx950, the build's report): 254
VGPRs, 0 AGPRs, no spill, no scratch, 65 SGPRs (248 before block 0's DMA was moved ahead of q's
split: ``mla_decode.py``'s prologue order, so the first gather is in flight while q loads).

Per (row, key) it issues the 16-row kernels' MFMAs (QK 9 per 16 keys x 16 rows, PV 1 per 16
latents x 64 keys x 16 rows where those run 2 per 128 keys) and reads about 1.1x their LDS
bytes: per block 2304 B per lane (K 1152, each byte twice since lane groups g and g + 2 pair
q's hi and lo; V 1024, likewise for P's hi and lo; q 128), 1179648 B per CTA, against 512 B
per lane per 128-key block in each of the 16-row kernels' 8 CTAs. Not measured on an MI355.

Compile-time study of this design (FlyDSL 0.5, ``waves_per_eu`` 2; the QK loop and q's split
varied, the rest as here; VGPRs / spilled VGPRs / scratch bytes / LDS): R QK steps of q in
VGPRs, steps outer, a ``sched_barrier`` per step: R = 4 250 / 0 / 0 / 155648, R = 5 248 / 0 / 0
/ 139264 (this kernel), R = 6 256 / 0 / 0 / 122880, R = 7 256 / 8 / 36, R = 8 256 / 21 / 88,
R = 9 (all of q) 256 / 25 / 104 / 73728; without the barriers R = 4 252 / 0 / 0, R = 5 256 / 2
/ 12, R = 6 256 / 10 / 44; key tiles outer with a barrier per tile R = 5 250 / 0 / 0, R = 6
256 / 2 / 12, without barriers 15 spilled VGPRs for R = 4 to 7. R <= 3 needs more than 160 KiB
of LDS.
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
    lds_barrier,
    log2,
    mfma_scaled,
    split_fp8,
    store_global,
    uniform,
    xcd_work_item,
)
from jax_sparse_mla.kernels.gfx950.configs import (
    MLA_DECODE_M128,
    MLA_DECODE_M128_BLOCK,
    MLA_DECODE_M128_ROWS,
)
from jax_sparse_mla.kernels.gfx950.configs import MLA_DECODE_PARTIALS_THREADS as THREADS
from jax_sparse_mla.kernels.gfx950.mla_decode import (
    E8M0_ONE,
    KV_DIM,
    LATENT,
    LO_SHIFT,
    NEG_INF,
    P_SHIFT,
    PARTIALS_WAVES_PER_EU,
    QK_STEPS,
    _load_lds,
    _q_operands,
    _store_lds,
    _swizzle,
    _tr8,
    dma_16,
    partials_launcher,
    score_scale,
    split_blocks,
    zero_slots,
)

ROWS = MLA_DECODE_M128_ROWS  # 128 query rows (heads) per CTA
BLOCK = MLA_DECODE_M128_BLOCK  # 64 keys per online-softmax block (a split: whole 128s)
WAVES = THREADS // 64  # 8: wave w owns rows [16 w, 16 w + 16)
KEY_TILES = BLOCK // 16  # 4 QK tiles of 16 keys
LAT_TILES = LATENT // 16  # 32 PV tiles of 16 latents per wave
SLOT_BYTES = BLOCK * KV_DIM  # 36864
DMA_KEYS = BLOCK // WAVES  # 8 keys (4608 B) copied by each wave
DMA_BYTES = DMA_KEYS * KV_DIM
DMA_INSTR = -(-DMA_BYTES // 1024)  # 5: 1024 B per wave instruction, the last one 512 B
Q_REG_STEPS = 5  # QK steps of q held in VGPRs; steps 5..8 are read from LDS every block
Q_STEP_BYTES = THREADS * 32  # one QK step of q, all lanes: 16 KiB
LDS_Q = 2 * SLOT_BYTES  # 73728
LDS_BYTES = LDS_Q + (QK_STEPS - Q_REG_STEPS) * Q_STEP_BYTES  # 139264


@dataclasses.dataclass(frozen=True)
class Config:
    """The one configuration of this module (the build's ``CONFIGS``)."""

    kernel: str = "mla_decode_partials_m128"

    @property
    def symbol(self) -> str:
        return MLA_DECODE_M128

    @property
    def design_waves_per_simd(self) -> int:
        return PARTIALS_WAVES_PER_EU


CONFIGS: tuple[Config, ...] = (Config(),)


# ---------------------------------------------------------------------------------------------
# Straight-line pieces of a block
# ---------------------------------------------------------------------------------------------


def _q_lds_operand(q_lds, s) -> Vec:
    """q's B operand of QK step ``s >= Q_REG_STEPS`` (this lane's 8 dwords) from LDS."""
    at = q_lds + (s - Q_REG_STEPS) * Q_STEP_BYTES
    return cat(_load_lds(at, 4), _load_lds(at + 16, 4))


def _qk(slot, k_rd, q_regs, q_lds, q_scale_b) -> list:
    """S^T = K Q^T of the block's 4 key tiles, QK steps outer (module docstring)."""
    acc = [Vec.filled(4, 0.0, fx.Float32) for _ in range(KEY_TILES)]
    for s in range_constexpr(QK_STEPS):
        qop = q_regs[s] if s < Q_REG_STEPS else _q_lds_operand(q_lds, s)
        for kt in range_constexpr(KEY_TILES):
            at = slot + kt * 16 * KV_DIM + 64 * s
            ka = cat(_load_lds(at + k_rd[0], 4), _load_lds(at + k_rd[1], 4))
            acc[kt] = mfma_scaled(ka, qop, acc[kt], E8M0_ONE, q_scale_b)
        rocdl.sched_barrier(0)
    return acc


def _scores(acc, live, g, sg) -> tuple[list, list]:
    """This lane's 16 scores ``t`` (-inf where masked) and visibility, key ``16 kt + 4 g + r``
    at ``4 kt + r``; ``live``: the block's unmasked-key bits, keys 0..31 and 32..63."""
    t_vals, vis = [], []
    for kt in range_constexpr(KEY_TILES):
        for r in range_constexpr(4):
            v = ((live[kt // 2] >> (16 * (kt % 2) + 4 * g + r)) & 1) != 0
            t_vals.append(v.select(f32(acc[kt][r]) * sg, fx.Float32(NEG_INF)))
            vis.append(v)
    return t_vals, vis


def _p_operand(p: list) -> Vec:
    """The PV B operand (8 dwords) from this lane's 16 P values (module docstring)."""
    pair = ir.Type.parse("!llvm.struct<(i32, i32)>")
    first, second = [], []
    for kt in range_constexpr(KEY_TILES):
        hi, lo = split_fp8(p[4 * kt : 4 * kt + 4])
        res = rocdl.permlane32_swap(pair, as_ir(hi), as_ir(lo), False, False)
        first.append(i32(llvm.extractvalue(T.i32, res, [0])))
        second.append(i32(llvm.extractvalue(T.i32, res, [1])))
    return Vec.from_elements(first + second, fx.Int32)


def _k_offsets(t, gp) -> list:
    """Slot byte offsets of lane (t, gp)'s two 16-B halves of the QK A operand of key tile 0,
    step 0 (+``16 kt KV_DIM`` per tile, +64 per step): key t, logical chunks ``2 gp + h``."""
    return [t * KV_DIM + _swizzle(t, 2 * gp + h) * 16 for h in range(2)]


def _v_bases(t, gp) -> tuple:
    """Slot byte offsets of this lane's V reads for even and odd latent tiles (without the
    compile-time part ``_v_const``): key ``16 (t >> 3) + 4 gp + ((t >> 1) & 3)``, byte
    ``8 (t & 1)``, the swizzle's lane bit ``gp`` as +-16 B."""
    lane = (16 * (t >> 3) + 4 * gp + ((t >> 1) & 3)) * KV_DIM + 8 * (t & 1)
    return lane + 16 * gp, lane - 16 * gp


def _v_const(jt, r) -> int:
    """Compile-time part of read r of latent tile jt: key ``32 (r & 1) + 8 (r >> 1)``, chunk
    ``jt`` XOR the swizzle's compile-time bits ``2 (r >> 1)``."""
    return (32 * (r & 1) + 8 * (r >> 1)) * KV_DIM + 16 * (jt ^ (2 * (r >> 1)))


def _pv(o_acc, slot, v_base, b_op, p_scale) -> list:
    """O^T += V^T P^T: one scaled MFMA per 16-latent tile, P's hi and lo paired."""
    out = []
    for jt in range_constexpr(LAT_TILES):
        base = slot + v_base[jt % 2]
        va = cat(
            cat(_tr8(base + _v_const(jt, 0)), _tr8(base + _v_const(jt, 1))),
            cat(_tr8(base + _v_const(jt, 2)), _tr8(base + _v_const(jt, 3))),
        )
        out.append(mfma_scaled(va, b_op, o_acc[jt], E8M0_ONE, p_scale))
    return out


def _dma_source(w, lane, i) -> tuple:
    """For DMA instruction i of wave w: the block key whose bytes this lane copies, its byte
    offset in the key's row (the logical chunk of the slot position, unswizzled), and whether
    the lane copies at all (the last instruction: lanes 0..31)."""
    p = 64 * i + lane
    kl = p // (KV_DIM // 16)
    key = w * DMA_KEYS + kl
    chunk = _swizzle(key, p - kl * (KV_DIM // 16))
    return key, chunk * 16, lane < (DMA_BYTES - 1024 * i) // 16


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


def build_partials_m128_launcher():
    """The ``flyc.jit`` launcher (``mla_decode.py``'s partials ABI, ``G = ceil(H / 128)``)."""

    @fx.struct
    class Smem:
        raw: fx.Array[fx.Uint8, LDS_BYTES, 16]

    @flyc.kernel(name=MLA_DECODE_M128, known_block_size=[THREADS, 1, 1])
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
        t = lane & 15  # query row 16 w + t; QK: key 16 kt + t of the A operand
        g = lane >> 4
        gp = g & 1

        groups = (num_heads + (ROWS - 1)) // ROWS
        item, hg = (uniform(x) for x in xcd_work_item(fx.Int32(fx.block_idx.x), groups))
        if item < num_requests * num_splits:
            req = item // num_splits
            split = item - req * num_splits
            kv_base, idx_base = base_address(KV), base_address(IDX)
            lds = fx.SharedAllocator().allocate(Smem).peek()
            lds0 = uniform(fx.ptrtoint(lds.raw.ptr))

            # ---- the split's key positions [lo, hi) (mla_decode.py's splits), 64-key blocks
            args = (num_splits, n_indices, tokens, BLOCK)
            start, _, lo, hi, nb = split_blocks(IPTR, req, split, *args)
            idx_rsrc = buffer_rsrc(global_ptr(idx_base), fx.Int64(n_indices) * 4)

            # ---- this lane's query row: head 128 hg + 16 w + t
            head = hg * ROWS + w * 16 + t
            row_ok = head < num_heads
            head_c = fx.min(head, num_heads - 1)
            q_lane = base_address(Q) + (
                fx.Int64(req * num_heads + head_c) * KV_DIM + fx.Int64(32 * gp)
            ) * fx.Int64(2)
            sg, ac2 = score_scale(sm_scale, k_scale)

            k_rd = _k_offsets(t, gp)
            v_base = _v_bases(t, gp)
            p_scale = (gp == 0).select(fx.Int32(E8M0_ONE), fx.Int32(E8M0_ONE - LO_SHIFT))

            def load_index(blk):
                """Raw kv_indices entry of block key ``lane``."""
                pos = start + lo + blk * BLOCK + lane
                v = rocdl.raw_ptr_buffer_load(
                    T.i32, idx_rsrc, as_ir(pos * 4), as_ir(fx.Int32(0)), aux=0
                )
                return i32(v)

            def check_index(raw, blk):
                """The key's cache row, or -1 when it is masked."""
                j = lo + blk * BLOCK + lane
                pos = start + j
                ok = (j < hi) & (pos >= 0) & (pos < n_indices)
                ok = ok & (fx.Uint32(as_ir(raw)) < fx.Uint32(as_ir(tokens)))
                return ok.select(raw, fx.Int32(-1))

            def dma(key, blk):
                """K rows of keys [8 w, 8 w + 8) of block blk -> its slot (masked: skipped)."""
                dst = lds0 + (blk & 1) * SLOT_BYTES + w * DMA_BYTES
                for i in range_constexpr(DMA_INSTR):
                    src_key, byte, copies = _dma_source(w, lane, i)
                    row = i32(rocdl.ds_bpermute(T.i32, as_ir(src_key * 4), as_ir(key)))
                    if copies & (row >= 0):
                        src = kv_base + fx.Int64(row) * KV_DIM + fx.Int64(byte)
                        dma_16(src, dst + 1024 * i)

            # Zero both slots (a masked key's slot then holds finite bytes), then block 0's DMA,
            # then q's split (mla_decode.py's order: the first gather is in flight while q is
            # loaded); q's steps 5..8 go to this lane's own LDS (read back by the same lane).
            raw_cur = load_index(0)
            zero_slots(lds0, tid, SLOT_BYTES)
            key_cur = check_index(raw_cur, 0)
            dma(key_cur, 0)
            raw_next = load_index(1)
            q_ops, q_scale_b = _q_operands(q_lane, row_ok, g)
            q_lds = lds0 + LDS_Q + tid * 32
            for s in range_constexpr(Q_REG_STEPS, QK_STEPS):
                at = q_lds + (s - Q_REG_STEPS) * Q_STEP_BYTES
                _store_lds(at, Vec.from_elements([q_ops[s][k] for k in range(4)], fx.Int32), 16)
                words = [q_ops[s][k] for k in range(4, 8)]
                _store_lds(at + 16, Vec.from_elements(words, fx.Int32), 16)
            q_regs = q_ops[:Q_REG_STEPS]

            m_run = fx.Float32(NEG_INF)
            l_run = fx.Float32(0.0)
            o_acc = [Vec.filled(4, 0.0, fx.Float32) for _ in range(LAT_TILES)]
            for blk_i in range(nb):
                blk = fx.Int32(blk_i)
                slot = lds0 + (blk & 1) * SLOT_BYTES
                # block blk's K rows have landed and every wave is done with the other slot
                lds_barrier(vm=True)
                mask = fx.Int64(rocdl.ballot(T.i64, as_ir(key_cur >= 0)))
                live = [fx.Int32(mask), fx.Int32(mask >> 32)]
                key_next = check_index(raw_next, blk + 1)
                dma(key_next, blk + 1)
                raw_next = load_index(blk + 2)

                acc = _qk(slot, k_rd, q_regs, q_lds, q_scale_b)
                t_vals, vis = _scores(acc, live, g, sg)
                tmax = t_vals[0]
                for x in t_vals[1:]:
                    tmax = fmax(tmax, x)
                m_new = fmax(m_run, group_max(tmax))
                alpha = (m_run == NEG_INF).select(fx.Float32(0.0), exp2((m_run - m_new) * ac2))
                p = [
                    v.select(exp2((x - m_new) * ac2 + P_SHIFT), fx.Float32(0.0))
                    for x, v in zip(t_vals, vis, strict=True)
                ]
                p_sum = p[0]
                for x in p[1:]:
                    p_sum = p_sum + x
                l_run = l_run * alpha + p_sum
                m_run = m_new
                o_acc = [
                    Vec.from_elements([f32(o[k]) * alpha for k in range(4)], fx.Float32)
                    for o in o_acc
                ]
                o_acc = _pv(o_acc, slot, v_base, _p_operand(p), p_scale)
                key_cur = key_next

            # ---- epilogue: l over the lane groups, o = O v_scale / l, lse
            l_tot = group_sum(l_run)
            has_l = l_tot != 0.0
            scale = has_l.select(v_scale / l_tot, fx.Float32(0.0))
            out_row = (fx.Int64(req) * fx.Int64(num_splits) + fx.Int64(split)) * fx.Int64(
                num_heads
            ) + fx.Int64(head_c)
            o_lane = base_address(OP) + (out_row * LATENT + fx.Int64(4 * g)) * 2
            if row_ok:
                for jt in range_constexpr(LAT_TILES):
                    res = Vec.from_elements(
                        [f32(o_acc[jt][k]) * scale for k in range(4)], fx.Float32
                    ).to(fx.BFloat16)
                    store_global(o_lane + 32 * jt, res.bitcast(fx.Int32), 8)
            lse = has_l.select(
                (m_run * ac2 + (log2(has_l.select(l_tot, fx.Float32(1.0))) - P_SHIFT)) * LN2,
                fx.Float32(float("-inf")),
            )
            if row_ok & (g == 0):
                store_global(base_address(LP) + out_row * 4, lse, 4)

    return partials_launcher(partials_kernel, ROWS)


def compile_config(config: Config):
    """Compiles the configuration from small CPU example tensors (no launch)."""
    b, h, s, tokens, n_idx = 2, ROWS, 2, 8, 8
    q = torch.zeros(b * h * KV_DIM, dtype=torch.bfloat16)
    kv = torch.zeros(tokens * KV_DIM, dtype=torch.uint8)
    idx = torch.zeros(n_idx, dtype=torch.int32)
    indptr = torch.zeros(b + 1, dtype=torch.int32)
    op = torch.zeros(b * s * h * LATENT, dtype=torch.bfloat16)
    lp = torch.zeros(b * s * h, dtype=torch.float32)
    scalars = (b, h, s, n_idx, tokens, 1.0, 1.0, KV_DIM**-0.5)
    return flyc.compile(build_partials_m128_launcher(), q, kv, idx, indptr, op, lp, *scalars)
