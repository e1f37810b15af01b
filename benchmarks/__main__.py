"""`python -m benchmarks [...]`: the benchmark harness (benchmarks/harness/__init__.py says what it runs)."""
import sys

from benchmarks.harness import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
