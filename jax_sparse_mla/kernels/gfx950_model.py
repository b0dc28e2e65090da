"""A static model of the gfx950 kernels on an AMD MI355X: work launched and bytes requested.

A model, not a measurement: for a decode shape it counts, from the kernels' documented
decomposition (``kernels/gfx950/*.py`` docstrings and grids) and today's split choices, the
workgroups one launch puts on the GPU's CUs and the bytes the kernels ask the memory system for,
and divides bytes by the HBM bandwidth. Caches (L2, Infinity Cache) are not modeled: where a
design counts on them it states its bound (``Estimate.max_bytes_ratio``: the head groups of a
``sparse_mla`` (row, split) or an ``mla_decode`` (split, request) run on one XCD at about the
same time, so of their G requests of a record HBM is expected to serve one). The "HBM time" is
what bandwidth alone allows for every byte requested, and a lower bound on the time only where
the kernel keeps the whole GPU busy. ``estimate(shape, cus)`` is a pure function
of the op (the shape's type), the shape and the device's CU count, so a redesign of the kernels
can update it and a test can hold the kernels to it; ``print_report(manifest)`` is the section
``python -m jax_sparse_mla.build --arch gfx950 --report`` prints after its resource table.

Facts come from where they are defined: the compiled configurations and the kernels' tile sizes
from ``kernels/gfx950/configs.py``, the record formats from ``formats.py`` (no FlyDSL needed).
This module lives outside ``kernels/gfx950/`` because the build keys every code object by the
digest of that directory's sources.

Targets of the redesign, reported here as misses (``tests/test_mi355_model.py`` asserts them
for every shape of ``DECODE_SHAPES``): records requested at most ``MAX_BYTES_RATIO`` x the
minimum (each record once per split: once per query row or request, and per KV head for
UltraQuant), or the bound a design states instead (``Estimate.max_bytes_ratio``: the G head
groups of ``sparse_mla`` and ``mla_decode`` each request a split's records, G x the minimum,
from one XCD's L2 after the first), and at least
``min(CUs, work units)`` workgroups per launch, a work unit being one 64-key (``SPLIT_KEYS``)
piece of one row's keys.
"""

from __future__ import annotations

import dataclasses
import math

from jax_sparse_mla._build.codeobject import SIMDS_PER_CU, KernelResources
from jax_sparse_mla.formats import (
    KV_DIM,
    LATENT_DIM,
    RECORD_BYTES,
    UQ_HEAD_DIM,
    UQ_SLOT_CONTENT_BYTES,
)
from jax_sparse_mla.kernels.gfx950 import configs

# AMD Instinct MI355X (AMD's product page): 256 CUs in 8 XCDs, 8 TB/s of HBM3E.
MI355X_CUS = configs.MI355X_CUS
MI355X_HBM_BYTES_PER_S = 8.0e12
MI355X_XCDS = 8  # mla_decode's grid rounds its work items up to a multiple of the XCDs

MAX_BYTES_RATIO = 1.1
SPLIT_KEYS = 64  # keys of a work unit, the fill target's piece (every op)


UQ_TILE = configs.ULTRAQUANT_TILE  # tokens per UltraQuant tile: one block-table read each
UQ_TILE_GROUP = configs.ULTRAQUANT_TILE_GROUP  # tokens per partition work item (128)
UQ_WORKGROUPS_PER_CU = configs.ULTRAQUANT_WORKGROUPS_PER_CU  # one-wave groups per CU: 12
UQ_SLOT_BYTES = UQ_SLOT_CONTENT_BYTES  # 272 read per (token, KV head)
BF16, F32, I32 = 2, 4, 4


# ---------------------------------------------------------------------------------------------
# Split choices of today's ops (ffi/calls.py launches these)
# ---------------------------------------------------------------------------------------------


def mla_decode_splits(batch: int, heads: int, qlen: int, n_indices: int, cus: int) -> int:
    """Splits that fill ``cus`` CUs with one CTA per (head group, split, request): 16 query
    rows, or 128 heads where the 128-row kernel serves the call (``configs.mla_decode_rows``);
    at most one split per 128-key block of the mean request."""
    rows = configs.mla_decode_rows(qlen, heads, batch, n_indices, cus)
    groups = configs.mla_decode_head_groups(qlen, heads, rows)
    return configs.mla_decode_fill_splits(batch, groups, n_indices, cus)


def sparse_mla_splits(n_q: int, heads: int, nnz: int, cus: int) -> int:
    """Key splits per query row that fill ``cus`` CUs with one workgroup per (row, split, group
    of 16 heads), at most one split per ``configs.SPARSE_MLA_SPLIT_KEYS`` (64) keys of the mean row
    (``nnz / n_q`` entries: a 2-D index array's top-k)."""
    groups = math.ceil(heads / configs.SPARSE_MLA_MAX_HEADS)
    tiles = math.ceil(nnz / max(n_q, 1) / configs.SPARSE_MLA_SPLIT_KEYS)
    return max(1, min(tiles, math.ceil(cus / max(n_q * groups, 1))))


def ultraquant_partitions(batch: int, kv_heads: int, max_tokens: int, cus: int) -> int:
    """Partitions that fill ``cus`` CUs (``UQ_WORKGROUPS_PER_CU`` one-wave groups each), at
    most one per 128-token tile group."""
    fill = math.ceil(cus * UQ_WORKGROUPS_PER_CU / max(batch * kv_heads, 1))
    return max(1, min(fill, math.ceil(max_tokens / UQ_TILE_GROUP)))


# ---------------------------------------------------------------------------------------------
# Shapes and estimates
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SparseMla:
    """``sparse_mla`` decode: ``n_q`` query rows of ``heads`` heads, ``topk`` valid keys each
    (distinct records), with the LSE."""

    n_q: int
    heads: int
    topk: int = 2048

    def __str__(self) -> str:
        return f"n_q={self.n_q} H={self.heads} topk={self.topk}"


@dataclasses.dataclass(frozen=True)
class MlaDecode:
    """``mla_decode``: ``batch`` requests of ``context`` keys, ``heads`` heads, ``qlen`` query
    positions each, default splits, with the LSE."""

    batch: int
    context: int
    heads: int
    qlen: int = 1

    def __str__(self) -> str:
        return f"B={self.batch} ctx={self.context} H={self.heads} qlen={self.qlen}"


@dataclasses.dataclass(frozen=True)
class UltraQuant:
    """``ultraquant_decode``: ``batch`` requests of ``context`` tokens, ``kv_heads`` KV heads
    of ``group`` query heads, default partitions."""

    batch: int
    context: int
    kv_heads: int
    group: int
    block_size: int = 64

    def __str__(self) -> str:
        return f"B={self.batch} ctx={self.context} Hk={self.kv_heads} G={self.group}"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the model says of one shape. Bytes are what the kernels request (all launches of
    the call); workgroups are per launch of the main kernel (launches run one after another)."""

    op: str
    shape: str
    launches: int  # launches of the main kernel (sparse_mla: the full head groups, a remainder)
    workgroups: int  # workgroups per launch
    work_units: int  # 64-key pieces of the rows' keys: the most workgroups that have work
    splits: int  # key splits per row / request (UltraQuant: partitions)
    record_bytes: int  # records / cache rows requested
    min_record_bytes: int  # each record once per split
    other_bytes: int  # indices / block tables, q, output (and partials written and read back)
    min_other_bytes: int  # indices once, q, output
    cus: int
    # the design's bound on record_bytes / min_record_bytes (sparse_mla: its head groups,
    # whose requests of a record after the first hit one XCD's L2)
    max_bytes_ratio: float = MAX_BYTES_RATIO

    @property
    def fill_target(self) -> int:
        return min(self.cus, self.work_units)

    @property
    def bytes_ratio(self) -> float:
        return self.record_bytes / self.min_record_bytes

    @property
    def hbm_s(self) -> float:
        """Seconds that HBM bandwidth alone allows for every byte requested."""
        return (self.record_bytes + self.other_bytes) / MI355X_HBM_BYTES_PER_S

    @property
    def min_hbm_s(self) -> float:
        """The same for the minimum bytes."""
        return (self.min_record_bytes + self.min_other_bytes) / MI355X_HBM_BYTES_PER_S

    def misses(self) -> list[str]:
        """The redesign's targets this shape misses today, with by how much."""
        found = []
        if self.bytes_ratio > max(self.max_bytes_ratio, MAX_BYTES_RATIO):
            found.append(f"bytes {self.bytes_ratio:.2g}x min")
        if self.workgroups < self.fill_target:
            found.append(f"fill {self.workgroups}/{self.fill_target} WGs")
        return found


def _sparse_mla(s: SparseMla, cus: int) -> Estimate:
    # One launch for the full groups of 16 heads (and one for a remainder), one workgroup per
    # (row, split, head group), rounded up to whole rounds of 8 (one per XCD) per group. Each
    # workgroup requests its split's records (656 bytes) and indices once. The G workgroups of
    # a (row, split) run on one XCD at about the same time, so HBM delivers each record once
    # and the other G - 1 requests hit that XCD's L2: requests G x the minimum (the design's
    # stated bound, ``max_bytes_ratio``), HBM about 1x. S > 1 writes bf16 partials and f32
    # LSEs [n_q, S, H] that the combine reads back.
    groups = math.ceil(s.heads / configs.SPARSE_MLA_MAX_HEADS)
    splits = sparse_mla_splits(s.n_q, s.heads, s.n_q * s.topk, cus)
    full = s.heads // configs.SPARSE_MLA_MAX_HEADS
    launch_groups = full or 1  # the main launch: the full groups, else the remainder alone
    keys = s.n_q * s.topk
    rows = s.n_q * s.heads
    q_out = rows * (KV_DIM * BF16 + LATENT_DIM * BF16 + F32)
    partials = 2 * rows * splits * (LATENT_DIM * BF16 + F32) if splits > 1 else 0
    return Estimate(
        op="sparse_mla",
        shape=str(s),
        launches=int(full > 0) + int(s.heads % configs.SPARSE_MLA_MAX_HEADS > 0),
        workgroups=MI355X_XCDS * launch_groups * math.ceil(s.n_q * splits / MI355X_XCDS),
        work_units=s.n_q * math.ceil(s.topk / SPLIT_KEYS),
        splits=splits,
        record_bytes=groups * keys * RECORD_BYTES,
        min_record_bytes=keys * RECORD_BYTES,
        other_bytes=groups * keys * I32 + q_out + partials,
        min_other_bytes=keys * I32 + q_out,
        cus=cus,
        max_bytes_ratio=float(groups),
    )


def _mla_decode(s: MlaDecode, cus: int) -> Estimate:
    # One CTA per (head group, split, request): 16 query rows, or 128 heads where
    # configs.mla_decode_rows picks the 128-row kernel; each requests the 576-byte rows of its
    # split's keys and their indices. The G CTAs of a (split, request) are consecutive block
    # ids of one XCD (grid 8 G ceil(B S / 8), ids 8 k + x on XCD x) and run together: each row
    # and index is requested G times (the stated bound; 1x, so 1.1, for the 128-row kernel at
    # H = 128), from HBM about once. Partials [B qlen, S, H] (512 bf16 + an f32 LSE) are written and
    # read back by the combine, unless one split writes the output itself.
    cta_rows = configs.mla_decode_rows(s.qlen, s.heads, s.batch, s.batch * s.context, cus)
    groups = configs.mla_decode_head_groups(s.qlen, s.heads, cta_rows)
    splits = mla_decode_splits(s.batch, s.heads, s.qlen, s.batch * s.context, cus)
    keys = s.batch * s.context
    rows = s.batch * s.qlen * s.heads
    q_out = rows * (KV_DIM * BF16 + LATENT_DIM * BF16 + F32)
    partials = 2 * rows * splits * (LATENT_DIM * BF16 + F32) if splits > 1 else 0
    return Estimate(
        op="mla_decode",
        shape=str(s),
        launches=1,
        workgroups=MI355X_XCDS * groups * math.ceil(s.batch * splits / MI355X_XCDS),
        work_units=s.batch * math.ceil(s.context / SPLIT_KEYS),
        splits=splits,
        record_bytes=groups * keys * KV_DIM,
        min_record_bytes=keys * KV_DIM,
        other_bytes=groups * keys * I32 + q_out + partials,
        min_other_bytes=keys * I32 + q_out,
        cus=cus,
        max_bytes_ratio=max(float(groups), MAX_BYTES_RATIO),
    )


def _ultraquant(s: UltraQuant, cus: int) -> Estimate:
    # One wave per (request, KV head, partition) serving the KV head's G query heads (padded
    # to the compiled G): each token's 272-byte slot once, one block-table entry per 16-token
    # tile; partials [B, Hk, P, G] (256 bf16 + two f32) written and read back by the reduce.
    kernel_g = configs.kernel_group_size(s.group)
    blocks = math.ceil(s.context / s.block_size)
    parts = ultraquant_partitions(s.batch, s.kv_heads, blocks * s.block_size, cus)
    heads = s.batch * s.kv_heads
    q_out = heads * s.group * 2 * UQ_HEAD_DIM * BF16
    tables = heads * math.ceil(s.context / UQ_TILE) * I32
    partials = 2 * heads * parts * kernel_g * (UQ_HEAD_DIM * BF16 + 2 * F32)
    return Estimate(
        op="ultraquant_decode",
        shape=str(s),
        launches=1,
        workgroups=heads * parts,
        work_units=heads * math.ceil(s.context / SPLIT_KEYS),
        splits=parts,
        record_bytes=heads * s.context * UQ_SLOT_BYTES,
        min_record_bytes=heads * s.context * UQ_SLOT_BYTES,
        other_bytes=tables + q_out + partials,
        min_other_bytes=s.batch * blocks * I32 + q_out,
        cus=cus,
    )


_MODELS = {SparseMla: _sparse_mla, MlaDecode: _mla_decode, UltraQuant: _ultraquant}


def estimate(shape: SparseMla | MlaDecode | UltraQuant, cus: int = MI355X_CUS) -> Estimate:
    """The model of today's kernels for ``shape`` on a device of ``cus`` CUs."""
    return _MODELS[type(shape)](shape, cus)


# The decode shapes users run. DeepSeek-V3.2: 128 heads (16 / 64 under TP 8 / 2), top-k 2048.
# Kimi-K3-style dense MLA decode (same 576 / 512 latent): 16 heads (a TP-sharded rank, the
# shape of aiter gluon's published figure) and 128 (unsharded). UltraQuant: the benchmark's
# shape, 8 KV heads of 8 query heads, 32k tokens, blocks of 64.
BATCHES = (1, 4, 16, 32, 64, 128)
DECODE_SHAPES: tuple = (
    *(SparseMla(n_q, h) for h in (16, 64, 128) for n_q in (1, 4, 32, 128)),
    *(MlaDecode(b, ctx, h) for h in (16, 128) for ctx in (8192, 32768) for b in BATCHES),
    *(UltraQuant(b, 32768, 8, 8) for b in BATCHES),
)
# The shapes of the published MI355X / MI350 figures (docs/mi355.md): sparse decode of 1 and 48
# tokens at 16 heads, top-k 2048; dense fp8 MLA decode, batch 1, 16 heads, 10M keys.
PEER_SHAPES: tuple = (SparseMla(1, 16), SparseMla(48, 16), MlaDecode(1, 10_000_000, 16))


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def configuration_lines(manifest: dict) -> list[str]:
    """Per compiled kernel: unified VGPRs allocated, LDS bytes, the waves per SIMD and the
    workgroups per CU they allow (and what limits them)."""
    head = f"{'symbol':34} {'VGPRs':>5} {'LDS B':>6} {'waves/SIMD':>10} {'WG/CU':>5}  limited by"
    lines = [head, "-" * len(head)]
    for entry in manifest["kernels"]:
        for r in (KernelResources(**x) for x in entry["resources"]):
            waves, limiter = r.occupancy()
            per_cu = waves * SIMDS_PER_CU // r.waves_per_workgroup
            lines.append(
                f"{entry['symbol']:34} {r.vgpr_alloc:5} {r.lds_bytes:6} {waves:10} "
                f"{per_cu:5}  {limiter}"
            )
    return lines


def shape_lines(shapes=DECODE_SHAPES, cus: int = MI355X_CUS) -> list[str]:
    """A markdown table, one row per shape: launches x workgroups against the target, records
    requested against the minimum and the bound on that ratio, all bytes, the HBM-only times and
    the targets missed (docs/mi355.md holds these rows)."""
    lines = [
        "| op | shape | launches | WGs | target | splits | records MB | min MB | ratio | bound | "
        "all MB | HBM us | min us | misses |",
        "| --- | --- |" + " ---: |" * 11 + " --- |",
    ]
    for shape in shapes:
        e = estimate(shape, cus)
        total = e.record_bytes + e.other_bytes
        cells = (
            e.op,
            e.shape,
            e.launches,
            e.workgroups,
            e.fill_target,
            e.splits,
            f"{e.record_bytes / 1e6:.2f}",
            f"{e.min_record_bytes / 1e6:.2f}",
            f"{e.bytes_ratio:.2f}",
            f"{max(e.max_bytes_ratio, MAX_BYTES_RATIO):g}",
            f"{total / 1e6:.2f}",
            f"{e.hbm_s * 1e6:.2f}",
            f"{e.min_hbm_s * 1e6:.2f}",
            "; ".join(e.misses()) or "meets both",
        )
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def print_report(manifest: dict, cus: int = MI355X_CUS) -> None:
    """The model section of the build report (after the resource table)."""
    print(
        f"\nMI355X model ({cus} CUs, HBM {MI355X_HBM_BYTES_PER_S / 1e12:g} TB/s; a model, not a "
        "measurement: jax_sparse_mla/kernels/gfx950_model.py, docs/mi355.md)"
    )
    print("\n".join(configuration_lines(manifest)))
    print(
        f"\nDecode shapes: WGs per launch against target min(CUs, 64-key pieces); records "
        f"requested against each once per split (target <= {MAX_BYTES_RATIO}x, or the design's "
        "stated bound); HBM us = all "
        "bytes / HBM bandwidth, min us = minimum bytes / HBM bandwidth"
    )
    print("\n".join(shape_lines(cus=cus)))
    missed = sum(bool(estimate(s, cus).misses()) for s in DECODE_SHAPES)
    print(f"{missed} of {len(DECODE_SHAPES)} decode shapes miss a target of the redesign")
