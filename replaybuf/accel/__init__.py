"""Fast paths: numba kernels, Triton kernels, CUDA graphs; each speeds up a general path and is
tested against it."""
