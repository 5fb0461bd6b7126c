"""Benchmarks, reachable as ``diffusion-runtime bench NAME`` and from ``benchmarks/``."""
