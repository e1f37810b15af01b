"""Benchmark harness: the engine vs HF transformers on fixed workloads, with the hardware floor.

`python scripts/bench.py --help`, or `main(argv)` from Python. Workloads, models and peers are the
ones fixed in BENCHMARKS.md; results go to benchmarks/results/<date>-<hardware>.json and .md.
"""

from .harness import WORKLOADS, main

__all__ = ["WORKLOADS", "main"]
