"""jax_sparse_mla: DeepSeek-V3.2 / Kimi-K3 style attention ops for JAX.

Ops (each works under ``jax.jit`` and ``jax.vmap``; ``implementation=None`` picks the best
available, ``"xla"`` the jax-native one that runs everywhere, each op computed exactly in
float32):

- ``sparse_mla``: sparse MLA over fp8_ds_mla records with a CSR index stream.
- ``mla_decode`` / ``mla_decode_partials`` / ``merge_attn_states``: split-KV MLA decode.
- ``ultraquant_decode``: GQA decode over a 4-bit UltraQuant paged cache (q rotated and rounded
  to e4m3, as the format's own implementations compute it; ``exact_q=True`` keeps it float32).
- ``*_sharded``: each op over a device mesh (heads, rows / requests, KV context), ``sharding``.

Record writers and readers live in ``jax_sparse_mla.formats`` and are re-exported here.
``checked(fn)`` makes the ops' ``validate=True`` checks inside ``fn`` (jitted or not) raise
their ``DataError`` (a ValueError), under ``jax.jit`` too. ``selfcheck()`` checks the gfx950
kernels on an MI355 against their emulation (``self_check``).
"""

from importlib import metadata as _metadata
from pathlib import Path as _Path

from jax_sparse_mla._checks import DataError, checked
from jax_sparse_mla.ffi import rocm_library
from jax_sparse_mla.formats import (
    concat_and_cache_ds_mla,
    concat_and_cache_mla,
    pack_fp8_ds_mla,
    ultraquant_store,
    unpack_fp8_ds_mla,
)
from jax_sparse_mla.mla_decode import (
    merge_attn_states,
    mla_decode,
    mla_decode_partials,
    validate_mla_decode,
)
from jax_sparse_mla.self_check import selfcheck
from jax_sparse_mla.sharding import (
    mla_decode_sharded,
    sparse_mla_sharded,
    ultraquant_decode_sharded,
)
from jax_sparse_mla.sparse_mla import (
    dense_to_csr,
    sparse_mla,
    validate_fp8_ds_mla_records,
    validate_sparse_mla,
)
from jax_sparse_mla.ultraquant import ultraquant_decode, validate_ultraquant_decode


def _version() -> str:
    """The installed distribution's version; in a source tree without one, pyproject.toml's."""
    try:
        return _metadata.version("jax_sparse_mla")
    except _metadata.PackageNotFoundError:
        import tomllib

        pyproject = _Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()

rocm_library()  # registers the gfx950 kernels' custom call targets for platform "ROCM"

__all__ = [
    "DataError",
    "checked",
    "concat_and_cache_ds_mla",
    "concat_and_cache_mla",
    "dense_to_csr",
    "merge_attn_states",
    "mla_decode",
    "mla_decode_partials",
    "mla_decode_sharded",
    "pack_fp8_ds_mla",
    "selfcheck",
    "sparse_mla",
    "sparse_mla_sharded",
    "ultraquant_decode",
    "ultraquant_decode_sharded",
    "ultraquant_store",
    "unpack_fp8_ds_mla",
    "validate_fp8_ds_mla_records",
    "validate_mla_decode",
    "validate_sparse_mla",
    "validate_ultraquant_decode",
]
