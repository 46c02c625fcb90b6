"""Fused kernels from optional libraries (apex), each guarded so that torch alone suffices."""
