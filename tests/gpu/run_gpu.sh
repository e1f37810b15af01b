#!/usr/bin/env bash
# One GPU session, one command: build the kernels, run tests/gpu, run the W4 kernel benchmark, memcheck the kernels.
# Logs go to $OUT (the device tool brings them back). Run from the repo root.
#   env: GPU_TESTS (default tests/gpu), RUN_W4 (default 1), ROLLOUT_KERNELS_CACHE (default /tmp/rollout_kernels)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ROLLOUT_KERNELS_CACHE=${ROLLOUT_KERNELS_CACHE:-/tmp/rollout_kernels}
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  $PY -c "import torch, transformers; print('torch', torch.__version__, torch.version.cuda, 'tf', transformers.__version__)"; } \
  2>&1 | tee "$OUT/env.log"

start=$(date +%s)
$PY -c "from rollout_service.ops._ext import build_kernels; m = build_kernels(verbose=True); print('BUILT', m.__file__)" \
  >"$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - start ))s"; grep -E "error|BUILT" "$OUT/build.log" | head -20
so=$(find "$ROLLOUT_KERNELS_CACHE" -name '*.so' | head -1)
[ -n "$so" ] && echo "SASS: HMMA=$(cuobjdump --dump-sass "$so" | grep -c HMMA) LDSM=$(cuobjdump --dump-sass "$so" | grep -c LDSM) LDGSTS=$(cuobjdump --dump-sass "$so" | grep -c LDGSTS)"

start=$(date +%s)
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
timeout 300 $PY -m pytest ${GPU_TESTS:-tests/gpu} -q -rfEP --maxfail=40 -p no:cacheprovider >"$OUT/tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - start ))s"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^(FAILED|ERROR)|hidden rel err" "$OUT/tests.log" | head -30

if [ "${RUN_W4:-1}" = 1 ]; then
  timeout 130 $PY -m benchmarks.harness.kernel_bench --json "$OUT/w4.json" 2>&1 | tee "$OUT/bench.log"
  echo "bench rc=$?"
fi

# Out-of-bounds check of the attention, MoE and FP8 kernels on small cases (Firecracker machines run compute-sanitizer).
T=tests/gpu/test_attention_kernels.py
M=tests/gpu/test_moe_gpu.py
timeout 150 compute-sanitizer --tool memcheck --print-limit 20 $PY -m pytest -q -p no:cacheprovider \
  "$T::test_decode_odd_lengths_and_page_boundaries[3-14-2-64-dtype0]" \
  "$T::test_prefill_ragged_with_cached_prefix[8-8-64-dtype0-auto-False]" \
  "$M::test_route_kernel_records_at_the_slots_and_flags_nan_rows" "$M::test_combine_has_the_references_bits" \
  "$M::test_permutation_is_the_reference_stable_grouping[37-8-2]" \
  "$M::test_experts_match_the_per_token_reference[1-128-8-2048-768]" \
  "$M::test_experts_match_the_per_token_reference[4-8-2-1000-72]" \
  "$M::test_every_token_on_one_expert[40]" >"$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed|Invalid" "$OUT/memcheck.log" | head -10
timeout 120 compute-sanitizer --tool memcheck --print-limit 20 $PY -m pytest -q -p no:cacheprovider \
  tests/gpu/test_fp8_gpu.py -k "not gemm and not decoder and not engine and (4864 or 2048 or 768)" \
  >"$OUT/memcheck_fp8.log" 2>&1
echo "memcheck fp8 rc=$?"; grep -E "ERROR SUMMARY|passed|failed|Invalid" "$OUT/memcheck_fp8.log" | head -10
