"""Pallas Mosaic GPU kernels for NVIDIA Hopper (sm_90a): warp-specialized, wgmma, bulk copies."""
