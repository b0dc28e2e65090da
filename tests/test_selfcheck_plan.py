"""The self-check's plan (``self_check.PLAN``) run through the recording HIP: every kernel code
object the library holds (the diagnostic probes aside) must be launched by the plan, each case
must launch its own configuration, and the mla_decode cases must give every split of their long
requests at least 3 softmax blocks (128 keys; 64 for the 128-row kernel: the second LDS slot,
its prefetch and the rescale by an earlier maximum run). A new configuration without cases
fails here.

The kernels do not run (the recording HIP logs their launches), so only the "flydsl" side of
each case runs; its outputs are not compared.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from jax_sparse_mla import self_check
from jax_sparse_mla._build import build_lib
from jax_sparse_mla.emulation.bounds import decode_split_keys
from jax_sparse_mla.kernels.gfx950 import configs
from tests.recording import register_for_cpu, run_recorded


def run_driver(library: str) -> list[dict]:
    """The subprocess: every case of the plan with "flydsl", its launches recorded."""
    import jax

    _, take = register_for_cpu(library)
    result = []
    for symbol, cases in self_check.PLAN.items():
        for case in cases:
            run, _ = case.setup()
            jax.block_until_ready(run("flydsl"))
            launches = [
                {"kernel": e["kernel"], "packed": {f"{n}:{k}": v for n, k, v in e["packed"]}}
                for e in take()
                if e["event"] == "launch"
            ]
            result.append({"symbol": symbol, "case": case.name, "launches": launches})
    return result


@pytest.fixture(scope="module")
def plan_launches(tmp_path_factory):
    return run_recorded(__file__, tmp_path_factory.mktemp("ffi"), timeout=1200)


def test_the_plan_launches_every_code_object_of_the_library(plan_launches):
    launched = {launch["kernel"] for case in plan_launches for launch in case["launches"]}
    held = {k["symbol"] for k in build_lib.manifest_kernels(build_lib.DEFAULT_KERNEL_DIR)}
    probes = set(configs.symbols()["probe"])
    assert held - probes - launched == set(), "code objects no self-check case launches"
    assert launched == set(configs.user_symbols())


def test_each_case_launches_its_own_configuration(plan_launches):
    assert len(plan_launches) == sum(len(c) for c in self_check.PLAN.values())
    for case in plan_launches:
        kernels = [launch["kernel"] for launch in case["launches"]]
        assert case["symbol"] in kernels, case
        if "partials" in case["symbol"]:
            assert kernels == [case["symbol"]]
        if case["symbol"].startswith("jsm_sparse_mla"):  # l1: S > 1 splits and the combine
            combine = [configs.MLA_DECODE_COMBINE] if case["symbol"].endswith("_l1") else []
            assert kernels == [case["symbol"], *combine]


def sparse_cases(plan_launches, lse: bool) -> list[dict]:
    return [
        c
        for c in plan_launches
        if c["symbol"].startswith("jsm_sparse_mla") and c["symbol"].endswith(f"_l{int(lse)}")
    ]


@pytest.mark.parametrize("lse", [False, True])
def test_sparse_cases_split_and_group(plan_launches, lse):
    """The l1 cases run S > 1 splits (several; some of them without keys: the 1-key row, the
    empty row, the 300-key row's tail) and the combine; the l0 cases S = 1 with one row of
    2100 keys (17 tiles, 9 passes of the index scan); the h16 cases 2 or 3 head groups in one
    launch."""
    for case in sparse_cases(plan_launches, lse):
        sparse, *_ = case["launches"]
        a = sparse["packed"]
        n_q, splits, groups = a["n_q:i32"], a["num_splits:i32"], a["head_groups:i32"]
        h = int(case["symbol"].split("_h")[1].split("_")[0])
        assert groups == ((2 + (not lse)) if h == 16 else 1)
        assert (splits >= 8) if lse else (splits == 1)
        q, _, idx, indptr = self_check.sparse_inputs(0, groups * h, lse)
        assert n_q == q.shape[0] and a["nnz:i32"] == idx.shape[0]
        lengths = np.diff(np.asarray(indptr))
        assert max(lengths) == 2100
        chunk = 64 * -(-lengths // (64 * splits))
        keys = np.minimum(
            np.maximum(lengths[:, None] - chunk[:, None] * np.arange(splits), 0), chunk[:, None]
        )
        per_row = (keys > 0).sum(axis=1)
        assert (keys.sum(axis=1) == lengths).all()
        if lse:
            assert per_row.max() >= 7 and per_row[1] == 1 and (keys == 0).any()  # empty splits


@pytest.mark.parametrize("qlen", configs.MLA_DECODE_QLENS)
def test_decode_cases_reach_three_blocks_in_every_split(plan_launches, qlen):
    symbol = configs.mla_decode_partials_launch(qlen, configs.MLA_DECODE_ROWS)
    (case,) = [c for c in plan_launches if c["symbol"] == symbol]
    (launch,) = case["launches"]
    splits = launch["packed"]["num_splits:i32"]
    assert splits == self_check.DECODE_SPLITS >= 2
    _, kv, idx, indptr = self_check.decode_inputs(0, qlen)  # seq lens do not depend on the seed
    blocks: dict[int, list[int]] = {}
    for row, _, _, n_blocks in decode_split_keys(idx, indptr, len(kv), qlen, splits):
        if row % qlen == 0:  # one row per request
            blocks.setdefault(row // qlen, []).append(n_blocks)
    seq = np.diff(np.asarray(indptr))
    assert seq[0] == 0  # an empty request
    for request in (1, 2):  # rising and falling scores
        assert min(blocks[request]) >= 3 and len(blocks[request]) == splits, blocks


def test_m128_cases_reach_three_blocks_in_every_split(plan_launches):
    """The 128-row kernel's cases: H = 128 and 256 (one and two head groups), qlen 1, 2 or more
    splits, each split of the rising and falling requests 3 or more 64-key blocks (the running
    max moves between blocks), an empty request; one of them with a negative sm_scale."""
    cases = [c for c in plan_launches if c["symbol"] == configs.MLA_DECODE_M128]
    heads, scales = set(), set()
    for case in cases:
        (launch,) = case["launches"]
        a = launch["packed"]
        h, splits = a["num_heads:i32"], a["num_splits:i32"]
        heads.add(h)
        scales.add(np.sign(np.array(a["sm_scale:f32"], np.uint32).view(np.float32)))
        assert splits >= 2
        _, kv, idx, indptr = self_check.decode_inputs(0, 1, h)
        assert configs.mla_decode_rows(1, h, len(indptr) - 1, len(idx), 256) == 128
        assert a["num_requests:i32"] == len(indptr) - 1 and np.diff(np.asarray(indptr))[0] == 0
        blocks: dict[int, list[int]] = {}
        for row, _, _, n_blocks in decode_split_keys(idx, indptr, len(kv), 1, splits, 64):
            blocks.setdefault(row, []).append(n_blocks)
        for request in (1, 2):
            assert min(blocks[request]) >= 3 and len(blocks[request]) == splits, blocks
    assert heads == {128, 256} and scales == {-1.0, 1.0}


if __name__ == "__main__":
    print(json.dumps(run_driver(sys.argv[1])))
