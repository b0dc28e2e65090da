"""The self-check that gates ``implementation=None`` on an MI355 (``jax_sparse_mla.self_check``),
on the CPU.

No gfx950 device here: its cases and bounds run with "gfx950_emulation" (or a perturbed copy of
it) standing in for "flydsl", and the choice at trace time runs with a faked MI355 (as
test_ffi_lowering.py does), the op tables' "flydsl" entry pointing at that stand-in. Lowering
for ROCm then shows which implementation was chosen.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _platform, ffi, self_check
from jax_sparse_mla._build import build_lib
from tests.impls import has_gfx950
from tests.test_ffi_lowering import FakeDevice, jsm_targets, sparse_args

ROOT = Path(__file__).resolve().parents[1]
MI355 = FakeDevice("AMD Instinct MI355X", "gfx950")
OPS = {f: importlib.import_module(f"jax_sparse_mla.{f}") for f in ("sparse_mla", "mla_decode")}
OPS["ultraquant"] = importlib.import_module("jax_sparse_mla.ultraquant")


def one_ulp_up(x):
    """Every nonzero bf16 element one ulp further from 0 (<= 2^-7 of it)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return jax.lax.bitcast_convert_type(jnp.where(x != 0, bits + 1, bits), jnp.bfloat16)


def reversed_dims(x):
    """The head dimension reversed: what a wrong operand layout does to an output."""
    return x[..., ::-1]


def stand_in(monkeypatch, family, perturb=None):
    """The op table's "flydsl" entry of ``family`` -> the emulation, its first output (out /
    o_parts) passed through ``perturb``."""
    table = OPS[family]._IMPLEMENTATIONS
    emu = table["gfx950_emulation"]

    def wrap(fn):
        if perturb is None:
            return fn

        def run(*args, **kw):
            res = fn(*args, **kw)
            return (perturb(res[0]), *res[1:]) if isinstance(res, tuple) else perturb(res)

        return run

    if family == "mla_decode":
        kernels = emu._replace(partials=wrap(emu.partials), decode=wrap(emu.decode))
    else:
        kernels = wrap(emu)
    monkeypatch.setitem(table, "flydsl", kernels)


@pytest.fixture
def mi355(monkeypatch, tmp_path):
    """This process sees one (fake) MI355 with the FFI library and all its kernels; verdicts
    kept under tmp_path, none decided yet. Each family keeps its first case (CPU time)."""
    monkeypatch.setattr(_platform, "rocm_devices", lambda: [MI355])
    monkeypatch.setattr(_platform, "flydsl_available", lambda: True)
    monkeypatch.setattr(ffi, "rocm_library", lambda: "the FFI library")
    monkeypatch.setattr(
        ffi,
        "library_kernels",
        lambda: frozenset(
            [
                "jsm_sparse_mla_h16_l1",
                "jsm_mla_decode_partials_q1",
                "jsm_mla_decode_combine",
                "jsm_ultraquant_decode_g8_bs16",
                "jsm_ultraquant_reduce",
            ]
        ),
    )
    monkeypatch.setenv(self_check.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(self_check, "_VERDICTS", {})
    for name, family in self_check.FAMILIES.items():
        monkeypatch.setitem(self_check.FAMILIES, name, family._replace(cases=family.cases[:1]))
    return tmp_path


def lower_once(expect_warning: str | None):
    """jsm targets of sparse_mla lowered for ROCm inside jax.jit; asserts the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = jsm_targets(jsm.sparse_mla, *sparse_args(), platform="rocm")
    messages = [str(w.message) for w in caught]
    if expect_warning is None:
        assert messages == []
    else:
        assert len(messages) == 1, messages
        assert expect_warning in messages[0], messages[0]
    return targets, messages


# ---------------------------------------------------------------------------------------------
# The cases and bounds, with the emulation standing in for the kernels
# ---------------------------------------------------------------------------------------------


def test_selfcheck_without_gfx950_says_so_and_runs_nothing(capsys):
    assert jsm.selfcheck() == {}
    out = capsys.readouterr().out
    assert (
        f"no gfx950 (MI355) ROCm device, nothing was run; jax sees: {_platform.devices_seen()}"
        in out
    )
    assert "pip install '.[rocm]'" in out


def test_emulation_in_place_of_the_kernels_passes_and_prints_the_table(capsys):
    results = jsm.selfcheck("gfx950_emulation")
    lines = capsys.readouterr().out.splitlines()
    header = "jax_sparse_mla self-check: gfx950_emulation vs gfx950_emulation on "
    assert lines[0] == header + jax.devices()[0].device_kind
    assert lines[1].split() == ["kernel", "case", "worst", "err/bound", "verdict"]
    assert lines[-1] == "3 of 3 kernel families passed"
    assert sorted(results) == ["mla_decode", "sparse_mla", "ultraquant"]
    rows = [c for r in results.values() for c in r.cases]
    assert len(lines) == len(rows) + 3
    for line, c in zip(lines[2:-1], rows, strict=True):
        assert c.error is None and c.ratio == 0
        assert line.startswith(c.kernel) and c.case in line and line.endswith("pass")
    cases = " ".join(c.case for c in rows)
    for feature in ("masked", "empty row", "empty request", "qlen 2", "G6", "G8", "G16"):
        assert feature in cases


@pytest.mark.parametrize("family", sorted(self_check.FAMILIES))
def test_a_wrong_layout_fails(monkeypatch, family):
    stand_in(monkeypatch, family, reversed_dims)
    kernel, case, check = self_check.FAMILIES[family].cases[0]
    ratio, error = check("flydsl")
    assert ratio > 1 and error is not None
    assert error.startswith(("out[", "o[")) and "elements out of bound" in error


def test_one_ulp_off_passes(monkeypatch):
    """The bound is not zero: every output one bf16 ulp away is within it."""
    stand_in(monkeypatch, "sparse_mla", one_ulp_up)
    ratio, error = self_check.FAMILIES["sparse_mla"].cases[0][2]("flydsl")
    assert error is None and 0 < ratio <= 1


def test_a_case_that_raises_fails_with_the_error(monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("UNIMPLEMENTED: kernel jsm_sparse_mla_h16_l1 is not here")

    monkeypatch.setitem(OPS["sparse_mla"]._IMPLEMENTATIONS, "flydsl", broken)
    result = self_check.run_family("sparse_mla", "flydsl", "dev")
    assert not result.passed and len(result.cases) == 2
    assert all(
        c.error == "RuntimeError: UNIMPLEMENTED: kernel jsm_sparse_mla_h16_l1 is not here"
        for c in result.cases
    )


# ---------------------------------------------------------------------------------------------
# The choice of implementation=None on a (fake) MI355
# ---------------------------------------------------------------------------------------------


def test_failing_self_check_falls_back_once_and_is_kept_on_disk(monkeypatch, mi355):
    stand_in(monkeypatch, "sparse_mla", reversed_dims)
    case = self_check.FAMILIES["sparse_mla"].cases[0][1]
    targets, (message,) = lower_once(
        f"kernel sparse_mla failed its self-check on {MI355.device_kind} (case '{case}': out["
    )
    assert targets == []  # "xla"
    assert "implementation=None runs 'xla' for sparse_mla" in message
    assert lower_once(None)[0] == []  # decided once: no second warning
    (path,) = mi355.glob("selfcheck-sparse_mla-*.json")
    record = json.loads(path.read_text())
    assert record["device"] == MI355.device_kind
    assert record["library_sha256"] == self_check.library_hash()
    assert record["cases"][0]["error"].startswith("out[")
    # A new process (verdicts forgotten) reads the disk, runs nothing and warns once again.
    monkeypatch.setattr(self_check, "_VERDICTS", {})
    monkeypatch.setattr(self_check, "run_family", lambda *a: pytest.fail("ran the check again"))
    assert lower_once(f"(case '{case}': out[")[0] == []


def test_passing_self_check_picks_the_kernels(monkeypatch, mi355):
    stand_in(monkeypatch, "sparse_mla")
    assert lower_once(None)[0] == ["jsm_sparse_mla"]
    (path,) = mi355.glob("selfcheck-sparse_mla-*.json")
    assert json.loads(path.read_text())["cases"][0]["error"] is None


def test_disk_verdict_is_per_device_and_library(monkeypatch, mi355):
    family, lib = "sparse_mla", self_check.library_hash()
    case = self_check.CaseResult("sparse_mla", "c", 0.5, None)
    passed = self_check.FamilyResult(family, MI355.device_kind, lib, (case,))
    self_check.write_verdict(passed)
    assert self_check.read_verdict(family, MI355.device_kind, lib) == passed
    assert self_check.read_verdict(family, "AMD Instinct MI300X", lib) is None
    assert self_check.read_verdict(family, MI355.device_kind, "0" * 64) is None
    monkeypatch.setattr(self_check, "run_family", lambda *a: pytest.fail("ran the check again"))
    assert lower_once(None)[0] == ["jsm_sparse_mla"]
    monkeypatch.setenv(self_check.CACHE_ENV, "off")
    assert self_check.cache_path(family, MI355.device_kind, lib) is None
    assert self_check.read_verdict(family, MI355.device_kind, lib) is None


def test_library_without_kernels_falls_back_and_flydsl_names_the_build_command(monkeypatch, mi355):
    monkeypatch.setattr(ffi, "library_kernels", lambda: frozenset())
    monkeypatch.setattr(self_check, "run_family", lambda *a: pytest.fail("nothing to check"))
    targets, (message,) = lower_once(
        "kernel jsm_sparse_mla failed its self-check on AMD Instinct MI355X (case '-': the FFI "
        "library has no jsm_sparse_mla kernel (0 kernels linked); build the kernels and relink: "
        "python -m jax_sparse_mla.build --arch gfx950 --link)"
    )
    assert targets == []
    with pytest.raises(RuntimeError, match="no jsm_sparse_mla kernel.*jax_sparse_mla.build"):
        jsm.sparse_mla(*sparse_args(), implementation="flydsl")


def test_library_lists_its_kernels(tmp_path):
    """A library linked without a kernel build lists none; the installed one its manifest's."""
    try:
        build_lib.compiler()
    except RuntimeError as e:
        pytest.skip(str(e))
    empty = build_lib.build_library(tmp_path / "empty.so", None, recording=True)
    assert ffi.kernel_symbols(ctypes.CDLL(str(empty))) == frozenset()
    kernels = {k["symbol"] for k in build_lib.manifest_kernels(build_lib.DEFAULT_KERNEL_DIR)}
    if not kernels:
        return
    full = build_lib.build_library(tmp_path / "full.so", build_lib.DEFAULT_KERNEL_DIR)
    assert ffi.kernel_symbols(ctypes.CDLL(str(full))) == kernels


# ---------------------------------------------------------------------------------------------
# conftest: -m gfx950 without an MI355 fails, otherwise the gfx950 tests skip
# ---------------------------------------------------------------------------------------------


def run_pytest(tmp_path, *args):
    test = tmp_path / "test_marked.py"
    test.write_text(
        "import pytest\n\n\n@pytest.mark.gfx950\ndef test_on_mi355():\n    pass\n\n\n"
        "def test_anywhere():\n    pass\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.conftest",
        "-c",
        "pyproject.toml",
        "--rootdir",
        ".",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
        *args,
        str(test),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_gfx950_marker_without_an_mi355_fails_saying_what_jax_sees(tmp_path):
    if has_gfx950():
        pytest.skip("this machine has an MI355")
    run = run_pytest(tmp_path, "-m", "gfx950")
    assert run.returncode == 1, run.stdout + run.stderr
    assert (
        "-m gfx950 asks for the MI355 tests, but jax "
        f"{jax.__version__} sees no gfx950 ROCm device: jax.devices() = {_platform.devices_seen()}"
    ) in run.stdout
    assert "pip install -e '.[rocm,test]'" in run.stdout
    assert "passed" not in run.stdout


def test_without_the_marker_gfx950_tests_skip_saying_why(tmp_path):
    if has_gfx950():
        pytest.skip("this machine has an MI355")
    run = run_pytest(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no MI355 (gfx950) ROCm device" in run.stdout and "1 passed, 1 skipped" in run.stdout
    run = run_pytest(tmp_path, "-m", "not gfx950")
    assert run.returncode == 0 and "1 passed, 1 deselected" in run.stdout
