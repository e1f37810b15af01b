#!/usr/bin/env python
"""What scoring and refresh-with-recompute cost: `python scripts/bench_rl_semantics.py [--quick]`
(rollout_service/bench/rl_semantics.py)."""
import os
import sys

# Run from a source tree without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout_service.bench.rl_semantics import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
