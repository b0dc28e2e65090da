"""Ahead-of-time build of the FlyDSL kernels, and their resource report.

    python -m jax_sparse_mla.build --arch gfx950 [--out build/gfx950] [--jobs N] [--report] [--link]

Compiles every configuration (``CONFIGS``) of every kernel module in
``jax_sparse_mla/kernels/<arch>/`` on a machine without any AMD GPU, exports each with FlyDSL's
``export_to_c`` and writes to ``--out``:

- ``objects/<symbol>.o`` + ``.h``: the host object (packed ``void **args`` entry, module
  init/load/unload) with the code object embedded; ``objects/<symbol>.s``: its kernel's final
  ISA (FlyDSL's dump of the same compilation; ``tests/test_isa.py`` checks its waits);
- ``manifest.json``: for each configuration its module, fields, symbol, launch ABI (FlyDSL's
  export metadata), the GPU kernel's argument sizes, kernel resources and a source key; a
  configuration whose key is unchanged is not recompiled.

Each module is compiled in its own subprocess (an LLVM selection error aborts the process that
hits it); when one dies, its configurations are retried one per process to name the culprit.
``--report`` prints VGPR / AGPR / SGPR / LDS / scratch / spills and the occupancy they allow for
every kernel, and exits non-zero when a kernel spills, uses scratch, exceeds 160 KiB of LDS or
misses its design occupancy; then the static MI355X model of the kernels
(``kernels/gfx950_model.py``: per decode shape, workgroups and bytes against the redesign's
targets, and the time HBM bandwidth alone allows). ``--link`` then relinks the installed FFI library
(``jax_sparse_mla/ffi/_jsm_ffi*.so``) with the objects. Needs the ``gfx950-build`` extra
(flydsl, a CPU torch, ziglang).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jax_sparse_mla._build.codeobject import (
    LDS_BYTES_PER_CU,
    KernelResources,
    read_kernel_arg_sizes,
    read_kernel_code,
    read_kernel_resources,
)
from jax_sparse_mla._build.isa import assemble_kernel

ARCHS = ("gfx950",)
KERNEL_MODULES = ("sparse_mla", "mla_decode", "mla_decode_m128", "ultraquant", "probe")
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def kernel_module(arch: str, name: str):
    return importlib.import_module(f"jax_sparse_mla.kernels.{arch}.{name}")


# ---------------------------------------------------------------------------------------------
# Toolchain: FlyDSL links code objects with $ROCM_PATH/llvm/bin/ld.lld
# ---------------------------------------------------------------------------------------------


def toolchain_env(arch: str, out: Path) -> dict[str, str]:
    """The environment for compiling: FLYDSL_GPU_ARCH and a ROCM_PATH that has an ld.lld.

    Uses ``$ROCM_PATH`` when it has ``llvm/bin/ld.lld``; otherwise writes ``<out>/toolchain`` with
    an ld.lld that runs PyPI ziglang's LLD (or a system ``ld.lld`` / ``ld.lld-19``).
    """
    env = dict(os.environ, FLYDSL_GPU_ARCH=arch)
    rocm = os.environ.get("ROCM_PATH")
    if rocm and (Path(rocm) / "llvm/bin/ld.lld").exists():
        return env
    root = (out / "toolchain").resolve()
    lld = root / "llvm/bin/ld.lld"
    lld.parent.mkdir(parents=True, exist_ok=True)
    (root / "amdgcn/bitcode").mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("ziglang") is not None:
        lld.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ziglang ld.lld "$@"\n')
        lld.chmod(0o755)
    else:
        system = shutil.which("ld.lld") or shutil.which("ld.lld-19")
        if system is None:
            raise SystemExit("no ld.lld found: pip install ziglang (or install lld)")
        lld.unlink(missing_ok=True)
        lld.symlink_to(system)
    env["ROCM_PATH"] = str(root)
    return env


# ---------------------------------------------------------------------------------------------
# Worker: compile some configurations of one module (runs in a subprocess)
# ---------------------------------------------------------------------------------------------


def compile_configs(arch: str, module: str, indices: list[int], objects: Path) -> None:
    """Compiles and exports ``CONFIGS[i]`` of ``module`` for each i; writes ``<symbol>.s`` (the
    final ISA, ``compile_with_isa``) and ``<symbol>.json``."""
    mod = kernel_module(arch, module)
    for i in indices:
        config = mod.CONFIGS[i]
        start = time.perf_counter()
        for attempt in range(ISA_ATTEMPTS):
            compiled, isa = compile_with_isa(mod.compile_config, config)
            compiled.export_to_c(str(objects), config.symbol)
            if isa_is_the_code(isa, (objects / f"{config.symbol}.o").read_bytes()):
                break
            print(f"{config.symbol}: the ISA dump is not the code object ({attempt + 1})")
        else:
            raise RuntimeError(f"{config.symbol}: no ISA dump matched its code object")
        (objects / f"{config.symbol}.s").write_text(isa)
        seconds = time.perf_counter() - start
        record = {"seconds": round(seconds, 3)}
        (objects / f"{config.symbol}.json").write_text(json.dumps(record))
        print(f"compiled {config.symbol} in {seconds:.1f} s", flush=True)


# FlyDSL dumps the ISA from a second compilation of the module, whose instruction order is
# not always that of the code object's (seen: 1 or 2 of the 32 sparse_mla configurations per
# build); the dump is kept only where it reassembles to the object's code, compiled again if not.
ISA_ATTEMPTS = 4


def isa_is_the_code(isa: str, object_bytes: bytes) -> bool:
    """Whether the kernel's ISA text reassembles to its code in ``object_bytes``."""
    (resources,) = read_kernel_resources(object_bytes)
    code = read_kernel_code(object_bytes)[resources.name]
    return assemble_kernel(isa, resources.name) == code


def compile_with_isa(compile_config, config) -> tuple[object, str]:
    """``compile_config(config)`` with FlyDSL's ISA dump on (``FLYDSL_DEBUG_DUMP_ASM``): the
    compiled function and the final ISA text of its kernel (the assembly of the code object:
    ``tests/test_isa.py`` reassembles it to the code object's bytes)."""
    saved = {k: os.environ.get(k) for k in ("FLYDSL_DEBUG_DUMP_ASM", "FLYDSL_DUMP_DIR")}
    with tempfile.TemporaryDirectory() as dump:
        os.environ.update(FLYDSL_DEBUG_DUMP_ASM="1", FLYDSL_DUMP_DIR=dump)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # FlyDSL prints each dump's path
                compiled = compile_config(config)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        found = sorted(Path(dump).glob("**/*_final_isa.s"))
        if len(found) != 1:
            raise RuntimeError(f"{config.symbol}: expected one ISA dump, found {found}")
        return compiled, found[0].read_text()


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    module: str
    index: int
    config: object
    key: str


def sources_digest(arch: str) -> str:
    """Digest of the kernel sources of ``arch`` and the FlyDSL version (read once per build)."""
    import flydsl

    h = hashlib.sha256()
    for path in sorted((_PACKAGE_DIR / "kernels" / arch).glob("*.py")):
        h.update(path.read_bytes())
    h.update(f"{flydsl.__version__}|{arch}".encode())
    return h.hexdigest()


def source_key(sources: str, module: str, config) -> str:
    """Changes when the kernel sources, the FlyDSL version or the configuration changes."""
    return hashlib.sha256(f"{sources}|{module}|{config!r}".encode()).hexdigest()[:16]


def build(arch: str, out: Path, jobs: int, force: bool = False) -> dict:
    """Compiles what is missing or stale; returns the manifest (also written to out)."""
    objects = out / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    env = toolchain_env(arch, out)
    manifest_path = out / "manifest.json"
    old = {}
    if manifest_path.exists() and not force:
        old = {e["symbol"]: e for e in json.loads(manifest_path.read_text())["kernels"]}

    sources = sources_digest(arch)
    all_jobs, stale = [], []
    for module in KERNEL_MODULES:
        for i, config in enumerate(kernel_module(arch, module).CONFIGS):
            job = Job(module, i, config, source_key(sources, module, config))
            all_jobs.append(job)
            prev = old.get(config.symbol)
            built = all((objects / f"{config.symbol}{ext}").exists() for ext in (".o", ".s"))
            if not (prev and prev["key"] == job.key and built):
                stale.append(job)

    start = time.perf_counter()
    failures = _run_jobs(arch, stale, objects, env, jobs)
    wall = time.perf_counter() - start
    if failures:
        for symbol, log in failures.items():
            print(f"FAILED {symbol}:\n{log}", file=sys.stderr)
        raise SystemExit(f"{len(failures)} configuration(s) failed to compile")

    entries = [_manifest_entry(job, objects, old) for job in all_jobs]
    manifest = {"arch": arch, "kernels": entries}
    manifest_path.write_text(json.dumps(manifest, indent=1))
    current = {job.config.symbol for job in all_jobs}
    for f in objects.iterdir():  # objects of configurations that no longer exist
        if f.stem not in current:
            f.unlink()
    size = sum(f.stat().st_size for f in objects.iterdir())
    print(
        f"built {len(stale)} of {len(all_jobs)} configurations in {wall:.0f} s "
        f"({len(all_jobs) - len(stale)} up to date); {out} holds {size / 2**20:.0f} MiB"
    )
    return manifest


def _run_jobs(arch, stale: list[Job], objects: Path, env, jobs: int) -> dict[str, str]:
    """Compiles ``stale`` in subprocesses: one per module and chunk, then singly on failure."""
    chunks = []
    for module in KERNEL_MODULES:
        mine = [j for j in stale if j.module == module]
        per = max(1, -(-len(mine) // max(1, jobs)))
        chunks += [mine[i : i + per] for i in range(0, len(mine), per)]

    def run(chunk: list[Job]) -> dict[str, str]:
        rc, log = _worker(arch, chunk, objects, env)
        done = [j for j in chunk if (objects / f"{j.config.symbol}.json").exists()]
        missing = [j for j in chunk if j not in done]
        if rc == 0 and not missing:
            return {}
        if len(chunk) == 1:
            return {chunk[0].config.symbol: log}
        failed = {}
        for job in missing:
            failed |= run([job])
        return failed

    for job in stale:
        (objects / f"{job.config.symbol}.json").unlink(missing_ok=True)
    failures: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for result in pool.map(run, chunks):
            failures |= result
    return failures


def _worker(arch: str, chunk: list[Job], objects: Path, env) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "jax_sparse_mla._build.build", "--arch", arch, "--worker"]
    cmd += [chunk[0].module, ",".join(str(j.index) for j in chunk), str(objects)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    return proc.returncode, proc.stdout[-2000:] + proc.stderr[-4000:]


def _manifest_entry(job: Job, objects: Path, old: dict) -> dict:
    symbol = job.config.symbol
    obj = (objects / f"{symbol}.o").read_bytes()
    timing = objects / f"{symbol}.json"
    seconds = (
        json.loads(timing.read_text())["seconds"]
        if timing.exists()
        else old.get(symbol, {}).get("compile_seconds")
    )
    resources = read_kernel_resources(obj)
    return {
        "symbol": symbol,
        "module": job.module,
        "config": dataclasses.asdict(job.config),
        "design_waves_per_simd": job.config.design_waves_per_simd,
        "key": job.key,
        "object": f"objects/{symbol}.o",
        "header": f"objects/{symbol}.h",
        "isa": f"objects/{symbol}.s",
        "abi": _export_metadata(obj, symbol),
        "kernel_arg_sizes": _one(read_kernel_arg_sizes(obj), symbol),
        "resources": [dataclasses.asdict(r) for r in resources],
        "compile_seconds": seconds,
    }


def _one(per_kernel: dict, symbol: str):
    if len(per_kernel) != 1:
        raise ValueError(f"{symbol}: expected one GPU kernel in the object, got {list(per_kernel)}")
    return next(iter(per_kernel.values()))


def _export_metadata(object_bytes: bytes, symbol: str) -> dict:
    """FlyDSL's export metadata (JSON: argument ABI, runtime symbols) from the host object."""
    marker = f'"metadata_symbol":"{symbol}__metadata"'.encode()
    at = object_bytes.find(marker)
    if at < 0:
        raise ValueError(f"{symbol}: no export metadata in the object")
    start = object_bytes.rfind(b'{"abi"', 0, at)
    end = object_bytes.index(b"\0", at)
    return json.loads(object_bytes[start:end])


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def report(manifest: dict) -> int:
    """Prints the resource table; returns the number of configurations that fail a check."""
    head = (
        f"{'symbol':42} {'kernel':30} {'VGPR':>4} {'AGPR':>4} {'alloc':>5} {'SGPR':>4} "
        f"{'LDS':>6} {'scr':>3} {'spill':>5} {'occ':>3} {'by':>5} {'design':>6}  status"
    )
    print(head)
    print("-" * len(head))
    bad = 0
    for entry in manifest["kernels"]:
        for r in (KernelResources(**x) for x in entry["resources"]):
            problems = resource_problems(r, entry["design_waves_per_simd"])
            bad += bool(problems)
            occ, limiter = r.occupancy()
            print(
                f"{entry['symbol']:42} {r.name[:30]:30} {r.vgpr:4} {r.agpr:4} {r.vgpr_alloc:5} "
                f"{r.sgpr:4} {r.lds_bytes:6} {r.scratch_bytes:3} "
                f"{r.vgpr_spills + r.sgpr_spills:5} {occ:3} {limiter:>5} "
                f"{entry['design_waves_per_simd']:6}  {'; '.join(problems) or 'ok'}"
            )
    n = sum(len(e["resources"]) for e in manifest["kernels"])
    print(f"{n} kernels in {len(manifest['kernels'])} configurations; {bad} failing the checks")
    importlib.import_module(f"jax_sparse_mla.kernels.{manifest['arch']}_model").print_report(
        manifest
    )
    return bad


def resource_problems(r: KernelResources, design_waves: int) -> list[str]:
    problems = []
    if r.vgpr_spills or r.sgpr_spills:
        problems.append(f"spills {r.vgpr_spills} VGPR / {r.sgpr_spills} SGPR")
    if r.scratch_bytes:
        problems.append(f"uses {r.scratch_bytes} B of scratch")
    if r.lds_bytes > LDS_BYTES_PER_CU:
        problems.append(f"LDS {r.lds_bytes} B > 160 KiB")
    occ, limiter = r.occupancy()
    if occ < design_waves:
        problems.append(f"occupancy {occ} < design {design_waves} (limited by {limiter})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_sparse_mla.build", description=__doc__)
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--out", type=Path, help="build directory (default build/<arch>)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--force", action="store_true", help="recompile everything")
    parser.add_argument("--report", action="store_true", help="print and check resources")
    parser.add_argument(
        "--link", action="store_true", help="relink the installed FFI library with the kernels"
    )
    parser.add_argument(
        "--worker", nargs=3, metavar=("MODULE", "INDICES", "DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        module, indices, objects = args.worker
        compile_configs(args.arch, module, [int(i) for i in indices.split(",")], Path(objects))
        return 0
    out = args.out or Path("build") / args.arch
    manifest = build(args.arch, out, args.jobs, args.force)
    if args.link:
        link_ffi_library(out)
    return 1 if args.report and report(manifest) else 0


def link_ffi_library(kernel_dir: Path) -> Path:
    """Links the FFI library this package loads (created next to ``jax_sparse_mla/ffi`` when the
    install has none) with ``kernel_dir``'s objects; a running process keeps the copy it loaded."""
    from jax_sparse_mla import ffi
    from jax_sparse_mla._build import build_lib

    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    path = ffi.library_path() or Path(ffi.__file__).parent / f"{ffi.LIBRARY_NAME}{suffix}"
    build_lib.build_library(path, kernel_dir)
    print(f"linked {path} with {len(build_lib.manifest_kernels(kernel_dir))} kernels")
    return path


if __name__ == "__main__":
    sys.exit(main())
