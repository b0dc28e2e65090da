"""Time every implementation of each op on this machine, and FlashMLA / aiter on the same data.

    python benchmarks/bench.py [--ops sparse_mla,mla_decode,ultraquant_decode]
        [--implementations xla,pallas,... | all] [--quick] [--samples 20] [--sample-ms 50]
        [--l2-flush] [--profiler] [--no-flashmla] [--no-aiter] [--json PATH]
        [--decode-heads 12,128] [--sparse 1x16,128x128]

The same on an H200 and an MI355: on the MI355 (ROCm) the defaults are "xla" and "flydsl", the
timing is the same host-clock method, ``--profiler`` reads the ROCm trace's device planes the
same way (where jax's ROCm profiler writes none, the row says why and keeps its wall-clock
times), and AMD aiter's kernels run beside ours when ``import aiter`` works.

Implementations: by default every name in the op's implementation table that runs natively on
this machine: "xla" everywhere; "pallas" and "mosaic" on CUDA; "flydsl" on gfx950; other names
(kernels added later) on any GPU; never an emulation ("gfx950_emulation") nor Pallas interpret
mode. On the CPU that leaves "xla". ``--implementations`` names them (a name an op lacks is
skipped for that op; "all" = the whole table).

Timing: each case is jitted and called back to back (asynchronous dispatch keeps the device
queue full); one sample = wall time of a batch of calls / calls, the batch sized to about
``--sample-ms``; the table and JSON give the median and the spread (min, p10, p25, p75, p90,
max) over ``--samples`` (>= 10) samples. ``--l2-flush``: before every call a buffer of
``--l2-flush-mib`` MiB (default 256, > the 60 MB L2) is read and written (``b + 1``, donated);
each sample then pairs a batch of (flush, call) with a batch of flushes alone, run right after
it, and is (paired time - flush-alone time) / calls. Short kernels are then noisy (the
difference of two larger numbers; a sample can even come out negative), and the flush leaves
dirty lines in L2 whose write-back the next call may pay. ``--profiler``: also traces
``max(samples, 20)`` calls with ``jax.profiler`` and reports the spread of per-call execution
times from the trace's timestamps ("device us"), read from the device planes (the host plane on
the CPU backend): the "XLA Modules" events of the case's module when the trace has that line,
else the span of the events tagged with the module, per ``run_id``, else the time that each
call's events cover (their union: its kernels' busy time; the flush is another module, so it
is never counted); the row records which (``times_from_profile``). FlashMLA's calls are traced
the same way: the trace's device planes hold every kernel of the process, and FlashMLA's are
those of no XLA module (the flush's kernels, found by tracing the flushes alone, left out), so
its "device us" is its kernels' busy time per call, as ours is (GPU only; its combine kernel
overlaps its decode kernel in the trace, which the union counts once). On the H200 with jax
0.11.2 the trace had neither of the first two: "device us" there is busy time, which leaves
out the gaps between a call's kernels. After the table, ``--profiler`` also lists each row's
kernels (``kernels_per_call``: name, median us, count per call; in the JSON under
``profiler.kernels``), which tells a kernel's own time from that of the XLA ops around it.

``--sparse`` picks the sparse_mla cases by (n_q)x(H); ``--decode-heads`` the mla_decode head
counts.

"dispatch floor": a jitted ``x + 1`` on a [16, 512] bf16 array, timed the same way in the same
run: what one jitted call costs the host here. A call whose device work is shorter than this is
bound by the host, whatever its kernels do; "device us" (``--profiler``) tells the two apart.

"bytes" counts what must be read or written once: the records / cache rows each query row
attends to (per row: sparse_mla rows do not share their reads), q and the output; "FLOPs" the
two matmuls (q.K over the 576 dims, P.V over the 512). "copy" is the device-to-device copy
bandwidth (read + write of ``a + 1`` on a 2 GiB buffer) measured in the same run.

aiter (``Aiter``): when ``import aiter`` works (its torch built for ROCm), every ``mla_decode``
case of qlen 1 also runs aiter's gluon MLA decode (``mla_decode_gluon``) on the same fp8 rows,
indices and indptr, timed and compared the same way. aiter's sparse MLA and UltraQuant decodes
are not wired yet (their interfaces and cache layouts were not checked against ours).

After the table, "side by side" gives per case our fastest implementation other than "xla" and
each peer's median time and its ratio to ours, or why the peer is absent (not importable, no
kernel wired for the op, or it failed).

FlashMLA: when ``import flash_mla`` works (torch and FlashMLA built for this GPU, e.g. by the
build script kept outside the repository), every sparse_mla case also runs FlashMLA's sparse fp8
decode (``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``, written against
FlashMLA's interface of 2026-04 (commit 9241ae3)) on the same bytes: the fp8_ds_mla records are
FlashMLA's 656-byte V3.2 layout, handed over by DLPack without a copy as a [blocks, 64, 1, 656]
uint8 cache, q as [n_q, 1, H, 576] bf16 (batch = query row, s_q = 1) and the indices as
[n_q, 1, topk] int32. FlashMLA takes 64 or 128 query heads only: fewer are padded with zero
heads (the row says so; its bytes and FLOPs still count the real heads). It is timed the same
way (``torch.cuda.synchronize``; the scheduling metadata is made by the warm-up call and reused,
as in a decode loop), and its output and lse are compared with the
reference implementation's (max abs difference). Every jax implementation is compared with the
reference too: "xla" when it runs, else the first implementation.

The JSON (``--json``) holds the versions (python, jax, jaxlib, the jax plugins, torch and
flash_mla / aiter when loaded), the devices, the GPU name and driver (nvidia-smi, else rocm-smi),
the git commit and whether the work tree is dirty, the command line, the settings (the timing
method among them), the copy bandwidth, every row and the side-by-side entries.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import hashlib
import importlib
import importlib.metadata
import itertools
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla as jsm
from jax_sparse_mla._platform import gpu_platforms

REPO = Path(__file__).resolve().parents[1]
OPS = ("sparse_mla", "mla_decode", "ultraquant_decode")
OP_MODULES = {
    "sparse_mla": "jax_sparse_mla.sparse_mla",
    "mla_decode": "jax_sparse_mla.mla_decode",
    "ultraquant_decode": "jax_sparse_mla.ultraquant",
}
# Where an implementation is compiled for the hardware (None: everywhere). Names not listed
# run natively on any GPU; emulations and interpret modes never count as native.
NATIVE_ON = {"xla": None, "pallas": {"cuda"}, "mosaic": {"cuda"}, "flydsl": {"gfx950"}}
MAX_CALLS = 2000
FLASHMLA_HEADS = (64, 128)
RECORD_BYTES = 656
DECODE_K_SCALE, DECODE_V_SCALE = 0.02, 0.03  # the mla_decode cases' cache scales
PEERS = ("flashmla", "aiter")  # the sources of the side-by-side table's peer columns
TIMING = (
    "median / min / p10 / p90 / max us: wall clock of back-to-back calls / calls (host clock, "
    "asynchronous dispatch); device us (--profiler): jax.profiler trace timestamps, blank where "
    "the trace has no device events"
)


@dataclasses.dataclass(frozen=True)
class Shapes:
    records: int
    topk: int
    sparse: tuple[tuple[int, int], ...]  # (n_q, H)
    decode_batches: tuple[int, ...]
    decode_seqs: tuple[int, ...]
    decode_qlens: tuple[int, ...]
    decode_heads: tuple[int, ...]
    uq_batches: tuple[int, ...]
    uq_seq: int
    uq_kv_heads: int
    uq_group: int
    uq_pool_blocks: int
    copy_mib: int


FULL = Shapes(
    records=200_000,
    topk=2048,
    sparse=tuple((n_q, h) for n_q in (1, 32, 128, 1024) for h in (16, 128)) + ((256, 128),),
    decode_batches=(1, 32, 128),
    decode_seqs=(8192, 32768),
    decode_qlens=(1, 2),
    decode_heads=(12,),
    uq_batches=(1, 32, 128),
    uq_seq=32768,
    uq_kv_heads=8,
    uq_group=8,
    uq_pool_blocks=2048,
    copy_mib=2048,
)
QUICK = Shapes(
    records=4096,
    topk=64,
    sparse=((1, 16), (4, 16)),
    decode_batches=(2,),
    decode_seqs=(256,),
    decode_qlens=(1, 2),
    decode_heads=(12,),
    uq_batches=(2,),
    uq_seq=256,
    uq_kv_heads=8,
    uq_group=8,
    uq_pool_blocks=8,
    copy_mib=16,
)
PAGE = 64  # mla_decode pages and UltraQuant blocks: 64 tokens


@dataclasses.dataclass
class Case:
    op: str
    name: str
    params: dict
    fn: Callable  # fn(*args, implementation=...) -> outputs
    args: tuple
    nbytes: int
    flops: int
    flashmla: dict | None = None  # sparse_mla: q, kv, topk_idx [n_q, topk], sm_scale


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _fp8_codes(key, shape):
    """Random finite e4m3fn codes (0x7F / 0xFF, the NaN codes, become 0x7E / 0xFE) as uint8."""
    bits = jax.random.bits(key, shape, jnp.uint8)
    return jnp.where(bits & 0x7F == 0x7F, bits - 1, bits)


def _as_bytes(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)


def _q(key, shape):
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def sparse_mla_cases(key, s: Shapes) -> Iterator[Case]:
    k = jax.random.split(key, 4)
    scales = jnp.full((s.records, 4), 2.0**-4, jnp.float32)
    rope = jax.random.normal(k[1], (s.records, 64), jnp.float32).astype(jnp.bfloat16)
    records = jnp.concatenate(
        [_fp8_codes(k[0], (s.records, 512)), _as_bytes(scales), _as_bytes(rope)], axis=1
    )
    sm_scale = 576**-0.5
    for n_q, h in s.sparse:
        q = _q(k[2], (n_q, h, 576))
        topk_idx = jax.random.randint(k[3], (n_q, s.topk), 0, s.records, jnp.int32)
        idx, indptr = jsm.dense_to_csr(topk_idx)
        yield Case(
            op="sparse_mla",
            name=f"n_q={n_q} H={h} topk={s.topk}",
            params={"n_q": n_q, "H": h, "topk": s.topk, "records": s.records},
            fn=functools.partial(jsm.sparse_mla, sm_scale=sm_scale, return_lse=True),
            args=(q, records, idx, indptr),
            nbytes=n_q * s.topk * RECORD_BYTES + q.nbytes + n_q * h * (512 * 2 + 4),
            flops=2 * n_q * h * s.topk * (576 + 512),
            flashmla={"q": q, "kv": records, "topk_idx": topk_idx, "sm_scale": sm_scale},
        )


def mla_decode_cases(key, s: Shapes) -> Iterator[Case]:
    k = jax.random.split(key, 3)
    for b in s.decode_batches:
        for seq in s.decode_seqs:
            tokens = b * seq
            cache = _fp8_codes(k[0], (tokens, 576))
            pages = jax.random.permutation(k[1], tokens // PAGE)  # pages in random order
            kv_indices = (pages[:, None] * PAGE + jnp.arange(PAGE)).reshape(-1).astype(jnp.int32)
            kv_indptr = jnp.arange(b + 1, dtype=jnp.int32) * seq
            for heads, qlen in itertools.product(s.decode_heads, s.decode_qlens):
                q = _q(k[2], (b * qlen, heads, 576))
                yield Case(
                    op="mla_decode",
                    name=f"B={b} seq={seq} qlen={qlen} H={heads}",
                    params={"B": b, "seq": seq, "qlen": qlen, "H": heads},
                    fn=functools.partial(
                        jsm.mla_decode,
                        qlen=qlen,
                        k_scale=DECODE_K_SCALE,
                        v_scale=DECODE_V_SCALE,
                        return_lse=True,
                    ),
                    args=(q, cache, kv_indices, kv_indptr),
                    nbytes=tokens * 576
                    + kv_indices.nbytes
                    + q.nbytes
                    + q.shape[0] * heads * (512 * 2 + 4),
                    flops=2 * b * qlen * heads * seq * (576 + 512),
                )
            del cache


def ultraquant_cases(key, s: Shapes) -> Iterator[Case]:
    k = jax.random.split(key, 4)
    seq, hk, g = s.uq_seq, s.uq_kv_heads, s.uq_group
    for b in s.uq_batches:
        blocks = b * seq // PAGE
        pool = min(blocks, s.uq_pool_blocks)  # random blocks, tiled: random bits are slow to make
        codes = jax.random.bits(k[0], (pool, PAGE, hk, 2, 128), jnp.uint8)
        scales = jax.random.randint(k[1], (pool, PAGE, hk, 2, 8), 120, 131).astype(jnp.uint8)
        cache = jnp.concatenate([codes, scales], axis=-1).reshape(pool, PAGE, hk, 272)
        cache = jnp.tile(cache, (-(-blocks // pool), 1, 1, 1))[:blocks]
        del codes, scales
        tables = jax.random.permutation(k[2], blocks).reshape(b, -1).astype(jnp.int32)
        seq_lens = jnp.full((b,), seq, jnp.int32)
        q = _q(k[3], (b, hk * g, 256))
        yield Case(
            op="ultraquant_decode",
            name=f"B={b} seq={seq} Hk={hk} G={g}",
            params={"B": b, "seq": seq, "Hk": hk, "G": g},
            fn=jsm.ultraquant_decode,
            args=(q, cache, tables, seq_lens),
            nbytes=b * seq * hk * 272 + tables.nbytes + 2 * q.nbytes,
            flops=2 * b * hk * g * seq * 512,
        )
        del cache


CASES = {
    "sparse_mla": sparse_mla_cases,
    "mla_decode": mla_decode_cases,
    "ultraquant_decode": ultraquant_cases,
}


# ---------------------------------------------------------------------------------------------
# Which implementations
# ---------------------------------------------------------------------------------------------


def table_implementations(op: str) -> list[str]:
    """The names in the op's implementation table (``implementation=None`` left out)."""
    table = importlib.import_module(OP_MODULES[op])._IMPLEMENTATIONS
    return [name for name in table if name is not None]


def machine_platforms() -> set[str]:
    """{"cpu"} plus "cuda", "rocm" and "gfx950" where jax has such devices."""
    return {"cpu", *gpu_platforms()}


def runs_natively(name: str, platforms: set[str]) -> bool:
    if "emulation" in name or "interpret" in name:
        return False
    where = NATIVE_ON.get(name, {"cuda", "rocm"})
    return where is None or bool(where & platforms)


def implementations_for(op: str, requested: list[str] | None, platforms: set[str]) -> list[str]:
    table = table_implementations(op)
    if requested is None:
        return [name for name in table if runs_natively(name, platforms)]
    if requested == ["all"]:
        return table
    return [name for name in requested if name in table]


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class JaxFlush:
    """Reads and writes a buffer larger than L2 (``b + 1``, donated) before each timed call."""

    def __init__(self, mib: int):
        self.buf = jnp.zeros((mib * 2**20 // 4,), jnp.uint32)

        def l2_flush_buffer(b):
            return b + 1

        self.fn = jax.jit(l2_flush_buffer, donate_argnums=0)
        self.run()
        self.sync()

    def run(self):
        self.buf = self.fn(self.buf)

    def sync(self):
        jax.block_until_ready(self.buf)


class TorchFlush:
    def __init__(self, torch, mib: int, device):
        self.torch = torch
        self.buf = torch.zeros((mib * 2**20 // 4,), dtype=torch.int32, device=device)
        self.is_cuda = self.buf.is_cuda

    def run(self):
        self.buf.add_(1)

    def sync(self):
        if self.is_cuda:
            self.torch.cuda.synchronize()


def _batch(launch: Callable, sync: Callable, calls: int, flush=None) -> float:
    """Wall seconds of ``calls`` back-to-back launches (each after a flush when given)."""
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        if flush is not None:
            flush.run()
        out = launch()
    sync(out)
    if flush is not None:
        flush.sync()
    return time.perf_counter() - t0


def _flushes(flush, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        flush.run()
    flush.sync()
    return time.perf_counter() - t0


def sample_times(
    launch: Callable, sync: Callable, *, samples: int, sample_s: float, flush=None
) -> tuple[list[float], int]:
    """Seconds per call, one value per sample, and the calls per sample. ``launch()`` enqueues
    one call and returns its output; ``sync(out)`` waits for it. Warms up (compiles) first."""
    sync(launch())
    one = _batch(launch, sync, 1, flush)
    calls = max(1, min(MAX_CALLS, int(sample_s / max(one, 1e-7))))
    times = []
    for _ in range(samples):
        t = _batch(launch, sync, calls, flush)
        if flush is not None:
            t -= _flushes(flush, calls)
        times.append(t / calls)
    return times, calls


def spread(times: list[float]) -> dict:
    a = np.asarray(times, np.float64)
    p = np.percentile(a, [10, 25, 50, 75, 90])
    return {
        "median_s": float(p[2]),
        "min_s": float(a.min()),
        "p10_s": float(p[0]),
        "p25_s": float(p[1]),
        "p75_s": float(p[3]),
        "p90_s": float(p[4]),
        "max_s": float(a.max()),
    }


def _profile(run: Callable[[], object]):
    """What ``run()`` did, as a ``jax.profiler.ProfileData`` trace, or None where the profiler
    wrote none."""
    with tempfile.TemporaryDirectory(prefix="bench_profile_") as tmp:
        with jax.profiler.trace(tmp):
            run()
        files = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        return jax.profiler.ProfileData.from_file(files[0]) if files else None


def profile_device_times(
    launch: Callable, sync: Callable, module_name: str | None, calls: int, flush
):
    """Per-call execution seconds from a ``jax.profiler`` trace of ``calls`` calls of the XLA
    module ``module_name``, or (None) of calls that launch kernels outside XLA (FlashMLA's
    PyTorch calls; the kernels of a flush-only trace are left out). Returns ({"method",
    "plane", "times", "kernels"} or None, why none); see ``times_from_profile``."""
    data = _profile(lambda: _batch(launch, sync, calls, flush))
    if data is None:
        return None, "jax.profiler wrote no .xplane.pb"
    skip: frozenset = frozenset()
    if module_name is None and flush is not None:
        flushes = _profile(lambda: _flushes(flush, calls))
        if flushes is not None:
            skip = frozenset(ev.name for _, ev, _ in _module_events(flushes, None))
    found, why = times_from_profile(data, module_name, calls, skip)
    if found:
        found["kernels"] = kernels_per_call(data, module_name, calls, skip)
    return found, why


def profiler_summary(found: dict | None, why: str) -> dict:
    """A row's "profiler" entry from ``profile_device_times``'s result."""
    if not found:
        return {"error": why}
    keep = ("method", "plane", "kernels")
    return {**spread(found["times"]), "values": len(found["times"])} | {k: found[k] for k in keep}


DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework Name Scope", "Framework Ops")


def _event_stats(ev) -> dict:
    try:
        return dict(ev.stats)
    except Exception:  # a stat the binding cannot convert
        return {}


def _planes(data, host: bool = True) -> list:
    """The trace's device planes, or (given ``host``) its host planes where it has none (the
    CPU backend)."""
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    return planes or [p for p in data.planes if host and p.name.startswith("/host:")]


def _module_events(
    data, module_name: str | None, skip: frozenset = frozenset()
) -> Iterator[tuple[str, object, dict]]:
    """(plane name, event, its stats) of each event tagged with the module (``_planes``; the
    derived lines, which repeat the kernels, left out); ``module_name`` None: each device
    event tagged with no XLA module (what other libraries launch), less those named in
    ``skip``."""
    for plane in _planes(data, host=module_name is not None):
        for line in plane.lines:
            if line.name in DERIVED_LINES:
                continue
            for ev in line.events:
                stats = _event_stats(ev)
                module = str(stats.get("hlo_module", ""))
                mine = not module if module_name is None else module_name in module
                if mine and ev.name not in skip:
                    yield plane.name, ev, stats


def kernels_per_call(
    data, module_name: str | None, calls: int, skip: frozenset = frozenset()
) -> list[dict]:
    """What one call of the module runs, from a trace of ``calls`` calls: per event (kernel)
    name, its count per call and median duration in seconds ({"name", "per_call",
    "median_s"}), the largest share of the call first. Tells a kernel's own time from that of
    the XLA ops around it."""
    durations: dict[str, list[float]] = {}
    for _, ev, _ in _module_events(data, module_name, skip):
        durations.setdefault(ev.name, []).append(ev.duration_ns * 1e-9)
    kernels = [
        {"name": name, "per_call": len(d) / calls, "median_s": float(np.median(d))}
        for name, d in durations.items()
    ]
    return sorted(kernels, key=lambda k: -k["per_call"] * k["median_s"])


def busy_ns(events: list[tuple[int, int]]) -> int:
    """Nanoseconds in which at least one of ``events`` (start, duration) runs: the length of
    their union, so that kernels that overlap (a kernel launched early to wait on the one
    before it) count once."""
    total, reach = 0, -math.inf
    for start, duration in sorted(events):
        end = start + duration
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def times_from_profile(data, module_name: str | None, calls: int, skip: frozenset = frozenset()):
    """The device planes ("/device:..."; the host planes where there is none, as on the CPU
    backend, which runs the module on host threads): 1) "XLA Modules" events named
    ``module_name``, one per call; else 2) the events tagged ``hlo_module`` = the module: the
    span (first start to last end) of each ``run_id`` (one per call); else 3) those events in
    start order, cut into ``calls`` runs of equal length (every call of a jitted function
    launches the same kernels, one call after another): the time each run's events cover
    (``busy_ns``), the kernels' busy time per call; else 4) the time all of them cover
    (``busy_ns``) / calls.
    ``module_name`` None: 3) or 4) over the device events of no XLA module but those in
    ``skip`` (``_module_events``)."""
    for plane in _planes(data) if module_name is not None else []:
        for line in plane.lines:
            if line.name == "XLA Modules":
                times = [ev.duration_ns * 1e-9 for ev in line.events if module_name in ev.name]
                if times:
                    return {"method": "XLA Modules events", "plane": plane.name, "times": times}, ""
    runs: dict = {}
    events, where = [], ""  # (start, duration) of the module's events
    for plane, ev, stats in _module_events(data, module_name, skip):
        where = plane
        events.append((ev.start_ns, ev.duration_ns))
        if "run_id" in stats:
            span = runs.setdefault(stats["run_id"], [math.inf, -math.inf])
            span[0] = min(span[0], ev.start_ns)
            span[1] = max(span[1], ev.start_ns + ev.duration_ns)
    if runs:
        times = [(end - begin) * 1e-9 for begin, end in runs.values()]
        return {"method": "span of each run_id's events", "plane": where, "times": times}, ""
    if events and len(events) % calls == 0:
        per_call = len(events) // calls
        ordered = sorted(events)
        times = [busy_ns(ordered[i : i + per_call]) * 1e-9 for i in range(0, len(events), per_call)]
        method = f"busy time: {per_call} events per call, their union (in start order)"
        return {"method": method, "plane": where, "times": times}, ""
    if events:
        times = [busy_ns(sorted(events)) * 1e-9 / calls]
        return {
            "method": f"busy time of {len(events)} events (their union) / {calls} calls",
            "plane": where,
            "times": times,
        }, ""
    names = ", ".join(p.name for p in data.planes) or "none"
    what = f"module {module_name}" if module_name is not None else "a device outside XLA"
    return None, f"no event of {what} in the trace (planes: {names})"


# ---------------------------------------------------------------------------------------------
# FlashMLA
# ---------------------------------------------------------------------------------------------


def import_peer(module: str, label: str) -> tuple[tuple | None, str]:
    """((the peer's module, torch), "") or (None, why they cannot be imported)."""
    try:
        peer = importlib.import_module(module)
        import torch
    except Exception as e:  # ImportError, or a library that fails to load
        return None, f"{label} not importable: {type(e).__name__}: {e}"
    return (peer, torch), ""


class FlashMLA:
    """FlashMLA's sparse fp8 decode on a sparse_mla case's own arrays (DLPack, no copy)."""

    def __init__(self, module, torch):
        self.mla = module
        self.torch = torch

    @classmethod
    def load(cls) -> tuple[FlashMLA | None, str]:
        modules, why = import_peer("flash_mla", "FlashMLA")
        return (None, why) if modules is None else (cls(*modules), "")

    def version(self) -> str:
        return str(getattr(self.mla, "__version__", "?"))

    def unsupported(self, case: Case) -> str | None:
        """Why FlashMLA has no kernel for ``case``, or None."""
        return None if case.flashmla is not None else f"no FlashMLA kernel for {case.op}"

    def prepare_case(self, case: Case):
        data = case.flashmla
        return self.prepare(data["q"], data["kv"], data["topk_idx"], data["sm_scale"])

    def prepare(self, q, kv, topk_idx, sm_scale: float):
        """(launch, sync, outputs(result) -> (out [n_q, H, 512], lse [n_q, H]), note)."""
        torch = self.torch
        from_dlpack = torch.utils.dlpack.from_dlpack
        jax.block_until_ready((q, kv, topk_idx))
        n_q, h, d = q.shape
        heads = next((n for n in FLASHMLA_HEADS if h <= n), None)
        if heads is None:
            raise ValueError(f"FlashMLA takes at most {FLASHMLA_HEADS[-1]} query heads, not {h}")
        tq = from_dlpack(q)
        note = ""
        if heads != h:
            padded = torch.zeros((n_q, heads, d), dtype=tq.dtype, device=tq.device)
            padded[:, :h] = tq
            tq = padded
            note = f"q padded {h} -> {heads} heads (FlashMLA: 64 or 128)"
        tq = tq.reshape(n_q, 1, heads, d)
        records = from_dlpack(kv.reshape(-1, RECORD_BYTES))
        rows = records.shape[0]
        block = next(b for b in (64, 32, 16, 8, 4, 2, 1) if rows % b == 0)
        cache = records.view(rows // block, block, 1, RECORD_BYTES)  # block * size + slot = row
        indices = from_dlpack(topk_idx).reshape(n_q, 1, topk_idx.shape[1])
        meta, _ = self.mla.get_mla_metadata()
        mla = self.mla

        def launch():
            return mla.flash_mla_with_kvcache(
                tq,
                cache,
                None,  # block_table: unused with indices
                None,  # cache_seqlens: unused with indices
                512,  # head_dim_v
                meta,
                None,  # num_splits: must be None
                softmax_scale=sm_scale,
                causal=False,
                is_fp8_kvcache=True,
                indices=indices,
            )

        def sync(_):
            if tq.is_cuda:
                torch.cuda.synchronize()

        def outputs(result):
            out, lse = result  # [n_q, 1, heads, 512] bf16, [n_q, heads, 1] f32
            return out[:, 0, :h], lse[:, :h, 0]

        return launch, sync, outputs, note


class Aiter:
    """AMD aiter's kernels on a case's own arrays (DLPack, no copy), where aiter has one for the
    op: ``mla_decode`` at qlen 1 runs aiter's gluon MLA decode (``mla_decode_gluon``, gfx950;
    its interface as ``aiter/ops/triton/gluon/README.md`` documents it, 2026) over the same fp8
    rows, indices and indptr. aiter's sparse MLA and UltraQuant decodes are not wired: their
    interfaces and cache layouts were not verified against ours, so those peer columns are
    absent."""

    def __init__(self, module, torch, gluon_mla=None, gluon_why: str = ""):
        self.aiter = module
        self.torch = torch
        self.gluon_mla = gluon_mla
        self.gluon_why = gluon_why

    @classmethod
    def load(cls) -> tuple[Aiter | None, str]:
        modules, why = import_peer("aiter", "aiter")
        if modules is None:
            return None, why
        aiter, torch = modules
        try:
            from aiter.ops.triton.gluon.mla_decode_gluon import mla_decode_gluon
        except Exception as e:
            return cls(aiter, torch, None, f"no mla_decode_gluon: {type(e).__name__}: {e}"), ""
        return cls(aiter, torch, mla_decode_gluon), ""

    def version(self) -> str:
        return str(getattr(self.aiter, "__version__", "?"))

    def unsupported(self, case: Case) -> str | None:
        """Why aiter has no kernel wired for ``case`` here, or None."""
        if case.op != "mla_decode":
            return f"no aiter kernel wired for {case.op}"
        if self.gluon_mla is None:
            return self.gluon_why
        if case.params["qlen"] != 1:
            return "aiter's gluon MLA decode is wired for qlen 1 only"
        return None

    def prepare_case(self, case: Case):
        """(launch, sync, outputs(result) -> (out [B, H, 512], lse [B, H]), note) of aiter's
        gluon MLA decode on an ``mla_decode`` case (qlen 1)."""
        torch = self.torch
        from_dlpack = torch.utils.dlpack.from_dlpack
        jax.block_until_ready(case.args)
        q, cache, kv_indices, kv_indptr = (from_dlpack(a) for a in case.args)
        kv = cache.view(torch.float8_e4m3fn)  # [tokens, 576] e4m3fn codes
        batch, heads, _ = q.shape
        o = torch.empty((batch, heads, 512), dtype=torch.bfloat16, device=q.device)
        mla = self.gluon_mla

        def launch():
            return mla(
                q_nope=q[..., :512],
                q_pe=q[..., 512:],
                kv_c=kv,
                o=o,
                page_table=kv_indices,  # 1-D view: kv_indices / kv_indptr
                seq_info=kv_indptr,
                sm_scale=576**-0.5,
                kv_pe_offset=512,
                use_2d_view=False,
                kv_scale=DECODE_K_SCALE,
                return_lse=True,
            )

        def sync(_):
            if q.is_cuda:
                torch.cuda.synchronize()

        def outputs(result):
            out, lse = result
            return out.float() * DECODE_V_SCALE, lse

        note = "kv_scale = k_scale (scores); its output times v_scale outside the timed call"
        return launch, sync, outputs, note


def _torch_max_abs_diff(torch, a, b) -> float:
    """max |a - b| over arrays of the same shape (jax or torch), NaN when either has a NaN."""
    from_dlpack = torch.utils.dlpack.from_dlpack
    a = a if isinstance(a, torch.Tensor) else from_dlpack(a)
    b = b if isinstance(b, torch.Tensor) else from_dlpack(b)
    a, b = a.float(), b.to(a.device).float()
    diff = (a - b).abs()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a == b)  # lse -inf of an empty row on both
    diff = torch.where(both_inf, torch.zeros_like(diff), diff)
    return float(diff.max().item()) if diff.numel() else 0.0


def _jax_max_abs_diff(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    diff = jnp.abs(a - b)
    diff = jnp.where(jnp.isinf(a) & (a == b), 0.0, diff)
    return float(jnp.max(diff)) if diff.size else 0.0


def _out_lse(result):
    """(out, lse or None) of an op's result."""
    if isinstance(result, tuple):
        return result[0], (result[1] if len(result) > 1 else None)
    return result, None


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def _run(cmd: list[str], cwd=None) -> tuple[str | None, str]:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"
    if done.returncode != 0:
        return None, (done.stderr or done.stdout).strip()[:300]
    return done.stdout.strip(), ""


def gpu_info() -> dict:
    """The GPUs as nvidia-smi (name, driver, memory, clocks per GPU) or else rocm-smi (its
    JSON: product name, driver version) reports them; both None and why where neither runs."""
    fields = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem"
    out, err = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"])
    if out is not None:
        gpus = []
        for line in out.splitlines():
            values = [v.strip() for v in line.split(",")]
            gpus.append(dict(zip(fields.split(","), values, strict=False)))
        return {"nvidia_smi": gpus, "rocm_smi": None, "error": ""}
    rocm, rocm_err = _run(["rocm-smi", "--showproductname", "--showdriverversion", "--json"])
    if rocm is not None:
        try:
            parsed = json.loads(rocm)
        except ValueError:
            parsed = {"text": rocm}
        return {"nvidia_smi": None, "rocm_smi": parsed, "error": ""}
    return {
        "nvidia_smi": None,
        "rocm_smi": None,
        "error": f"nvidia-smi: {err}; rocm-smi: {rocm_err}",
    }


def gpu_driver(gpu: dict) -> str:
    """The driver version ``gpu_info`` found, for the header line."""
    if gpu["nvidia_smi"]:
        return gpu["nvidia_smi"][0].get("driver_version", "n/a")
    versions = [
        v
        for card in (gpu["rocm_smi"] or {}).values()
        if isinstance(card, dict)
        for k, v in card.items()
        if "driver" in k.lower()
    ]
    return str(versions[0]) if versions else "n/a"


def source_sha256() -> str:
    """sha256 of the package's Python sources (paths and bytes, sorted): identifies the code
    that ran where the checkout's git metadata is missing or stale (a copied work tree)."""
    digest = hashlib.sha256()
    package = Path(jsm.__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def git_info() -> dict:
    """HEAD, whether the work tree differs from it, and ``source_sha256`` (compare it with
    the same function run on a checkout to find the commit)."""
    sources = source_sha256()
    head, err = _run(["git", "rev-parse", "HEAD"], cwd=REPO)
    if head is None:
        return {"head": None, "dirty": None, "source_sha256": sources, "error": err}
    status, _ = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO)
    dirty = bool(status) if status is not None else None
    return {"head": head, "dirty": dirty, "source_sha256": sources, "error": ""}


def plugin_versions() -> dict:
    """Installed jax backend plugins (jax-cuda*-plugin / -pjrt, jax-rocm*-...) and versions."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(("jax-cuda", "jax-rocm", "jax-tpu", "libtpu")):
            found[name] = dist.version
    return dict(sorted(found.items()))


def environment(
    flashmla: FlashMLA | None, flashmla_status: str, aiter: Aiter | None, aiter_status: str
) -> dict:
    devices = jax.devices()
    backend = {"name": jax.default_backend()}
    try:
        backend["platform_version"] = devices[0].client.platform_version
    except Exception as e:  # the attribute moved between jax versions
        backend["platform_version"] = f"unknown ({type(e).__name__})"
    env = {
        "python": sys.version.split()[0],
        "python_full": sys.version,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "jax_plugins": plugin_versions(),
        "jax_sparse_mla": jsm.__version__,
        "numpy": np.__version__,
        "backend": backend,
        "devices": [{"platform": d.platform, "kind": d.device_kind, "id": d.id} for d in devices],
        "gpu": gpu_info(),
        "git": git_info(),
        "flashmla": flashmla_status or "loaded",
        "aiter": aiter_status or "loaded",
    }
    if flashmla is not None:
        env["torch"] = flashmla.torch.__version__
        env["torch_cuda"] = flashmla.torch.version.cuda
        env["flash_mla"] = flashmla.version()
        env["flash_mla_file"] = getattr(flashmla.mla, "__file__", None)
    if aiter is not None:
        env["torch"] = aiter.torch.__version__
        env["torch_hip"] = getattr(aiter.torch.version, "hip", None)
        env["aiter_version"] = aiter.version()
        env["aiter_gluon_mla"] = aiter.gluon_why or "loaded"
    return env


# ---------------------------------------------------------------------------------------------
# Rows and the table
# ---------------------------------------------------------------------------------------------


COLUMNS = (
    "| op | case | impl | median us | min us | p10 us | p90 us | max us | TB/s | % copy | "
    "TFLOP/s | device us | max abs diff | note |"
)


def _us(seconds) -> str:
    return "" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e6:.1f}"


def markdown_row(row: dict) -> str:
    if row.get("error"):
        cells = [row["op"], row["case"], row["implementation"], *[""] * 10, row["error"][:200]]
        return "| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |"
    prof = row.get("profiler") or {}
    diff = row.get("max_abs_diff")
    cells = [
        row["op"],
        row["case"],
        row["implementation"],
        _us(row["median_s"]),
        _us(row["min_s"]),
        _us(row["p10_s"]),
        _us(row["p90_s"]),
        _us(row["max_s"]),
        f"{row['bandwidth_Bps'] / 1e12:.3g}",
        f"{row['pct_copy']:.0f}%",
        f"{row['tflops']:.3g}",
        _us(prof.get("median_s")),
        "" if diff is None else f"{diff:.3g} vs {row['diff_vs']}",
        row.get("note", ""),
    ]
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def kernels_table(rows: list[dict], top: int = 6) -> str:
    """One line per profiled row: its ``top`` kernels by share of a call (``kernels_per_call``),
    each as name, median us and, past one, the count per call."""
    lines = ["kernels of one call (jax.profiler; median us, x count per call past one):"]
    for row in rows:
        kernels = (row.get("profiler") or {}).get("kernels")
        if not kernels:
            continue
        cells = [
            f"{k['name'][:48]} {_us(k['median_s'])}"
            + (f" x{k['per_call']:g}" if k["per_call"] != 1 else "")
            for k in kernels[:top]
        ]
        more = f", {len(kernels) - top} more" if len(kernels) > top else ""
        name = f"{row['op']} {row['case']} {row['implementation']}"
        lines.append(f"- {name}: {', '.join(cells)}{more}")
    return "\n".join(lines)


def _row_key(case: Case, impl: str, source: str) -> dict:
    return {
        "op": case.op,
        "case": case.name,
        "params": case.params,
        "implementation": impl,
        "source": source,
    }


def make_row(case: Case, impl: str, source: str, times, calls, copy_bps: float, **extra) -> dict:
    stats = spread(times)
    median = stats["median_s"]
    bps = case.nbytes / median if median > 0 else float("nan")
    return {
        **_row_key(case, impl, source),
        "calls_per_sample": calls,
        "samples": len(times),
        "samples_s": times,
        **stats,
        "bytes": case.nbytes,
        "flops": case.flops,
        "bandwidth_Bps": bps,
        "pct_copy": 100 * bps / copy_bps,
        "tflops": case.flops / median / 1e12 if median > 0 else float("nan"),
        "profiler": None,
        "max_abs_diff": None,
        "lse_max_abs_diff": None,
        "diff_vs": None,
        "note": "",
        "error": "",
        **extra,
    }


def error_row(case: Case, impl: str, source: str, error: BaseException) -> dict:
    return {**_row_key(case, impl, source), "error": f"{type(error).__name__}: {error}".strip()}


def _module_name(op: str, impl: str) -> str:
    return "bench_" + "".join(c if c.isalnum() else "_" for c in f"{op}_{impl}")


def jitted(case: Case, impl: str) -> Callable:
    fn = functools.partial(case.fn, implementation=impl)

    def call(*args):
        return fn(*args)

    call.__name__ = call.__qualname__ = _module_name(case.op, impl)
    return jax.jit(call)


def bench_case(case: Case, impls: list[str], ctx: dict) -> list[dict]:
    args = ctx["args"]
    rows = []
    reference = None  # (impl, out, lse)
    order = sorted(impls, key=lambda name: name != "xla")  # "xla" first: the reference
    for impl in order:
        try:
            f = jitted(case, impl)
            result = f(*case.args)
            jax.block_until_ready(result)
            out, lse = _out_lse(result)
            del result

            def launch(f=f):
                return f(*case.args)

            times, calls = sample_times(
                launch,
                jax.block_until_ready,
                samples=args.samples,
                sample_s=args.sample_ms / 1e3,
                flush=ctx["jax_flush"],
            )
            row = make_row(case, impl, "jax_sparse_mla", times, calls, ctx["copy_bps"])
            if reference is None:
                reference = (impl, out, lse)
            else:
                row["diff_vs"] = reference[0]
                row["max_abs_diff"] = _jax_max_abs_diff(out, reference[1])
                if lse is not None and reference[2] is not None:
                    row["lse_max_abs_diff"] = _jax_max_abs_diff(lse, reference[2])
            if args.profiler:
                found, why = profile_device_times(
                    launch,
                    jax.block_until_ready,
                    _module_name(case.op, impl),
                    max(args.samples, 20),
                    ctx["jax_flush"],
                )
                row["profiler"] = profiler_summary(found, why)
        except Exception as e:  # one implementation failing must not stop the run
            row = error_row(case, impl, "jax_sparse_mla", e)
        rows.append(row)
        print(markdown_row(row), flush=True)
    for name, peer in peer_calls(case, ctx):
        row = bench_peer(case, reference, ctx, name, peer)
        rows.append(row)
        print(markdown_row(row), flush=True)
    return rows


def peer_calls(case: Case, ctx: dict) -> list[tuple[str, FlashMLA | Aiter]]:
    """(name, peer) of each loaded peer (``PEERS``) with a kernel for ``case``; why each other
    peer is absent goes to ``ctx["absent"][(op, case name)]`` (the side-by-side table)."""
    status = ctx.get("peer_status", {})
    calls, absent = [], {}
    for name in PEERS:
        peer = ctx.get(name)
        why = status.get(name, "off") if peer is None else peer.unsupported(case)
        if why:
            absent[name] = why
        else:
            calls.append((name, peer))
    ctx.setdefault("absent", {})[(case.op, case.name)] = absent
    return calls


def bench_peer(case: Case, reference, ctx: dict, name: str, peer: FlashMLA | Aiter) -> dict:
    """A row for a peer library's kernel (``peer.torch`` is its torch) on the case's arrays,
    timed as ours are, its outputs compared with the reference implementation's."""
    args = ctx["args"]
    try:
        launch, sync, outputs, note = peer.prepare_case(case)
        result = launch()
        sync(result)
        out, lse = outputs(result)
        flush = ctx["torch_flush"](peer)
        times, calls = sample_times(
            launch, sync, samples=args.samples, sample_s=args.sample_ms / 1e3, flush=flush
        )
        row = make_row(case, name, name, times, calls, ctx["copy_bps"], note=note)
        if args.profiler:
            found, why = profile_device_times(launch, sync, None, max(args.samples, 20), flush)
            row["profiler"] = profiler_summary(found, why)
        if reference is not None:
            row["diff_vs"] = reference[0]
            row["max_abs_diff"] = _torch_max_abs_diff(peer.torch, out, reference[1])
            if reference[2] is not None:
                row["lse_max_abs_diff"] = _torch_max_abs_diff(peer.torch, lse, reference[2])
        return row
    except Exception as e:
        return error_row(case, name, name, e)


def side_by_side(rows: list[dict], absent: dict) -> list[dict]:
    """Per case: ours (the fastest of our implementations other than "xla", else "xla") and
    each peer's median time and its ratio to ours, or why the peer is absent."""
    table: dict = {}
    for row in rows:
        table.setdefault((row["op"], row["case"]), []).append(row)
    found = []
    for (op, case), group in table.items():
        ok = [r for r in group if not r.get("error")]
        mine = [r for r in ok if r["source"] == "jax_sparse_mla"]
        best = min(
            [r for r in mine if r["implementation"] != "xla"] or mine,
            key=lambda r: r["median_s"],
            default=None,
        )
        entry = {
            "op": op,
            "case": case,
            "ours": best and best["implementation"],
            "ours_s": best and best["median_s"],
        }
        for peer in PEERS:
            row = next((r for r in group if r["source"] == peer), None)
            if row is None:
                entry[peer] = {"absent": absent.get((op, case), {}).get(peer, "not run")}
            elif row.get("error"):
                entry[peer] = {"error": row["error"]}
            else:
                ratio = row["median_s"] / best["median_s"] if best else None
                entry[peer] = {"median_s": row["median_s"], "vs_ours": ratio}
        found.append(entry)
    return found


def side_by_side_table(entries: list[dict]) -> str:
    """``side_by_side`` as markdown: a peer's cell is its median us and its time / ours."""

    def cell(p: dict) -> str:
        if "median_s" in p:
            ratio = f" ({p['vs_ours']:.2f}x ours)" if p["vs_ours"] else ""
            return f"{_us(p['median_s'])}{ratio}"
        if "error" in p:
            return f"failed: {p['error'][:80]}"
        return f"absent: {p['absent'][:80]}"

    lines = [
        "side by side (median us of back-to-back calls):",
        "| op | case | ours | ours us | " + " | ".join(f"{p} us" for p in PEERS) + " |",
        "| --- | --- | --- | ---: |" + " --- |" * len(PEERS),
    ]
    for e in entries:
        cells = [e["op"], e["case"], e["ours"] or "", _us(e["ours_s"])]
        cells += [cell(e[p]) for p in PEERS]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def copy_bandwidth(mib: int, samples: int, sample_s: float) -> float:
    """Bytes per second of ``a + 1`` over a ``mib`` MiB buffer (read + write)."""
    x = jnp.zeros((mib * 2**20 // 4,), jnp.uint32) + 1

    def copy_bandwidth_probe(a):
        return a + 1

    f = jax.jit(copy_bandwidth_probe)
    times, _ = sample_times(lambda: f(x), jax.block_until_ready, samples=samples, sample_s=sample_s)
    return 2 * x.nbytes / spread(times)["median_s"]


def dispatch_floor(samples: int, sample_s: float) -> float:
    """Seconds per call of a jitted ``x + 1`` on a [16, 512] bf16 array (one tiny kernel),
    timed as the cases are: the host's cost of one jitted call."""
    x = jnp.ones((16, 512), jnp.bfloat16)

    def dispatch_floor_probe(a):
        return a + 1

    f = jax.jit(dispatch_floor_probe)
    times, _ = sample_times(lambda: f(x), jax.block_until_ready, samples=samples, sample_s=sample_s)
    return spread(times)["median_s"]


def _positive_ints(text: str, sep: str = ",") -> tuple[int, ...] | None:
    """``text`` as positive integers split at ``sep``, or None where it is not that."""
    try:
        values = tuple(int(v) for v in text.split(sep) if v)
    except ValueError:
        return None
    return values if values and min(values) >= 1 else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    p.add_argument(
        "--implementations",
        default=None,
        help="comma list, or 'all' (default: every implementation native to this machine)",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--samples", type=int, default=None, help="samples per row (>= 10; 20)")
    p.add_argument("--sample-ms", type=float, default=None, help="ms per sample (50; quick 2)")
    p.add_argument("--l2-flush", action="store_true", help="flush L2 before every call")
    p.add_argument("--l2-flush-mib", type=int, default=None, help="flush buffer (256; quick 16)")
    p.add_argument("--profiler", action="store_true", help="also jax.profiler device times")
    p.add_argument("--no-flashmla", action="store_true", help="skip FlashMLA even if importable")
    p.add_argument("--no-aiter", action="store_true", help="skip aiter even if importable")
    p.add_argument("--json", default=None, help="write the environment and rows here")
    p.add_argument("--decode-heads", default=None, help="comma list of mla_decode head counts (12)")
    p.add_argument(
        "--batches",
        default=None,
        help="comma list of mla_decode and ultraquant_decode batch sizes (1,32,128)",
    )
    p.add_argument("--sparse", default=None, help="comma list of sparse_mla cases n_qxH (all)")
    args = p.parse_args(argv)
    args.samples = args.samples if args.samples is not None else (10 if args.quick else 20)
    if args.samples < 10:
        p.error("--samples must be >= 10")
    if args.sample_ms is None:
        args.sample_ms = 2.0 if args.quick else 50.0
    if args.l2_flush_mib is None:
        args.l2_flush_mib = 16 if args.quick else 256
    args.ops = [op for op in args.ops.split(",") if op]
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {OPS}")
    if args.implementations is not None:
        args.implementations = [n for n in args.implementations.split(",") if n]
    for name, example in (("decode_heads", "12,128"), ("batches", "128")):
        if getattr(args, name) is not None:
            setattr(args, name, _positive_ints(getattr(args, name)))
            if getattr(args, name) is None:
                option = "--" + name.replace("_", "-")
                p.error(f"{option} must be a comma list of positive integers, e.g. {example}")
    if args.sparse is not None:
        pairs = [_positive_ints(case, "x") for case in args.sparse.split(",")]
        if not pairs or any(pair is None or len(pair) != 2 for pair in pairs):
            p.error("--sparse must be a comma list of n_qxH cases, e.g. 1x16,128x128")
        args.sparse = tuple(pairs)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    shapes = QUICK if args.quick else FULL
    if args.decode_heads is not None:
        shapes = dataclasses.replace(shapes, decode_heads=args.decode_heads)
    if args.sparse is not None:
        shapes = dataclasses.replace(shapes, sparse=args.sparse)
    if args.batches is not None:
        shapes = dataclasses.replace(shapes, decode_batches=args.batches, uq_batches=args.batches)
    platforms = machine_platforms()
    flashmla, flashmla_status = (None, "off (--no-flashmla)")
    if not args.no_flashmla:
        flashmla, flashmla_status = FlashMLA.load()
        if flashmla is None:
            print(flashmla_status)
    aiter, aiter_status = (None, "off (--no-aiter)")
    if not args.no_aiter:
        aiter, aiter_status = Aiter.load()
        print(aiter_status or f"aiter {aiter.version()} loaded ({aiter.gluon_why or 'gluon MLA'})")
    copy_bps = copy_bandwidth(shapes.copy_mib, args.samples, args.sample_ms / 1e3)
    floor_s = dispatch_floor(args.samples, args.sample_ms / 1e3)
    env = environment(flashmla, flashmla_status, aiter, aiter_status)
    dev = jax.devices()[0]
    print(
        f"device: {dev.device_kind} ({jax.default_backend()}); jax {jax.__version__}; "
        f"driver {gpu_driver(env['gpu'])}; copy {copy_bps / 1e12:.3f} TB/s "
        f"({shapes.copy_mib} MiB a + 1); dispatch floor {_us(floor_s)} us (jitted x + 1); "
        f"{args.samples} samples of ~{args.sample_ms} ms"
        + ("; L2 flushed before every call" if args.l2_flush else "")
    )
    print(f"times: {TIMING}")
    ctx = {
        "args": args,
        "copy_bps": copy_bps,
        "flashmla": flashmla,
        "aiter": aiter,
        "peer_status": {"flashmla": flashmla_status, "aiter": aiter_status},
        "jax_flush": JaxFlush(args.l2_flush_mib) if args.l2_flush else None,
        "torch_flush": (
            (lambda fm: TorchFlush(fm.torch, args.l2_flush_mib, _torch_device(fm)))
            if args.l2_flush
            else (lambda fm: None)
        ),
    }
    print(COLUMNS)
    print("|" + " --- |" * 3 + " ---: |" * 10 + " --- |", flush=True)
    rows = []
    key = jax.random.key(0)
    for op in args.ops:
        impls = implementations_for(op, args.implementations, platforms)
        missing = [n for n in (args.implementations or []) if n not in impls and n != "all"]
        if missing:
            print(f"({op} has no implementation {', '.join(missing)}: skipped)", flush=True)
        for case in CASES[op](key, shapes):
            rows += bench_case(case, impls, ctx)
    if args.profiler:
        print(kernels_table(rows))
        missing = [r for r in rows if (r.get("profiler") or {}).get("error")]
        if missing:
            why = missing[0]["profiler"]["error"]
            print(f"no device time for {len(missing)} rows (first: {why}): wall clock only")
    pairs = side_by_side(rows, ctx.get("absent", {}))
    print(side_by_side_table(pairs))
    report = {
        "schema": 1,
        "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "argv": list(sys.argv) if argv is None else list(argv),
        "environment": env,
        "settings": {
            "quick": args.quick,
            "ops": args.ops,
            "implementations": args.implementations or "native",
            "samples": args.samples,
            "sample_ms": args.sample_ms,
            "max_calls_per_sample": MAX_CALLS,
            "l2_flush": args.l2_flush,
            "l2_flush_mib": args.l2_flush_mib if args.l2_flush else None,
            "profiler": args.profiler,
            "timing": TIMING,
            "shapes": dataclasses.asdict(shapes),
        },
        "copy_bandwidth_Bps": copy_bps,
        "dispatch_floor_s": floor_s,
        "rows": rows,
        "side_by_side": pairs,
    }
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return report


def _torch_device(fm: FlashMLA):
    return "cuda" if fm.torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
