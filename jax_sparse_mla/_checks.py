"""Trace-time argument checks shared by every public function.

Each check raises ``TypeError`` (wrong dtype) or ``ValueError`` (wrong rank or shape) with a
message that names the function, the argument and what was expected. They only look at
static shapes and dtypes, so they work on tracers under ``jax.jit`` and ``jax.vmap``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def run_data_check(check: Callable[..., None], *arrays) -> None:
    """Runs a data-dependent check (numpy arrays in, ValueError out) on the arguments' values.

    Concrete arguments are checked at once. Under ``jax.jit`` / ``jax.vmap`` the check runs as a
    host callback when the computation executes, and its ValueError surfaces as the runtime error
    of the call (under ``jax.vmap`` the check runs once per batch element).
    """
    if is_concrete(*arrays):
        check(*(np.asarray(a) for a in arrays))
    else:
        jax.debug.callback(lambda *xs: check(*(np.asarray(x) for x in xs)), *arrays)


def check_csr(
    op: str, indices_name: str, indptr_name: str, indices: np.ndarray, indptr: np.ndarray
) -> None:
    """CSR structure: ``indptr`` starts >= 0, never decreases, and ends at ``len(indices)``."""
    nnz = indices.shape[0]
    if indptr.shape[0] == 0:
        raise ValueError(f"{op}: {indptr_name} must have at least one entry")
    if indptr[0] < 0:
        raise ValueError(f"{op}: {indptr_name}[0] must be >= 0, got {indptr[0]}")
    steps = np.diff(indptr)
    if (steps < 0).any():
        r = int(np.argmax(steps < 0))
        raise ValueError(
            f"{op}: {indptr_name} must be non-decreasing, but {indptr_name}[{r + 1}] = "
            f"{indptr[r + 1]} < {indptr_name}[{r}] = {indptr[r]}"
        )
    if indptr[-1] != nnz:
        raise ValueError(
            f"{op}: {indptr_name}[-1] must equal len({indices_name}) = {nnz}, got {indptr[-1]}"
        )


def check_index_range(
    op: str, name: str, values: np.ndarray, upper: int, what: str, *, allow=None
) -> None:
    """Every entry in [0, upper) (or equal to ``allow``, e.g. -1 padding)."""
    bad = (values < 0) | (values >= upper)
    if allow is not None:
        bad &= values != allow
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        pos = ", ".join(str(i) for i in where)
        pad = f" or {allow}" if allow is not None else ""
        raise ValueError(
            f"{op}: {name}[{pos}] = {values[where]} is outside [0, {upper}){pad} ({what}); "
            f"{int(bad.sum())} such entr{'y' if bad.sum() == 1 else 'ies'}"
        )
