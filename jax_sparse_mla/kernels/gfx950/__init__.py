"""FlyDSL kernels for AMD MI355 (gfx950), compiled ahead of time by ``jax_sparse_mla.build``."""
