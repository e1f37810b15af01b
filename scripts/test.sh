#!/usr/bin/env bash
# Set up (if needed) and run the CPU test suite. GPU tests in tests/gpu skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTEST=(.venv/bin/python -m pytest -q --timeout=900)
if [ $# -gt 0 ]; then exec "${PYTEST[@]}" "$@"; fi
# The whole suite in three shards side by side: the Ray tests (marked `ray`) spend most of their time waiting for
# processes to start, which the other tests' computing fills; they run in two halves, each on its own Ray cluster
# (tests/ray_fixtures.py), the second half the modules below, the first every other one. The shard without Ray
# gets an address where no Ray answers, so that a test there that started using Ray fails instead of joining one.
SECOND_HALF=(tests/test_ray_delta.py tests/test_ray_faults.py tests/test_ray_colocate.py tests/test_newcomer.py
             tests/test_ray_scale.py tests/test_ray_multinode.py tests/test_ray_nodes.py tests/test_ray_job.py
             tests/test_overflow_guard.py)
# each shard lists its 20 slowest tests: the suite must stay under 15 minutes on a 2-core machine
SHARD=(-p no:cacheprovider --durations=20)
first_half=()
for f in "${SECOND_HALF[@]}"; do first_half+=(--ignore="$f"); done
logs=("$(mktemp)" "$(mktemp)")
"${PYTEST[@]}" -m ray "${SHARD[@]}" "${first_half[@]}" >"${logs[0]}" 2>&1 &
pids=($!)
"${PYTEST[@]}" -m ray "${SHARD[@]}" "${SECOND_HALF[@]}" >"${logs[1]}" 2>&1 &
pids+=($!)
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
status=0
RAY_ADDRESS=127.0.0.1:9 "${PYTEST[@]}" -m "not ray" "${SHARD[@]}" || status=$?
for k in 0 1; do
  wait "${pids[$k]}" || status=$?
done
trap - EXIT
for k in 0 1; do
  echo "== the Ray tests, half $((k + 1)):"
  cat "${logs[$k]}"
done
rm -f "${logs[@]}"
exit $status
