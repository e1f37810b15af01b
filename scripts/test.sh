#!/usr/bin/env bash
# Set up (if needed) and run the CPU test suite. GPU tests in tests/gpu skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --timeout=900 "$@"
