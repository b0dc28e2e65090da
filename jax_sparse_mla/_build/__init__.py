"""Build tooling: the gfx950 kernels' ahead-of-time build (``build``), the reader of their code
objects (``codeobject``) and the FFI library's compile and link (``build_lib``). Not imported at
run time."""
