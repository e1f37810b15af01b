"""One attention kernel case, for Nsight Compute and for page-layout experiments (csrc/NOTES.md).

  python scripts/lab/ncu_attention.py decode B CTX HQ HK D [--launches N]   # N launches of our decode kernel
  python scripts/lab/ncu_attention.py prefill L HQ HK D [--batch B]          # one causal prefill of B x L
  python scripts/lab/ncu_attention.py layout                                 # shuffled vs in-order pages, W4 cases

Under ncu, profile one launch after warm-up, e.g.
  ncu --clock-control none -k regex:decode_kernel --launch-skip 2 --launch-count 1 --section ... \
      python scripts/lab/ncu_attention.py decode 128 1024 14 2 64
"""
from __future__ import annotations

import argparse

import torch

from rollout_service.ops import kernel_bench as kb
from rollout_service.ops.cuda_ops import CudaOps


def run_decode(batch: int, ctx: int, hq: int, hk: int, d: int, launches: int) -> None:
    ops = CudaOps()
    cache, cases, _ = kb._decode_case(batch, ctx, hq, hk, d, 16, torch.bfloat16)
    for i in range(launches):
        q, meta, _ = cases[i % len(cases)]
        ops.attention(q, cache, meta, d**-0.5)
    torch.cuda.synchronize()


def run_prefill(seq_len: int, hq: int, hk: int, d: int, batch: int) -> None:
    kb.bench_prefill_attention(seq_len=seq_len, batch=batch, head_shapes=((hq, hk, d),), iters=1, reps=1)
    torch.cuda.synchronize()


def layout() -> None:
    """µs of our decode kernel on the W4 cases with shuffled pages (the harness) and with each sequence's
    pages in order: whether scattering 2-4 KB page reads costs HBM efficiency."""
    ops = CudaOps()
    hbm = kb.measure_hbm_bandwidth()
    print(f"copy ceiling {hbm / 1e9:.0f} GB/s")
    for hq, hk, d in kb.HEAD_SHAPES:
        for ctx in (1024, 4096):
            for batch in (1, 32, 128):
                cache, cases, kv_bytes = kb._decode_case(batch, ctx, hq, hk, d, 16, torch.bfloat16)
                times = {}
                for name in ("shuffled", "in_order"):
                    if name == "in_order":
                        for c, (_, meta, _) in enumerate(cases):
                            n = meta.kv_indices.numel()
                            meta.kv_indices.copy_(torch.arange(c * n, (c + 1) * n, device="cuda") + 1)
                    times[name] = kb._graph_time_us(
                        lambda i: ops.attention(cases[i][0], cache, cases[i][1], d**-0.5), len(cases), 20, 7
                    )
                frac = {k: kv_bytes / (v * 1e-6) / hbm for k, v in times.items()}
                print(f"{hq}/{hk} d{d} ctx{ctx} B{batch}: KV {kv_bytes / 1e6:.1f} MB  "
                      + "  ".join(f"{k} {times[k]:.1f} us ({frac[k]:.0%})" for k in times))
                del cache, cases
                torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    dec = sub.add_parser("decode")
    for name in ("batch", "ctx", "hq", "hk", "d"):
        dec.add_argument(name, type=int)
    dec.add_argument("--launches", type=int, default=4)
    pre = sub.add_parser("prefill")
    for name in ("seq_len", "hq", "hk", "d"):
        pre.add_argument(name, type=int)
    pre.add_argument("--batch", type=int, default=4)
    sub.add_parser("layout")
    args = parser.parse_args()
    if args.what == "decode":
        run_decode(args.batch, args.ctx, args.hq, args.hk, args.d, args.launches)
    elif args.what == "prefill":
        run_prefill(args.seq_len, args.hq, args.hk, args.d, args.batch)
    else:
        layout()


if __name__ == "__main__":
    main()
