"""Leaf compute, importing nothing of ours: the C++ CPU decode kernels (`cpu_decode.cpp` over the
vector layer `simd*.h`, one build per instruction set), the CPU-capability decisions that pick a
build (`cpu_features.py`) and the loader (`cpu_decode.py`). NVFP4 formats and Triton kernels are
not here yet."""
