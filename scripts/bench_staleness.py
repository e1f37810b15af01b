#!/usr/bin/env python
"""Staleness-first vs FIFO scheduling on a mixed stream with refreshes: `python scripts/bench_staleness.py`
(rollout_service/bench/staleness.py)."""
import os
import sys

# Run from a source tree without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout_service.bench.staleness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
