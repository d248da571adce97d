"""The CPU fast paths of a loaded model: kernel-backed linear layers and the fused small-batch forward pass.

The kernels themselves (C++, one build per instruction set) are in `kernels/`; this package attaches them.
"""
