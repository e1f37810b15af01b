#!/usr/bin/env python
"""The control plane measured with fabricating engines: `python scripts/bench_router.py [--quick]`
(rollout_service/bench/control_plane.py)."""
import os
import sys

# Run from a source tree without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout_service.bench.control_plane import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
