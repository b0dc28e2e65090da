"""jax-native emulations of the device kernels' own arithmetic (numerics studies, tight oracles)."""
