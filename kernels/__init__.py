"""Leaf compute, importing nothing of ours: the C++ CPU decode kernels (`cpu_decode.cpp` over the
vector layer `simd*.h`, one build per instruction set), the CPU-capability decisions that pick a
build (`cpu_features.py`), the loader (`cpu_decode.py`), the NVFP4 weight format as the exact
torch reference every NVFP4 kernel is tested against (`nvfp4.py`), and the NVFP4 Triton kernels for
GPUs (`nvfp4_triton.py`; the CPU's NVFP4 kernel is part of `cpu_decode.cpp`)."""
