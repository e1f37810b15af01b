#!/usr/bin/env python
"""Benchmark harness entry point: `python scripts/bench.py --help` (see rollout_service/bench)."""
import os
import sys

# Run from a source tree without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout_service.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
