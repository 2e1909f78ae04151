"""Benchmarks of the reference (CPU) and of the fast kernels (GPU), their history per
machine under ``benchmarks/results/``, and the performance page built from it.

See ``benchmarks/README.md`` for the conventions a benchmark case follows."""
