"""Benchmark cases, one module per op family; each registers with `@bench_case`."""
