"""Decode attention split-count sweep over the W4 cases, for tuning decode_num_splits (csrc/NOTES.md).

  python scripts/lab/decode_sweep.py [--csrc DIR] [--splits 1,2] [--batches 256 --contexts 256]
  (DIR: a modified copy of csrc/ to build and time instead)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollout_service.ops import kernel_bench as kb
from rollout_service.ops._ext import build_kernels
from rollout_service.ops.cuda_ops import CudaOps


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csrc")
    parser.add_argument("--splits", default="1,2,4,8,16", help="-1: one warp per (sequence, kv head)")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--json")
    args = parser.parse_args()
    ops = CudaOps()
    if args.csrc:
        ops.kernels = build_kernels(csrc=Path(args.csrc).resolve())
    rows = kb.bench_decode_attention(batch_sizes=ints(args.batches), contexts=ints(args.contexts),
                                     split_sweep=ints(args.splits), sweep_all=True, ops=ops)
    for r in rows:
        sweep = r["split_sweep_us"]
        best = min(sweep, key=sweep.get)
        print(f"{r['q_heads']}/{r['kv_heads']} d{r['head_dim']} ctx{r['ctx']} B{r['batch']} KV {r['kv_mb']:.1f} MB: "
              f"auto({r['num_splits']}) {r['us']:.1f} ({r['hbm_frac']:.0%}) best {best}:{sweep[best]:.1f} "
              f"sdpa {r['sdpa_us']:.1f} err {r['rel_err_vs_sdpa']:.1e} | "
              + " ".join(f"{n}:{t:.1f}({r['split_sweep_rel_err'][n]:.0e})" for n, t in sweep.items()))
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
