#!/usr/bin/env python
"""Prefix-aware vs load-only routing on 2 CPU workers: `python scripts/bench_routing.py [--quick]`
(rollout_service/bench/prefix_routing.py)."""
import os
import sys

# Run from a source tree without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout_service.bench.prefix_routing import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
