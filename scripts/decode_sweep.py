"""Decode attention split-count sweep over the W4 cases, for tuning decode_num_splits (csrc/NOTES.md).

  python scripts/decode_sweep.py [--csrc DIR] [--splits 1,2] [--batches 256 --contexts 256]
  (DIR: a modified copy of csrc/ to build and time instead)
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from rollout_service.ops import kernel_bench as kb
from rollout_service.ops.cuda_ops import CudaOps


def load_variant(csrc: str):
    from torch.utils.cpp_extension import load

    from rollout_service.ops._ext import _arch_flags

    sources = [os.path.join(csrc, f) for f in sorted(os.listdir(csrc)) if f.endswith(".cu")]
    build = os.path.join("/tmp", "variant_" + os.path.basename(csrc.rstrip("/")))
    os.makedirs(build, exist_ok=True)
    return load(name="rollout_variant", sources=sources + [os.path.join(csrc, "bindings.cpp")],
                extra_include_paths=[csrc], extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", *_arch_flags()],
                build_directory=build)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csrc")
    parser.add_argument("--splits", default="1,2,4,8,16")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--json")
    args = parser.parse_args()
    ops = CudaOps()
    if args.csrc:
        ops.kernels = load_variant(args.csrc)
    hbm = kb.measure_hbm_bandwidth()
    rows = []
    for hq, hk, d in kb.HEAD_SHAPES:
        for ctx in [int(c) for c in args.contexts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                cache, cases, kv_bytes = kb._decode_case(batch, ctx, hq, hk, d, 16, torch.bfloat16)
                scale = d**-0.5
                auto = ops.kernels.decode_num_splits(cases[0][0], hk, ctx)
                t = {}
                for n in [0] + [int(s) for s in args.splits.split(",")]:
                    t[n or "auto"] = kb._graph_time_us(
                        lambda i, n=n: ops.kernels.decode_attention(
                            cases[i][0], cache, cases[i][1].kv_indptr, cases[i][1].kv_indices,
                            cases[i][1].kv_last_page_len, scale, ctx, n),
                        len(cases), 20, 7)
                sdpa = kb._graph_time_us(lambda i: F.scaled_dot_product_attention(
                    cases[i][0].view(batch, hq, 1, d), cases[i][2][0], cases[i][2][1], scale=scale,
                    enable_gqa=hq != hk), len(cases), 20, 7)
                best = min((v, k) for k, v in t.items() if k != "auto")
                print(f"{hq}/{hk} d{d} ctx{ctx} B{batch} KV {kv_bytes / 1e6:.1f} MB: auto({auto}) {t['auto']:.1f} "
                      f"({kv_bytes / (t['auto'] * 1e-6) / hbm:.0%}) best {best[1]}:{best[0]:.1f} sdpa {sdpa:.1f} | "
                      + " ".join(f"{k}:{v:.1f}" for k, v in t.items() if k != "auto"), flush=True)
                rows.append(dict(hq=hq, hk=hk, d=d, ctx=ctx, batch=batch, auto_splits=auto, us=t, sdpa_us=sdpa))
                del cache, cases
                torch.cuda.empty_cache()
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
