#!/usr/bin/env bash
# Nsight Compute profiles of the attention kernels on the W4 shapes (one launch each, after warm-up),
# plus the page-layout experiment; text reports under $OUT/ncu. Needs a machine where ncu reads counters.
#   usage: scripts/lab/ncu_profile.sh [decode|prefill|layout ...]   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} ROLLOUT_KERNELS_CACHE=${ROLLOUT_KERNELS_CACHE:-/tmp/rollout_kernels}
OUT=${OUT:-/tmp/ncu_out}; mkdir -p "$OUT/ncu"
PY=${PY:-python3}
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats"
WHAT=${*:-decode prefill layout}
$PY -c "from rollout_service.ops._ext import build_kernels; build_kernels()" || exit 1
for what in $WHAT; do
  case $what in
    decode)
      for c in "128 1024 14 2 64" "32 4096 14 2 64" "128 4096 14 2 64" "32 1024 32 8 128" "128 4096 32 8 128" \
               "1 4096 14 2 64"; do
        name=decode_$(echo "$c" | tr ' ' '_')
        timeout 120 ncu --clock-control none -k regex:decode_kernel --launch-skip 2 --launch-count 1 $SECTIONS \
          $PY scripts/lab/ncu_attention.py decode $c >"$OUT/ncu/$name.txt" 2>&1
        echo "$name rc=$?"
      done ;;
    prefill)
      for c in "4096 32 8 128" "4096 14 2 64"; do
        name=prefill_$(echo "$c" | tr ' ' '_')
        timeout 180 ncu --clock-control none -k regex:prefill_kernel --launch-skip 1 --launch-count 1 $SECTIONS \
          $PY scripts/lab/ncu_attention.py prefill $c >"$OUT/ncu/$name.txt" 2>&1
        echo "$name rc=$?"
      done ;;
    layout) timeout 200 $PY scripts/lab/ncu_attention.py layout 2>&1 | tee "$OUT/ncu/layout.txt" ;;
  esac
done
