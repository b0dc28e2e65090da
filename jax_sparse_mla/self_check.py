"""Verify on first use: the gfx950 kernels run against their emulation on this machine's GPU
before ``implementation=None`` chooses them.

A kernel family (``FAMILIES``: sparse_mla; mla_decode = partials + combine; ultraquant =
partials + reduce) is checked the first time ``implementation=None`` would choose it on a gfx950
(MI355) ROCm device: a few small cases (masked indices, an empty row / request, qlen 1 and 2,
G 6 / 8 / 16, several splits and partitions) run with ``implementation="flydsl"`` and
``"gfx950_emulation"`` on the same inputs, and every output must lie within the kernel-vs-
emulation bound of the emulation module's docstring (``emulation/bounds.py``). The check runs
eagerly on concrete arrays, also when the first call is being traced by ``jax.jit``.

The verdict is kept for the process and on disk, per (device name, sha256 of the FFI library,
hash of this check's and the emulation's sources), under ``$JAX_SPARSE_MLA_SELFCHECK_CACHE``
(default ``$XDG_CACHE_HOME/jax_sparse_mla``, else ``~/.cache/jax_sparse_mla``; ``off``: keep
verdicts in memory only). A family that fails, or whose kernels the FFI library does not have,
runs "xla" instead, with one warning naming the kernel, the case and the error. An explicit
``implementation="flydsl"`` is never redirected. Lowering for ROCm on a host without ROCm
devices (nothing to check on) chooses the kernels unchecked.

``jax_sparse_mla.selfcheck()`` runs every family and prints the table of cases.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import _platform, ffi
from jax_sparse_mla.emulation import bounds as B
from jax_sparse_mla.formats import KV_DIM, UQ_HEAD_DIM, pack_fp8_ds_mla, ultraquant_store
from jax_sparse_mla.mla_decode import merge_attn_states, mla_decode_partials
from jax_sparse_mla.sparse_mla import sparse_mla
from jax_sparse_mla.ultraquant import ultraquant_decode

EMULATION = "gfx950_emulation"
CACHE_ENV = "JAX_SPARSE_MLA_SELFCHECK_CACHE"


class CaseResult(NamedTuple):
    kernel: str
    case: str
    ratio: float  # worst |kernel - emulation| / bound over the outputs (nan: did not run)
    error: str | None  # None when the case passed


class FamilyResult(NamedTuple):
    family: str
    device: str
    library: str  # sha256 of the FFI library ("none" without one)
    cases: tuple[CaseResult, ...]

    @property
    def passed(self) -> bool:
        return all(c.error is None for c in self.cases)


Check = Callable[[str], tuple[float, "str | None"]]  # implementation -> (ratio, error)


def _worst(*results: tuple[float, str | None]) -> tuple[float, str | None]:
    ratio = max((r for r, _ in results), key=lambda r: -1 if math.isnan(r) else r)
    return ratio, next((e for _, e in results if e is not None), None)


# ---------------------------------------------------------------------------------------------
# Cases: small deterministic inputs, the op run with `impl` and with the emulation
# ---------------------------------------------------------------------------------------------


def _bf16(r, shape, scale=1.0) -> jax.Array:
    return jnp.asarray(r.standard_normal(shape) * scale, jnp.bfloat16)


def _sparse(seed: int, heads: int, lengths: tuple[int, ...], impl: str):
    """Rows of ``lengths`` random entries into 64 records, a third of them masked (-1 or past
    the last record); row 1 all -1."""
    r, rows = np.random.default_rng(seed), 64
    latent = r.standard_normal((rows, 512)) * 2.0 ** r.integers(-3, 4, (rows, 1))
    kv = pack_fp8_ds_mla(
        jnp.asarray(latent, jnp.float32), jnp.asarray(r.standard_normal((rows, 64)), jnp.float32)
    )
    idx = [r.integers(-rows // 4, rows + rows // 4, n) for n in lengths]
    idx[1][:] = -1
    idx = jnp.asarray(np.concatenate(idx), jnp.int32)
    indptr = jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)
    q = _bf16(r, (len(lengths), heads, KV_DIM))
    sm_scale = KV_DIM**-0.5

    def run(implementation):
        fn = functools.partial(sparse_mla, sm_scale=sm_scale, return_lse=True)
        return jax.jit(functools.partial(fn, implementation=implementation))(q, kv, idx, indptr)

    out_k, lse_k = run(impl)
    out_e, lse_e = run(EMULATION)
    tol, lse_tol = B.sparse_mla_bound(q, kv, idx, indptr, sm_scale, out_e, lse_e)
    return _worst(B.compare("out", out_k, out_e, tol), B.compare("lse", lse_k, lse_e, lse_tol))


def _partials(seed: int, qlen: int, heads: int, seq_lens: tuple[int, ...], splits: int, impl):
    """Requests of ``seq_lens`` keys over 512 tokens, 5% of the indices -1 and 3% past the
    last token; causal over ``qlen`` positions; k_scale 0.5, v_scale 2."""
    r, tokens = np.random.default_rng(seed), 512
    kv = jnp.asarray(r.standard_normal((tokens, KV_DIM)) * 4, jnp.float8_e4m3fn).view(jnp.uint8)
    idx = r.integers(0, tokens, sum(seq_lens))
    idx[r.random(len(idx)) < 0.05] = -1
    idx[r.random(len(idx)) < 0.03] = tokens + 7
    idx, indptr = jnp.asarray(idx, jnp.int32), jnp.asarray(np.cumsum([0, *seq_lens]), jnp.int32)
    q = _bf16(r, (len(seq_lens) * qlen, heads, KV_DIM))
    static = dict(qlen=qlen, k_scale=0.5, v_scale=2.0, sm_scale=KV_DIM**-0.5)

    def run(implementation):
        fn = functools.partial(mla_decode_partials, **static, num_splits=splits)
        return jax.jit(functools.partial(fn, implementation=implementation))(q, kv, idx, indptr)

    o_k, lse_k = run(impl)
    o_e, lse_e = run(EMULATION)
    tol, lse_tol = B.mla_decode_partials_bound(q, kv, idx, indptr, **static, o_e=o_e, lse_e=lse_e)
    return _worst(B.compare("o", o_k, o_e, tol), B.compare("lse", lse_k, lse_e, lse_tol))


def _combine(seed: int, n: int, splits: int, heads: int, impl: str):
    """Random bf16 partials; 30% of them -inf with NaN / inf garbage in o; row 0 all -inf."""
    r = np.random.default_rng(seed)
    o = np.asarray(_bf16(r, (n, splits, heads, 512), 3.0), np.float32)
    lse = (r.standard_normal((n, splits, heads)) * 20).astype(np.float32)
    empty = r.random(lse.shape) < 0.3
    empty[0] = True
    lse[empty] = -np.inf
    o[empty] = np.nan
    o[..., 0][empty] = np.inf
    o, lse = jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse)

    def run(implementation):
        fn = functools.partial(merge_attn_states, return_lse=True, implementation=implementation)
        return jax.jit(fn)(o, lse)

    out_k, lse_k = run(impl)
    out_e, lse_e = run(EMULATION)
    tol, lse_tol = B.merge_bound(o, lse, out_e, lse_e)
    return _worst(B.compare("out", out_k, out_e, tol), B.compare("lse", lse_k, lse_e, lse_tol))


def _ultraquant(seed, g, hk, block_size, seq_lens, partitions, impl):
    """Requests of ``seq_lens`` tokens, 4 blocks each from a shuffled table with one entry -1
    and one past the last block; every slot written by ``ultraquant_store``."""
    r, batch, max_blocks = np.random.default_rng(seed), len(seq_lens), 4
    nb = batch * max_blocks + 2
    tokens = nb * block_size
    k, v = (jnp.asarray(r.standard_normal((tokens, hk, UQ_HEAD_DIM)), jnp.float32) for _ in "kv")
    cache = jnp.zeros((nb, block_size, hk, 272), jnp.uint8)
    cache = ultraquant_store(cache, k, v, jnp.arange(tokens, dtype=jnp.int32))
    tables = r.permutation(nb)[: batch * max_blocks].reshape(batch, max_blocks)
    tables[0, 1], tables[-1, 2] = -1, nb + 3
    tables, lens = jnp.asarray(tables, jnp.int32), jnp.asarray(seq_lens, jnp.int32)
    q = _bf16(r, (batch, hk * g, UQ_HEAD_DIM), 2.0)
    sm_scale = 1.0 / 16

    def run(implementation, cache):
        fn = functools.partial(
            ultraquant_decode,
            sm_scale=sm_scale,
            num_partitions=partitions,
            implementation=implementation,
        )
        return jax.jit(fn)(q, cache, tables, lens)

    out_k, out_e = run(impl, cache), run(EMULATION, cache)
    a_e = run(EMULATION, jnp.asarray(B.abs_v_cache(cache)))
    tol = B.ultraquant_bound(
        q, cache, tables, lens, sm_scale=sm_scale, num_partitions=partitions, out_e=out_e, a_e=a_e
    )
    return B.compare("out", out_k, out_e, tol)


class Family(NamedTuple):
    targets: tuple[str, ...]  # custom call targets whose kernels the family runs
    cases: tuple[tuple[str, str, Check], ...]  # (kernel, case, check)


P = functools.partial
FAMILIES = {
    "sparse_mla": Family(
        ("jsm_sparse_mla",),
        (
            ("sparse_mla", "H16, masked entries, an empty row, 2 tiles",
             P(_sparse, 1, 16, (0, 9, 200, 40))),
            ("sparse_mla", "H20 (two head groups)", P(_sparse, 2, 20, (33, 5, 130))),
        ),
    ),
    "mla_decode": Family(
        ("jsm_mla_decode_partials", "jsm_mla_decode_combine"),
        (
            ("mla_decode_partials", "qlen 1, 3 splits, masked indices, an empty request",
             P(_partials, 3, 1, 16, (0, 37, 300), 3)),
            ("mla_decode_partials", "qlen 2, 2 splits, H20, causal",
             P(_partials, 4, 2, 20, (5, 200), 2)),
            ("mla_decode_combine", "5 partials, -inf ones over NaN", P(_combine, 5, 4, 5, 8)),
        ),
    ),
    "ultraquant": Family(
        ("jsm_ultraquant_partials", "jsm_ultraquant_reduce"),
        (
            ("ultraquant_decode", "G6, block 16, 2 partitions, an empty request, masked blocks",
             P(_ultraquant, 6, 6, 1, 16, (0, 50, 21), 2)),
            ("ultraquant_decode", "G8, block 32, 1 partition, 2 KV heads",
             P(_ultraquant, 7, 8, 2, 32, (100, 3), 1)),
            ("ultraquant_decode", "G16, block 64, 3 partitions",
             P(_ultraquant, 8, 16, 1, 64, (256, 130), 3)),
        ),
    ),
}  # fmt: skip


def run_family(family: str, implementation: str = "flydsl", device: str = "") -> FamilyResult:
    """Runs ``family``'s cases with ``implementation`` against the emulation (eagerly)."""
    results = []
    for kernel, case, check in FAMILIES[family].cases:
        try:
            ratio, error = check(implementation)
        except Exception as e:  # a kernel that cannot run fails its case, with its error
            ratio, error = float("nan"), f"{type(e).__name__}: {str(e).strip()[:400]}"
        results.append(CaseResult(kernel, case, ratio, error))
    return FamilyResult(family, device, library_hash(), tuple(results))


# ---------------------------------------------------------------------------------------------
# Verdicts: in this process and on disk
# ---------------------------------------------------------------------------------------------


def library_hash() -> str:
    """sha256 of the FFI library file this process loads, "none" without one."""
    path = ffi.library_path()
    if path is None or not path.exists():
        return "none"
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def _sources_hash() -> str:
    """Of this module and the emulation: a change to the cases or bounds is a new check."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in [Path(__file__).resolve(), *sorted((here / "emulation").glob("*.py"))]:
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path | None:
    """Where verdicts are kept (module docstring); None: in memory only."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off") else Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jax_sparse_mla"


def cache_path(family: str, device: str, library: str) -> Path | None:
    where = cache_dir()
    if where is None:
        return None
    key = hashlib.sha256(f"{device}|{library}|{_sources_hash()}".encode()).hexdigest()[:24]
    return where / f"selfcheck-{family}-{key}.json"


def _key(result: FamilyResult) -> dict:
    return {
        "family": result.family,
        "device": result.device,
        "library_sha256": result.library,
        "check_sha256": _sources_hash(),
    }


def write_verdict(result: FamilyResult) -> None:
    path = cache_path(result.family, result.device, result.library)
    if path is None:
        return
    record = {**_key(result), "cases": [c._asdict() for c in result.cases]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(record, indent=1))
        os.replace(partial, path)
    except OSError as e:
        warnings.warn(
            f"jax_sparse_mla: cannot keep the self-check verdict in {path}: {e}", stacklevel=2
        )


def read_verdict(family: str, device: str, library: str) -> FamilyResult | None:
    path = cache_path(family, device, library)
    try:
        record = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    result = FamilyResult(family, device, library, ())
    if record is None or {k: record.get(k) for k in _key(result)} != _key(result):
        return None
    return result._replace(cases=tuple(CaseResult(**c) for c in record["cases"]))


def _missing_kernels(family: str, device: str) -> FamilyResult | None:
    """A failed result when the FFI library lacks one of ``family``'s kernels."""
    missing = ffi.missing_kernels(FAMILIES[family].targets)
    if not missing:
        return None
    error = (
        f"the FFI library has no {missing[0]} kernel ({len(ffi.library_kernels())} kernels "
        f"linked); build the kernels and relink: {ffi.BUILD_COMMAND}"
    )
    return FamilyResult(
        family, device, library_hash(), (CaseResult(missing[0], "-", math.nan, error),)
    )


def verdict(family: str, device: str) -> FamilyResult:
    """``family``'s result on ``device`` (a device name): missing kernels, else the disk
    cache, else the check itself, run now (eagerly, also inside a trace) and kept."""
    if (missing := _missing_kernels(family, device)) is not None:
        return missing
    if (kept := read_verdict(family, device, library_hash())) is not None:
        return kept
    with jax.ensure_compile_time_eval():
        result = run_family(family, "flydsl", device)
    write_verdict(result)
    return result


def failure_message(result: FamilyResult) -> str:
    bad = next(c for c in result.cases if c.error is not None)
    return (
        f"jax_sparse_mla: the gfx950 kernel {bad.kernel} failed its self-check on "
        f"{result.device} (case '{bad.case}': {bad.error}); implementation=None runs 'xla' for "
        f"{result.family} (jax_sparse_mla.selfcheck() prints every case)"
    )


_VERDICTS: dict[str, bool] = {}
_LOCK = threading.Lock()


def kernels_verified(family: str) -> bool:
    """Whether ``implementation=None`` may run ``family``'s kernels here: True without ROCm
    devices (lowering for another host), else the family's verdict on this GPU, decided once
    per process (a failure warns once)."""
    devices = _platform.rocm_devices()
    if not devices:
        return True
    with _LOCK:
        if family not in _VERDICTS:
            result = verdict(family, devices[0].device_kind)
            _VERDICTS[family] = result.passed
            if not result.passed:
                warnings.warn(failure_message(result), stacklevel=4)
        return _VERDICTS[family]


# ---------------------------------------------------------------------------------------------
# selfcheck(): every family, a table
# ---------------------------------------------------------------------------------------------


def format_table(results: dict[str, FamilyResult], implementation: str) -> str:
    rows = [("kernel", "case", "worst err/bound", "verdict")]
    for result in results.values():
        for c in result.cases:
            verdict_text = "pass" if c.error is None else f"FAIL: {c.error}"
            rows.append((c.kernel, c.case, f"{c.ratio:.3g}", verdict_text))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join([*(r[i].ljust(widths[i]) for i in range(3)), r[3]]) for r in rows]
    device = next(iter(results.values())).device if results else "?"
    passed = sum(r.passed for r in results.values())
    return "\n".join(
        [
            f"jax_sparse_mla self-check: {implementation} vs {EMULATION} on {device}",
            *lines,
            f"{passed} of {len(results)} kernel families passed",
        ]
    )


def selfcheck(implementation: str = "flydsl", *, file=None) -> dict[str, FamilyResult]:
    """Runs every kernel family's self-check cases and prints a table (kernel, case, worst
    |kernel - emulation| / bound, verdict) to ``file`` (default stdout).

    ``implementation="flydsl"`` (the default) needs a gfx950 (MI355) ROCm device; without one
    it prints what jax sees, runs nothing and returns {}. Its verdicts refresh the disk cache
    that ``implementation=None`` reads. Another implementation (e.g. "gfx950_emulation") runs
    the same cases and bounds on any device, as a check of the check.

    Returns:
      {family: FamilyResult} (``.passed``, ``.cases``: kernel, case, ratio, error).
    """
    out = sys.stdout if file is None else file
    if implementation == "flydsl":
        gfx950 = _platform.gfx950_devices()
        if not gfx950:
            print(
                "jax_sparse_mla self-check: no gfx950 (MI355) ROCm device, nothing was run; "
                f"jax sees: {_platform.devices_seen()}. The FlyDSL kernels need an MI355 with the "
                "ROCm jax plugin (pip install '.[rocm]', see README)",
                file=out,
            )
            return {}
        device = gfx950[0].device_kind
    else:
        device = jax.devices()[0].device_kind
    results = {}
    for family in FAMILIES:
        result = _missing_kernels(family, device) if implementation == "flydsl" else None
        if result is None:
            result = run_family(family, implementation, device)
            if implementation == "flydsl":
                write_verdict(result)
        results[family] = result
    print(format_table(results, implementation), file=out)
    return results
