"""Benchmarks: run each from the repository root as a module, `python -m benchmarks.NAME`."""
