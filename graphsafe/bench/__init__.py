"""Benchmarks: `python -m graphsafe bench [--op NAME] [--full] [--time-limit SECONDS] [--json PATH]`
(see harness.py): each case's default shapes on a GPU, its full sweep with `--full`, its
CPU shapes on a CPU (cases without them are skipped there)."""
