"""Attention backends, Triton kernels and the native C kernels."""
