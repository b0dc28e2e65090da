"""Pallas (Triton backend) kernels for NVIDIA GPUs: ``implementation="pallas"``.

Every entry point runs the compiled Triton kernel when lowered for CUDA and the same kernel in
Pallas interpret mode on any other platform (slow; it is how the CPU tests run the kernels).
"""
