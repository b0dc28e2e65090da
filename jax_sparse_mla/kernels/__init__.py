"""Kernels behind the ops: ``gfx950`` (FlyDSL, AMD MI355) and ``pallas`` (NVIDIA)."""
