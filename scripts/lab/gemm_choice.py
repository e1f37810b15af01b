"""The decode step's linear layers at batch M (llama3-8b, qwen2.5-0.5b shapes): what cuBLAS gives by default,
with cuBLASLt preferred, and after torch's TunableOp search, CUDA-graph timed over weight copies past L2.

    python scripts/lab/gemm_choice.py [--m 256] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from rollout_service.ops.kernel_bench import ROTATE_BYTES, _graph_time_us

SHAPES = {  # (name, N, K) of x[M, K] @ W[N, K]^T
    "llama3-8b": (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                  ("lm_head", 128256, 4096)),
    "qwen2.5-0.5b": (("qkv", 1152, 896), ("o_proj", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864)),
}


def run(m: int, mode: str) -> list[dict]:
    torch.backends.cuda.preferred_blas_library("cublaslt" if mode == "cublaslt" else "cublas")
    rows = []
    for model, shapes in SHAPES.items():
        for name, n, k in shapes:
            copies = max(1, min(16, ROTATE_BYTES // (n * k * 2)))
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(copies)]
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            us = _graph_time_us(lambda i: F.linear(x, ws[i]), copies, iters=10 * copies, reps=5)
            rows.append(dict(model=model, layer=name, m=m, n=n, k=k, mode=mode, us=round(us, 2),
                             tflops=round(2 * m * n * k / (us * 1e-6) / 1e12, 1)))
            del ws
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = run(args.m, "cublas") + run(args.m, "cublaslt")
    os.environ.setdefault("PYTORCH_TUNABLEOP_FILENAME", "/tmp/tunableop_results.csv")
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    torch.cuda.tunable.set_max_tuning_duration(200)
    rows += run(args.m, "tunableop")  # the graph warm-up calls tune each shape before capture
    torch.cuda.tunable.enable(False)
    for r in rows:
        print(f"{r['model']:>13} {r['layer']:>8} M{r['m']} {r['n']}x{r['k']} {r['mode']:>9}: {r['us']:8.1f} us "
              f"{r['tflops']:6.1f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
