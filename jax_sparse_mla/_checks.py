"""Argument checks shared by every public function.

The trace-time checks raise ``TypeError`` (wrong dtype) or ``ValueError`` (wrong rank or shape)
with a message that names the function, the argument and what was expected. They only look at
static shapes and dtypes, so they work on tracers under ``jax.jit`` and ``jax.vmap``. The data
checks (``DataCheck``, ``run_data_checks``, ``checked``) look at values, where the data lives.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jax_sparse_mla._vma import replicated


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
    inside and outside ``jax.jit``), gathered where an Explicit mesh axis splits them
    (``_vma.replicated``); called after the static checks."""
    return tuple(replicated(jnp.asarray(x)) for x in xs)


def is_concrete(*xs) -> bool:
    """True when every argument holds concrete values (no tracer), so data checks can run."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


class DataError(ValueError):
    """A data-dependent check failed (``validate=True``, a ``validate_*`` function, or an op's
    check under ``checked``)."""


class DataCheck(NamedTuple):
    """One data-dependent condition, computed in jnp where the data lives: ``failed`` (a bool
    scalar) and ``message``, a ``str.format`` template filled with ``args`` (int or float
    scalars: a count, a first bad index, its value). Only ``failed`` and ``args`` leave the
    device."""

    failed: jax.Array
    message: str
    args: tuple[jax.Array, ...] = ()


class _Message(str):
    """A DataCheck's template as handed to ``checkify.check``: marks the failure as the op's."""


_CHECKIFY = jax.make_user_context(False)  # True while ``checked`` traces (a jit cache key)


def literal(text: str) -> str:
    """``text`` as a literal part of a DataCheck message template (braces escaped)."""
    return text.replace("{", "{{").replace("}", "}}")


def run_data_checks(checks: Sequence[DataCheck], tie: jax.Array | None = None):
    """Raises the first failing check's DataError (a ValueError); returns ``tie``.

    Only the checks' findings (counts, a first bad index and its value) leave the device, never
    the checked arrays. Concrete arguments are checked at once. Traced inside ``checked`` the
    checks become ``checkify.check``s and ``checked`` raises the DataError after the call.
    Otherwise, under ``jax.jit`` / ``jax.vmap``, the report runs as a host callback when the
    computation executes (once per batch element under ``jax.vmap``), and the returned ``tie``
    (pass a small array the op reads, e.g. its indptr) depends on it, so the op runs after its
    checks; a failure stops the call with a ``jax.errors.JaxRuntimeError`` whose message ends
    with the op's own ValueError message (a compiled computation cannot raise a Python
    exception type of its own), and nothing is logged to stderr.
    """

    def report(*found):
        for check, (failed, args) in zip(checks, found, strict=True):
            if failed:
                raise DataError(_format(check.message, args))
        return np.bool_(True)

    found = [(check.failed, check.args) for check in checks]
    if is_concrete(*jax.tree.leaves(found)):
        report(*found)
        return tie
    if _CHECKIFY.value:
        for check in checks:
            checkify.check(~check.failed, _Message(check.message), *check.args)
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


def _format(message: str, args) -> str:
    return message.format(*(np.asarray(a) for a in args))


def checked(fn: Callable) -> Callable:
    """``fn`` whose ops' data checks (``validate=True``, ``validate_*``) raise their DataError.

    ``checked(fn)(*args)`` traces ``fn`` (which may be or call ``jax.jit`` functions) under
    ``jax.experimental.checkify.checkify`` with the ops' checks as ``checkify.check``s: they
    run where the data lives and only their findings reach the host, at the end of the call;
    the first failing one raises the op's DataError (a ValueError) with the op's message,
    naming the kv row or index, with nothing on stderr. Other ``checkify.check``s in ``fn``
    raise checkify's error. A ``jax.jit`` function traced outside ``checked`` is traced again
    inside it (the mode is part of jit's cache key), and the other way round. Call ``checked``
    outside ``jax.jit`` (the result is concrete: it waits for the findings).
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _CHECKIFY(True):
            error, out = checkify.checkify(fn)(*args, **kwargs)
        if not is_concrete(*jax.tree.leaves(error)):
            raise TypeError("checked: call it outside jax.jit (it raises on the host)")
        failure = error.get_exception()
        # an error state that passed through a shard_map comes back per device (batched)
        failure = next(iter(getattr(failure, "error_mapping", {None: failure}).values()))
        if isinstance(getattr(failure, "fmt_string", None), _Message):  # one of the ops' checks
            raise DataError(_format(failure.fmt_string, failure.args)) from None
        error.throw()
        return out

    return call


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


def csr_check(op: str, indices_name: str, indptr_name: str, nnz: int, indptr) -> list[DataCheck]:
    """CSR structure: ``indptr`` starts >= 0, never decreases, and ends at ``nnz``."""
    ptr = literal(indptr_name)
    if indptr.shape[0] > 1:
        _, r = first_true(indptr[1:] < indptr[:-1])
        decreasing = jnp.any(indptr[1:] < indptr[:-1])
    else:
        r, decreasing = jnp.int32(0), jnp.bool_(False)
    at = (r + 1, indptr[jnp.minimum(r + 1, indptr.shape[0] - 1)], r, indptr[r])
    return [
        DataCheck(indptr[0] < 0, f"{literal(op)}: {ptr}[0] must be >= 0, got {{}}", (indptr[0],)),
        DataCheck(
            decreasing,
            f"{literal(op)}: {ptr} must be non-decreasing, but {ptr}[{{}}] = {{}} < "
            f"{ptr}[{{}}] = {{}}",
            at,
        ),
        DataCheck(
            indptr[-1] != nnz,
            f"{literal(op)}: {ptr}[-1] must equal len({literal(indices_name)}) = {nnz}, got {{}}",
            (indptr[-1],),
        ),
    ]


def range_check(op: str, name: str, values, upper: int, what: str, *, allow=None) -> DataCheck:
    """Every entry of ``values`` in [0, upper) (or equal to ``allow``, e.g. -1 padding)."""
    bad = (values < 0) | (values >= upper)
    if allow is not None:
        bad &= values != allow
    count, first = first_true(bad)
    value = values.reshape(-1)[first] if values.size else jnp.int32(0)
    pos = jnp.unravel_index(first, values.shape) if values.size else (first,) * values.ndim
    pad = f" or {allow}" if allow is not None else ""
    message = (
        f"{literal(op)}: {literal(name)}[{', '.join(['{}'] * values.ndim)}] = {{}} is outside "
        f"[0, {upper}){pad} ({literal(what)}); failing entries: {{}} of {values.size}"
    )
    return DataCheck(count > 0, message, (*pos, value, count))
