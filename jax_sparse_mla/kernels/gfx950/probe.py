"""gfx950 diagnostic kernel: one scaled MFMA 16x16x128 on operands given lane by lane.

The kernels assume operand and scale layouts of ``v_mfma_scale_f32_16x16x128_f8f6f4`` that no
machine of this project could check (each operand by its own bit width: 8-bit split, 4-bit
contiguous; ``sparse_mla`` / ``mla_decode`` for e4m3 x e4m3, ``ultraquant`` for e2m1 x e4m3;
BUILD.md). This kernel runs exactly one such MFMA on raw per-lane registers, so that an MI355
test can compare its result with each assumption
(``tests/test_gfx950.py::test_mfma_operand_layouts_*``).

One wave (grid (1, 1, 1), block (64, 1, 1)); lane ``l``:

- ``A``: uint8 [64, 32]: its A operand registers (e4m3: all 32 bytes; e2m1: bytes 0-15);
- ``B``: uint8 [64, 32]: its B operand registers (e4m3);
- ``S``: int32 [64, 2]: its E8M0 scale_a and scale_b registers (the MFMA reads byte 0);
- ``C``: float32 [64, 4]: the accumulator it holds after ``C = 0 + A x B`` with the scales.

Launch ABI: tensors A, B, S, C (flat 1-D), then the stream. Symbols ``jsm_mfma_probe_f0`` (A
e4m3) and ``jsm_mfma_probe_f4`` (A e2m1).
"""

import dataclasses

import flydsl.compiler as flyc
import flydsl.expr as fx
import torch
from flydsl.expr.typing import Vector as Vec

from jax_sparse_mla.kernels.gfx950._primitives import (
    base_address,
    load_global,
    mfma_scaled,
    store_global,
)

MAX_WAVES_PER_SIMD = 8
A_FORMATS = (0, 4)  # the MFMA's cbsz: 0 = e4m3, 4 = e2m1


@dataclasses.dataclass(frozen=True)
class Config:
    """One compiled variant: the A operand's format."""

    kernel: str = "mfma_probe"
    a_format: int = 0

    @property
    def symbol(self) -> str:
        return f"jsm_mfma_probe_f{self.a_format}"

    @property
    def design_waves_per_simd(self) -> int:
        return MAX_WAVES_PER_SIMD


CONFIGS: tuple[Config, ...] = tuple(Config(a_format=f) for f in A_FORMATS)


def build_launcher(config: Config):
    """The ``flyc.jit`` launcher of one configuration (module docstring: ABI)."""
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


def compile_config(config: Config):
    """Compiles one configuration from CPU example tensors (no launch)."""
    a = torch.zeros(64 * 32, dtype=torch.uint8)
    b = torch.zeros(64 * 32, dtype=torch.uint8)
    s = torch.zeros(64 * 2, dtype=torch.int32)
    c = torch.zeros(64 * 4, dtype=torch.float32)
    return flyc.compile(build_launcher(config), a, b, s, c)
