"""Code-generation primitives shared by the gfx950 FlyDSL kernels (trace-time Python).

Each helper emits a fixed, short sequence of MLIR ops (no control flow) for the kernels in
this package: value conversions, synchronization points (LDS barriers, compiler fences),
64-bit global / 32-bit LDS addressing, raw buffer descriptors, cross-lane reductions over the
4 lane groups of a wave, hardware exp2 / log2, e4m3 packing and the scaled 16x16x128 MFMA.
Like the kernels, it imports flydsl at module top and is only imported by the ahead-of-time
build.
"""

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import llvm
from flydsl.expr import rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
BUFFER_FLAGS = (7 << 12) | (4 << 15)  # CDNA raw buffer descriptor word 3
BUFFER_NO_LIMIT = 0xFFFFFFFF  # the largest num_records of a buffer descriptor

_V = TypeVar("_V")


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------


def as_ir(x) -> ir.Value:
    """The MLIR value of a DSL value (anything else, e.g. a raw value or an int, unchanged)."""
    return x.ir_value() if hasattr(x, "ir_value") else x


def i32(x) -> fx.Int32:
    """``x`` (DSL or raw i32 value, or int) as a DSL Int32."""
    return fx.Int32(as_ir(x))


def f32(x) -> fx.Float32:
    """``x`` (DSL or raw f32 value, or float) as a DSL Float32."""
    return fx.Float32(as_ir(x))


def uniform(x) -> fx.Int32:
    """readfirstlane: an SGPR copy of a wave-uniform i32."""
    return fx.Int32(rocdl.readfirstlane(T.i32, as_ir(fx.Int32(x))))


def cat(a, b) -> Vec:
    """Concatenation of two vectors."""
    a, b = Vec(a), Vec(b)
    return a.shuffle(b, list(range(a.numel + b.numel)))


def bf16_pair(word: fx.Int32) -> tuple[fx.Float32, fx.Float32]:
    """The two bf16 halves (low = element 2i) of a 32-bit word as exact f32 values."""
    return (word << 16).bitcast(fx.Float32), (word & -65536).bitcast(fx.Float32)


def pin(value: _V) -> _V:
    """``value`` through an empty side-effecting asm (``=v,0``): an ordering point. The value is
    computed before it, in program order (not sunk towards its use), and its users stay after
    it. Returns a value of the same DSL type (a Vector for a vector)."""
    raw = as_ir(value)
    out = llvm.inline_asm(raw.type, [raw], "", "=v,0", has_side_effects=True)
    return Vec(out) if isinstance(value, Vec) else type(value)(out)


# ---------------------------------------------------------------------------------------------
# Synchronization
# ---------------------------------------------------------------------------------------------


def compiler_fence() -> None:
    """No load or store moves across this point, neither in LLVM IR nor in machine code; it
    emits no instruction and no wait.

    An empty ``asm sideeffect "", "~{memory}"``: IR passes see a call that may read and write
    any memory, the backend an ``INLINEASM`` that may load and store. The calls of
    ``llvm.amdgcn.s.barrier``, ``.s.waitcnt`` and ``.sched.barrier`` are such points today, but
    only through how they are declared: ``IntrinsicsAMDGPU.td`` marks them ``IntrNoMem`` and
    ``IntrHasSideEffects``, and LLVM's intrinsic emitter turns that pair into unknown memory
    effects (``getEffectiveME``, with a TODO to refine it). FlyDSL 0.5's LLVM declares them
    without ``memory(none)``, and a bare ``s_barrier`` between an LDS store and a load of the
    same word keeps the load. This fence states the ordering instead of relying on that.
    """
    llvm.inline_asm(None, [], "", "~{memory}", has_side_effects=True)


def lds_barrier(vm: bool = False) -> None:
    """``s_barrier`` that separates LDS writes from LDS reads of other waves, without a fence.

    Emits ``s_waitcnt lgkmcnt(0)`` (with ``vmcnt(0)`` when ``vm``: the wave's loads and
    ``global_load_lds`` DMA have landed), then ``s_barrier`` between ``compiler_fence`` and
    ``sched_barrier(0)`` on both sides: no LDS access moves across it and nothing else waits.

    Why not a workgroup-scope fence pair (``fence syncscope("workgroup") release`` /
    ``acquire`` around ``s_barrier``: what ``gpu.barrier`` and ``__syncthreads`` lower to). In
    the LLVM AMDGPU memory model for GFX942 / GFX950 outside tgsplit mode (``AMDGPUUsage``,
    memory model GFX942; ``SIMemoryLegalizer``), the workgroup release is ``s_waitcnt
    lgkmcnt(0)`` only (no ``vmcnt``: a workgroup's waves share one CU, whose L1 keeps their
    memory operations in order; a CU performs its LDS operations in one global order) and the
    acquire emits nothing (``buffer_inv sc0`` in tgsplit mode only).
    But a release that covers LDS must also wait for the LDS write of every LDS DMA in flight
    (``llvm/test/CodeGen/AMDGPU/lds-dma-workgroup-release.ll``: gfx942 puts ``s_waitcnt
    vmcnt(0) lgkmcnt(0)`` before ``s_barrier`` after a ``buffer_load ... lds``, alias scopes
    notwithstanding), whatever the barrier is for. Measured with FlyDSL 0.5's LLVM on the
    mla_decode partials: the fence pair, the pair restricted to LDS (MMRA
    ``amdgpu-synchronize-as: local``) and ``gpu.barrier`` with ``memfence
    [#gpu.address_space<workgroup>]`` each put ``s_waitcnt vmcnt(1) lgkmcnt(0)`` before the
    row-maxima barrier: the next block's nine DMA drained mid-block. So the hardware part of a
    workgroup LDS release (``lgkmcnt(0)``) is explicit here and the compiler part (no motion of
    LDS accesses) is ``compiler_fence``. Use a fence (``gpu.barrier``) where no DMA is in flight
    (it costs the same ``lgkmcnt(0)`` there). ``tests/test_isa.py`` checks the emitted waits.
    """
    rocdl.s_waitcnt(lgkmcnt=0, vmcnt=0 if vm else None)
    compiler_fence()
    rocdl.sched_barrier(0)
    rocdl.s_barrier()
    rocdl.sched_barrier(0)
    compiler_fence()


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def xcd_work_item(bid, groups) -> tuple:
    """(work item, head group) of workgroup ``bid``: XCD ``x = bid % 8`` serves items
    ``x, x + 8, ...``, each as ``groups`` consecutive workgroups of the XCD (block ids
    ``8 (groups k + hg) + x``, round-robin dispatch assumed), so the head groups of one item
    share that XCD's L2. Ints or kernel values."""
    k = bid >> 3
    return (k // groups) * 8 + (bid & 7), k % groups


def xcd_grid_x(items, groups):
    """Workgroups of a launch of ``items`` work items of ``groups`` head groups each:
    ``8 groups ceil(items / 8)`` (whole rounds of the 8 XCDs)."""
    return 8 * groups * ((items + 7) // 8)


def base_address(tensor) -> fx.Int64:
    """64-bit byte address of a tensor argument's data."""
    return fx.Int64(fx.ptrtoint(fx.get_iter(tensor)))


def global_ptr(addr) -> ir.Value:
    """!llvm.ptr<1> at a 64-bit byte address."""
    return llvm.inttoptr(ir.Type.parse("!llvm.ptr<1>"), as_ir(fx.Int64(addr)))


def lds_ptr(addr) -> ir.Value:
    """!llvm.ptr<3> at a 32-bit LDS byte address."""
    return llvm.inttoptr(ir.Type.parse("!llvm.ptr<3>"), as_ir(fx.Int32(addr)))


def load_global(addr, words: int, elem: ir.Type | None = None, align: int = 0) -> Vec:
    """``words`` 32-bit elements (i32, or ``elem``) at a 64-bit global byte address aligned to
    ``align`` bytes (default ``4 * words``)."""
    ty = T.vec(words, T.i32 if elem is None else elem)
    return Vec(llvm.LoadOp(ty, global_ptr(addr), alignment=align or 4 * words).result)


def store_global(addr, value, align: int) -> None:
    """Stores ``value`` at a 64-bit global byte address aligned to ``align`` bytes."""
    llvm.StoreOp(as_ir(value), global_ptr(addr), alignment=align)


def load_lds(
    addr, words: int, elem: ir.Type | None = None, noalias_scopes: ir.Attribute | None = None
) -> Vec:
    """``words`` 32-bit elements (i32, or ``elem``) at an LDS byte address aligned to
    ``4 * words`` bytes; ``noalias_scopes``: alias scopes the load does not touch."""
    ty = T.vec(words, T.i32 if elem is None else elem)
    op = llvm.LoadOp(ty, lds_ptr(addr), alignment=4 * words, noalias_scopes=noalias_scopes)
    return Vec(op.result)


def store_lds(addr, value, align: int, noalias_scopes: ir.Attribute | None = None) -> None:
    """Stores ``value`` at an LDS byte address aligned to ``align`` bytes."""
    llvm.StoreOp(as_ir(value), lds_ptr(addr), alignment=align, noalias_scopes=noalias_scopes)


def buffer_rsrc(ptr: ir.Value, num_bytes=BUFFER_NO_LIMIT) -> ir.Value:
    """Raw buffer descriptor (stride 0) at the global pointer ``ptr``: accesses at byte offsets
    ``>= num_bytes`` read 0 / are dropped without touching memory."""
    return rocdl.make_buffer_rsrc(
        ir.Type.parse("!llvm.ptr<8>"),
        ptr,
        as_ir(fx.Int16(0)),
        as_ir(fx.Int64(num_bytes)),
        as_ir(fx.Int32(BUFFER_FLAGS)),
    )


# ---------------------------------------------------------------------------------------------
# Arithmetic and cross-lane reductions
# ---------------------------------------------------------------------------------------------


def fmax(a, b) -> fx.Float32:
    """f32 maxnum (a NaN operand yields the other one)."""
    return f32(fx.maxnumf(f32(a), f32(b)))


def exp2(x) -> fx.Float32:
    """``v_exp_f32``: the hardware 2^x."""
    return f32(rocdl.exp2(T.f32, as_ir(f32(x))))


def log2(x) -> fx.Float32:
    """``v_log_f32``: the hardware log2(x)."""
    return f32(rocdl.log(T.f32, as_ir(f32(x))))


def permlane_swap(op: Callable, x: fx.Int32) -> tuple[fx.Int32, fx.Int32]:
    """``op`` (``rocdl.permlane16_swap`` / ``permlane32_swap``) of an i32 with itself: the two
    values of the exchanged pair."""
    pair = ir.Type.parse("!llvm.struct<(i32, i32)>")
    res = op(pair, as_ir(x), as_ir(x), False, False)
    return tuple(i32(llvm.extractvalue(T.i32, res, [k])) for k in (0, 1))


def _group_reduce(x, combine: Callable) -> fx.Float32:
    """``combine`` of an f32 over the 4 lane groups (rows of 16 lanes) sharing lane % 16."""
    for op in (rocdl.permlane16_swap, rocdl.permlane32_swap):
        a, b = permlane_swap(op, f32(x).bitcast(fx.Int32))
        x = combine(a.bitcast(fx.Float32), b.bitcast(fx.Float32))
    return x


def group_max(x) -> fx.Float32:
    """f32 maxnum over the 4 lane groups (rows of 16 lanes) sharing lane % 16."""
    return _group_reduce(x, fmax)


def group_sum(x) -> fx.Float32:
    """f32 sum over the 4 lane groups sharing lane % 16."""
    return _group_reduce(x, lambda a, b: a + b)


# ---------------------------------------------------------------------------------------------
# e4m3 and the scaled MFMA
# ---------------------------------------------------------------------------------------------


def fp8x4(vals: Sequence) -> fx.Int32:
    """4 f32 -> one i32 of e4m3fn codes (RNE, no saturation), byte i = vals[i]."""
    word = rocdl.cvt_pk_fp8_f32(T.i32, f32(vals[0]), f32(vals[1]), fx.Int32(0), False)
    return i32(rocdl.cvt_pk_fp8_f32(T.i32, f32(vals[2]), f32(vals[3]), word, True))


def fp8x4_values(word) -> list[fx.Float32]:
    """One i32 of e4m3fn codes -> 4 exact f32."""
    out = []
    for hi in (False, True):
        pair = Vec(rocdl.cvt_pk_f32_fp8(T.vec(2, T.f32), as_ir(word), hi))
        out += [f32(pair[0]), f32(pair[1])]
    return out


def split_fp8(x: Sequence) -> tuple[fx.Int32, fx.Int32]:
    """4 f32 ``x`` (|x| <= 256) -> (hi, lo) words: ``hi = e4m3(x)``, ``lo = e4m3((x - hi) 32)``."""
    hi = fp8x4(x)
    dec = fp8x4_values(hi)
    return hi, fp8x4([(x[k] - dec[k]) * 32.0 for k in range(4)])


def mfma_scaled(a, b, acc, scale_a, scale_b, a_format: int = 0) -> Vec:
    """``acc += (A 2^(scale_a - 127)) (B 2^(scale_b - 127))``: v_mfma_scale_f32_16x16x128_f8f6f4
    with E8M0 scales, B e4m3 and A e4m3 (``a_format`` 0) or e2m1 (``a_format`` 4)."""
    ops = [a, b, acc, a_format, 0, 0, i32(scale_a), 0, i32(scale_b)]
    return Vec(rocdl.mfma_scale_f32_16x16x128_f8f6f4(T.vec(4, T.f32), ops))
