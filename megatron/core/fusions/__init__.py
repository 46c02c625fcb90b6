"""Fused kernels, from optional libraries (apex, Triton) or chunked PyTorch, each guarded so
that torch alone suffices."""
