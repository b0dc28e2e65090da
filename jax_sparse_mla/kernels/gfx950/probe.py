"""gfx950 diagnostic kernels: one scaled MFMA 16x16x128 on operands given lane by lane, and one
transposing LDS read (``ds_read_b64_tr_b8`` / ``ds_read_b64_tr_b16``) of bytes given lane by lane.

The kernels assume hardware semantics that no machine of this project could check (BUILD.md,
"What only an MI355 can tell"). Each probe runs exactly one such instruction on raw per-lane
data, so that an MI355 test can compare its result with each assumption
(``tests/test_gfx950.py::test_mfma_operand_layouts_*`` and
``::test_ds_read_b64_tr_b*_lane_map``). Both run one wave (grid (1, 1, 1), block (64, 1, 1)).

MFMA probe (``v_mfma_scale_f32_16x16x128_f8f6f4``; the kernels assume each operand laid out by
its own bit width: 8-bit split, 4-bit contiguous; ``sparse_mla`` / ``mla_decode`` for
e4m3 x e4m3, ``ultraquant`` for e2m1 x e4m3). Lane ``l``:

- ``A``: uint8 [64, 32]: its A operand registers (e4m3: all 32 bytes; e2m1: bytes 0-15);
- ``B``: uint8 [64, 32]: its B operand registers (e4m3);
- ``S``: int32 [64, 2]: its E8M0 scale_a and scale_b registers (the MFMA reads byte 0);
- ``C``: float32 [64, 4]: the accumulator it holds after ``C = 0 + A x B`` with the scales.

Launch ABI: tensors A, B, S, C (flat 1-D), then the stream. Symbols ``jsm_mfma_probe_f0`` (A
e4m3) and ``jsm_mfma_probe_f4`` (A e2m1).

Transposing-read probe. Lane ``l`` stores ``L[16 l : 16 l + 16]`` at LDS bytes ``16 l ..`` (so
the LDS holds ``L``), waits for the wave's LDS writes, and issues one transposing read at LDS
byte ``A[l] & 1016`` (``A[l]`` taken modulo 1024, rounded down to a multiple of 8); ``R[l]`` is
the 64-bit register pair it receives (register 0 = bytes 0-3, little-endian). Tensors:

- ``L``: uint8 [1024]: the LDS contents;
- ``A``: int32 [64]: each lane's read address;
- ``R``: uint32 [64, 2]: each lane's result registers.

AMD's CDNA4 ISA reference guide (section 11.4, "MFMA Transpose Load from LDS", and the DS
opcode list: DS_READ_B64_TR_B8 opcode 226, DS_READ_B64_TR_B16 opcode 227) says each reads 64
bits per lane, "interprets the data as a matrix with 8 (16) bit elements and transposes the
matrix"; it is meant for column-major A / row-major B MFMA operands, each lane of the source
holding consecutive M or N values, and needs EXEC all ones and 8-byte aligned addresses. The
exact lane map comes from FlyDSL's CDNA4 copy atom for these reads (ROCm/FlyDSL,
``lib/Dialect/FlyROCDL/CDNA4/CopyAtom.cpp``: 16 lanes per atom, source bits
``(16, 64):(64, 1)``, destination ``(16, (8, 8)):(8, (1, 128))`` for 8-bit and
``(16, (16, 4)):(16, (1, 256))`` for 16-bit elements) and agrees with FlyDSL's gfx950 MLA
decode kernel's tr8 V addressing (``kernels/attention/mla_fwd_decode_m16x8_fp8_fp8.py``) and
with the Mojo standard library's description ("each 16-lane row reads 16x8 bytes and performs
two interleaved 8x8 byte transposes"). Within each row of 16 lanes (``16 g .. 16 g + 15``):

- tr_b8: destination lane ``16 g + t`` byte ``k`` (k < 8) = source lane ``16 g + 2 k + t // 8``'s
  byte ``t % 8`` (what ``sparse_mla`` and ``mla_decode`` assume for V);
- tr_b16: destination lane ``16 g + t`` element ``k`` (k < 4, 2 bytes) = source lane
  ``16 g + 4 k + t // 4``'s element ``t % 4`` (what ``ultraquant`` assumes for V).

Launch ABI: tensors L, A, R (flat 1-D), then the stream. Symbols ``jsm_ds_read_tr_probe_b8``
and ``jsm_ds_read_tr_probe_b16``.
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
import torch
from flydsl._mlir.dialects import llvm
from flydsl.expr import rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from jax_sparse_mla.kernels.gfx950._primitives import (
    base_address,
    lds_ptr,
    load_global,
    mfma_scaled,
    store_global,
    store_lds,
    uniform,
)
from jax_sparse_mla.kernels.gfx950.configs import PROBE_A_FORMATS as A_FORMATS
from jax_sparse_mla.kernels.gfx950.configs import PROBE_READ_BITS as READ_BITS

MAX_WAVES_PER_SIMD = 8
LDS_BYTES = 1024  # the transposing-read probe's LDS: 16 bytes per lane


@dataclasses.dataclass(frozen=True)
class Config:
    """One compiled MFMA probe: the A operand's format."""

    kernel: str = "mfma_probe"
    a_format: int = 0

    @property
    def symbol(self) -> str:
        return f"jsm_mfma_probe_f{self.a_format}"

    @property
    def design_waves_per_simd(self) -> int:
        return MAX_WAVES_PER_SIMD


@dataclasses.dataclass(frozen=True)
class ReadConfig:
    """One compiled transposing-read probe: the element width of the read."""

    kernel: str = "ds_read_tr_probe"
    bits: int = 8

    @property
    def symbol(self) -> str:
        return f"jsm_ds_read_tr_probe_b{self.bits}"

    @property
    def design_waves_per_simd(self) -> int:
        return MAX_WAVES_PER_SIMD


CONFIGS: tuple[Config | ReadConfig, ...] = (
    *(Config(a_format=f) for f in A_FORMATS),
    *(ReadConfig(bits=b) for b in READ_BITS),
)


def build_launcher(config: Config):
    """The ``flyc.jit`` launcher of one MFMA probe (module docstring: ABI)."""
    a_words = 8 if config.a_format == 0 else 4

    @flyc.kernel(name=config.symbol, known_block_size=[64, 1, 1])
    def probe_kernel(A: fx.Tensor, B: fx.Tensor, S: fx.Tensor, C: fx.Tensor):
        lane = fx.Int64(fx.Int32(fx.thread_idx.x))
        a = load_global(base_address(A) + lane * 32, a_words, align=16)
        b = load_global(base_address(B) + lane * 32, 8, align=16)
        s = load_global(base_address(S) + lane * 8, 2)
        acc = mfma_scaled(a, b, Vec.filled(4, 0.0, fx.Float32), s[0], s[1], config.a_format)
        store_global(base_address(C) + lane * 16, acc, 16)

    @flyc.jit
    def launch(
        A: fx.Tensor,
        B: fx.Tensor,
        S: fx.Tensor,
        C: fx.Tensor,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008
    ):
        probe_kernel(A, B, S, C).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)

    launch.compile_hints = {"waves_per_eu": MAX_WAVES_PER_SIMD, "fast_fp_math": False}
    return launch


def _transposing_read(addr, bits: int) -> Vec:
    """``ds_read_b64_tr_b{bits}`` at an LDS byte address: the lane's 2 result registers."""
    if bits == 8:
        return Vec(rocdl.ds_read_tr8_b64(T.vec(2, T.i32), lds_ptr(addr)).result)
    halves = rocdl.ds_read_tr16_b64(T.vec(4, T.i16), lds_ptr(addr)).result
    return Vec(llvm.bitcast(T.vec(2, T.i32), halves))


def build_read_launcher(config: ReadConfig):
    """The ``flyc.jit`` launcher of one transposing-read probe (module docstring: ABI)."""

    @fx.struct
    class Smem:
        raw: fx.Array[fx.Uint8, LDS_BYTES, 16]

    @flyc.kernel(name=config.symbol, known_block_size=[64, 1, 1])
    def read_kernel(L: fx.Tensor, A: fx.Tensor, R: fx.Tensor):
        lane = fx.Int32(fx.thread_idx.x)
        lds0 = uniform(fx.ptrtoint(fx.SharedAllocator().allocate(Smem).peek().raw.ptr))
        data = load_global(base_address(L) + fx.Int64(lane) * 16, 4, align=16)
        store_lds(lds0 + lane * 16, data, 16)
        addr = fx.Int32(load_global(base_address(A) + fx.Int64(lane) * 4, 1)[0])
        # One wave: its LDS ops run in order; wait for the writes anyway, and keep the
        # scheduler from moving the read above them.
        rocdl.sched_barrier(0)
        rocdl.s_waitcnt(lgkmcnt=0)
        rocdl.sched_barrier(0)
        regs = _transposing_read(lds0 + (addr & (LDS_BYTES - 8)), config.bits)
        store_global(base_address(R) + fx.Int64(lane) * 8, regs, 8)

    @flyc.jit
    def launch(
        L: fx.Tensor,
        A: fx.Tensor,
        R: fx.Tensor,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008
    ):
        read_kernel(L, A, R).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)

    launch.compile_hints = {"waves_per_eu": MAX_WAVES_PER_SIMD, "fast_fp_math": False}
    return launch


def compile_config(config: Config | ReadConfig):
    """Compiles one configuration from CPU example tensors (no launch)."""
    if isinstance(config, ReadConfig):
        lds = torch.zeros(LDS_BYTES, dtype=torch.uint8)
        addrs = torch.zeros(64, dtype=torch.int32)
        regs = torch.zeros(64 * 2, dtype=torch.int32)
        return flyc.compile(build_read_launcher(config), lds, addrs, regs)
    a = torch.zeros(64 * 32, dtype=torch.uint8)
    b = torch.zeros(64 * 32, dtype=torch.uint8)
    s = torch.zeros(64 * 2, dtype=torch.int32)
    c = torch.zeros(64 * 4, dtype=torch.float32)
    return flyc.compile(build_launcher(config), a, b, s, c)
