"""The self-check that gates ``implementation=None`` on an MI355 (``jax_sparse_mla.self_check``
and ``_verdicts``), on the CPU.

No gfx950 device here: the cases and bounds run with "gfx950_emulation" (or a perturbed copy
of it) standing in for "flydsl"; the choice at trace time runs with a faked MI355 (as
test_ffi_lowering.py does), its child processes running the cases with the emulation. Faults
in the child (abort, hang, out of memory) are injected through ``self_check.FAULT_ENV``.
Which kernel code objects the plan launches is measured with the recording HIP in
``test_selfcheck_plan.py``.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _platform, _verdicts, ffi, self_check
from jax_sparse_mla.kernels.gfx950 import configs
from tests.impls import has_gfx950
from tests.test_ffi_lowering import FakeDevice, jsm_targets, sparse_args

ROOT = Path(__file__).resolve().parents[1]
MI355 = FakeDevice("AMD Instinct MI355X", "gfx950")
OPS = {f: sys.modules[f"jax_sparse_mla.{f}"] for f in ("sparse_mla", "mla_decode", "ultraquant")}
# One configuration of each kind (CPU time): their cases run with the emulation here.
SAMPLE = (
    "jsm_sparse_mla_h16_l1",
    "jsm_sparse_mla_h3_l0",
    "jsm_mla_decode_partials_q1",
    "jsm_mla_decode_partials_q2",
    "jsm_mla_decode_partials_q4",
    "jsm_mla_decode_partials_m128",
    "jsm_mla_decode_combine",
    "jsm_ultraquant_decode_g6_bs64",
    "jsm_ultraquant_reduce",
)


def one_ulp_up(x):
    """Every nonzero bf16 element one ulp further from 0 (<= 2^-7 of it)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return jax.lax.bitcast_convert_type(jnp.where(x != 0, bits + 1, bits), jnp.bfloat16)


def reversed_dims(x):
    """The head dimension reversed: what a wrong operand layout does to an output."""
    return x[..., ::-1]


def perturbed(fn, perturb):
    def run(*args, **kw):
        res = fn(*args, **kw)
        return (perturb(res[0]), *res[1:]) if isinstance(res, tuple) else perturb(res)

    return run


def stand_in(monkeypatch, symbol, perturb=None):
    """The "flydsl" entry that ``symbol``'s cases run -> the emulation, its first output
    passed through ``perturb``."""
    if symbol == configs.ULTRAQUANT_REDUCE:
        fn = self_check.REDUCES[self_check.EMULATION]
        fn = fn if perturb is None else perturbed(fn, perturb)
        monkeypatch.setitem(self_check.REDUCES, "flydsl", fn)
        return
    family = next((f for f in ("sparse_mla", "mla_decode") if f in symbol), "ultraquant")
    table = OPS[family]._IMPLEMENTATIONS
    emu = table["gfx950_emulation"]
    wrap = (lambda f: f) if perturb is None else (lambda f: perturbed(f, perturb))
    if family == "mla_decode":
        kernels = emu._replace(
            partials=wrap(emu.partials), combine=wrap(emu.combine), decode=wrap(emu.decode)
        )
    else:
        kernels = wrap(emu)
    monkeypatch.setitem(table, "flydsl", kernels)


# ---------------------------------------------------------------------------------------------
# The plan, its cases and bounds (the emulation standing in for the kernels)
# ---------------------------------------------------------------------------------------------


def test_plan_has_cases_for_every_configuration_the_ops_launch():
    assert tuple(self_check.PLAN) == configs.user_symbols()
    assert len(self_check.PLAN) == 53
    for symbol, cases in self_check.PLAN.items():
        assert cases and all(c.symbol == symbol for c in cases)


def test_selfcheck_without_gfx950_says_so_and_runs_nothing(capsys):
    assert jsm.selfcheck() == {}
    out = capsys.readouterr().out
    assert (
        f"no gfx950 (MI355) ROCm device, nothing was run; jax sees: {_platform.devices_seen()}"
        in out
    )
    assert "pip install '.[rocm]'" in out


def test_emulation_in_place_of_the_kernels_passes_and_prints_each_case(capsys):
    verdicts = jsm.selfcheck("gfx950_emulation", symbols=SAMPLE)
    lines = capsys.readouterr().out.splitlines()
    cases = [c for s in SAMPLE for c in self_check.PLAN[s]]
    assert lines[0] == (
        f"jax_sparse_mla self-check: gfx950_emulation vs gfx950_emulation on "
        f"{jax.devices()[0].device_kind}, {len(SAMPLE)} configurations, {len(cases)} cases"
    )
    assert lines[-1] == f"{len(SAMPLE)} of {len(SAMPLE)} kernel configurations passed"
    assert len(lines) == len(cases) + 2
    for line, case in zip(lines[1:-1], cases, strict=True):
        assert line.split()[0] == case.symbol and case.name in line
        assert line.split()[-2:] == ["0", "pass"]
    assert list(verdicts) == list(SAMPLE)
    assert all(v.status == "pass" and v.ratio == 0 and v.error is None for v in verdicts.values())


@pytest.mark.parametrize("symbol", SAMPLE)
def test_a_wrong_layout_fails(monkeypatch, symbol):
    stand_in(monkeypatch, symbol, reversed_dims)
    ratio, error = self_check.check(self_check.PLAN[symbol][0], "flydsl")
    assert ratio > 1 and error is not None
    assert error.startswith(("out[", "o[")) and "elements out of bound" in error


def test_one_ulp_off_passes(monkeypatch):
    """The bound is not zero: every output one bf16 ulp away is within it."""
    stand_in(monkeypatch, "jsm_sparse_mla_h16_l1", one_ulp_up)
    ratio, error = self_check.check(self_check.PLAN["jsm_sparse_mla_h16_l1"][0], "flydsl")
    assert error is None and 0 < ratio <= 1


def test_a_case_that_raises_fails_with_the_error(monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("UNIMPLEMENTED: kernel jsm_sparse_mla_h16_l1 is not here")

    monkeypatch.setitem(OPS["sparse_mla"]._IMPLEMENTATIONS, "flydsl", broken)
    ratio, error = self_check.check(self_check.PLAN["jsm_sparse_mla_h16_l1"][0], "flydsl")
    assert error == "RuntimeError: UNIMPLEMENTED: kernel jsm_sparse_mla_h16_l1 is not here"


def test_decode_cases_have_rising_and_falling_maxima_over_blocks():
    """The long requests' scores rise (request 1) and fall (request 2) from block to block."""
    q, kv, idx, indptr = self_check.decode_inputs(0, 1)
    k = np.asarray(kv.view(jnp.float8_e4m3fn).astype(jnp.float32))
    qf = np.asarray(q.astype(jnp.float32))
    ptr = np.asarray(indptr)
    for request, sign in ((1, 1), (2, -1)):
        ids = np.asarray(idx[ptr[request] : ptr[request + 1]])
        ids = ids[(ids >= 0) & (ids < len(k))]
        scores = (qf[request, 0] @ k[ids].T) * 0.5 * 576**-0.5
        block_max = [scores[i : i + 128].max() for i in range(0, len(scores) - 127, 128)]
        assert len(block_max) >= 6
        assert all(sign * (b - a) > 0 for a, b in zip(block_max, block_max[1:], strict=False))
        assert sign * (block_max[-1] - block_max[0]) > 10


# ---------------------------------------------------------------------------------------------
# The choice of implementation=None on a (fake) MI355, verified in child processes
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def mi355(monkeypatch, tmp_path):
    """This process sees one (fake) MI355 with the FFI library (built here or not) and all its
    kernels; verdicts kept under tmp_path, none known yet; the child runs the cases with the
    emulation."""
    monkeypatch.setattr(_platform, "rocm_devices", lambda: [MI355])
    monkeypatch.setattr(_platform, "flydsl_available", lambda: True)
    monkeypatch.setattr(ffi, "rocm_library", lambda: "the FFI library")
    monkeypatch.setattr(ffi, "library_kernels", lambda: configs.all_symbols())
    monkeypatch.setenv(_verdicts.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_verdicts, "_KNOWN", {})
    monkeypatch.setattr(_verdicts, "_WARNED", set())
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    run_child = _verdicts._run_child

    def emulated_child(symbols, device, implementation, on_event):
        return run_child(symbols, device, self_check.EMULATION, on_event)

    monkeypatch.setattr(_verdicts, "_run_child", emulated_child)
    return tmp_path


def new_process(monkeypatch):
    """What a new process knows: the disk, nothing in memory."""
    monkeypatch.setattr(_verdicts, "_KNOWN", {})
    monkeypatch.setattr(_verdicts, "_WARNED", set())


def no_child(monkeypatch):
    monkeypatch.setattr(_verdicts, "_run_child", lambda *a: pytest.fail("started a child"))


def lower(h: int, expect_warning: str | None):
    """jsm targets of sparse_mla (H heads, lse) lowered for ROCm inside jax.jit; asserts the
    warnings (one containing ``expect_warning``, or none)."""
    fn = functools.partial(jsm.sparse_mla, sm_scale=0.1, return_lse=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = jsm_targets(fn, *sparse_args(h=h), platform="rocm")
    messages = [str(w.message) for w in caught]
    if expect_warning is None:
        assert messages == []
    else:
        assert len(messages) == 1, messages
        assert expect_warning in messages[0], messages[0]
    return targets


def disk(device=MI355.device_kind):
    return _verdicts.DiskVerdicts(device).read()


def test_trusted_configurations_pick_the_kernel(monkeypatch, mi355):
    asked = []
    monkeypatch.setattr(_verdicts, "trusted", lambda s, device: asked.append((s, device)) or True)
    assert lower(19, None) == ["jsm_sparse_mla"]
    assert asked == [(("jsm_sparse_mla_h16_l1", "jsm_sparse_mla_h3_l1"), MI355.device_kind)]


def test_a_crash_fails_that_configuration_and_the_rest_are_verified(monkeypatch, mi355):
    """H = 19 launches h16 and h3. The child aborts on h16's case: h16 fails (SIGABRT, kept),
    a second child verifies h3 (passes, kept); the call runs "xla" with one warning."""
    monkeypatch.setenv(self_check.FAULT_ENV, "abort:jsm_sparse_mla_h16_l1")
    message = "kernel jsm_sparse_mla_h16_l1 failed its self-check on AMD Instinct MI355X (case"
    assert lower(19, message) == []
    verdicts = disk()["verdicts"]
    h16, h3 = verdicts["jsm_sparse_mla_h16_l1"], verdicts["jsm_sparse_mla_h3_l1"]
    assert h16.status == "fail" and "killed by SIGABRT (Aborted)" in h16.error
    assert h16.case == self_check.PLAN["jsm_sparse_mla_h16_l1"][0].name
    assert h3.status == "pass" and h3.error is None and h3.ratio == 0
    assert lower(19, None) == []  # decided: no second warning, no child
    new_process(monkeypatch)
    no_child(monkeypatch)
    assert lower(3, None) == ["jsm_sparse_mla"]  # h3's kept pass
    assert lower(19, "killed by SIGABRT") == []  # h16's kept failure, warned again


def test_a_hang_is_retried_once_then_fails(monkeypatch, mi355):
    monkeypatch.setenv(self_check.FAULT_ENV, "hang:jsm_sparse_mla_h3_l1")
    monkeypatch.setenv(_verdicts.TIMEOUT_ENV, "15")
    message = "could not be verified on AMD Instinct MI355X now (case 'H3, rows of"
    assert lower(3, message) == []
    assert lower(3, None) == []  # this process: the retry verdict, no new child
    record = disk()
    assert "jsm_sparse_mla_h3_l1" not in record["verdicts"]
    assert record["timeouts"] == {"jsm_sparse_mla_h3_l1": 1}
    new_process(monkeypatch)
    assert lower(3, "ran past its limit of 15 s per case") == []
    v = disk()["verdicts"]["jsm_sparse_mla_h3_l1"]
    assert v.status == "fail" and "for the second time" in v.error


def test_out_of_memory_is_reported_and_not_kept(monkeypatch, mi355):
    monkeypatch.setenv(self_check.FAULT_ENV, "oom:jsm_sparse_mla_h3_l1")
    assert lower(3, "could not be verified on AMD Instinct MI355X now") == []
    w = _verdicts.message(_verdicts._KNOWN[MI355.device_kind, "jsm_sparse_mla_h3_l1"], "x")
    assert "RESOURCE_EXHAUSTED" in w and "checked again in a later process" in w
    assert disk() == {"verdicts": {}, "timeouts": {}}
    # A later process without the fault verifies it and runs the kernel.
    monkeypatch.delenv(self_check.FAULT_ENV)
    new_process(monkeypatch)
    assert lower(3, None) == ["jsm_sparse_mla"]
    assert disk()["verdicts"]["jsm_sparse_mla_h3_l1"].status == "pass"


def test_library_without_the_kernel_falls_back_and_flydsl_names_the_build_command(
    monkeypatch, mi355
):
    monkeypatch.setattr(ffi, "library_kernels", lambda: frozenset())
    no_child(monkeypatch)
    assert (
        lower(
            3,
            "kernel jsm_sparse_mla_h3_l1 failed its self-check on AMD Instinct MI355X "
            "(no case ran: "
            "the FFI library has no jsm_sparse_mla_h3_l1 kernel (0 kernels linked); build the "
            "kernels and relink: python -m jax_sparse_mla.build --arch gfx950 --link)",
        )
        == []
    )
    with pytest.raises(RuntimeError, match="no jsm_sparse_mla kernel.*jax_sparse_mla.build"):
        jsm.sparse_mla(*sparse_args(), implementation="flydsl")


def test_verdicts_are_per_device_library_and_check(monkeypatch, mi355):
    v = _verdicts.Verdict("jsm_sparse_mla_h3_l1", "pass", "c", 0.5, None)
    with _verdicts.DiskVerdicts(MI355.device_kind).update() as record:
        record["verdicts"][v.symbol] = v
    assert disk()["verdicts"] == {v.symbol: v}
    assert disk("AMD Instinct MI300X")["verdicts"] == {}
    assert _verdicts.DiskVerdicts(MI355.device_kind, "0" * 64).read()["verdicts"] == {}
    monkeypatch.setattr(_verdicts, "check_hash", lambda: "another check")
    assert disk()["verdicts"] == {}
    monkeypatch.setenv(_verdicts.CACHE_ENV, "off")
    assert _verdicts.DiskVerdicts(MI355.device_kind).path is None


# ---------------------------------------------------------------------------------------------
# The layering: the platform choice reads verdicts without importing the ops
# ---------------------------------------------------------------------------------------------


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("module", ["_platform.py", "_verdicts.py"])
def test_the_platform_choice_imports_no_op_and_no_self_check(module):
    names = imported_modules(ROOT / "jax_sparse_mla" / module)
    for op in ("self_check", "sparse_mla", "mla_decode", "ultraquant", "sharding"):
        assert not any(n.startswith(f"jax_sparse_mla.{op}") for n in names), (module, names)


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
