"""The compiled configurations of the gfx950 kernels: the one list every consumer reads.

FlyDSL-free (standard library only), so that everything that must agree on what is compiled
reads it: the kernel modules' ``CONFIGS`` (the build), the Python checks of
``implementation="flydsl"`` (``ffi/calls.py``), the C++ handlers (``_build/build_lib.py`` writes
``jsm_configs.h`` from ``cpp_header()`` into every library build) and the wheel check of CI.
Each kernel's own parameters (tile sizes, LDS layout, occupancy) stay in its module, but for
the threads per workgroup, which the handlers' grid checks need too.
"""

from __future__ import annotations

SPARSE_MLA_MAX_HEADS = 16  # heads per sparse_mla launch: H = 1..16, larger H in head groups
SPARSE_MLA_HEADS = tuple(range(1, SPARSE_MLA_MAX_HEADS + 1))
SPARSE_MLA_RETURN_LSE = (False, True)
SPARSE_MLA_SPLIT_KEYS = 64  # a sparse_mla key split is whole 64-position chunks of its row
MLA_DECODE_QLENS = (1, 2, 4)  # query positions per request (16 / qlen heads per CTA)
ULTRAQUANT_GROUP_SIZES = (6, 8, 16)  # query heads per KV head (GQA group size G)
ULTRAQUANT_BLOCK_SIZES = (16, 32, 64, 128, 256)  # tokens per cache block
PROBE_A_FORMATS = (0, 4)  # the scaled MFMA's cbsz: 0 = e4m3, 4 = e2m1
PROBE_READ_BITS = (8, 16)  # ds_read_b64_tr_b8 / _b16

# Threads per workgroup (all in x) of each launch: the kernel modules' block sizes, and the
# handlers' grid checks (HSA: workgroups x threads <= 2^32 - 1 work-items per grid dimension).
SPARSE_MLA_THREADS = 256  # 4 waves
MLA_DECODE_PARTIALS_THREADS = 512  # 8 waves
MLA_DECODE_COMBINE_THREADS = 256  # 4 waves, one merged row each
ULTRAQUANT_THREADS = 64  # one wave: the decode partials and the reduce
MLA_DECODE_ROWS = 16  # query rows (head x position) per partials CTA
MLA_DECODE_BLOCK = 128  # keys per partials block; a split is whole blocks
MLA_DECODE_M128_ROWS = 128  # query rows per CTA of the 128-row partials kernel
MLA_DECODE_M128_QLEN = 1  # the query positions per request it serves
MLA_DECODE_M128_BLOCK = 64  # its online-softmax block (keys); its splits stay whole 128s
MLA_DECODE_M128 = "jsm_mla_decode_partials_m128"
MLA_DECODE_M128_MIN_SPLIT_KEYS = 2048  # its splits' least keys of the mean request (partials)
MI355X_CUS = 256  # the CUs of an MI350X / MI355X, where no device says otherwise
ULTRAQUANT_TILE = 16  # tokens per QK / PV MFMA step (one block-table read each)
ULTRAQUANT_TILE_GROUP = 128  # tokens per partition work item
ULTRAQUANT_WORKGROUPS_PER_CU = 12  # one-wave decode groups a CU's 160 KiB LDS holds


def symbols() -> dict[str, tuple[str, ...]]:
    """Kernel module -> the symbols of its configurations, in the modules' ``CONFIGS`` order."""
    return {
        "sparse_mla": tuple(
            f"jsm_sparse_mla_h{h}_l{int(lse)}"
            for h in SPARSE_MLA_HEADS
            for lse in SPARSE_MLA_RETURN_LSE
        ),
        "mla_decode": (
            *(f"jsm_mla_decode_partials_q{q}" for q in MLA_DECODE_QLENS),
            MLA_DECODE_COMBINE,
        ),
        "mla_decode_m128": (MLA_DECODE_M128,),
        "ultraquant": (
            *(
                f"jsm_ultraquant_decode_g{g}_bs{bs}"
                for g in ULTRAQUANT_GROUP_SIZES
                for bs in ULTRAQUANT_BLOCK_SIZES
            ),
            ULTRAQUANT_REDUCE,
        ),
        "probe": (
            *(f"jsm_mfma_probe_f{f}" for f in PROBE_A_FORMATS),
            *(f"jsm_ds_read_tr_probe_b{b}" for b in PROBE_READ_BITS),
        ),
    }


def sparse_mla_launches(heads: int, return_lse: bool, splits: int = 1) -> tuple[str, ...]:
    """The configurations one ``sparse_mla`` call of ``heads`` heads and ``splits`` key splits
    per row launches, in the handler's order: one launch for the full groups of 16 heads, one
    for a remainder of ``heads % 16``; then the combine when ``splits > 1`` (the partials
    always carry their LSE then)."""
    lse = int(return_lse or splits > 1)
    groups = [SPARSE_MLA_MAX_HEADS] if heads >= SPARSE_MLA_MAX_HEADS else []
    groups += [heads % SPARSE_MLA_MAX_HEADS] if heads % SPARSE_MLA_MAX_HEADS else []
    kernels = tuple(f"jsm_sparse_mla_h{h}_l{lse}" for h in groups)
    return kernels + ((MLA_DECODE_COMBINE,) if splits > 1 else ())


def sparse_mla_split_range(length, split, splits, minimum=min):
    """Positions ``[lo, hi)`` (from the row's first) of key split ``split`` of a ``sparse_mla``
    row of ``length`` entries cut into ``splits``: chunks of
    ``c = 64 ceil(length / (64 splits))``, the last ones short or empty. ``minimum`` is the
    min of the values given (Python ints: ``min``; jnp arrays, kernel values: theirs)."""
    per = SPARSE_MLA_SPLIT_KEYS * splits
    chunk = (length + per - 1) // per * SPARSE_MLA_SPLIT_KEYS
    lo = minimum(split * chunk, length)
    return lo, minimum(lo + chunk, length)


MLA_DECODE_COMBINE = "jsm_mla_decode_combine"
ULTRAQUANT_REDUCE = "jsm_ultraquant_reduce"


def mla_decode_m128_serves(qlen: int, heads: int) -> bool:
    """Whether the 128-row partials kernel can serve ``qlen`` positions and ``heads`` heads:
    one position and whole groups of 128 heads (no idle rows)."""
    return qlen == MLA_DECODE_M128_QLEN and heads > 0 and heads % MLA_DECODE_M128_ROWS == 0


def mla_decode_fill_splits(batch: int, groups: int, n_indices: int, cus: int) -> int:
    """Splits that fill ``cus`` CUs with ``groups`` CTAs per (request, split) of ``batch``
    requests, at most one split per 128-key block of the mean request (``n_indices / batch``
    keys), at least one."""
    blocks = -(-n_indices // (max(batch, 1) * MLA_DECODE_BLOCK))
    return max(1, min(blocks, -(-cus // max(batch * groups, 1))))


def mla_decode_rows(qlen: int, heads: int, batch: int, n_indices: int, cus: int) -> int:
    """Query rows per partials CTA for a call of ``batch`` requests over ``n_indices`` keys on
    ``cus`` CUs: 128 (one K request per (request, split) for 128 heads) where that kernel
    serves the shape and its CTAs fill the CUs with splits of at least
    ``MLA_DECODE_M128_MIN_SPLIT_KEYS`` keys of the mean request (or one split): its partials,
    ``1028 H`` bytes per (request, split), then stay under ``1.78 H / 2048`` (1/9 at H = 128)
    of the K bytes. Elsewhere 16: ``ceil(H qlen / 16)`` CTAs per (request, split) fill the CUs
    with 8x fewer splits, hence 8x fewer partial bytes, and a GPU that 128-row CTAs would
    leave idle does not wait on a few of them (the MFMA work per key is the same)."""
    if not mla_decode_m128_serves(qlen, heads):
        return MLA_DECODE_ROWS
    batch, groups = max(batch, 1), heads // MLA_DECODE_M128_ROWS
    splits = mla_decode_fill_splits(batch, groups, n_indices, cus)
    fills = batch * groups * splits >= cus
    long = splits == 1 or n_indices >= MLA_DECODE_M128_MIN_SPLIT_KEYS * batch * splits
    return MLA_DECODE_M128_ROWS if fills and long else MLA_DECODE_ROWS


def mla_decode_partials_launch(qlen: int, rows: int) -> str:
    """The partials configuration of ``qlen`` query positions per request and ``rows`` query
    rows per CTA (``mla_decode_rows``)."""
    return MLA_DECODE_M128 if rows == MLA_DECODE_M128_ROWS else f"jsm_mla_decode_partials_q{qlen}"


def mla_decode_head_groups(qlen: int, heads: int, rows: int) -> int:
    """CTAs per (request, split), the grids' G: ``ceil(H qlen / rows)``."""
    return -(-heads * qlen // rows)


def mla_decode_softmax_block(rows: int) -> int:
    """Keys per online-softmax block of the partials kernel of ``rows`` rows per CTA."""
    return MLA_DECODE_M128_BLOCK if rows == MLA_DECODE_M128_ROWS else MLA_DECODE_BLOCK


def kernel_group_size(g: int) -> int | None:
    """The compiled G that serves ``g`` query heads per KV head (zero rows padded), or None."""
    return next((k for k in ULTRAQUANT_GROUP_SIZES if k >= g), None)


def ultraquant_launches(g: int, block_size: int) -> tuple[str, str]:
    """The decode configuration serving ``g`` heads per KV head, and the reduce."""
    return f"jsm_ultraquant_decode_g{kernel_group_size(g)}_bs{block_size}", ULTRAQUANT_REDUCE


def all_symbols() -> frozenset[str]:
    """Every configuration's symbol: what a library linked with a complete build holds."""
    return frozenset(s for group in symbols().values() for s in group)


def user_symbols() -> tuple[str, ...]:
    """The configurations the ops launch (the diagnostic probes aside), in ``symbols()`` order:
    what the self-check verifies."""
    return tuple(s for module, group in symbols().items() if module != "probe" for s in group)


def cpp_header() -> str:
    """``jsm_configs.h``: the sets above as C++ constants and membership tests, the threads
    per workgroup, and which shapes the 128-row mla_decode partials kernel can serve."""

    def member(name: str, values: tuple[int, ...]) -> list[str]:
        test = " || ".join(f"v == {v}" for v in values)
        listed = ", ".join(map(str, values))
        return [
            f'constexpr const char* {name}Text = "{listed}";',
            f"constexpr bool {name}(int64_t v) {{ return {test}; }}",
        ]

    return "\n".join(
        [
            "// Generated by jax_sparse_mla/_build/build_lib.py from kernels/gfx950/configs.py.",
            "#pragma once",
            "#include <cstdint>",
            "namespace jsm {",
            f"constexpr int64_t kSparseMaxHeads = {SPARSE_MLA_MAX_HEADS};",
            f"constexpr int64_t kSparseMlaThreads = {SPARSE_MLA_THREADS};",
            f"constexpr int64_t kMlaDecodePartialsThreads = {MLA_DECODE_PARTIALS_THREADS};",
            f"constexpr int64_t kMlaDecodeCombineThreads = {MLA_DECODE_COMBINE_THREADS};",
            f"constexpr int64_t kMlaDecodeRows = {MLA_DECODE_ROWS};",
            f"constexpr int64_t kMlaDecodeM128Rows = {MLA_DECODE_M128_ROWS};",
            f'constexpr const char* kMlaDecodeM128 = "{MLA_DECODE_M128}";',
            "// mla_decode_m128_serves: the 128-row partials can serve the shape",
            "constexpr bool MlaDecodeM128Serves(int64_t qlen, int64_t heads) {",
            f"  return qlen == {MLA_DECODE_M128_QLEN} && heads > 0 &&",
            "         heads % kMlaDecodeM128Rows == 0;",
            "}",
            f"constexpr int64_t kUltraquantThreads = {ULTRAQUANT_THREADS};",
            *member("KernelQlen", MLA_DECODE_QLENS),
            *member("KernelGroupSize", ULTRAQUANT_GROUP_SIZES),
            *member("KernelBlockSize", ULTRAQUANT_BLOCK_SIZES),
            *member("KernelAFormat", PROBE_A_FORMATS),
            *member("KernelReadBits", PROBE_READ_BITS),
            "}  // namespace jsm",
            "",
        ]
    )
