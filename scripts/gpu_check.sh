#!/usr/bin/env bash
# One command on a GPU host (no network; torch + transformers preinstalled; run from the source tree):
# builds the kernels if the tree has them, runs tests/gpu, runs the benchmark harness on qwen2.5-0.5b and
# llama3-8b, and writes benchmarks/results/<date>-<gpu>-<workload>.json + .md, one file per workload, each replacing
# the older file of its GPU and workload (copied to $OUT too when set; file them into a checkout with
# `python -m benchmarks.harness.file_results $OUT/benchmarks/results/*.json`, which drops the older files there).
# Ray: used when importable; else installed from an offline bundle in .raybundle/ (scripts/device_ray_env.sh).
# Everything is bounded so the whole check ends in under 9 minutes; a failing step is reported, not fatal,
# and the exit status is 0 only when the GPU tests and the benchmark both passed.
#   usage: scripts/gpu_check.sh
#   env: PYTHON (default python3), OUT, GPU_CHECK_BUDGET_S (default 530),
#        GPU_CHECK_MODELS (default qwen2.5-0.5b,llama3-8b), GPU_CHECK_ARGS (extra harness arguments),
#        GPU_CHECK_RESULTS (default benchmarks/results), GPU_CHECK_TAG (a label of the runs, kept in their meta),
#        GPU_CHECK_BENCH (the benchmark steps, in order: default w7,rls,w6,w3,wd,ws,w4,w2p,wbi,main,moe; the budget cuts
#        the last ones), GPU_CHECK_MOE (the moe step's workloads, default WM,W2,W1,W5,WMF,WBI),
#        GPU_CHECK_MAIN (the main step's workloads, default W1,W2,W5,W2fp8,W1fp8,W2w,WP,W2n),
#        GPU_CHECK_W6_MODELS (the w6 step's models, default GPU_CHECK_MODELS),
#        GPU_CHECK_TESTS=0 (skip tests/gpu: a second call on the same machine, for the steps the budget cut)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "${PYTHON:-python3}" -c "import ray" 2>/dev/null && [ -d .raybundle ]; then
  source scripts/device_ray_env.sh
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-530}
MODELS=${GPU_CHECK_MODELS:-qwen2.5-0.5b,llama3-8b}
RESULTS=${GPU_CHECK_RESULTS:-benchmarks/results}
START=$(date +%s)
LOG=${OUT:-/tmp}/gpu_check.log
mkdir -p "$RESULTS" "$(dirname "$LOG")"
MARK=$(mktemp); touch "$MARK"
BASE=$(mktemp -d)  # the results as they were: the runs below replace files, the regression check reads these
cp "$RESULTS"/*.json "$BASE"/ 2>/dev/null || true
BENCH_STEPS=${GPU_CHECK_BENCH:-w7,rls,w6,w3,wd,ws,w4,w2p,wbi,main,moe}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
wanted() { [[ ",$BENCH_STEPS," == *",$1,"* ]]; }
declare -A STATUS

step() {  # step NAME LIMIT_S CMD...: run with a wall-clock limit, remember its exit status
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s, $(left)s of the budget left)" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  STATUS[$name]=${PIPESTATUS[0]}
  echo "== $name: exit ${STATUS[$name]} after $(( $(date +%s) - START ))s total" | tee -a "$LOG"
}

{ nvidia-smi -L; "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, torch.cuda.get_device_name())'; } 2>&1 | tee -a "$LOG"

if [ -f rollout_service/ops/_ext.py ]; then
  step build_kernels 200 "$PY" -c 'from rollout_service.ops._ext import build_kernels; build_kernels()'
else
  echo "== build_kernels: skipped, rollout_service/ops/_ext.py not in this tree" | tee -a "$LOG"
fi

if [ -d tests/gpu ] && [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
  step gpu_tests 240 "$PY" -m pytest -q -rf tests/gpu  # no -x: one failure must not hide the rest
fi

# W7 (multi-turn episodes, prefix cache on vs off, HF re-run per turn) and WDS (dynamic sampling's overhead) on
# qwen2.5-0.5b: the RL-rollout features, in-process.
W7_S=$(( $(left) > 120 ? ($(left) > 210 ? 180 : $(left) - 30) : 0 ))
if wanted w7 && [ "$W7_S" -gt 0 ]; then
  step bench_w7 "$W7_S" "$PY" -m benchmarks --model qwen2.5-0.5b --workloads W7,WDS --budget-s $(( W7_S - 20 )) \
    --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi

# The RL semantics' cost on qwen2.5-0.5b: client.score's engine path vs the transformers recompute (64 sequences
# of 1k tokens), and on_refresh continue vs recompute on W2n's shape with a refresh every 64 decode steps.
RLS_S=$(( $(left) > 300 ? 90 : 0 ))
if wanted rls && [ "$RLS_S" -gt 0 ]; then
  step bench_rls "$RLS_S" "$PY" -m benchmarks.harness.rl_semantics --model qwen2.5-0.5b --device cuda --out "$RESULTS" \
    ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi

# W6 (one colocated GRPO step per model: a Ray service with a learner actor on the same GPU) on its own, first:
# it is the RL loop as users run it; W6fp8 the same step with FP8 rollouts and the learner's TIS correction.
# Only the models' configs are loaded in this process.
W6_S=$(( $(left) > 200 ? ($(left) > 420 ? 330 : $(left) - 60) : 0 ))
if wanted w6 && [ "$W6_S" -gt 0 ]; then
  step bench_w6 "$W6_S" "$PY" -m benchmarks --model "${GPU_CHECK_W6_MODELS:-$MODELS}" --workloads W6,W6fp8 \
    --budget-s $(( W6_S - 30 )) --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi

# W3 (weight refresh by every transport through a one-worker service, and the sleep/wake cycle) on its own:
# it starts a local Ray instance, which the main run should not carry.
W3_S=$(( $(left) > 300 ? 200 : 0 ))
if wanted w3 && [ "$W3_S" -gt 0 ]; then
  step bench_w3 "$W3_S" "$PY" -m benchmarks --model "$MODELS" --workloads W3 --budget-s $(( W3_S - 20 )) \
    --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi

# WD (issue 49: delta refreshes after real optimizer steps, dense vs delta in the same run) on both models, on its
# own like W3 (a local Ray instance, one worker, the object store, bf16): 10 GRPO steps of W6's learner, each
# refresh sent as a delta, then the same weights dense; the digests must match. qwen2.5-0.5b trains with AdamW
# through fp32 masters; llama3-8b with the memory-light step (benchmarks/harness/delta_learner.py: its masters and
# moments would not fit beside the worker). A step that would end past the budget is not started.
WD_S=$(( $(left) > 300 ? 240 : ($(left) > 180 ? $(left) - 10 : 0) ))
if wanted wd && [ "$WD_S" -gt 0 ]; then
  step bench_wd "$WD_S" "$PY" -m benchmarks --model "$MODELS" --workloads WD --budget-s $(( WD_S - 35 )) \
    --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi

# WS (issue 47: exact speculative decoding on vs off in one run) on qwen2.5-0.5b with random weights in bf16 (the
# embedded model's weights are not on a GPU host): its own suffix drafter (random text: the drafts fail, and the
# cost model must keep speculation from being slower), and drafts replaying the plain run's tokens, each right with
# probability 0.5 / 1.0: what a verify step gives at a given acceptance. Then batch-invariant mode at batch 8 and 64,
# where the tokens must be identical (bf16 otherwise rounds a wider batch differently, as any change of batch does:
# the default run reports the fraction identical).
WS_S=$(( $(left) > 300 ? 170 : ($(left) > 150 ? $(left) - 100 : 0) ))
if wanted ws && [ "$WS_S" -gt 0 ]; then
  step bench_ws "$WS_S" "$PY" -m benchmarks.harness.speculative_bench --model qwen2.5-0.5b --device cuda \
    --drafters suffix,replay@0.5,replay@1.0 --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
  if [ "$(left)" -gt 100 ]; then
    step bench_wsi 70 "$PY" -m benchmarks.harness.speculative_bench --model qwen2.5-0.5b --device cuda \
      --batch-invariant --batches 8,64 --drafters replay@0.5 --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
  fi
fi

# W4 (kernel micro-benchmarks; independent of the model) runs first, on its own: inside the main run it came
# after the HF peers and was cut by the budget. The main harness run shares its budget between the two
# models, starts no part once it is spent, and writes its report after every workload, so even a run cut
# short by the outer timeout keeps what it measured. For llama3-8b the static-cache + compile peer (~90 s
# of compile), W2n and the W1 generate_batch peer are skipped to fit, and W2n's generate_batch peer for
# every model (it returns a fraction of the tokens asked for and took ~2 minutes).
W4_S=$(( $(left) > 300 ? 130 : 0 ))
if wanted w4 && [ "$W4_S" -gt 0 ]; then
  step bench_w4 "$W4_S" "$PY" -m benchmarks --model qwen2.5-0.5b --workloads W4 --budget-s $(( W4_S - 20 )) \
    --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi

# W2p (long prompts: 32 prompts x n=16, prompt 1000, 64 new) on both models, on its own. Cost from the shapes:
# the engine prefills 32k prompt tokens and runs 64 decode steps of 512 sequences (seconds, plus graph capture);
# HF generate prefills all 512 copies of the prompts in one padded call, 512k tokens: for llama3-8b ~8 PFLOP,
# ~15-25 s with its 64 decode steps, and ~125 GiB at its peak (62 GiB of KV + ~45 GiB of MLP activations +
# the weights). That fits the step, so llama's HF peer runs; if it runs out of memory its cell says so (n/a
# with the error) and the rest stands. generate_batch is skipped as for W2n (there it returned a fraction
# of the tokens asked for and took ~2 minutes).
W2P_S=$(( $(left) > 300 ? 200 : 0 ))
if wanted w2p && [ "$W2P_S" -gt 0 ]; then
  step bench_w2p "$W2P_S" "$PY" -m benchmarks --model "$MODELS" --workloads W2p --budget-s $(( W2P_S - 30 )) \
    --skip W2p:hf_generate_batch --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi
# WBI (batch-invariant mode on vs off at W2's and W2n's shapes, in one run, and its bitwise checks: a sample of
# sequences re-run alone, every sequence recomputed by the learner forward) on both models.
WBI_S=$(( $(left) > 240 ? ($(left) > 420 ? 360 : $(left) - 40) : 0 ))
if wanted wbi && [ "$WBI_S" -gt 0 ]; then
  step bench_wbi "$WBI_S" "$PY" -m benchmarks --model "$MODELS" --workloads WBI --repeats 2 --budget-s $(( WBI_S - 30 )) \
    --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi
BENCH_S=$(( $(left) - 20 ))
if ! wanted main; then
  echo "== bench: not in GPU_CHECK_BENCH=$BENCH_STEPS" | tee -a "$LOG"
elif [ "$BENCH_S" -gt 90 ]; then
  # shellcheck disable=SC2086  # GPU_CHECK_ARGS is meant to split into words
  # W2fp8 / W1fp8 (FP8 rollouts; their HF peers are W2's and W1's), W2w (1024 sequences) and WP (a decode step's
  # GPU time by kernel class at W2's and W2w's batch) for the small model's gap to its floor.
  step bench "$BENCH_S" "$PY" -m benchmarks --model "$MODELS" \
    --workloads "${GPU_CHECK_MAIN:-W1,W2,W5,W2fp8,W1fp8,W2w,WP,W2n}" --budget-s $(( BENCH_S - 50 )) --out "$RESULTS" \
    ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"} --skip llama3-8b:hf_static --skip llama3-8b:W2n --skip W2n:hf_generate_batch \
    --skip llama3-8b:W1:hf_generate_batch --skip llama3-8b:W2w --skip llama3-8b:WP --skip W2w:hf_generate_batch \
    ${GPU_CHECK_ARGS:-}
else
  echo "== bench: cut by the budget, only $(left)s left (choose steps with GPU_CHECK_BENCH)" | tee -a "$LOG"
fi

# The mixture-of-experts model, qwen3-30b-a3b (61 GB in bf16): the engine runs the transformers model's own tensors
# (load_format=share), so the two fit one 80 GB GPU. WM (one layer's experts, each way the cuda backend can run
# them), W2, W1, W5, WMF (the learner's recompute with and without routing replay) and WBI (bitwise mode's cost,
# checked alone and against the learner on a sample). transformers' MoE forward loops over the experts with a host
# sync each, the same cost at every step: its peers are timed on 32 new tokens (--peer-new-tokens), and the
# static-cache and generate_batch peers are left out.
MOE_S=$(( $(left) > 200 ? $(left) - 20 : 0 ))
if wanted moe && [ "$MOE_S" -gt 0 ]; then
  step bench_moe "$MOE_S" "$PY" -m benchmarks --model qwen3-30b-a3b --workloads "${GPU_CHECK_MOE:-WM,W2,W1,W5,WMF,WBI}" \
    --engine-opt load_format=share --peer-new-tokens 32 --skip hf_static --skip hf_generate_batch \
    --shape wbi_check=4 --shape wbi_learner_check=16 --budget-s $(( MOE_S - 30 )) --out "$RESULTS" ${GPU_CHECK_TAG:+--tag "$GPU_CHECK_TAG"}
fi

NEW=$(find "$RESULTS" -maxdepth 1 -type f -newer "$MARK" \( -name '*.json' -o -name '*.md' \))
rm -f "$MARK"
REPLACED=$(for f in "$BASE"/*.json; do [ -e "$f" ] && [ ! -e "$RESULTS/${f##*/}" ] && echo "${f##*/}"; done)
if [ -n "${OUT:-}" ] && [ -n "$NEW" ]; then
  mkdir -p "$OUT/benchmarks/results" && cp $NEW "$OUT/benchmarks/results/"
fi
echo "== summary after $(( $(date +%s) - START ))s:" | tee -a "$LOG"
for k in "${!STATUS[@]}"; do echo "   $k: ${STATUS[$k]}"; done | tee -a "$LOG"
echo "   results: ${NEW:-none}" | tee -a "$LOG"
echo "   replaced (older files of the same GPU and workload, now merged into the new ones): ${REPLACED:-none}" | tee -a "$LOG"
NEW_JSON=$(printf '%s\n' $NEW | grep '\.json$' || true)
if [ -n "$NEW_JSON" ]; then  # every figure against the newest committed one of its workload and model (>10%: warned)
  # shellcheck disable=SC2086  # one argument per file
  "$PY" -m benchmarks.harness.regressions $NEW_JSON --against "$BASE" 2>&1 | tee -a "$LOG"
  # docs/benchmark-results.md with this run's figures (commit it with the result files; a test checks it)
  "$PY" -m benchmarks.harness.summary 2>&1 | tee -a "$LOG"
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/docs" && cp docs/benchmark-results.md "$OUT/docs/"; fi
fi
for f in $NEW; do case $f in *.md) cat "$f";; esac; done
# green: the GPU tests (where the tree has them) passed, every benchmark step that ran passed, and one did run
green=$([ "${STATUS[gpu_tests]:-0}" = 0 ] && echo 1 || echo 0)
ran=0
for b in bench_w7 bench_w6 bench_w3 bench_wd bench_ws bench_wsi bench_w4 bench_w2p bench_wbi bench bench_moe; do
  case ${STATUS[$b]:-} in "") ;; 0) ran=1 ;; *) green=0 ;; esac
done
[ "$green" = 1 ] && [ "$ran" = 1 ]
