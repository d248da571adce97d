"""NVFP4 formats and Triton kernels (a later issue)."""
