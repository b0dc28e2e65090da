"""The platform choice of ``implementation=None``, in one place.

``by_platform`` picks a branch per lowering platform (a lowering holds only its own platform's
branch); within a branch the choice is made at trace time from the devices of this process:
``hopper_or`` (CUDA: the Pallas kernels on Hopper or newer) and ``gfx950_or`` (ROCm: the FlyDSL
kernels on MI355 GPUs, when the FFI library has the configurations a call launches and each
passed its own self-check on this GPU: ``_verdicts``). With no
device of the lowering's platform in the process (lowering for another host) the target is
assumed to be the one the kernels are for.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import jax
import numpy as np

from jax_sparse_mla import _verdicts, ffi
from jax_sparse_mla._vma import vary_like


def is_static_scalar(x) -> bool:
    """A Python or numpy float: handed to kernels as it is, never traced, so that what is made
    of it (a scale vector, say) is an XLA constant rather than a kernel."""
    return isinstance(x, (float, np.floating))


def split_static(args) -> tuple[list, Callable]:
    """(operands, merge): the arguments that are not static scalars (``is_static_scalar``), and
    ``merge(xs)``, the whole argument list again with ``xs`` in those operands' places."""
    static = [is_static_scalar(a) for a in args]

    def merge(xs) -> list:
        it = iter(xs)
        return [a if s else next(it) for a, s in zip(args, static, strict=True)]

    return [a for a, s in zip(args, static, strict=True) if not s], merge


def by_platform(default: Callable, **per_platform: Callable) -> Callable:
    """``fn(*arrays, **options)`` that runs ``per_platform[p]`` when lowered for platform ``p``
    (e.g. ``cuda=...``) and ``default`` elsewhere (``jax.lax.platform_dependent``: a lowering
    holds only its own platform's branch). Every branch must return the same shapes; under
    ``jax.shard_map`` each output varies over the axes any argument varies over. Python and
    numpy scalars among ``arrays`` reach the branches as they are (static), not as operands."""

    def run(*args, **options):
        operands, merge = split_static(args)

        def branch(f):
            return lambda *xs: vary_like(f(*merge(xs), **options), *xs, options)

        branches = {p: branch(f) for p, f in per_platform.items()}
        return jax.lax.platform_dependent(*operands, default=branch(default), **branches)

    return run


# ---------------------------------------------------------------------------------------------
# CUDA: Hopper
# ---------------------------------------------------------------------------------------------


def _cuda_capabilities() -> list[float] | None:
    """The compute capabilities of the visible CUDA devices; None with none visible (lowering
    for CUDA from another host: the target is then assumed to be a Hopper GPU, 9.0)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    return [float(getattr(d, "compute_capability", "9.0")) for d in devices]


@functools.cache
def cuda_is_hopper() -> bool:
    """True unless a visible CUDA device is older than Hopper (compute capability 9.0)."""
    caps = _cuda_capabilities()
    return caps is None or all(c >= 9.0 for c in caps)


@functools.cache
def cuda_is_sm90() -> bool:
    """True unless a visible CUDA device is not a Hopper GPU (9.x): the Mosaic GPU kernel uses
    sm_90a's wgmma, which later GPUs do not have."""
    caps = _cuda_capabilities()
    return caps is None or all(9.0 <= c < 10.0 for c in caps)


def hopper_choice() -> str:
    """The CUDA kernels ``implementation=None`` runs on Hopper or newer GPUs, where an op has
    both: "mosaic" on Hopper itself (faster than "pallas" on the H200 wherever the kernels'
    time exceeds the host's dispatch: README, "NVIDIA H200"), "pallas" on later GPUs, which
    lack the sm_90a instructions the Mosaic GPU kernels use."""
    return "mosaic" if cuda_is_sm90() else "pallas"


def hopper_or(pallas_fn: Callable, fallback: Callable, mosaic_fn: Callable | None = None):
    """The CUDA branch of ``implementation=None``: on Hopper or newer GPUs ``mosaic_fn`` where
    ``hopper_choice`` says "mosaic" and the op has one, else ``pallas_fn``; ``fallback`` (the
    exact "xla" implementation) on older GPUs. Decided at trace time."""

    def run(*args, **options):
        if not cuda_is_hopper():
            fn = fallback
        elif mosaic_fn is not None and hopper_choice() == "mosaic":
            fn = mosaic_fn
        else:
            fn = pallas_fn
        return fn(*args, **options)

    return run


# ---------------------------------------------------------------------------------------------
# ROCm: gfx950 (MI355)
# ---------------------------------------------------------------------------------------------


def rocm_devices() -> list:
    try:
        return jax.devices("rocm")
    except RuntimeError:  # no ROCm backend in this process (e.g. lowering for ROCm from a CPU host)
        return []


def is_gfx950(device) -> bool:
    """Whether a jax ROCm device is an MI350-series (gfx950) GPU."""
    names = f"{getattr(device, 'compute_capability', '')} {device.device_kind}".lower()
    return "gfx950" in names or "mi35" in names


def gfx950_devices() -> list:
    """This process's MI350-series (gfx950) ROCm devices."""
    return [d for d in rocm_devices() if is_gfx950(d)]


@functools.cache
def gpu_platforms() -> frozenset[str]:
    """The GPU platforms jax has devices of in this process: "cuda", "rocm", and "gfx950" where
    a ROCm device is an MI355."""
    found = set()
    for name in ("cuda", "rocm"):
        try:
            jax.devices(name)
        except RuntimeError:
            continue
        found.add(name)
    if "rocm" in found and gfx950_devices():
        found.add("gfx950")
    return frozenset(found)


def devices_seen() -> str:
    """What jax sees here, for messages: e.g. "cpu (cpu)" or "gpu (NVIDIA H200), ..."."""
    return ", ".join(f"{d.platform} ({d.device_kind})" for d in jax.devices())


@functools.cache
def flydsl_available() -> bool:
    """Whether ``implementation=None`` may pick the FlyDSL kernels for a ROCm lowering.

    With no ROCm device in this process (lowering for ROCm from another host) the target is
    assumed to be an MI355. With ROCm devices, all of them must be gfx950 and the FFI library
    must be built; otherwise a one-time warning says why the jax-native implementation runs.
    """
    devices = rocm_devices()
    if not devices:
        return True
    other = sorted({d.device_kind for d in devices if not is_gfx950(d)})
    if other:
        warnings.warn(
            f"jax_sparse_mla: the FlyDSL kernels need gfx950 (MI355) GPUs; this process has "
            f"{', '.join(other)}: implementation=None runs the jax-native 'xla' implementation",
            stacklevel=3,
        )
        return False
    if ffi.rocm_library() is None:
        warnings.warn(
            "jax_sparse_mla: this install has no FFI library (built only when asked: "
            "JAX_SPARSE_MLA_KERNELS=gfx950 pip install ..., or the gfx950 wheel, see BUILD.md): "
            "implementation=None runs the jax-native 'xla' implementation on ROCm",
            stacklevel=3,
        )
        return False
    return True


def gfx950_or(
    kernel_fn: Callable, fallback: Callable, unsupported: Callable, configurations: Callable
) -> Callable:
    """The ROCm branch of ``implementation=None``: ``kernel_fn`` when the target is gfx950,
    ``unsupported(*args, **options)`` is None and every kernel configuration the call launches
    (``configurations(*args, **options)``) passed its self-check on this machine's GPU
    (``_verdicts.trusted``: verified lazily, in a child process, the first time a configuration
    would run), else ``fallback``; decided at trace time. With no ROCm device in this process
    (lowering for another host) nothing can be checked and the kernels are chosen."""

    def run(*args, **options):
        if flydsl_available() and unsupported(*args, **options) is None:
            devices = rocm_devices()
            symbols = configurations(*args, **options)
            if not devices or _verdicts.trusted(symbols, devices[0].device_kind):
                return kernel_fn(*args, **options)
        return fallback(*args, **options)

    return run
