"""benchmarks/bench.py: a --quick CPU run writes the JSON it promises, and its peer adapters hand
FlashMLA the fp8_ds_mla bytes in FlashMLA's layout and aiter's gluon MLA decode the fp8 rows in
its layout (checked against torch stand-ins that follow each interface as documented, since
FlashMLA needs a Hopper GPU and aiter an MI355); the side-by-side table marks absent peers."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

import jax_sparse_mla as jsm
from tests.cpu_subprocess import REPO, run_on_cpu

BENCH = REPO / "benchmarks" / "bench.py"


@functools.cache
def _load_bench():
    """benchmarks/bench.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("jsm_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_quick_run_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--implementations", "xla", "--profiler"]
    done = run_on_cpu([*cmd, "--json", str(out)])
    report = json.loads(out.read_text())

    assert report["schema"] == 1
    assert "--quick" in report["command"] and report["argv"][-1] == str(out)
    assert report["settings"]["profiler"]
    env_ = report["environment"]
    for key in ("python", "jax", "jaxlib", "jax_plugins", "backend", "devices", "gpu", "git"):
        assert key in env_, key
    assert env_["jax"] == jax.__version__ and env_["python"] == sys.version.split()[0]
    assert isinstance(env_["jax_plugins"], dict)
    assert env_["backend"]["name"] == "cpu"
    assert {"nvidia_smi", "rocm_smi", "error"} <= set(env_["gpu"])
    assert report["settings"]["timing"].startswith("median / min")
    assert "times: median / min" in done.stdout
    assert set(env_["git"]) >= {"head", "dirty", "source_sha256"}
    assert env_["git"]["source_sha256"] == _load_bench().source_sha256()  # the sources that ran
    if shutil.which("git") and (REPO / ".git").exists():
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        assert env_["git"]["head"] == head and isinstance(env_["git"]["dirty"], bool)
    if importlib.util.find_spec("flash_mla") is None:
        assert "FlashMLA not importable" in done.stdout
        assert env_["flashmla"].startswith("FlashMLA not importable")
    assert report["settings"]["quick"] and report["settings"]["samples"] >= 10
    assert report["copy_bandwidth_Bps"] > 0
    assert 0 < report["dispatch_floor_s"] < 1 and "dispatch floor" in done.stdout

    rows = report["rows"]
    assert {r["op"] for r in rows} == {"sparse_mla", "mla_decode", "ultraquant_decode"}
    for r in rows:
        assert r["implementation"] == "xla" and not r["error"], r
        assert r["samples"] >= 10 and len(r["samples_s"]) == r["samples"]
        assert r["min_s"] > 0, r
        assert r["min_s"] <= r["p10_s"] <= r["median_s"] <= r["p90_s"] <= r["max_s"], r
        assert r["calls_per_sample"] >= 1 and r["bytes"] > 0 and r["flops"] > 0
        assert r["bandwidth_Bps"] > 0 and r["tflops"] > 0
        prof = r["profiler"]  # trace timestamps, or why there are none
        assert isinstance(prof, dict) and ("median_s" in prof or prof["error"]), prof
        if "median_s" in prof:
            assert 0 < prof["min_s"] <= prof["median_s"] <= prof["max_s"] and prof["method"]
            assert prof["kernels"] and all(k["median_s"] > 0 for k in prof["kernels"])
    main_table, pairs_table = done.stdout.split("side by side")
    table = [line for line in main_table.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows)  # header, separator, one line per row
    pairs = report["side_by_side"]
    assert [(p["op"], p["case"]) for p in pairs] == [(r["op"], r["case"]) for r in rows]
    assert len([line for line in pairs_table.splitlines() if line.startswith("| ")]) == 2 + len(
        pairs
    )
    for p in pairs:
        assert p["ours"] == "xla" and p["ours_s"] > 0
        if importlib.util.find_spec("aiter") is None:
            assert p["aiter"]["absent"].startswith("aiter not importable"), p
        if importlib.util.find_spec("flash_mla") is None:
            assert p["flashmla"]["absent"].startswith("FlashMLA not importable"), p
    after = done.stdout.split("kernels of one call")[1].splitlines()[1:]
    kernels = [line for line in after if line.startswith("- ")]
    assert len(kernels) == sum("median_s" in r["profiler"] for r in rows), kernels


def test_default_implementations_are_native():
    bench = _load_bench()
    cpu = {"cpu"}
    assert bench.implementations_for("sparse_mla", None, cpu) == ["xla"]
    cuda = bench.implementations_for("sparse_mla", None, {"cpu", "cuda"})
    assert "xla" in cuda and "pallas" in cuda
    assert "gfx950_emulation" not in cuda and "flydsl" not in cuda
    assert bench.runs_natively("mosaic", {"cpu", "cuda"})
    assert not bench.runs_natively("mosaic", cpu)
    assert bench.implementations_for("mla_decode", ["xla", "nope"], cpu) == ["xla"]
    mi355 = {"cpu", "rocm", "gfx950"}
    for op in bench.OPS:
        assert bench.implementations_for(op, None, mi355) == ["xla", "flydsl"], op
    table = bench.table_implementations("ultraquant_decode")
    assert bench.implementations_for("ultraquant_decode", ["all"], cpu) == table


def _fake_flash_mla(torch):
    """FlashMLA's sparse fp8 decode as its interface documents it (flash_mla_interface.py at
    9241ae3), in plain torch, with the argument checks the real one makes."""

    class SchedMeta:
        have_initialized = False

    def get_mla_metadata(*args, **kwargs):
        return SchedMeta(), None

    def flash_mla_with_kvcache(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        tile_scheduler_metadata,
        num_splits=None,
        softmax_scale=None,
        causal=False,
        is_fp8_kvcache=False,
        indices=None,
    ):
        assert isinstance(tile_scheduler_metadata, SchedMeta) and num_splits is None
        assert is_fp8_kvcache and not causal and indices is not None and head_dim_v == 512
        b, s_q, h_q, d_qk = q.shape
        assert q.dtype == torch.bfloat16 and d_qk == 576 and h_q in (64, 128)
        assert k_cache.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn)
        assert k_cache.ndim == 4 and k_cache.shape[2:] == (1, 656) and k_cache.stride(1) == 656
        assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q)
        flat = k_cache.reshape(-1, 656).view(torch.uint8)
        rows = flat.shape[0]
        codes = flat[:, :512].contiguous().view(torch.float8_e4m3fn).float()
        scales = flat[:, 512:528].contiguous().view(torch.float32)  # [rows, 4]
        rope = flat[:, 528:].contiguous().view(torch.bfloat16).float()
        latent = (codes.view(rows, 4, 128) * scales[:, :, None]).view(rows, 512)
        keys = torch.cat([latent, rope], dim=1)  # [rows, 576]
        invalid = (indices < 0) | (indices >= rows)
        gathered = keys[indices.clamp(0, rows - 1).long()]  # [b, s_q, topk, 576]
        scale = softmax_scale if softmax_scale is not None else d_qk**-0.5
        scores = torch.einsum("bshd,bskd->bshk", q.float(), gathered) * scale
        scores = scores.masked_fill(invalid[:, :, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [b, s_q, h_q]
        p = torch.exp(scores - lse[..., None])
        out = torch.einsum("bshk,bskd->bshd", p, gathered[..., :512])
        return out.to(torch.bfloat16), lse.transpose(1, 2)

    return types.SimpleNamespace(
        __version__="fake",
        get_mla_metadata=get_mla_metadata,
        flash_mla_with_kvcache=flash_mla_with_kvcache,
    )


def test_flashmla_adapter_layout():
    torch = pytest.importorskip("torch")
    bench = _load_bench()
    fm = bench.FlashMLA(_fake_flash_mla(torch), torch)
    shapes = dataclasses.replace(bench.QUICK, sparse=((3, 16), (2, 128)))
    cases = list(bench.sparse_mla_cases(jax.random.key(1), shapes))
    for case in cases:
        data = case.flashmla
        q, kv, idx, indptr = case.args
        want_out, want_lse = jsm.sparse_mla(
            q, kv, idx, indptr, sm_scale=data["sm_scale"], return_lse=True, implementation="xla"
        )
        launch, sync, outputs, note = fm.prepare(
            data["q"], data["kv"], data["topk_idx"], data["sm_scale"]
        )
        result = launch()
        sync(result)
        out, lse = outputs(result)
        h = case.params["H"]
        assert tuple(out.shape) == (case.params["n_q"], h, 512)
        assert tuple(lse.shape) == (case.params["n_q"], h)
        assert ("padded 16 -> 64" in note) == (h == 16)
        want_out = np.asarray(want_out, np.float32)
        scale = np.abs(want_out).max()
        np.testing.assert_allclose(out.float().cpu().numpy(), want_out, atol=2**-7 * scale)
        np.testing.assert_allclose(lse.cpu().numpy(), np.asarray(want_lse), rtol=1e-4, atol=1e-3)

    # The row the benchmark writes for FlashMLA, after the jax implementations of the case.
    args = bench.parse_args(["--quick", "--implementations", "xla", "--profiler"])
    ctx = {
        "args": args,
        "copy_bps": 1e9,
        "flashmla": fm,
        "jax_flush": None,
        "torch_flush": lambda fm: None,
    }
    rows = bench.bench_case(cases[0], ["xla"], ctx)
    assert [r["implementation"] for r in rows] == ["xla", "flashmla"]
    row = rows[1]
    assert not row["error"], row
    assert row["diff_vs"] == "xla" and "padded 16 -> 64" in row["note"]
    assert 0 <= row["max_abs_diff"] < 1 and 0 <= row["lse_max_abs_diff"] < 1e-2
    assert 0 < row["min_s"] <= row["median_s"] <= row["max_s"]
    # The profiler times the jax rows; FlashMLA's calls (the stand-in's torch ops on the same
    # device) only where the trace has a device plane: on a GPU, not on the CPU backend.
    assert rows[0]["profiler"]["median_s"] > 0
    if jax.default_backend() == "gpu":
        assert row["profiler"]["median_s"] > 0 and row["profiler"]["kernels"], row["profiler"]
    else:
        assert "no event of a device outside XLA" in row["profiler"]["error"]


def _fake_gluon_mla(torch, seen: list):
    """aiter's ``mla_decode_gluon`` as ``aiter/ops/triton/gluon/README.md`` documents it (fp8
    KV, 1-D ``kv_indices`` / ``kv_indptr`` view, ``kv_scale`` folded into the scores, natural-log
    LSE), in plain torch, with the checks of its documented layout; records its keywords."""

    def mla_decode_gluon(
        q_nope,
        q_pe,
        kv_c,
        o,
        page_table,
        seq_info,
        sm_scale,
        k_pe=None,
        kv_pe_offset=512,
        use_2d_view=True,
        kv_scale=1.0,
        min_kv_seq_len=1,
        return_lse=False,
        num_kv_splits=None,
    ):
        seen.append({"use_2d_view": use_2d_view, "kv_scale": kv_scale, "return_lse": return_lse})
        assert not use_2d_view and k_pe is None and kv_pe_offset == 512 and return_lse
        assert kv_c.dtype == torch.float8_e4m3fn and kv_c.ndim == 2 and kv_c.shape[1] == 576
        batch, heads, _ = q_nope.shape
        assert q_nope.dtype == q_pe.dtype == torch.bfloat16 and q_pe.shape == (batch, heads, 64)
        assert page_table.dtype == seq_info.dtype == torch.int32 and page_table.ndim == 1
        assert seq_info.shape == (batch + 1,) and o.shape == (batch, heads, 512)
        keys = kv_c.float()
        lse = torch.empty((batch, heads))
        for b in range(batch):
            k = keys[page_table[seq_info[b] : seq_info[b + 1]].long()]
            q = torch.cat([q_nope[b], q_pe[b]], dim=-1).float()
            scores = q @ k.T * (sm_scale * kv_scale)
            lse[b] = torch.logsumexp(scores, dim=-1)
            o[b] = (torch.softmax(scores, dim=-1) @ k[:, :512]).to(torch.bfloat16)
        return o, lse

    return mla_decode_gluon


def test_aiter_adapter_layout_and_the_side_by_side_table():
    torch = pytest.importorskip("torch")
    bench = _load_bench()
    seen = []
    ai = bench.Aiter(types.SimpleNamespace(__version__="fake"), torch, _fake_gluon_mla(torch, seen))
    shapes = dataclasses.replace(bench.QUICK, decode_heads=(16,))
    cases = list(bench.mla_decode_cases(jax.random.key(2), shapes))
    one, two = cases  # qlen 1 and 2
    assert ai.unsupported(one) is None
    assert "qlen 1 only" in ai.unsupported(two)
    sparse = next(bench.sparse_mla_cases(jax.random.key(2), bench.QUICK))
    assert ai.unsupported(sparse) == "no aiter kernel wired for sparse_mla"
    assert "no mla_decode_gluon" in bench.Aiter(
        None, torch, None, "no mla_decode_gluon: X"
    ).unsupported(one)

    launch, sync, outputs, note = ai.prepare_case(one)
    result = launch()
    sync(result)
    out, lse = outputs(result)
    assert seen[-1]["kv_scale"] == bench.DECODE_K_SCALE and "v_scale" in note
    want_out, want_lse = one.fn(*one.args, implementation="xla")
    want_out = np.asarray(want_out, np.float32)
    np.testing.assert_allclose(out.numpy(), want_out, atol=2**-7 * np.abs(want_out).max())
    np.testing.assert_allclose(lse.numpy(), np.asarray(want_lse), rtol=1e-4, atol=1e-3)

    args = bench.parse_args(["--quick", "--implementations", "xla"])
    ctx = {
        "args": args,
        "copy_bps": 1e9,
        "flashmla": None,
        "aiter": ai,
        "peer_status": {"flashmla": "FlashMLA not importable: test"},
        "jax_flush": None,
        "torch_flush": lambda peer: None,
    }
    rows = bench.bench_case(one, ["xla"], ctx) + bench.bench_case(two, ["xla"], ctx)
    assert [(r["case"][-12:], r["implementation"]) for r in rows] == [
        (one.name[-12:], "xla"),
        (one.name[-12:], "aiter"),
        (two.name[-12:], "xla"),
    ]
    assert not rows[1]["error"] and rows[1]["diff_vs"] == "xla" and rows[1]["max_abs_diff"] < 1
    pairs = bench.side_by_side(rows, ctx["absent"])
    assert pairs[0]["aiter"]["vs_ours"] == pytest.approx(rows[1]["median_s"] / rows[0]["median_s"])
    assert pairs[0]["flashmla"] == {"absent": "FlashMLA not importable: test"}
    assert "qlen 1 only" in pairs[1]["aiter"]["absent"]
    table = bench.side_by_side_table(pairs).splitlines()
    assert len(table) == 3 + 2 and "x ours)" in table[3] and "absent: aiter's gluon" in table[4]


def test_gpu_driver_from_either_tool():
    bench = _load_bench()
    nvidia = {"nvidia_smi": [{"driver_version": "580.1"}], "rocm_smi": None, "error": ""}
    rocm = {"nvidia_smi": None, "rocm_smi": {"system": {"Driver version": "6.12.12"}}, "error": ""}
    neither = {"nvidia_smi": None, "rocm_smi": None, "error": "x"}
    assert [bench.gpu_driver(g) for g in (nvidia, rocm, neither)] == ["580.1", "6.12.12", "n/a"]


POSITIVE_INTS = "must be a comma list of positive integers"


def _assert_rejected(bench, capsys, option: str, values, message: str):
    """Each of ``values`` for ``option`` makes bench's parser exit with "<option> <message>"."""
    for bad in values:
        with pytest.raises(SystemExit):
            bench.parse_args([option, bad])
        assert f"{option} {message}" in capsys.readouterr().err, (option, bad)


def test_decode_heads_option_sets_the_decode_cases_head_counts(capsys):
    bench = _load_bench()
    args = bench.parse_args(["--quick", "--decode-heads", "16,128"])
    assert args.decode_heads == (16, 128)
    assert bench.parse_args(["--quick"]).decode_heads is None  # the shapes' own (12)
    shapes = dataclasses.replace(bench.QUICK, decode_heads=args.decode_heads)
    cases = list(bench.mla_decode_cases(jax.random.PRNGKey(0), shapes))
    assert len(cases) == 2 * len(shapes.decode_qlens)
    for case in cases:
        q = case.args[0]
        assert q.shape == (case.params["B"] * case.params["qlen"], case.params["H"], 576)
        assert case.name.endswith(f"H={case.params['H']}")
    assert {c.params["H"] for c in cases} == {16, 128}
    _assert_rejected(bench, capsys, "--decode-heads", ("", "12,x", "0", "-4"), POSITIVE_INTS)


def test_batches_option_sets_both_decode_ops_batch_sizes(capsys):
    bench = _load_bench()
    args = bench.parse_args(["--quick", "--batches", "1,3"])
    assert args.batches == (1, 3)
    assert bench.parse_args(["--quick"]).batches is None  # the shapes' own
    shapes = dataclasses.replace(bench.QUICK, decode_batches=args.batches, uq_batches=args.batches)
    key = jax.random.PRNGKey(0)
    decode = list(bench.mla_decode_cases(key, shapes))
    assert sorted({c.params["B"] for c in decode}) == [1, 3]
    for case in decode:
        assert case.args[3].shape == (case.params["B"] + 1,)  # kv_indptr
    uq = list(bench.ultraquant_cases(key, shapes))
    assert [c.params["B"] for c in uq] == [1, 3]
    assert [c.args[0].shape[0] for c in uq] == [1, 3]
    _assert_rejected(bench, capsys, "--batches", ("", "1,x", "0"), POSITIVE_INTS)


def test_sparse_option_picks_the_sparse_mla_cases(capsys):
    bench = _load_bench()
    args = bench.parse_args(["--quick", "--sparse", "2x16,3x8"])
    assert args.sparse == ((2, 16), (3, 8))
    assert bench.parse_args(["--quick"]).sparse is None  # the shapes' own
    shapes = dataclasses.replace(bench.QUICK, sparse=args.sparse)
    cases = list(bench.sparse_mla_cases(jax.random.PRNGKey(0), shapes))
    assert [(c.params["n_q"], c.params["H"]) for c in cases] == [(2, 16), (3, 8)]
    assert [c.args[0].shape for c in cases] == [(2, 16, 576), (3, 8, 576)]
    bad = ("", "16", "1x16x2", "1x0", "ax16", "1x16,")
    _assert_rejected(bench, capsys, "--sparse", bad, "must be a comma list of n_qxH cases")


def test_dispatch_cost_prints_a_row_per_chain_length():
    script = REPO / "benchmarks" / "dispatch_cost.py"
    cmd = [sys.executable, str(script), "--kernels", "1,4", "--samples", "10", "--sample-ms", "2"]
    rows = [line for line in run_on_cpu(cmd).stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 4  # header, separator, k = 1 and 4
    one, four = (row.strip("| ").split(" | ") for row in rows[2:])
    assert one[0] == "1" and four[0] == "4"
    assert float(one[2]) > 0 and float(four[2]) > 0 and four[5]  # us per step past k = 1


def _trace(*lines, plane="/device:GPU:0"):
    """A stand-in for jax.profiler.ProfileData: lines of (name, [(start, duration, stats[,
    event name])]) (event name "ev" where not given)."""
    ns = types.SimpleNamespace
    return ns(
        planes=[
            ns(
                name=plane,
                lines=[
                    ns(
                        name=name,
                        events=[
                            ns(name=ev, start_ns=t, duration_ns=d, stats=list(stats.items()))
                            for t, d, stats, ev in (
                                e if len(e) == 4 else (*e, "ev") for e in events
                            )
                        ],
                    )
                    for name, events in lines
                ],
            )
        ]
    )


def test_kernels_per_call_name_each_kernel_with_its_median_and_count():
    bench = _load_bench()
    mod = {"hlo_module": "jit_bench_op"}
    us = 1000  # ns
    # Two calls, one per stream: a fusion, a kernel, a fusion run twice; and another module.
    first = [(0, 7 * us, mod, "fusion"), (10, 40 * us, mod, "kernel")]
    first += [(20, 5 * us, mod, "prep"), (25, 5 * us, mod, "prep")]
    second = [(30, 9 * us, mod, "fusion"), (40, 44 * us, mod, "kernel")]
    second += [(50, 6 * us, mod, "prep"), (55, 6 * us, mod, "prep")]
    second += [(60, 999 * us, {"hlo_module": "jit_other"}, "other")]
    trace = _trace(("Stream #1", first), ("Stream #2", second))
    got = bench.kernels_per_call(trace, "bench_op", calls=2)
    # By share of a call: the fusion's 8 us once come after prep's 5.5 us twice.
    assert [k["name"] for k in got] == ["kernel", "prep", "fusion"]
    assert [k["per_call"] for k in got] == [1, 2, 1]
    assert [k["median_s"] for k in got] == pytest.approx([42e-6, 5.5e-6, 8e-6])
    row = {"op": "sparse_mla", "case": "n_q=1", "implementation": "mosaic"}
    table = bench.kernels_table([{**row, "profiler": {"kernels": got}}, row], top=2)
    assert table.splitlines()[1:] == ["- sparse_mla n_q=1 mosaic: kernel 42.0, prep 5.5 x2, 1 more"]


def test_profile_times_per_call_from_each_source_the_trace_has():
    times_from_profile = _load_bench().times_from_profile
    mod = {"hlo_module": "jit_bench_op"}
    # Two calls of two kernels each, plus another module's kernel (ignored).
    kernels = [(0, 3, mod), (10, 4, mod), (20, 5, mod), (30, 6, mod), (40, 99, {"hlo_module": "x"})]
    got, _ = times_from_profile(_trace(("Stream #1", kernels)), "bench_op", calls=2)
    assert got["times"] == pytest.approx([7e-9, 11e-9]) and "per call" in got["method"]
    got, _ = times_from_profile(
        _trace(("Stream #1", kernels[:2]), ("Stream #2", kernels[2:])), "bench_op", calls=2
    )
    assert got["times"] == pytest.approx([7e-9, 11e-9])  # the same calls on two streams
    got, _ = times_from_profile(_trace(("Stream #1", kernels[:3])), "bench_op", calls=2)
    assert got["times"] == pytest.approx([6e-9]) and "(their union) / 2 calls" in got["method"]
    overlapping = [(0, 3, mod), (1, 4, mod), (20, 5, mod)]  # 3 events for 2 calls: 5 + 5 ns
    got, _ = times_from_profile(_trace(("Stream #1", overlapping)), "bench_op", calls=2)
    assert got["times"] == pytest.approx([5e-9])  # the overlap counted once, not 12 / 2
    with_runs = [(t, d, {**s, "run_id": t // 20}) for t, d, s in kernels[:4]]
    got, _ = times_from_profile(_trace(("Stream #1", with_runs)), "bench_op", calls=2)
    assert got["times"] == pytest.approx([14e-9, 16e-9]) and "run_id" in got["method"]
    modules = _trace(("XLA Modules", [(0, 50, {})]), ("Stream #1", kernels))
    modules.planes[0].lines[0].events[0].name = "jit_bench_op(123)"
    got, _ = times_from_profile(modules, "bench_op", calls=1)
    assert got["times"] == pytest.approx([50e-9]) and got["method"] == "XLA Modules events"
    got, why = times_from_profile(_trace(("Stream #1", kernels[4:])), "bench_op", calls=2)
    assert got is None and "no event of module bench_op" in why


def test_profile_of_kernels_outside_xla_leaves_out_modules_and_the_flush():
    """FlashMLA's calls (module None): the device events of no XLA module, less the flush's."""
    bench = _load_bench()
    mod = {"hlo_module": "jit_bench_op"}
    # Two calls of (flush, metadata kernel, decode kernel), and an XLA kernel in between.
    call = [(0, 50, {}, "flush"), (60, 2, {}, "meta"), (70, 9, {}, "decode")]
    second = [(t + 100, d, s, n) for t, d, s, n in call]
    trace = _trace(("Stream #7", [*call, (90, 99, mod, "xla"), *second]))
    got, _ = bench.times_from_profile(trace, None, calls=2, skip=frozenset({"flush"}))
    assert got["times"] == pytest.approx([11e-9, 11e-9]) and "2 events per call" in got["method"]
    kernels = bench.kernels_per_call(trace, None, calls=2, skip=frozenset({"flush"}))
    assert [(k["name"], k["per_call"]) for k in kernels] == [("decode", 1), ("meta", 1)]
    got, _ = bench.times_from_profile(trace, None, calls=2)  # the flush counted when not skipped
    assert got["times"] == pytest.approx([61e-9, 61e-9])
    # The host plane (the CPU backend) holds no device's kernels: nothing to time there.
    got, why = bench.times_from_profile(_trace(("t", call), plane="/host:CPU"), None, calls=2)
    assert got is None and "no event of a device outside XLA" in why
    summary = bench.profiler_summary(None, why)
    assert summary == {"error": why}


def test_busy_time_counts_overlapping_kernels_once():
    """A kernel launched early to wait on the one before it (FlashMLA's combine) overlaps it."""
    busy_ns = _load_bench().busy_ns
    assert busy_ns([(0, 10), (20, 5)]) == 15  # apart: the sum
    assert busy_ns([(0, 10), (4, 10)]) == 14  # overlapping: the union
    assert busy_ns([(5, 2), (0, 10), (30, 1)]) == 11  # inside another, in any order
    assert busy_ns([]) == 0
