"""The ROCm custom calls, lowered from this (CPU) host, and the FFI library without ROCm.

``jax.jit(f).trace(*args).lower(lowering_platforms=("rocm",))`` lowers exactly what an MI355
would compile: each op must reach its ``jsm_*`` targets with the expected operand and result
types and f32 attributes; CPU and CUDA lowerings must hold none of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _platform, _verdicts, ffi
from jax_sparse_mla._build import build_lib

CALL = re.compile(r"stablehlo\.custom_call @(\w+)\((.*?)\) \{(.*)\} : \((.*?)\) -> \(?(.*?)\)?$")


def custom_calls(fn, *args, platform="rocm"):
    """[(target, attributes, operand types, result types)] of ``fn``'s lowering (traced anew:
    the choice of implementation happens at trace time)."""
    fresh = jax.jit(lambda *a: fn(*a))
    text = fresh.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    calls = []
    for line in text.splitlines():
        if m := CALL.search(line.strip()):
            target, _, attrs, operands, results = m.groups()
            config = re.search(r"mhlo\.backend_config = \{(.*?)\}", attrs).group(1)
            calls.append((target, config, operands.split(", "), results.split(", ")))
    return calls


def jsm_targets(fn, *args, platform):
    return [c[0] for c in custom_calls(fn, *args, platform=platform) if c[0].startswith("jsm_")]


def sparse_args(n_q=3, h=20, rows=10, nnz=7):
    return (
        jnp.zeros((n_q, h, 576), jnp.bfloat16),
        jnp.zeros((rows, 656), jnp.uint8),
        jnp.zeros((nnz,), jnp.int32),
        jnp.asarray(np.linspace(0, nnz, n_q + 1).astype(np.int32)),
    )


def decode_args(batch=2, qlen=2, h=16, tokens=40):
    return (
        jnp.zeros((batch * qlen, h, 576), jnp.bfloat16),
        jnp.zeros((tokens, 576), jnp.float8_e4m3fn),
        jnp.zeros((tokens,), jnp.int32),
        jnp.asarray(np.linspace(0, tokens, batch + 1).astype(np.int32)),
    )


def uq_args(batch=2, hk=2, g=8, block_size=16, num_blocks=4, max_blocks=3):
    return (
        jnp.zeros((batch, hk * g, 256), jnp.bfloat16),
        jnp.zeros((num_blocks, block_size, hk, 272), jnp.uint8),
        jnp.zeros((batch, max_blocks), jnp.int32),
        jnp.zeros((batch,), jnp.int32),
    )


@pytest.mark.parametrize("implementation", [None, "flydsl"])
def test_sparse_mla_lowers_to_its_custom_call(implementation):
    fn = functools.partial(
        jsm.sparse_mla, sm_scale=0.1, return_lse=True, implementation=implementation
    )
    ((target, attrs, operands, results),) = custom_calls(fn, *sparse_args())
    assert target == "jsm_sparse_mla"
    assert attrs == "sm_scale = 1.000000e-01 : f32"
    assert operands == [
        "tensor<3x20x576xbf16>",
        "tensor<10x656xui8>",
        "tensor<7xi32>",
        "tensor<4xi32>",
    ]
    assert results == ["tensor<3x1x20x512xbf16>", "tensor<3x1x20xf32>"]  # S = 1 split
    # Without the LSE the call has one result; any leading kv shape arrives as rows.
    q, kv, idx, indptr = sparse_args()
    fn = functools.partial(jsm.sparse_mla, implementation=implementation)
    ((_, attrs, operands, results),) = custom_calls(fn, q, kv.reshape(2, 5, 656), idx, indptr)
    assert attrs == f"sm_scale = {np.float32(576**-0.5):.9} : f32"
    assert operands[1] == "tensor<10x656xui8>" and results == ["tensor<3x1x20x512xbf16>"]


@pytest.mark.parametrize("implementation", [None, "flydsl"])
def test_sparse_mla_splits_lower_to_partials_and_combine(implementation):
    """2 rows of 500 keys, 20 heads (2 head groups) on 256 CUs: S = min(ceil(500 / 64),
    ceil(256 / 4)) = 8 splits; the partials and their LSEs (also without return_lse) feed the
    combine."""
    fn = functools.partial(jsm.sparse_mla, sm_scale=0.1, implementation=implementation)
    (sparse, combine) = custom_calls(fn, *sparse_args(n_q=2, h=20, nnz=1000))
    assert sparse[0] == "jsm_sparse_mla"
    assert sparse[3] == ["tensor<2x8x20x512xbf16>", "tensor<2x8x20xf32>"]
    assert combine[0] == "jsm_mla_decode_combine"
    assert combine[2] == sparse[3] and combine[3] == ["tensor<2x20x512xbf16>", "tensor<2x20xf32>"]


@pytest.mark.parametrize("implementation", [None, "flydsl"])
def test_mla_decode_lowers_to_partials_and_combine(implementation):
    fn = functools.partial(
        jsm.mla_decode,
        qlen=2,
        k_scale=0.5,
        v_scale=2.0,
        sm_scale=0.25,
        num_splits=3,
        implementation=implementation,
    )
    (partials, combine) = custom_calls(fn, *decode_args())
    assert partials[0] == "jsm_mla_decode_partials"
    assert partials[1] == (
        "cta_rows = 16 : i32, k_scale = 5.000000e-01 : f32, qlen = 2 : i32, "
        "sm_scale = 2.500000e-01 : f32, v_scale = 2.000000e+00 : f32"
    )
    assert partials[2] == [
        "tensor<4x16x576xbf16>",
        "tensor<40x576xui8>",
        "tensor<40xi32>",
        "tensor<3xi32>",
    ]
    assert partials[3] == ["tensor<4x3x16x512xbf16>", "tensor<4x3x16xf32>"]
    assert combine[0] == "jsm_mla_decode_combine" and combine[1] == ""
    assert combine[2] == partials[3]
    assert combine[3] == ["tensor<4x16x512xbf16>", "tensor<4x16xf32>"]
    # The split count the kernel path picks itself (num_splits=None) is static: 20 keys a
    # request here, one split, whose partial is the output (no combine).
    fn = functools.partial(jsm.mla_decode, qlen=2, implementation=implementation)
    ((target, _, _, results),) = custom_calls(fn, *decode_args())
    assert target == "jsm_mla_decode_partials"
    assert results == ["tensor<4x1x16x512xbf16>", "tensor<4x1x16xf32>"]


@pytest.mark.parametrize("implementation", [None, "flydsl"])
def test_partials_and_merge_lower_to_their_custom_calls(implementation):
    fn = functools.partial(
        jsm.mla_decode_partials, qlen=1, num_splits=2, implementation=implementation
    )
    ((target, _, _, results),) = custom_calls(fn, *decode_args(qlen=1))
    assert target == "jsm_mla_decode_partials"
    assert results == ["tensor<2x2x16x512xbf16>", "tensor<2x2x16xf32>"]
    o = jnp.zeros((5, 3, 4, 512), jnp.bfloat16)
    lse = jnp.zeros((5, 3, 4), jnp.float32)
    merge = functools.partial(jsm.merge_attn_states, implementation=implementation)
    ((target, _, operands, results),) = custom_calls(merge, o, lse)
    assert target == "jsm_mla_decode_combine"
    assert operands == ["tensor<5x3x4x512xbf16>", "tensor<5x3x4xf32>"]
    assert results == ["tensor<5x4x512xbf16>", "tensor<5x4xf32>"]


@pytest.mark.parametrize("implementation", [None, "flydsl"])
@pytest.mark.parametrize(("g", "kernel_g"), [(8, 8), (3, 6), (16, 16)])
def test_ultraquant_lowers_to_partials_and_reduce(implementation, g, kernel_g):
    fn = functools.partial(
        jsm.ultraquant_decode, sm_scale=0.0625, num_partitions=2, implementation=implementation
    )
    partials, reduce = custom_calls(fn, *uq_args(g=g))
    assert partials[0] == "jsm_ultraquant_partials"
    assert partials[1] == "sm_scale = 6.250000e-02 : f32"
    assert partials[2] == [
        f"tensor<2x{2 * kernel_g}x256xbf16>",
        "tensor<4x16x2x272xui8>",
        "tensor<2x3xi32>",
        "tensor<2xi32>",
    ]
    parts = f"tensor<2x2x2x{kernel_g}"
    assert partials[3] == [f"{parts}x256xbf16>", f"{parts}xf32>", f"{parts}xf32>"]
    assert reduce[0] == "jsm_ultraquant_reduce" and reduce[2] == partials[3]
    assert reduce[3] == [f"tensor<2x{2 * kernel_g}x256xbf16>"]


@pytest.mark.parametrize("a_format", [0, 4])
def test_mfma_probe_lowers_to_its_custom_call(a_format):
    from jax_sparse_mla.ffi.calls import mfma_probe

    args = (
        jnp.zeros((64, 32), jnp.uint8),
        jnp.zeros((64, 32), jnp.uint8),
        jnp.zeros((64, 2), jnp.int32),
    )
    fn = functools.partial(mfma_probe, a_format=a_format)
    ((target, attrs, operands, results),) = custom_calls(fn, *args)
    assert (target, attrs) == ("jsm_mfma_probe", f"a_format = {a_format} : i32")
    assert operands == ["tensor<64x32xui8>", "tensor<64x32xui8>", "tensor<64x2xi32>"]
    assert results == ["tensor<64x4xf32>"]


@pytest.mark.parametrize("bits", [8, 16])
def test_ds_read_tr_probe_lowers_to_its_custom_call(bits):
    from jax_sparse_mla.ffi.calls import ds_read_tr_probe

    args = (jnp.zeros((1024,), jnp.uint8), jnp.zeros((64,), jnp.int32))
    fn = functools.partial(ds_read_tr_probe, bits=bits)
    ((target, attrs, operands, results),) = custom_calls(fn, *args)
    assert (target, attrs) == ("jsm_ds_read_tr_probe", f"bits = {bits} : i32")
    assert operands == ["tensor<1024xui8>", "tensor<64xi32>"]
    assert results == ["tensor<64x2xui32>"]


CALLS = {
    "sparse_mla": (jsm.sparse_mla, sparse_args),
    "mla_decode": (functools.partial(jsm.mla_decode, qlen=2), decode_args),
    "ultraquant_decode": (jsm.ultraquant_decode, uq_args),
}


@pytest.mark.parametrize("op", sorted(CALLS))
def test_cpu_lowering_never_holds_the_rocm_calls(op):
    fn, args = CALLS[op]
    assert jsm_targets(fn, *args(), platform="rocm")
    assert jsm_targets(fn, *args(), platform="cpu") == []


@pytest.mark.parametrize("op", sorted(CALLS))
def test_cuda_lowering_never_holds_the_rocm_calls(op):
    fn, args = CALLS[op]
    try:
        targets = jsm_targets(fn, *args(), platform="cuda")
    except RuntimeError as e:
        if "No supported GPU devices" not in str(e):
            raise
        pytest.skip("this jax lowers the Pallas (Triton) calls for CUDA only with a GPU present")
    assert targets == []


@pytest.mark.parametrize(
    ("op", "fn", "args", "why"),
    [
        (
            "mla_decode",
            functools.partial(jsm.mla_decode, qlen=3),
            lambda: decode_args(qlen=3),
            "qlen must be one of",
        ),
        (
            "ultraquant_decode",
            jsm.ultraquant_decode,
            lambda: uq_args(block_size=48),
            "block_size must be one of",
        ),
        (
            "ultraquant_decode",
            jsm.ultraquant_decode,
            lambda: uq_args(g=20),
            "query heads per KV head must be <= 16",
        ),
        (
            "merge_attn_states",
            jsm.merge_attn_states,
            lambda: (jnp.zeros((2, 2, 4, 512), jnp.float32), jnp.zeros((2, 2, 4), jnp.float32)),
            "bf16",
        ),
    ],
)
def test_unsupported_configurations_fall_back(op, fn, args, why):
    """implementation=None lowers to "xla" for what the kernels cannot serve; "flydsl" says why."""
    assert jsm_targets(fn, *args(), platform="rocm") == []
    with pytest.raises(NotImplementedError, match=f"{op}: implementation='flydsl'.*{why}"):
        fn(*args(), implementation="flydsl")


def test_traced_scales_fall_back():
    q, kv, idx, indptr = sparse_args()

    def f(scale):
        return jsm.sparse_mla(q, kv, idx, indptr, sm_scale=scale)

    assert jsm_targets(f, jnp.float32(0.1), platform="rocm") == []
    assert jsm_targets(lambda: f(0.1), platform="rocm") == ["jsm_sparse_mla"]


def test_vmap_runs_the_call_per_batch_element():
    q, kv, idx, indptr = sparse_args()
    qs = jnp.stack([q, q])
    fn = jax.vmap(lambda q: jsm.sparse_mla(q, kv, idx, indptr, implementation="flydsl"))
    text = jax.jit(fn).trace(qs).lower(lowering_platforms=("rocm",)).as_text()
    assert "stablehlo.while" in text
    ((_, _, operands, results),) = custom_calls(fn, qs)
    assert operands[0] == "tensor<3x20x576xbf16>" and results == ["tensor<3x1x20x512xbf16>"]


def test_donated_cache_aliases_the_output():
    """A decode step that writes the donated UltraQuant cache and reads it: the cache buffer is
    the output's (no copy), and the ROCm calls read it."""
    q, cache, tables, lens = uq_args()
    k = jnp.zeros((2, 2, 256), jnp.bfloat16)
    slots = jnp.array([0, 17], jnp.int32)

    def step(q, cache, k, slots):
        cache = jsm.ultraquant_store(cache, k, k, slots)
        return jsm.ultraquant_decode(q, cache, tables, lens), cache

    lowered = jax.jit(step, donate_argnums=1).trace(q, cache, k, slots)
    text = lowered.lower(lowering_platforms=("rocm",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert re.search(r"%arg1: tensor<4x16x2x272xui8> \{tf\.aliasing_output = 1", main)
    assert "@jsm_ultraquant_partials" in text


# ---------------------------------------------------------------------------------------------
# Choosing the kernels on a ROCm machine (its devices faked: none here)
# ---------------------------------------------------------------------------------------------


class FakeDevice:
    def __init__(self, kind, arch):
        self.device_kind, self.compute_capability = kind, arch


@pytest.fixture
def rocm_devices(monkeypatch):
    def use(*devices):
        monkeypatch.setattr(_platform, "rocm_devices", lambda: list(devices))
        _platform.flydsl_available.cache_clear()

    yield use
    _platform.flydsl_available.cache_clear()


def test_non_gfx950_rocm_device_warns_once_and_falls_back(rocm_devices):
    rocm_devices(FakeDevice("AMD Instinct MI300X", "gfx942"))
    with pytest.warns(UserWarning, match="need gfx950.*MI300X"):
        assert jsm_targets(jsm.sparse_mla, *sparse_args(), platform="rocm") == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next lowering is silent
        assert jsm_targets(jsm.sparse_mla, *sparse_args(), platform="rocm") == []


def test_gfx950_device_picks_the_kernels(rocm_devices, monkeypatch):
    if ffi.rocm_library() is None:
        pytest.skip("the FFI library is not built")
    rocm_devices(FakeDevice("AMD Instinct MI355X", "gfx950"))
    monkeypatch.setattr(_verdicts, "trusted", lambda symbols, device: True)  # test_selfcheck.py
    assert jsm_targets(jsm.sparse_mla, *sparse_args(), platform="rocm") == ["jsm_sparse_mla"]


def test_gfx950_without_the_library_falls_back_or_says_so(rocm_devices, monkeypatch):
    rocm_devices(FakeDevice("AMD Instinct MI355X", "gfx950"))
    monkeypatch.setattr(ffi, "rocm_library", lambda: None)
    with pytest.warns(UserWarning, match="this install has no FFI library"):
        assert jsm_targets(jsm.sparse_mla, *sparse_args(), platform="rocm") == []
    with pytest.raises(RuntimeError, match="'flydsl' needs the FFI library"):
        jsm.sparse_mla(*sparse_args(), implementation="flydsl")


# ---------------------------------------------------------------------------------------------
# The installed library, without ROCm
# ---------------------------------------------------------------------------------------------


def installed_library() -> ctypes.CDLL:
    if ffi.library_path() is None:  # a default install is pure Python (BUILD.md)
        pytest.skip(f"the FFI library is not built: {ffi.BUILD_COMMAND}")
    return ffi.rocm_library()


def test_library_loads_without_rocm_and_says_why_it_cannot_launch():
    lib = installed_library()
    for symbol in ffi.TARGETS.values():
        assert getattr(lib, symbol)  # the handlers are exported
    try:
        ctypes.CDLL("libamdhip64.so")
        pytest.skip("this machine has the ROCm runtime")
    except OSError:
        pass
    message = ctypes.create_string_buffer(1024)
    assert lib.jsm_prepare_launch(b"jsm_mla_decode_combine", 0, message, len(message)) == 1
    assert message.value.decode().startswith(
        "jax_sparse_mla: cannot launch the gfx950 kernel jsm_mla_decode_combine: the ROCm "
        'runtime is unavailable (dlopen("libamdhip64.so") failed: libamdhip64.so: cannot open'
    )


def test_stale_library_warns_and_is_not_used(monkeypatch):
    """A library from an older version (here: libc, which has none of the handlers)."""
    monkeypatch.setenv("JAX_SPARSE_MLA_FFI_LIBRARY", ctypes.util.find_library("c"))
    ffi.rocm_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="predates this version.*JsmSparseMla"):
            assert ffi.rocm_library() is None
    finally:
        monkeypatch.delenv("JAX_SPARSE_MLA_FFI_LIBRARY")
        ffi.rocm_library.cache_clear()
        ffi.rocm_library()  # the installed one again


def test_library_without_a_kernel_names_the_build_command(tmp_path):
    """A library linked without kernel objects (pip install before the kernel build) says how
    to get them; the HIP check comes first, so use the recording build (HIP always there)."""
    try:
        build_lib.compiler()
    except RuntimeError as e:
        pytest.skip(str(e))
    lib = ctypes.CDLL(str(build_lib.build_library(tmp_path / "empty.so", None, recording=True)))
    message = ctypes.create_string_buffer(1024)
    assert lib.jsm_prepare_launch(b"jsm_sparse_mla_h4_l1", 0, message, len(message)) == 1
    assert message.value.decode() == (
        "jax_sparse_mla: kernel jsm_sparse_mla_h4_l1 is not in this FFI library (0 kernels "
        "linked from 'no kernel build'); build the kernels and relink: python -m "
        "jax_sparse_mla.build --arch gfx950 --link"
    )
