"""The FFI handlers' launches, recorded on the CPU.

The recording library (``build_lib.build_library(..., recording=True)``) is the handler code and
the real FlyDSL objects of ``build/gfx950`` with a HIP whose ``hipModuleLaunchKernel`` logs what
it would launch: kernel, grid, block, stream, the handler's packed ``void **args`` (by the
export ABI) and the kernel arguments the FlyDSL host code passes on. Its handlers run on XLA CPU.

Registering them for the CPU is process-wide, so the scenarios run in a subprocess (this file
run as a script prints one JSON object); the tests compare its log with what each kernel
module's launch ABI says. Needs the kernel build (``python -m jax_sparse_mla.build --arch
gfx950``) and a C++ compiler.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import sys

import numpy as np
import pytest

from jax_sparse_mla.kernels.gfx950 import configs
from tests.recording import register_for_cpu, run_recorded

# kv_indices' length at which 2 or 3 requests of 128 or 256 heads get the 128-row kernel on
# 256 CUs (configs.mla_decode_rows: the GPU filled with splits of 2048 keys)
M128_N = configs.MLA_DECODE_M128_MIN_SPLIT_KEYS * configs.MI355X_CUS

RECORDING_STREAM = 0x5157  # the stand-in stream of the recording build (handlers.cc)
BIG_RECORDS = 6_600_000  # 4.33 GB of fp8_ds_mla records: byte offsets past 2^32
INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Scenarios (run in the subprocess): name -> (function of the arrays, the arrays)
# ---------------------------------------------------------------------------------------------


def scenarios():
    import jax
    import jax.numpy as jnp

    import jax_sparse_mla as jsm

    def sparse(n_q, h, rows, nnz, return_lse):
        args = dict(
            q=jnp.ones((n_q, h, 576), jnp.bfloat16),
            kv=jnp.zeros((rows, 656), jnp.uint8),
            idx=jnp.arange(nnz, dtype=jnp.int32) % max(rows, 1),
            indptr=jnp.asarray(np.linspace(0, nnz, n_q + 1).astype(np.int32)),
        )
        fn = jax.jit(
            lambda q, kv, idx, indptr: jsm.sparse_mla(
                q,
                kv,
                idx,
                indptr,
                sm_scale=0.125,
                return_lse=return_lse,
                implementation="flydsl",
            )
        )
        return fn, args

    def decode(batch, qlen, h, splits, tokens, n_idx=0):
        """Requests over kv_indices' first 2 tokens entries; ``n_idx``: its length (longer:
        padding, never read; the length picks the 128-row kernel at H = 128)."""
        args = dict(
            q=jnp.ones((batch * qlen, h, 576), jnp.bfloat16),
            kv=jnp.zeros((tokens, 576), jnp.uint8),  # codes (e4m3fn would be bitcast: a copy)
            kv_indices=jnp.arange(max(n_idx, 2 * tokens), dtype=jnp.int32) % tokens,
            kv_indptr=jnp.asarray(np.linspace(0, 2 * tokens, batch + 1).astype(np.int32)),
        )
        fn = jax.jit(
            lambda q, kv, i, p: jsm.mla_decode(
                q,
                kv,
                i,
                p,
                qlen=qlen,
                k_scale=0.5,
                v_scale=2.0,
                sm_scale=0.1,
                num_splits=splits,
                implementation="flydsl",
            )
        )
        return fn, args

    def ultraquant(batch, hk, g, block_size, parts):
        args = dict(
            q=jnp.ones((batch, hk * g, 256), jnp.bfloat16),
            cache=jnp.zeros((5, block_size, hk, 272), jnp.uint8),
            block_tables=jnp.asarray(np.arange(3 * batch, dtype=np.int32).reshape(batch, 3) % 5),
            seq_lens=jnp.asarray(np.arange(batch, dtype=np.int32) * 7 + 3),
        )
        fn = jax.jit(
            lambda q, c, t, s: jsm.ultraquant_decode(
                q, c, t, s, sm_scale=0.0625, num_partitions=parts, implementation="flydsl"
            )
        )
        return fn, args

    def probe(a_format):
        from jax_sparse_mla.ffi.calls import mfma_probe

        args = dict(
            a=jnp.zeros((64, 32), jnp.uint8),
            b=jnp.zeros((64, 32), jnp.uint8),
            scales=jnp.full((64, 2), 127, jnp.int32),
        )
        return jax.jit(functools.partial(mfma_probe, a_format=a_format)), args

    def tr_probe(bits):
        from jax_sparse_mla.ffi.calls import ds_read_tr_probe

        args = dict(lds=jnp.zeros((1024,), jnp.uint8), addrs=jnp.arange(64, dtype=jnp.int32) * 8)
        return jax.jit(functools.partial(ds_read_tr_probe, bits=bits)), args

    return {
        "probe_f0": lambda: probe(0),
        "probe_f4": lambda: probe(4),
        "tr_probe_b8": lambda: tr_probe(8),
        "tr_probe_b16": lambda: tr_probe(16),
        "sparse_h20_lse": lambda: sparse(3, 20, 10, 7, True),
        "sparse_h1": lambda: sparse(2, 1, 10, 7, False),
        "sparse_h40_splits": lambda: sparse(2, 40, 10, 1000, False),
        "sparse_empty": lambda: sparse(0, 4, 10, 7, True),
        "sparse_big_cache": lambda: sparse(2, 16, BIG_RECORDS, 4, True),
        "decode_q2": lambda: decode(3, 2, 16, 4, 50),
        "decode_q1_h128": lambda: decode(2, 1, 128, 1, 20, M128_N),
        "decode_q1_h256": lambda: decode(3, 1, 256, 3, 30, M128_N),
        "decode_q1_h128_short": lambda: decode(2, 1, 128, 2, 20),
        "decode_q1_h20": lambda: decode(2, 1, 20, 2, 20),
        "ultraquant_g8": lambda: ultraquant(2, 2, 8, 32, 3),
        "ultraquant_g3": lambda: ultraquant(2, 2, 3, 16, 1),
    }


def bad_calls():
    """Direct custom calls with one wrong buffer each: (target, args, results, attrs)."""
    import jax
    import jax.numpy as jnp

    bf, f32, s32, u8 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.uint8

    def z(shape, dtype):
        return jnp.zeros(shape, dtype)

    def out(*shape_dtypes):
        return [jax.ShapeDtypeStruct(s, d) for s, d in shape_dtypes]

    sparse_ok = [z((2, 4, 576), bf), z((10, 656), u8), z((6,), s32), z((3,), s32)]
    partials_ok = [z((4, 16, 576), bf), z((9, 576), u8), z((9,), s32), z((3,), s32)]
    scales = dict(k_scale=np.float32(1), v_scale=np.float32(1), sm_scale=np.float32(1))
    uq_ok = [z((2, 16, 256), bf), z((4, 16, 2, 272), u8), z((2, 3), s32), z((2,), s32)]
    uq_parts = out(((2, 2, 1, 8, 256), bf), ((2, 2, 1, 8), f32), ((2, 2, 1, 8), f32))
    return {
        "sparse_q_dtype": ("jsm_sparse_mla", [z((2, 4, 576), f32), *sparse_ok[1:]],
                           out(((2, 4, 512), bf)), dict(sm_scale=np.float32(1))),
        "sparse_indptr": ("jsm_sparse_mla", [*sparse_ok[:3], z((2,), s32)],
                          out(((2, 4, 512), bf)), dict(sm_scale=np.float32(1))),
        "sparse_lse_shape": ("jsm_sparse_mla", sparse_ok,
                             out(((2, 1, 4, 512), bf), ((2, 1, 5), f32)),
                             dict(sm_scale=np.float32(1))),
        "sparse_out_shape": ("jsm_sparse_mla", sparse_ok, out(((2, 4, 512), bf)),
                             dict(sm_scale=np.float32(1))),
        "sparse_splits_without_lse": ("jsm_sparse_mla", sparse_ok, out(((2, 3, 4, 512), bf)),
                                      dict(sm_scale=np.float32(1))),
        "sparse_kv_record": ("jsm_sparse_mla", [sparse_ok[0], z((10, 576), u8), *sparse_ok[2:]],
                             out(((2, 4, 512), bf)), dict(sm_scale=np.float32(1))),
        "partials_qlen": ("jsm_mla_decode_partials", partials_ok,
                          out(((4, 2, 16, 512), bf), ((4, 2, 16), f32)),
                          dict(qlen=np.int32(3), cta_rows=np.int32(16), **scales)),
        "partials_q_rows": ("jsm_mla_decode_partials", partials_ok,
                            out(((4, 2, 16, 512), bf), ((4, 2, 16), f32)),
                            dict(qlen=np.int32(1), cta_rows=np.int32(16), **scales)),
        "partials_indptr": ("jsm_mla_decode_partials", [*partials_ok[:3], z((0,), s32)],
                            out(((4, 2, 16, 512), bf), ((4, 2, 16), f32)),
                            dict(qlen=np.int32(1), cta_rows=np.int32(16), **scales)),
        "partials_cta_rows": ("jsm_mla_decode_partials", partials_ok,
                              out(((4, 2, 16, 512), bf), ((4, 2, 16), f32)),
                              dict(qlen=np.int32(2), cta_rows=np.int32(32), **scales)),
        "partials_m128_heads": ("jsm_mla_decode_partials", partials_ok,
                                out(((4, 2, 16, 512), bf), ((4, 2, 16), f32)),
                                dict(qlen=np.int32(2), cta_rows=np.int32(128), **scales)),
        "combine_lse": ("jsm_mla_decode_combine", [z((3, 2, 4, 512), bf), z((3, 2, 5), f32)],
                        out(((3, 4, 512), bf), ((3, 4), f32)), {}),
        "uq_block_size": ("jsm_ultraquant_partials",
                          [uq_ok[0], z((4, 48, 2, 272), u8), *uq_ok[2:]], uq_parts,
                          dict(sm_scale=np.float32(1))),
        "uq_group": ("jsm_ultraquant_partials", [z((2, 10, 256), bf), *uq_ok[1:]], uq_parts,
                     dict(sm_scale=np.float32(1))),
        "uq_slot": ("jsm_ultraquant_partials", [uq_ok[0], z((4, 16, 2, 270), u8), *uq_ok[2:]],
                    uq_parts, dict(sm_scale=np.float32(1))),
        "probe_format": ("jsm_mfma_probe", [z((64, 32), u8), z((64, 32), u8), z((64, 2), s32)],
                         out(((64, 4), f32)), dict(a_format=np.int32(2))),
        "probe_scales": ("jsm_mfma_probe", [z((64, 32), u8), z((64, 32), u8), z((64,), s32)],
                         out(((64, 4), f32)), dict(a_format=np.int32(0))),
        "tr_probe_bits": ("jsm_ds_read_tr_probe", [z((1024,), u8), z((64,), s32)],
                          out(((64, 2), jnp.uint32)), dict(bits=np.int32(4))),
        "tr_probe_regs": ("jsm_ds_read_tr_probe", [z((1024,), u8), z((64,), s32)],
                          out(((64, 2), s32)), dict(bits=np.int32(8))),
        "reduce_out": ("jsm_ultraquant_reduce", [z((2, 2, 1, 8, 256), bf), z((2, 2, 1, 8), f32),
                                                 z((2, 2, 1, 8), f32)],
                       out(((2, 8, 256), bf)), {}),
    }  # fmt: skip


# The handlers' grids and grid checks through the recording build's jsm_record_grid:
# name -> (target, its quantities). Cases named after a scenario are compared with that
# scenario's launches; "<case>_at" is the largest grid within the HSA limit of 2^32 - 1
# work-items per dimension, "<case>_past" the next one. No handler call reaches the limit
# with less than 8 GiB of buffers: each grid grows with a result (sparse_mla's out is 16 GiB
# at n_q = 2^24, the reduce's 32 GiB at B = 2^26), and XLA CPU skips a custom call whose
# results are all empty (H = 0, say), so the checks are exercised here on their quantities.
GRID_CASES = {
    "sparse_h20_lse": ("jsm_sparse_mla", (3, 1, 1)),  # n_q, S, head groups
    "sparse_h40_splits": ("jsm_sparse_mla", (2, 8, 2)),
    "decode_q2": ("jsm_mla_decode_partials", (3, 16, 4, 2, 16)),  # B, H, S, qlen, CTA rows
    "decode_q1_h128": ("jsm_mla_decode_partials", (2, 128, 1, 1, 128)),
    "decode_q1_h256": ("jsm_mla_decode_partials", (3, 256, 3, 1, 128)),
    "decode_q1_h20": ("jsm_mla_decode_partials", (2, 20, 2, 1, 16)),
    "decode_q2_combine": ("jsm_mla_decode_combine", (6, 16)),  # n = B * qlen, H
    "ultraquant_g8": ("jsm_ultraquant_partials", (2, 2, 3)),  # B, Hk, P
    "ultraquant_g8_reduce": ("jsm_ultraquant_reduce", (2, 16)),  # B, Hq
    "sparse_at": ("jsm_sparse_mla", (2**24 - 8, 1, 1)),
    "sparse_past": ("jsm_sparse_mla", (2**24 - 7, 1, 1)),  # rounded up to 8: 2^24 workgroups
    "sparse_splits_at": ("jsm_sparse_mla", (2**18 - 1, 8, 8)),
    "sparse_splits_past": ("jsm_sparse_mla", (2**18, 8, 8)),
    "partials_at": ("jsm_mla_decode_partials", (2**20 - 1, 16, 8, 1, 16)),
    "partials_past": ("jsm_mla_decode_partials", (2**20, 16, 8, 1, 16)),
    "partials_m128_at": ("jsm_mla_decode_partials", (2**20 - 1, 128, 8, 1, 128)),
    "partials_m128_past": ("jsm_mla_decode_partials", (2**20, 128, 8, 1, 128)),
    "combine_at": ("jsm_mla_decode_combine", (2**24 - 1, 4)),
    "combine_past": ("jsm_mla_decode_combine", (2**24, 4)),
    "uq_at": ("jsm_ultraquant_partials", (2**26 - 1, 1, 1)),
    "uq_past": ("jsm_ultraquant_partials", (2**26, 1, 1)),
    "reduce_at": ("jsm_ultraquant_reduce", (2**26 - 1, 8)),
    "reduce_past": ("jsm_ultraquant_reduce", (2**26, 8)),
}


def run_driver(library: str) -> dict:
    """The subprocess: registers the recording library for the CPU, runs every scenario twice
    (the second run's events show whether code objects load again) and every bad call."""
    import jax

    lib, take = register_for_cpu(library)
    result = {}
    for name, make in scenarios().items():
        fn, args = make()
        pointers = {k: v.unsafe_buffer_pointer() for k, v in args.items()}
        jax.block_until_ready(fn(*args.values()))
        first = take()
        jax.block_until_ready(fn(*args.values()))
        result[name] = {"pointers": pointers, "events": first, "again": take()}
        del args
    errors = {}
    for name, (target, args, results, attrs) in bad_calls().items():
        try:
            jax.block_until_ready(jax.ffi.ffi_call(target, results)(*args, **attrs))
            errors[name] = None
        except Exception as e:  # noqa: BLE001  (the message is the result)
            errors[name] = str(e)
    result["errors"] = errors
    lib.jsm_record_grid.restype = ctypes.c_int
    grids = {}
    for name, (target, quantities) in GRID_CASES.items():
        q = (ctypes.c_int64 * 5)(*quantities)
        grid = (ctypes.c_int64 * 4)()
        message = ctypes.create_string_buffer(1024)
        rc = lib.jsm_record_grid(target.encode(), q, grid, message, len(message))
        grids[name] = {"rc": rc, "grid": list(grid), "message": message.value.decode()}
    result["grids"] = grids
    return result


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return run_recorded(__file__, tmp_path_factory.mktemp("ffi"), timeout=900)


def launches(events):
    return [e for e in events if e["event"] == "launch"]


def packed(event) -> dict:
    """name:kind -> value of the handler's packed arguments."""
    return {f"{n}:{k}": v for n, k, v in event["packed"]}


def f32_bits(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


def check_launch(event, kernel, grid, block):
    assert event["kernel"] == kernel
    assert event["grid"] == list(grid) and event["block"] == list(block)
    assert event["stream"] == RECORDING_STREAM and event["shared"] == 0


SPARSE_SCALARS = (
    "n_q:i32",
    "nnz:i32",
    "kv_rows:i32",
    "num_splits:i32",
    "head_groups:i32",
    "q_row_stride:i32",
    "q_head_stride:i32",
    "out_row_stride:i32",
    "out_head_stride:i32",
    "lse_row_stride:i32",
    "sm_scale:f32",
)


def sparse_grid(n_q, splits, groups):
    """One workgroup per (row, split, head group), 8 rounds of items (one per XCD) per group."""
    return (8 * groups * math.ceil(n_q * splits / 8), 1, 1)


def check_sparse_launches(r, n_q, h, rows, nnz, splits, lse):
    """The launches of heads [0, 16 G) (configuration h16, G head groups) and of the remainder:
    q / out / lse offset by the launch's first head, the full tensors' strides, out / lse
    [n_q, S, H(, 512)]; every packed argument reaches the kernel as it is."""
    full, rem = divmod(h, 16)
    plan = ([(0, 16, full)] if full else []) + ([(16 * full, rem, 1)] if rem else [])
    events = launches(r["events"])[: len(plan)]
    assert len(events) == len(plan)
    for event, (h0, group, groups) in zip(events, plan, strict=True):
        l_flag = int(lse or splits > 1)
        check_launch(
            event,
            f"jsm_sparse_mla_h{group}_l{l_flag}",
            sparse_grid(n_q, splits, groups),
            (256, 1, 1),
        )
        a = packed(event)
        assert a["Q:p"] == r["pointers"]["q"] + h0 * 576 * 2
        assert a["Q:L1"] == n_q * h * 576 - h0 * 576
        assert (a["KV:p"], a["KV:L1"]) == (r["pointers"]["kv"], rows * 656)
        assert (a["IDX:p"], a["IDX:L1"]) == (r["pointers"]["idx"], nnz)
        assert (a["IPTR:p"], a["IPTR:L1"]) == (r["pointers"]["indptr"], n_q + 1)
        assert a["OUT:L1"] == n_q * splits * h * 512 - h0 * 512
        assert a["LSE:L1"] == ((n_q * splits * h - h0) if l_flag else 0)
        assert [a[k] for k in SPARSE_SCALARS] == [
            n_q, nnz, rows, splits, groups, h * 576, 576, h * 512, 512, h, f32_bits(0.125)
        ]  # fmt: skip
        assert event["kernel_args"] == [v for _, _, v in event["packed"]]
    if len(events) == 2:
        a0, a1 = packed(events[0]), packed(events[1])
        assert a1["OUT:p"] - a0["OUT:p"] == 16 * full * 512 * 2
        assert a1["LSE:p"] - a0["LSE:p"] == 16 * full * 4
    return events


def test_sparse_mla_head_groups(recorded):
    """H = 20, 3 rows of about 2 keys: one split (S = 1), heads 0-15 then 16-19, each launch
    one 256-thread workgroup per row in whole rounds of 8; the output is written directly."""
    r = recorded["sparse_h20_lse"]
    first, second = check_sparse_launches(r, n_q=3, h=20, rows=10, nnz=7, splits=1, lse=True)
    assert len(launches(r["events"])) == 2  # no combine
    assert packed(first)["OUT:p"] not in r["pointers"].values()


def test_sparse_mla_splits_head_groups_and_combine(recorded):
    """H = 40, 2 rows of 500 keys on 256 CUs: S = min(ceil(500 / 64), ceil(256 / (2 rows x 3
    head groups))) = 8 splits; heads 0-31 in one launch (2 groups of 16 in the block id),
    32-39 in another; the bf16 partials [2, 8, 40, 512] and their LSEs (written although the
    call asks for no LSE) feed the combine."""
    r = recorded["sparse_h40_splits"]
    n_q, h, splits = 2, 40, 8
    assert splits == min(math.ceil(1000 / n_q / 64), math.ceil(256 / (n_q * 3)))
    first, _ = check_sparse_launches(r, n_q, h, rows=10, nnz=1000, splits=splits, lse=False)
    *_, comb = launches(r["events"])
    assert len(launches(r["events"])) == 3
    check_launch(comb, "jsm_mla_decode_combine", (math.ceil(n_q * h / 4), 1, 1), (256, 1, 1))
    c, a = packed(comb), packed(first)
    assert (c["OP:p"], c["LP:p"]) == (a["OUT:p"], a["LSE:p"])  # the partials feed the combine
    assert (c["OP:L1"], c["LP:L1"]) == (n_q * splits * h * 512, n_q * splits * h)
    assert [c["num_rows:i32"], c["num_heads:i32"], c["num_splits:i32"]] == [n_q * h, h, splits]


def test_sparse_mla_without_lse_and_empty(recorded):
    (event,) = check_sparse_launches(
        recorded["sparse_h1"], n_q=2, h=1, rows=10, nnz=7, splits=1, lse=False
    )
    assert (packed(event)["LSE:p"], packed(event)["LSE:L1"]) == (0, 0)
    assert recorded["sparse_empty"]["events"] == []  # n_q = 0: nothing to launch


def test_code_objects_load_once_per_device(recorded):
    """Each configuration's code object is loaded just before its first launch in the process
    (the scenarios run in order, each twice), on the launch's device, and never again."""
    loaded = set()
    for name, r in recorded.items():
        if name in ("errors", "grids"):
            continue
        for event in r["events"] + r["again"]:
            assert event["device"] == 0
            if event["event"] == "load":
                assert event["kernel"] not in loaded
                loaded.add(event["kernel"])
            else:
                assert event["kernel"] in loaded
        assert [e["event"] for e in r["again"]] == ["launch"] * len(launches(r["events"]))
    assert len(loaded) == 15  # the 128-row partials beside the q1 and q2 ones


def test_cache_over_4_gib(recorded):
    """Records past byte 2^32: the data pointer is 64-bit, the unused int32 layout is clamped,
    kv_rows is the record count."""
    r = recorded["sparse_big_cache"]
    (event,) = launches(r["events"])
    a = packed(event)
    assert BIG_RECORDS * 656 > 2**32
    assert (a["KV:p"], a["KV:L1"], a["kv_rows:i32"]) == (
        r["pointers"]["kv"],
        INT32_MAX,
        BIG_RECORDS,
    )


M128 = configs.MLA_DECODE_M128


@pytest.mark.parametrize(
    ("name", "batch", "qlen", "h", "splits", "tokens", "n_idx", "kernel", "groups"),
    [
        ("decode_q2", 3, 2, 16, 4, 50, 100, "jsm_mla_decode_partials_q2", 2),  # 16 rows a CTA
        ("decode_q1_h128", 2, 1, 128, 1, 20, M128_N, M128, 1),  # 128 heads per CTA
        ("decode_q1_h256", 3, 1, 256, 3, 30, M128_N, M128, 2),
        ("decode_q1_h128_short", 2, 1, 128, 2, 20, 40, "jsm_mla_decode_partials_q1", 8),
        ("decode_q1_h20", 2, 1, 20, 2, 20, 40, "jsm_mla_decode_partials_q1", 2),
    ],
)
def test_mla_decode_partials_then_combine(
    recorded, name, batch, qlen, h, splits, tokens, n_idx, kernel, groups
):
    """The partials (the 128-row kernel where ``configs.mla_decode_rows`` picks it: qlen 1, H a
    multiple of 128 and kv_indices long enough to fill 256 CUs with splits of 2048 keys; else
    the 16-row kernel of qlen: G head groups), then the combine of their splits; one split's
    partial is the output (no combine launched)."""
    r = recorded[name]
    part, *comb = launches(r["events"])
    assert len(comb) == (splits > 1)
    check_launch(part, kernel, (8 * groups * math.ceil(batch * splits / 8), 1, 1), (512, 1, 1))
    a = packed(part)
    n = batch * qlen
    assert (a["Q:p"], a["Q:L1"]) == (r["pointers"]["q"], n * h * 576)
    assert (a["KV:p"], a["KV:L1"]) == (r["pointers"]["kv"], tokens * 576)
    assert (a["IDX:p"], a["IDX:L1"]) == (r["pointers"]["kv_indices"], n_idx)
    # kv_indptr is clipped to [0, len(kv_indices)] before the call: the kernel gets that copy,
    # B + 1 int32 in a buffer of its own (not the caller's nor any other argument's)
    others = {a[k] for k in ("Q:p", "KV:p", "IDX:p", "OP:p", "LP:p")} | {
        r["pointers"][k] for k in ("q", "kv", "kv_indices", "kv_indptr")
    }
    assert a["IPTR:p"] != 0 and a["IPTR:p"] not in others and a["IPTR:L1"] == batch + 1
    assert (a["OP:L1"], a["LP:L1"]) == (n * splits * h * 512, n * splits * h)
    scalars = [
        a[k]
        for k in (
            "num_requests:i32",
            "num_heads:i32",
            "num_splits:i32",
            "n_indices:i32",
            "tokens:i32",
            "k_scale:f32",
            "v_scale:f32",
            "sm_scale:f32",
        )
    ]
    assert scalars == [
        batch,
        h,
        splits,
        n_idx,
        tokens,
        f32_bits(0.5),
        f32_bits(2.0),
        f32_bits(0.1),
    ]
    for event in (part, *comb):
        assert event["kernel_args"] == [v for _, _, v in event["packed"]]
    if not comb:
        return
    check_launch(comb[0], "jsm_mla_decode_combine", (math.ceil(n * h / 4), 1, 1), (256, 1, 1))
    c = packed(comb[0])
    assert (c["OP:p"], c["LP:p"]) == (a["OP:p"], a["LP:p"])  # the partials feed the combine
    assert [c["num_rows:i32"], c["num_heads:i32"], c["num_splits:i32"]] == [n * h, h, splits]
    assert (c["OUT:L1"], c["LOUT:L1"]) == (n * h * 512, n * h)


@pytest.mark.parametrize(
    ("name", "g", "kernel_g", "block_size", "parts"),
    [("ultraquant_g8", 8, 8, 32, 3), ("ultraquant_g3", 3, 6, 16, 1)],
)
def test_ultraquant_partials_then_reduce(recorded, name, g, kernel_g, block_size, parts):
    """Grid (B, Hk, P) of one-wave groups, then the reduce over (B, Hq); G = 3 runs as the G = 6
    kernel with zero query rows (q is a padded copy)."""
    r = recorded[name]
    batch, hk = 2, 2
    dec, red = launches(r["events"])
    check_launch(
        dec, f"jsm_ultraquant_decode_g{kernel_g}_bs{block_size}", (batch, hk, parts), (64, 1, 1)
    )
    a = packed(dec)
    rows = batch * hk * parts * kernel_g
    assert (a["out_parts:L1"], a["max_logits:L1"], a["exp_sums:L1"]) == (rows * 256, rows, rows)
    assert a["q:L1"] == batch * hk * kernel_g * 256
    assert (a["q:p"] == r["pointers"]["q"]) == (g == kernel_g)
    assert (a["cache:p"], a["cache:L1"]) == (r["pointers"]["cache"], 5 * block_size * hk * 272)
    assert (a["block_tables:p"], a["block_tables:L1"]) == (r["pointers"]["block_tables"], 6)
    assert (a["seq_lens:p"], a["seq_lens:L1"]) == (r["pointers"]["seq_lens"], batch)
    scalars = [
        a[k]
        for k in (
            "num_seqs:i32",
            "num_kv_heads:i32",
            "slot_bytes:i32",
            "num_blocks:i32",
            "max_blocks_per_seq:i32",
            "num_partitions:i32",
            "stride_q_seq:i32",
            "stride_q_head:i32",
            "sm_scale:f32",
        )
    ]
    assert scalars == [batch, hk, 272, 5, 3, parts, hk * kernel_g * 256, 256, f32_bits(0.0625)]
    # The grid carries num_seqs: the kernel receives every other argument, in order.
    assert dec["kernel_args"] == [v for n, _, v in dec["packed"] if n != "num_seqs"]
    check_launch(red, "jsm_ultraquant_reduce", (batch, hk * kernel_g, 1), (64, 1, 1))
    b = packed(red)
    assert [b["out_parts:p"], b["max_logits:p"], b["exp_sums:p"]] == [
        a["out_parts:p"],
        a["max_logits:p"],
        a["exp_sums:p"],
    ]
    assert [
        b["num_seqs:i32"],
        b["num_kv_heads:i32"],
        b["query_group_size:i32"],
        b["num_partitions:i32"],
    ] == [batch, hk, kernel_g, parts]
    assert red["kernel_args"] == [v for n, _, v in red["packed"] if n != "num_seqs"]


@pytest.mark.parametrize("a_format", [0, 4])
def test_mfma_probe_launches_one_wave(recorded, a_format):
    r = recorded[f"probe_f{a_format}"]
    (event,) = launches(r["events"])
    check_launch(event, f"jsm_mfma_probe_f{a_format}", (1, 1, 1), (64, 1, 1))
    a = packed(event)
    for name, arg, elements in (("a", "A", 64 * 32), ("b", "B", 64 * 32), ("scales", "S", 128)):
        assert (a[f"{arg}:p"], a[f"{arg}:L1"]) == (r["pointers"][name], elements)
    assert a["C:L1"] == 64 * 4
    assert event["kernel_args"] == [v for _, _, v in event["packed"]]


@pytest.mark.parametrize("bits", [8, 16])
def test_ds_read_tr_probe_launches_one_wave(recorded, bits):
    r = recorded[f"tr_probe_b{bits}"]
    (event,) = launches(r["events"])
    check_launch(event, f"jsm_ds_read_tr_probe_b{bits}", (1, 1, 1), (64, 1, 1))
    a = packed(event)
    for name, arg, elements in (("lds", "L", 1024), ("addrs", "A", 64)):
        assert (a[f"{arg}:p"], a[f"{arg}:L1"]) == (r["pointers"][name], elements)
    assert a["R:L1"] == 64 * 2
    assert event["kernel_args"] == [v for _, _, v in event["packed"]]


EXPECTED_ERRORS = {
    "sparse_q_dtype": "jsm_sparse_mla: q must be bf16[n_q, H, 576], got f32[2, 4, 576]",
    "sparse_indptr": "jsm_sparse_mla: indptr must be s32[2 + 1], got s32[2]",
    "sparse_lse_shape": "jsm_sparse_mla: lse must be f32[2, 1, 4], got f32[2, 1, 5]",
    "sparse_out_shape": "jsm_sparse_mla: out must be bf16[2, S, 4, 512], got bf16[2, 4, 512]",
    "sparse_splits_without_lse": "jsm_sparse_mla: S = 3 splits: needs S >= 1, and the lse "
    "result when S > 1",
    "sparse_kv_record": "jsm_sparse_mla: kv must be u8[rows, 656], got u8[10, 576]",
    "partials_qlen": "jsm_mla_decode_partials: qlen must be one of 1, 2, 4 (the compiled "
    "kernels), got 3",
    "partials_q_rows": "jsm_mla_decode_partials: q must be bf16[B * qlen = 2, H, 576], "
    "got bf16[4, 16, 576]",
    "partials_indptr": "jsm_mla_decode_partials: kv_indptr must hold B + 1 >= 1 entries",
    "partials_cta_rows": "jsm_mla_decode_partials: cta_rows (query rows per CTA) must be 16 or "
    "128, got 32",
    "partials_m128_heads": "jsm_mla_decode_partials: the 128-row kernel serves qlen 1 and H a "
    "positive multiple of 128, got qlen 2, H 16",
    "combine_lse": "jsm_mla_decode_combine: lse_parts must be f32[3, 2, 4], got f32[3, 2, 5]",
    "uq_block_size": "jsm_ultraquant_partials: cache block_size must be one of 16, 32, 64, 128, "
    "256 (the compiled kernels), got 48",
    "uq_group": "jsm_ultraquant_partials: Hq / Hk must be one of 6, 8, 16 (the compiled "
    "kernels), got Hq = 10, Hk = 2",
    "uq_slot": "jsm_ultraquant_partials: cache slot_bytes must be >= 272 and a multiple of 4, "
    "got 270",
    "probe_format": "jsm_mfma_probe: a_format must be 0 (e4m3) or 4 (e2m1), got 2",
    "probe_scales": "jsm_mfma_probe: scales must be s32[64 lanes, 2], got s32[64]",
    "tr_probe_bits": "jsm_ds_read_tr_probe: bits must be 8 (ds_read_b64_tr_b8) or 16 "
    "(ds_read_b64_tr_b16), got 4",
    "tr_probe_regs": "jsm_ds_read_tr_probe: regs must be u32[64 lanes, 2], got s32[64, 2]",
    "reduce_out": "jsm_ultraquant_reduce: out must be bf16[2, 16, 256], got bf16[2, 8, 256]",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_handlers_reject_bad_buffers(recorded, name):
    message = recorded["errors"][name]
    assert message is not None and "INVALID_ARGUMENT" in message
    assert EXPECTED_ERRORS[name] in message


@pytest.mark.parametrize(
    ("case", "scenario", "kernel"),
    [
        ("sparse_h20_lse", "sparse_h20_lse", "jsm_sparse_mla_h16_l1"),
        ("sparse_h40_splits", "sparse_h40_splits", "jsm_sparse_mla_h16_l1"),
        ("decode_q2", "decode_q2", "jsm_mla_decode_partials_q2"),
        ("decode_q1_h128", "decode_q1_h128", M128),
        ("decode_q1_h256", "decode_q1_h256", M128),
        ("decode_q1_h20", "decode_q1_h20", "jsm_mla_decode_partials_q1"),
        ("decode_q2_combine", "decode_q2", "jsm_mla_decode_combine"),
        ("ultraquant_g8", "ultraquant_g8", "jsm_ultraquant_decode_g8_bs32"),
        ("ultraquant_g8_reduce", "ultraquant_g8", "jsm_ultraquant_reduce"),
    ],
)
def test_grid_checks_model_the_launches(recorded, case, scenario, kernel):
    """The grid each handler checks is the grid FlyDSL's launcher launched, threads included."""
    g = recorded["grids"][case]
    assert g["rc"] == 0 and g["message"] == ""
    (event,) = [e for e in launches(recorded[scenario]["events"]) if e["kernel"] == kernel]
    assert event["grid"] == g["grid"][:3] and event["block"] == [g["grid"][3], 1, 1]


SPARSE_X = "8 * head groups * ceil(n_q * S / 8)"


@pytest.mark.parametrize(
    ("case", "target", "x_is", "threads", "x_at"),
    [
        ("sparse", "jsm_sparse_mla", SPARSE_X, 256, 2**24 - 8),
        ("sparse_splits", "jsm_sparse_mla", SPARSE_X, 256, 2**24 - 64),
        (
            "partials",
            "jsm_mla_decode_partials",
            "8 * ceil(H * qlen / 16) * ceil(B * S / 8)",
            512,
            2**23 - 8,
        ),
        (
            "partials_m128",
            "jsm_mla_decode_partials",
            "8 * (H / 128) * ceil(B * S / 8)",
            512,
            2**23 - 8,
        ),
        ("combine", "jsm_mla_decode_combine", "ceil(n * H / 4)", 256, 2**24 - 1),
        ("uq", "jsm_ultraquant_partials", "B", 64, 2**26 - 1),
        ("reduce", "jsm_ultraquant_reduce", "B", 64, 2**26 - 1),
    ],
)
def test_grids_past_the_hsa_limit_are_rejected(recorded, case, target, x_is, threads, x_at):
    at, past = recorded["grids"][f"{case}_at"], recorded["grids"][f"{case}_past"]
    assert at["message"] == "" and at["grid"][0] == x_at and x_at * threads <= 2**32 - 1
    x = past["grid"][0]
    assert x * threads >= 2**32 and past["grid"][3] == threads
    assert past["message"] == (
        f"{target}: the grid's x dimension, {x_is} = {x} workgroups of {threads} threads = "
        f"{x * threads} work-items, exceeds the HSA limit of 2^32 - 1 = 4294967295 "
        "work-items per grid dimension"
    )


if __name__ == "__main__":
    print(json.dumps(run_driver(sys.argv[1])))
