"""The benchmark harness (benchmarks/harness/) and its committed results (benchmarks/results/), beside the service
and not part of its installed package. From the repository root: `python -m benchmarks --help`; the plan of the
workloads is benchmarks/README.md."""
