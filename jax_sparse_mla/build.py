"""``python -m jax_sparse_mla.build``: the ahead-of-time build of the gfx950 kernels (the tool
itself lives in ``jax_sparse_mla._build.build``; see its docstring and BUILD.md)."""

import sys

from jax_sparse_mla._build.build import main

if __name__ == "__main__":
    sys.exit(main())
