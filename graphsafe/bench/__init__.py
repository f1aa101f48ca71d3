"""Benchmarks: `python -m graphsafe bench [--op NAME]` (see harness.py)."""
