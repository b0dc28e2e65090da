"""Which gfx950 kernel configurations ``implementation=None`` may launch on this machine's GPU.

A configuration (one compiled code object, e.g. ``jsm_sparse_mla_h8_l1``; the list is
``kernels/gfx950/configs.py``) is trusted only after its own self-check cases passed on this
GPU against ``gfx950_emulation`` (``jax_sparse_mla.self_check``). Verification is lazy: the
first call that would launch an unverified configuration verifies the configurations it needs,
in a child process (``python -m jax_sparse_mla.self_check``), so that a kernel that faults,
aborts or hangs takes down that child, not the caller. The child reports each case as a JSON
line on its standard output; the parent reads them with a time limit per case and decides:

* **pass** / **fail** (a case out of bound or raising, or the child killed by a signal or
  exiting while running the case): kept for the process and on disk.
* **retry**: an error that says nothing about the kernel (out of memory, a busy or missing
  device, the child failing before its first case) or a first time-out: reported, the call runs
  ``"xla"``, and the configuration is checked again in a later process. A second time-out of
  the same configuration is a failure.

Verdicts are kept per (device name, sha256 of the FFI library, hash of the self-check's and
the emulation's sources) under ``$JAX_SPARSE_MLA_SELFCHECK_CACHE`` (default
``$XDG_CACHE_HOME/jax_sparse_mla``, else ``~/.cache/jax_sparse_mla``; ``off``: in memory only).
``$JAX_SPARSE_MLA_SELFCHECK_TIMEOUT`` is the time limit per case in seconds (default 180: the
first case also pays for the child's start and its compilations).

Standard library and ``jax_sparse_mla.ffi`` only: the platform choice reads verdicts here
without importing the ops, which the self-check itself sits above.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from jax_sparse_mla import ffi

CACHE_ENV = "JAX_SPARSE_MLA_SELFCHECK_CACHE"
TIMEOUT_ENV = "JAX_SPARSE_MLA_SELFCHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 180.0
CHILD_MODULE = "jax_sparse_mla.self_check"
_PACKAGE = Path(__file__).resolve().parent
# The child's environment: no GPU memory taken up front beside a parent that may hold most of it.
CHILD_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
# Errors that say nothing about the kernel: the case is retried in a later process.
TRANSIENT_MARKERS = (
    "RESOURCE_EXHAUSTED",
    "out of memory",
    "hipErrorOutOfMemory",
    "hipErrorDeviceBusy",
    "device busy",
    "hipErrorNoDevice",
    "UNAVAILABLE",
)


_KNOWN: dict[tuple[str, str], Verdict] = {}  # (device, symbol) -> this process's verdict
_WARNED: set[tuple[str, str]] = set()
_LOCK = threading.RLock()


class Verdict(NamedTuple):
    """One configuration's verdict: status "pass", "fail" or "retry"; the case it was decided
    on ("" when no case ran), worst |kernel - emulation| / bound over its cases (nan: not run)
    and the error (None when passed)."""

    symbol: str
    status: str
    case: str
    ratio: float
    error: str | None


def is_transient(error: str) -> bool:
    """Whether ``error`` (a case's exception text) says nothing about the kernel."""
    return any(marker.lower() in error.lower() for marker in TRANSIENT_MARKERS)


# ---------------------------------------------------------------------------------------------
# Keys and the disk cache
# ---------------------------------------------------------------------------------------------


def library_hash() -> str:
    """sha256 of the FFI library file this process loads, "none" without one."""
    path = ffi.library_path()
    return "none" if path is None or not path.exists() else _file_sha256(path)


@functools.cache
def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def check_hash() -> str:
    """Of the self-check's cases, this module, the emulation and the configuration list: a
    change to any of them is a new check."""
    h = hashlib.sha256()
    files = [
        _PACKAGE / "self_check.py",
        Path(__file__).resolve(),
        _PACKAGE / "kernels" / "gfx950" / "configs.py",
        *sorted((_PACKAGE / "emulation").glob("*.py")),
    ]
    for path in files:
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path | None:
    """Where verdicts are kept (module docstring); None: in memory only."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off") else Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jax_sparse_mla"


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)


class DiskVerdicts:
    """The verdicts file of one (device, library, check): ``{"verdicts": {symbol: Verdict},
    "timeouts": {symbol: count}}``, updated under a file lock (processes may verify at once)."""

    def __init__(self, device: str, library: str | None = None):
        self.key = {"device": device, "library_sha256": library or library_hash()}
        self.key["check_sha256"] = check_hash()
        where = cache_dir()
        digest = hashlib.sha256("|".join(self.key.values()).encode()).hexdigest()[:24]
        self.path = None if where is None else where / f"selfcheck-{digest}.json"

    def read(self) -> dict:
        try:
            record = json.loads(self.path.read_text()) if self.path is not None else {}
        except (OSError, ValueError):
            record = {}
        if any(record.get(k) != v for k, v in self.key.items()):
            record = {}
        verdicts = {s: Verdict(**v) for s, v in record.get("verdicts", {}).items()}
        return {"verdicts": verdicts, "timeouts": dict(record.get("timeouts", {}))}

    @contextlib.contextmanager
    def update(self):
        """Yields the record (as ``read``) to change in place; written back atomically."""
        if self.path is None:
            yield self.read()
            return
        import fcntl  # POSIX (the ROCm hosts this serves); imported here so Windows can import us

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_name(f".{self.path.name}.lock"), "w")  # noqa: SIM115
        except OSError as e:
            warnings.warn(f"jax_sparse_mla: cannot keep self-check verdicts: {e}", stacklevel=3)
            yield self.read()
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            record = self.read()
            yield record
            out = {
                **self.key,
                "verdicts": {s: v._asdict() for s, v in record["verdicts"].items()},
                "timeouts": record["timeouts"],
            }
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(out, indent=1))
            os.replace(partial, self.path)


# ---------------------------------------------------------------------------------------------
# The child process
# ---------------------------------------------------------------------------------------------


class ChildRun(NamedTuple):
    events: list[dict]  # the child's JSON lines, in order
    returncode: int | None  # None: killed for running past the time limit
    stderr: str


def _run_child(
    symbols: list[str], device: str, implementation: str, on_event: Callable[[dict], None]
) -> ChildRun:
    """Runs the self-check child on ``symbols``; kills it when a case runs past the limit."""
    argv = [sys.executable, "-m", CHILD_MODULE, "--child", "--device", device]
    argv += ["--implementation", implementation, *symbols]
    env = {**os.environ, **CHILD_ENV}
    events: list[dict] = []
    lines: queue.Queue = queue.Queue()
    with (
        tempfile.TemporaryFile("w+") as err,
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc,
    ):

        def read():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        limit, returncode = timeout_s(), None
        deadline = time.monotonic() + limit
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:  # a case ran past the limit
                proc.kill()
                proc.wait()
                break
            if line is None:
                returncode = proc.wait()
                break
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                events.append(event)
                on_event(event)
                deadline = time.monotonic() + limit
        reader.join()
        err.seek(0)
        return ChildRun(events, returncode, err.read())


def _death(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} ({signal.strsignal(-returncode)})"
    return f"exited with status {returncode}"


def _tail(text: str, n: int = 300) -> str:
    text = " ".join(text.split())
    return text[-n:] if text else "nothing on stderr"


def settle(child: ChildRun, pending: list[str], timeouts: dict) -> dict[str, Verdict]:
    """Verdicts from one child's run: every finished configuration's, and the one whose case
    was running when the child died or hung; the rest of ``pending`` stay undecided."""
    cases: dict[str, list[dict]] = {}
    running = None
    for e in child.events:
        if e["event"] == "start":
            running = e
        elif e["event"] == "done":
            cases.setdefault(e["symbol"], []).append(e)
            running = None
    finished = {e["symbol"] for e in child.events if e["event"] == "finished"}
    out = {}
    for symbol in (s for s in pending if s in finished):
        done = cases.get(symbol, [])
        bad = next((c for c in done if c["error"] is not None), None)
        ratio = max((c["ratio"] for c in done), default=float("nan"))
        if bad is None:
            out[symbol] = Verdict(symbol, "pass", done[-1]["case"] if done else "", ratio, None)
        else:
            status = "retry" if is_transient(bad["error"]) else "fail"
            out[symbol] = Verdict(symbol, status, bad["case"], bad["ratio"], bad["error"])
    if running is not None:
        symbol, case = running["symbol"], running["case"]
        if child.returncode is None:
            count = timeouts.get(symbol, 0) + 1
            timeouts[symbol] = count
            error = (
                f"the self-check process ran past its limit of {timeout_s():g} s per case "
                f"({TIMEOUT_ENV}) and was killed"
            )
            status = "fail" if count >= 2 else "retry"
            error += " for the second time" if count >= 2 else " (a first time-out)"
        else:
            status = "fail"
            error = (
                f"the self-check process {_death(child.returncode)} while running this case; "
                f"its stderr ends: {_tail(child.stderr)}"
            )
        out[symbol] = Verdict(symbol, status, case, float("nan"), error)
    elif not finished:  # the child failed before its first case
        why = "ran past its time limit" if child.returncode is None else _death(child.returncode)
        error = f"the self-check process {why} before any case ran: {_tail(child.stderr)}"
        out = {s: Verdict(s, "retry", "", float("nan"), error) for s in pending}
    return out


def verify(
    symbols: Iterable[str],
    device: str,
    implementation: str = "flydsl",
    on_event: Callable[[dict], None] = lambda event: None,
    refresh: bool = False,
) -> dict[str, Verdict]:
    """Runs the self-check of ``symbols`` on ``device`` (a device name) in child processes
    (a new one after each that died on a case, until every configuration has a verdict), and
    keeps pass / fail verdicts and time-out counts on disk. ``on_event`` sees each of the
    child's JSON events as it arrives (progress). Verdicts already on disk are taken as they
    are unless ``refresh``; the new ones replace this process's."""
    order = pending = list(dict.fromkeys(symbols))
    disk = DiskVerdicts(device)
    verdicts: dict[str, Verdict] = {}
    while pending:
        with disk.update() as record:  # one process verifies at a time; the others read
            if not refresh:
                kept = record["verdicts"]
                verdicts.update({s: kept[s] for s in pending if s in kept})
                pending = [s for s in pending if s not in verdicts]
            if not pending:
                break
            child = _run_child(pending, device, implementation, on_event)
            settled = settle(child, pending, record["timeouts"])
            for symbol, v in settled.items():
                if v.status != "retry":
                    record["verdicts"][symbol] = v
                    record["timeouts"].pop(symbol, None)
        if not settled:  # the child decided nothing: say so rather than start another
            why = f"the self-check process decided nothing: {_tail(child.stderr)}"
            settled = {s: Verdict(s, "retry", "", float("nan"), why) for s in pending}
        verdicts.update(settled)
        pending = [s for s in pending if s not in verdicts]
    verdicts = {s: verdicts[s] for s in order if s in verdicts}
    with _LOCK:
        _KNOWN.update({(device, s): v for s, v in verdicts.items()})
    return verdicts


# ---------------------------------------------------------------------------------------------
# The platform choice's question
# ---------------------------------------------------------------------------------------------


def _missing(symbol: str) -> Verdict | None:
    if symbol in ffi.library_kernels():
        return None
    error = (
        f"the FFI library has no {symbol} kernel ({len(ffi.library_kernels())} kernels "
        f"linked); build the kernels and relink: {ffi.BUILD_COMMAND}"
    )
    return Verdict(symbol, "fail", "", float("nan"), error)


def message(v: Verdict, device: str) -> str:
    """The one warning of a configuration that ``implementation=None`` does not launch."""
    case = f"case '{v.case}'" if v.case else "no case ran"
    head = f"jax_sparse_mla: the gfx950 kernel {v.symbol} "
    if v.status == "retry":
        head += f"could not be verified on {device} now ({case}: {v.error}); "
        tail = "it is checked again in a later process"
    else:
        head += f"failed its self-check on {device} ({case}: {v.error}); "
        tail = "jax_sparse_mla.selfcheck() prints every case"
    return head + f"implementation=None runs 'xla' where it would be launched ({tail})"


def trusted(symbols: Iterable[str], device: str) -> bool:
    """Whether every configuration of ``symbols`` passed its self-check on ``device``: known
    verdicts first (this process, then the disk), the rest verified now (module docstring).
    A configuration not trusted warns once per process."""
    symbols = tuple(symbols)
    with _LOCK:
        unknown = [s for s in symbols if (device, s) not in _KNOWN]
        if unknown:
            kept = DiskVerdicts(device).read()["verdicts"]
            for s in unknown:
                v = _missing(s) or kept.get(s)
                if v is not None:
                    _KNOWN[device, s] = v
            todo = [s for s in unknown if (device, s) not in _KNOWN]
            if todo:
                verify(todo, device)
        ok = True
        for s in symbols:
            v = _KNOWN[device, s]
            if v.status != "pass":
                ok = False
                if (device, s) not in _WARNED:
                    _WARNED.add((device, s))
                    warnings.warn(message(v, device), stacklevel=5)
        return ok
