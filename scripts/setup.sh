#!/usr/bin/env bash
# Idempotent set-up: a .venv in the repo root with rollout_service installed (editable) and its test tools.
# On a machine without a GPU it installs the CPU build of torch first, so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
if ! "$VPY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$VPY" -m pip install -q torch
    else
        "$VPY" -m pip install -q "torch==2.13.0"
    fi
fi
"$VPY" -m pip install -q -e ".[test,plot]"
"$VPY" -c "import torch, ray, transformers; print(f'set-up ok: torch {torch.__version__}, ray {ray.__version__}, transformers {transformers.__version__}')"
