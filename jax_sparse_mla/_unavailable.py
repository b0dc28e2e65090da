"""A kernel asked for where it cannot run: a placeholder that fails when lowered.

A per-platform branch (``jax.lax.platform_dependent``) is traced for every platform but lowered
only for the one the computation is compiled for, so the check "can this platform run the
kernel" belongs to lowering: ``unavailable(message, shapes, *operands)`` has the kernel's
result shapes, and lowering it raises ``NotImplementedError(message)``: at ``jax.jit``'s first
call (or ``.lower()``), before anything runs, once, with what the kernel needs. A lowering for
the kernel's own platform never holds it (lowering for ROCm or CUDA from a CPU host works).
"""

from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

_unavailable_p = Primitive("jsm_unavailable")
_unavailable_p.multiple_results = True


def unavailable(message: str, shapes, *operands):
    """Arrays shaped like ``shapes`` (a pytree of ShapeDtypeStructs) whose lowering raises
    NotImplementedError(``message``); ``operands`` tie it to the computation."""
    leaves, tree = jax.tree.flatten(shapes)
    specs = tuple((tuple(s.shape), s.dtype) for s in leaves)
    outs = _unavailable_p.bind(*operands, specs=specs, message=message)
    return jax.tree.unflatten(tree, outs)


def _abstract(*_, specs, message):
    return [jax.core.ShapedArray(shape, dtype) for shape, dtype in specs]


def _fail(*_, specs, message):
    """Lowered (or evaluated eagerly, on this process's platform): the kernel cannot run here."""
    raise NotImplementedError(message)


def _batch(args, dims, *, specs, message):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    batched = tuple(((size, *shape), dtype) for shape, dtype in specs)
    return _unavailable_p.bind(*args, specs=batched, message=message), [0] * len(specs)


_unavailable_p.def_abstract_eval(_abstract)
_unavailable_p.def_impl(_fail)
mlir.register_lowering(_unavailable_p, lambda ctx, *args, **params: _fail(*args, **params))
batching.primitive_batchers[_unavailable_p] = _batch
