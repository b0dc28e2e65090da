"""Implementation names per op: "mosaic" (the Mosaic GPU kernels, every op) fails off CUDA
naming what it needs; tests/impls.py lists for each op only the implementations its table has
and that run on this machine."""

import importlib

import jax
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _platform
from tests import cases as C
from tests import impls

# ---------------------------------------------------------------------------------------------
# "mosaic" in the ops
# ---------------------------------------------------------------------------------------------


def _mosaic_calls():
    """op -> a call of it with implementation="mosaic" (small cases)."""
    d = C.decode_case(40, seq_lens=(3, 9), h=2, qlen=1, n_nan=0)
    sp = C.sparse_case(42, n_q=2, h=2, n_rec=8)
    uq = C.uq_case(41, seq_lens=(5, 20), hk=1, g=2)
    return {
        "sparse_mla": lambda: jsm.sparse_mla(*sp.args(), return_lse=True, implementation="mosaic"),
        "mla_decode": lambda: jsm.mla_decode(*d.args(), implementation="mosaic"),
        "mla_decode_partials": lambda: jsm.mla_decode_partials(
            *d.args(), num_splits=2, implementation="mosaic"
        ),
        "ultraquant_decode": lambda: jsm.ultraquant_decode(*uq.args(), implementation="mosaic"),
    }


@pytest.mark.skipif(impls.has_cuda(), reason="off CUDA only: on a CUDA GPU 'mosaic' runs")
@pytest.mark.parametrize("op", sorted(_mosaic_calls()))
@pytest.mark.parametrize("jit", [False, True])
def test_mosaic_off_cuda_needs_an_nvidia_hopper_gpu(op, jit):
    """No interpret mode: off CUDA the call fails when lowered (before anything runs, eagerly
    too), with a NotImplementedError saying that it needs an NVIDIA Hopper GPU."""
    call = _mosaic_calls()[op]
    with pytest.raises(NotImplementedError, match="NVIDIA Hopper") as e:
        jax.jit(call).lower() if jit else call()
    assert "mosaic" in str(e.value)


@pytest.mark.skipif(impls.has_gfx950(), reason="off ROCm only: on an MI355 'flydsl' runs")
@pytest.mark.parametrize("jit", [False, True])
def test_flydsl_off_rocm_names_the_platform_and_the_build(jit):
    """Without a handler for this platform (the CPU here; the recording-HIP tests register one
    and run it), "flydsl" fails when lowered, naming ROCm, the MI355 and the build command."""
    from jax_sparse_mla import ffi

    sp = C.sparse_case(42, n_q=2, h=2, n_rec=8)

    def call():
        return jsm.sparse_mla(*sp.args(), implementation="flydsl")

    with pytest.raises(NotImplementedError, match="ROCm only") as e:
        jax.jit(call).lower() if jit else call()
    assert "MI355" in str(e.value) and ffi.BUILD_COMMAND in str(e.value)


def test_mosaic_is_a_known_name():
    """Unlike an unknown name (ValueError), "mosaic" is one of the implementation names."""
    from jax_sparse_mla._dispatch import IMPLEMENTATIONS

    assert "mosaic" in IMPLEMENTATIONS
    d = C.decode_case(40, seq_lens=(3, 9), h=2, qlen=1, n_nan=0)
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        jsm.mla_decode(*d.args(), implementation="mosaics")


# ---------------------------------------------------------------------------------------------
# tests/impls.py: which implementations the suites run, per op
# ---------------------------------------------------------------------------------------------

OPS = tuple(impls.OP_MODULES)


def _clear():
    impls.available.cache_clear()
    impls.default.cache_clear()


@pytest.fixture
def machine(monkeypatch):
    """fake(cuda, hopper, gfx950, sm90): impls' view of this machine (and ``_platform``'s own
    test for sm_90, which None's Hopper choice reads), caches cleared (and again afterwards, so the
    suites see the real machine). ``sm90`` (a Hopper, not a later GPU) follows ``hopper``
    unless given."""

    def fake(cuda: bool, hopper: bool, gfx950: bool = False, sm90: bool | None = None):
        sm90 = hopper if sm90 is None else sm90
        monkeypatch.setattr(impls, "has_cuda", lambda: cuda)
        monkeypatch.setattr(impls, "cuda_is_hopper", lambda: hopper)
        monkeypatch.setattr(impls, "cuda_is_sm90", lambda: sm90)
        monkeypatch.setattr(_platform, "cuda_is_sm90", lambda: sm90)
        monkeypatch.setattr(impls, "has_gfx950", lambda: gfx950)
        _clear()

    yield fake
    _clear()


@pytest.mark.parametrize("op", OPS)
def test_available_per_op_is_the_ops_table(op):
    table = importlib.import_module(impls.OP_MODULES[op])._IMPLEMENTATIONS
    assert impls.implementations(op) == tuple(n for n in table if n is not None)
    assert impls.available(op) == tuple(n for n in impls.available() if n in table)
    assert impls.available(op)[0] == "xla"


def test_mosaic_only_on_a_hopper_gpu():
    """This machine: "mosaic" is listed exactly when a Hopper CUDA GPU (sm_90) is here."""
    assert ("mosaic" in impls.available()) == (impls.has_cuda() and impls.cuda_is_sm90())
    for op in OPS:
        assert ("mosaic" in impls.available(op)) == ("mosaic" in impls.available())


def test_faked_hopper_lists_mosaic_for_the_ops_that_have_it(machine):
    machine(cuda=True, hopper=True)
    with_mosaic = ("xla", "gfx950_emulation", "pallas", "mosaic")
    assert impls.available() == with_mosaic
    for op in OPS:
        assert impls.available(op) == with_mosaic, op
        # _platform.hopper_choice; None merges partials with the Pallas kernel
        assert impls.default(op) == ("pallas" if op == "merge_attn_states" else "mosaic"), op
    assert impls.common("sparse_mla", "mla_decode", "ultraquant_decode") == with_mosaic


def test_faked_later_gpu_runs_pallas_not_mosaic(machine):
    """A GPU past Hopper (no sm_90a wgmma): "mosaic" is not listed and None runs "pallas"."""
    machine(cuda=True, hopper=True, sm90=False)
    for op in (None, *OPS):
        assert impls.available(op) == ("xla", "gfx950_emulation", "pallas"), op
    for op in OPS:
        assert impls.default(op) == "pallas", op


@pytest.mark.parametrize("cuda,hopper", [(False, True), (True, False), (False, False)])
def test_no_mosaic_without_a_hopper_gpu(machine, cuda, hopper):
    """No CUDA GPU (cuda_is_hopper is True without one: lowering for CUDA from another host),
    or one older than Hopper: neither is "mosaic" listed nor does None run a kernel."""
    machine(cuda=cuda, hopper=hopper)
    for op in (None, *OPS):
        assert impls.available(op) == ("xla", "gfx950_emulation", "pallas"), op
    for op in OPS:
        assert impls.default(op) == "xla", op


def test_faked_gfx950_lists_flydsl(machine):
    machine(cuda=False, hopper=True, gfx950=True)
    for op in OPS:
        assert impls.available(op) == ("xla", "gfx950_emulation", "pallas", "flydsl"), op
        assert impls.default(op) == "flydsl", op


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown op"):
        impls.available("sparse_mlaa")
    with pytest.raises(ValueError, match="unknown op"):
        impls.default("decode")
