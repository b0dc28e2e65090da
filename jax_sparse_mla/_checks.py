"""Trace-time argument checks shared by every public function.

Each check raises ``TypeError`` (wrong dtype) or ``ValueError`` (wrong rank or shape) with a
message that names the function, the argument and what was expected. They only look at
static shapes and dtypes, so they work on tracers under ``jax.jit`` and ``jax.vmap``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def _dtype_names(dtypes: Sequence[np.dtype]) -> str:
    return " or ".join(np.dtype(d).name for d in dtypes)


def check_array(
    op: str,
    name: str,
    x,
    *,
    dtypes: Sequence | None = None,
    ndim: int | None = None,
    min_ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    last_dims: Sequence[int] | None = None,
) -> None:
    """Checks one array argument.

    Args:
      op: the public function's name, for the message.
      name: the argument's name.
      x: the argument (array or tracer).
      dtypes: accepted dtypes (any of them).
      ndim: exact rank.
      min_ndim: minimum rank.
      shape: expected shape; ``None`` entries are free.
      last_dims: expected trailing dimensions (for "any leading shape" arguments).
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be a jax or numpy array, got {type(x).__name__}")
    if dtypes is not None and not any(x.dtype == np.dtype(d) for d in dtypes):
        raise TypeError(
            f"{op}: {name} must have dtype {_dtype_names(dtypes)}, got {np.dtype(x.dtype).name}"
        )
    if ndim is not None and x.ndim != ndim:
        raise ValueError(
            f"{op}: {name} must have rank {ndim}, got shape {tuple(x.shape)} (rank {x.ndim})"
        )
    if min_ndim is not None and x.ndim < min_ndim:
        raise ValueError(f"{op}: {name} must have rank >= {min_ndim}, got shape {tuple(x.shape)}")
    if shape is not None:
        ok = len(shape) == x.ndim and all(
            e is None or e == s for e, s in zip(shape, x.shape, strict=False)
        )
        if not ok:
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{op}: {name} must have shape {want}, got {list(x.shape)}")
    if last_dims is not None:
        k = len(last_dims)
        if x.ndim < k or tuple(x.shape[x.ndim - k :]) != tuple(last_dims):
            want = "[..., " + ", ".join(str(d) for d in last_dims) + "]"
            raise ValueError(f"{op}: {name} must have shape {want}, got {list(x.shape)}")


def check_equal(op: str, what: str, a: int, b: int, detail: str) -> None:
    """Raises ValueError when two sizes that must agree do not."""
    if a != b:
        raise ValueError(f"{op}: {what}: {detail} (got {a} and {b})")


def check_positive_int(op: str, name: str, value, *, allow_none: bool = False) -> None:
    """Checks a static integer option (e.g. ``qlen``, ``num_splits``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{op}: {name} must be a positive Python int, got {value!r}")


def check_scalar(op: str, name: str, value) -> jax.Array:
    """Accepts a Python number or a 0-d float array (traced or not); returns float32 (a numpy
    scalar for a number, so that it stays static under ``jax.jit``)."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a real scalar, got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return np.float32(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        if value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(
                f"{op}: {name} must be a Python float or a 0-d float array, got "
                f"{np.dtype(value.dtype).name} array of shape {tuple(value.shape)}"
            )
        return jnp.asarray(value, jnp.float32)
    raise TypeError(f"{op}: {name} must be a real scalar, got {type(value).__name__}")


def as_jax(*xs) -> tuple[jax.Array, ...]:
    """The array arguments as jax arrays (numpy arrays are accepted wherever a jax array is,
    inside and outside ``jax.jit``); called after the static checks."""
    return tuple(jnp.asarray(x) for x in xs)


def is_concrete(*xs) -> bool:
    """True when every argument holds concrete values (no tracer), so data checks can run."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


class DataError(ValueError):
    """A data-dependent check failed (``validate=True`` or a ``validate_*`` function)."""


class DataCheck(NamedTuple):
    """One data-dependent check: ``found``, a few scalars computed in jnp where the data lives,
    and ``report(*found)`` (numpy scalars in), which raises DataError when they show a problem."""

    found: tuple[jax.Array, ...]
    report: Callable[..., None]


def run_data_checks(checks: Sequence[DataCheck], tie: jax.Array | None = None):
    """Raises the first failing check's DataError (a ValueError); returns ``tie``.

    Only the checks' findings (counts, a first bad index and its value) leave the device, never
    the checked arrays. Concrete arguments are checked at once. Under ``jax.jit`` / ``jax.vmap``
    the report runs as a host callback when the computation executes (once per batch element
    under ``jax.vmap``), and the returned ``tie`` (pass a small array the op reads, e.g. its
    indptr) depends on it, so the op runs after its checks; a failure stops the call with a
    ``jax.errors.JaxRuntimeError`` whose message ends with the op's own ValueError message (a
    compiled computation cannot raise a Python exception type of its own), and nothing is
    logged to stderr.
    """

    def report(*found):
        for check, values in zip(checks, found, strict=True):
            check.report(*(np.asarray(v) for v in values))
        return np.bool_(True)

    found = [check.found for check in checks]
    if is_concrete(*jax.tree.leaves(found)):
        report(*found)
        return tie
    _quiet_data_errors()
    if tie is None:  # nothing to tie the check to: an effect, never removed
        jax.debug.callback(report, *found)
        return tie
    # A pure callback (no runtime token: a failure is this call's alone, not re-raised by later
    # effects), kept alive by the array the op reads (``ok`` is True whenever it returns).
    ok = jax.pure_callback(
        report, jax.ShapeDtypeStruct((), jnp.bool_), *found, vmap_method="sequential"
    )
    return jnp.where(ok, tie, jnp.zeros_like(tie))


class _DropDataErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], DataError))


@functools.cache
def _quiet_data_errors() -> None:
    """JAX logs every exception a host callback raises, with its traceback; a DataError is the
    op's answer, not a crash: drop those records (every other one is kept)."""
    for name in ("jax._src.debugging", "jax._src.callback"):
        logging.getLogger(name).addFilter(_DropDataErrors())


def first_true(bad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(number of True entries, flat index of the first one; 0 when none) of a bool array."""
    flat = bad.reshape(-1)
    if flat.shape[0] == 0:
        return jnp.int32(0), jnp.int32(0)
    return jnp.sum(flat, dtype=jnp.int32), jnp.argmax(flat).astype(jnp.int32)


def csr_check(op: str, indices_name: str, indptr_name: str, nnz: int, indptr) -> DataCheck:
    """CSR structure: ``indptr`` starts >= 0, never decreases, and ends at ``nnz``."""
    if indptr.shape[0] > 1:
        _, r = first_true(indptr[1:] < indptr[:-1])
        decreasing = jnp.any(indptr[1:] < indptr[:-1])
        at = jnp.stack([jnp.where(decreasing, r, -1), indptr[r + 1], indptr[r]])
    else:
        at = jnp.full((3,), -1, jnp.int32)
    found = (jnp.stack([indptr[0], indptr[-1]]), at)

    def report(ends, at):
        first, last = int(ends[0]), int(ends[1])
        if first < 0:
            raise DataError(f"{op}: {indptr_name}[0] must be >= 0, got {first}")
        r = int(at[0])
        if r >= 0:
            raise DataError(
                f"{op}: {indptr_name} must be non-decreasing, but {indptr_name}[{r + 1}] = "
                f"{int(at[1])} < {indptr_name}[{r}] = {int(at[2])}"
            )
        if last != nnz:
            raise DataError(
                f"{op}: {indptr_name}[-1] must equal len({indices_name}) = {nnz}, got {last}"
            )

    return DataCheck(found, report)


def range_check(op: str, name: str, values, upper: int, what: str, *, allow=None) -> DataCheck:
    """Every entry of ``values`` in [0, upper) (or equal to ``allow``, e.g. -1 padding)."""
    bad = (values < 0) | (values >= upper)
    if allow is not None:
        bad &= values != allow
    count, first = first_true(bad)
    value = values.reshape(-1)[first] if values.size else jnp.int32(0)
    shape = values.shape

    def report(count, first, value):
        if count:
            pos = ", ".join(str(int(i)) for i in np.unravel_index(int(first), shape))
            pad = f" or {allow}" if allow is not None else ""
            raise DataError(
                f"{op}: {name}[{pos}] = {int(value)} is outside [0, {upper}){pad} ({what}); "
                f"{int(count)} such entr{'y' if count == 1 else 'ies'}"
            )

    return DataCheck((count, first, value), report)
