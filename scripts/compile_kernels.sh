#!/usr/bin/env bash
# Compile every csrc/*.cu with plain nvcc (no torch, no GPU needed) for sm_90a and sm_80 and print each
# kernel's registers, shared memory, stack frame and spills (ptxas -v). Exit status != 0 on any error.
# Flags mirror torch.utils.cpp_extension's (the __CUDA_NO_*__ defines) so this catches what the JIT build would.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
ARCHS=${ARCHS:-"compute_90a,code=sm_90a compute_80,code=sm_80"}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
gencodes=()
for arch in $ARCHS; do gencodes+=(-gencode=arch="$arch"); done
jobs=()
for src in csrc/*.cu; do  # every arch in one nvcc per file: the host side is compiled once
  name=$(basename "$src" .cu)
  "$NVCC" -c -O3 -std=c++17 --expt-relaxed-constexpr -Icsrc \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
    -D__CUDA_NO_HALF2_OPERATORS__ "${gencodes[@]}" -Xptxas -v \
    "$src" -o "$out/$name.o" >"$out/$name.log" 2>&1 &
  jobs+=("$!:$name")
done
status=0
for job in "${jobs[@]}"; do
  if ! wait "${job%%:*}"; then
    echo "COMPILE ERROR: ${job#*:}"
    cat "$out/${job#*:}.log"
    status=1
  fi
done
[ $status -eq 0 ] || exit $status
# One line per kernel: arch, registers, smem, stack, spill stores/loads, demangled name.
python3 - "$out" <<'PY' | c++filt | sed -E 's/rollout_kernels::\(anonymous namespace\):://g; s/\(rollout_kernels::[A-Za-z]+Params\)//'
import pathlib, re, sys
rows = []
for log in sorted(pathlib.Path(sys.argv[1]).glob("*.log")):
    fn = arch = None
    stack = st = ld = "?"
    for line in log.read_text().splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line):
            fn, arch = m.groups()
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            stack, st, ld = m.groups()
        elif (m := re.search(r"Used (\d+) registers", line)) and fn:
            smem = re.search(r"(\d+) bytes smem", line)
            rows.append(f"{arch:7} regs={m.group(1):<4} smem={smem.group(1) if smem else 0:<5} stack={stack:<4} "
                        f"spill_st={st:<4} spill_ld={ld:<4} {fn}")
            fn = None
print("\n".join(sorted(rows)))
PY
