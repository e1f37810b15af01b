#!/usr/bin/env bash
# Set up (if needed) and run a local rollout on the embedded SmolLM2-135M-Instruct: prompts, completions,
# per-token logprobs and tokens/s. Extra arguments go to scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python scripts/demo.py "$@"
