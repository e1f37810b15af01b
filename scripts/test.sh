#!/usr/bin/env bash
# Set up (if needed) and run the CPU test suite. GPU tests in tests/gpu skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTEST=(.venv/bin/python -m pytest -q --timeout=900)
if [ $# -gt 0 ]; then exec "${PYTEST[@]}" "$@"; fi
# The whole suite in two shards side by side: the Ray tests (marked `ray`) spend most of their time waiting for
# processes to start, which the other tests' computing fills. The other shard gets an address where no Ray
# answers, so that a test there that started using Ray fails instead of joining the Ray shard's cluster.
ray_log=$(mktemp)
"${PYTEST[@]}" -m ray -p no:cacheprovider >"$ray_log" 2>&1 &
ray_pid=$!
trap 'kill "$ray_pid" 2>/dev/null || true' EXIT
status=0
RAY_ADDRESS=127.0.0.1:9 "${PYTEST[@]}" -m "not ray" -p no:cacheprovider || status=$?
wait "$ray_pid" || status=$?
trap - EXIT
echo "== the Ray tests:"
cat "$ray_log"
rm -f "$ray_log"
exit $status
