"""Where batch-invariant mode's time goes on the cuda backend, op by op (eager, as prefill runs; decode steps are
graphs, so their Python overhead is not counted there): fixed-shape GEMM chunks vs one cuBLAS call, the decode
kernel's fixed layout vs its per-batch choice, and per-query prefill attention vs the prefill kernel.

    python scripts/lab/invariant_cost.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from rollout_service.ops.attention import make_metadata
from rollout_service.ops.cuda_ops import CudaOps
from rollout_service.ops import invariant_cuda
from rollout_service.ops.invariant_cuda import CudaInvariantOps, per_query_pages

GEMMS = {"qwen2.5-0.5b": ((1152, 896), (896, 896), (9728, 896), (896, 4864)),
         "llama3-8b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))}
HEADS = {"qwen2.5-0.5b": (14, 2, 64), "llama3-8b": (32, 8, 128)}


def timed_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def gemm_rows(fast: CudaOps, inv: CudaInvariantOps) -> list[dict]:
    rows = []
    for model, shapes in GEMMS.items():
        for m in (200, 256, 4096, 8192):
            plain = chunked = 0.0
            for n, k in shapes:
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                plain += timed_us(lambda: F.linear(x, w))
                chunked += timed_us(lambda: inv.linear(x, w))
            rows.append(dict(op="layer GEMMs", model=model, m=m, fast_us=round(plain, 1),
                             invariant_us=round(chunked, 1), ratio=round(chunked / plain, 3)))
    rows.append(dict(op="wide GEMM rows give the chunks' bits", shapes={str(k): v for k, v in inv._wide.items()}))
    return rows


def paged(batch: int, ctx: int, hk: int, d: int):
    pages_per = -(-ctx // 16)
    kv = torch.randn(batch * pages_per + 1, 2, hk, 16, d, device="cuda", dtype=torch.bfloat16)
    tables = [list(range(1 + b * pages_per, 1 + (b + 1) * pages_per)) for b in range(batch)]
    return kv, tables


def attention_rows(fast: CudaOps, inv: CudaInvariantOps) -> list[dict]:
    rows = []
    for model, (hq, hk, d) in HEADS.items():
        for batch, ctx in ((256, 256), (256, 1024)):
            kv, tables = paged(batch, ctx, hk, d)
            meta = make_metadata(tables, [1] * batch, [ctx] * batch, 16, False, "cuda")
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            auto = timed_us(lambda: fast.decode_attention(q, kv, meta, d**-0.5))
            one = timed_us(lambda: fast.decode_attention(q, kv, meta, d**-0.5, num_splits=1))
            warp = timed_us(lambda: fast.decode_attention(q, kv, meta, d**-0.5, num_splits=-1))
            rows.append(dict(op="decode attention", model=model, batch=batch, ctx=ctx, auto_us=round(auto, 1),
                             splits1_us=round(one, 1), per_warp_us=round(warp, 1)))
        for seqs, length in ((256, 128), (32, 512)):
            kv, tables = paged(seqs, length, hk, d)
            meta = make_metadata(tables, [length] * seqs, [length] * seqs, 16, True, "cuda")
            q = torch.randn(seqs * length, hq, d, device="cuda", dtype=torch.bfloat16)
            kernel = timed_us(lambda: fast.prefill_attention(q, kv, meta, d**-0.5))
            per_query = {}
            for layout in (1, -1):
                invariant_cuda.DECODE_LAYOUT = layout
                per_query[layout] = timed_us(lambda: inv.attention(q, kv, meta, d**-0.5))
            invariant_cuda.DECODE_LAYOUT = 1
            expand = timed_us(lambda: per_query_pages(meta, 16))
            rows.append(dict(op="prefill attention", model=model, seqs=seqs, length=length, fast_us=round(kernel, 1),
                             per_query_cta_us=round(per_query[1], 1), per_query_warp_us=round(per_query[-1], 1),
                             expand_us=round(expand, 1)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    fast, inv = CudaOps(), CudaInvariantOps()
    rows = gemm_rows(fast, inv) + attention_rows(fast, inv)
    for r in rows:
        print(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
