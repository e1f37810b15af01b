"""Kernel micro-benchmarks (benchmarks/README.md, W4): paged decode attention and ragged prefill attention
against torch SDPA on contiguous (unpaged) KV, with the measured HBM copy bandwidth as the ceiling.

Each timed region is a CUDA graph of `iters` launches that cycle through enough independent input copies
to exceed the L2 cache, so launch gaps and cache hits stay out of the numbers; the median of `reps`
replays is reported. `python -m benchmarks.harness.kernel_bench [--json FILE]` prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from rollout_service.ops.attention import AttentionMetadata

if TYPE_CHECKING:
    from rollout_service.ops.cuda_ops import CudaOps

HEAD_SHAPES = ((32, 8, 128), (14, 2, 64))  # (q heads, kv heads, head_dim): llama3-8b, qwen2.5-0.5b
ROTATE_BYTES = 512 << 20  # inputs cycled per timed region: several times the H200's 60 MB L2


def _graph_time_us(fn: Callable[[int], object], copies: int, iters: int, reps: int) -> float:
    """Median µs per call of fn(i % copies), timed as graph replays of `iters` calls."""
    for i in range(min(copies, 3)):  # warm-up outside capture (lazy init, allocator growth)
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i % copies)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def _peer_time_us(fn: Callable[[int], object], copies: int, iters: int, reps: int) -> float:
    """Like _graph_time_us; a peer that cannot be captured is reported as NaN instead of failing the run."""
    try:
        return _graph_time_us(fn, copies, iters, reps)
    except RuntimeError as exc:
        print(f"peer timing failed: {exc}")
        return float("nan")


def measure_hbm_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def _decode_case(batch: int, ctx: int, hq: int, hk: int, d: int, page_size: int, dtype: torch.dtype):
    """Paged caches (shuffled pages) + metadata per input copy, and the same KV contiguous for the peer."""
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * ctx * hk * d * elem
    copies = max(1, min(16, math.ceil(ROTATE_BYTES / kv_bytes)))
    pages_per_seq = ctx // page_size
    n_pages = copies * batch * pages_per_seq + 1  # page 0 stays the engine's scratch page
    cache = torch.randn(n_pages, 2, hk, page_size, d, dtype=dtype, device="cuda")
    order = torch.randperm(n_pages - 1, device="cuda").to(torch.int32) + 1
    cases = []
    for c in range(copies):
        pages = order[c * batch * pages_per_seq : (c + 1) * batch * pages_per_seq]
        table = pages.view(batch, pages_per_seq)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
            positions=torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda"),
            qo_indptr=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            kv_indptr=torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per_seq,
            kv_indices=pages.contiguous(),
            kv_last_page_len=torch.full((batch,), page_size, dtype=torch.int32, device="cuda"),
            kv_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
            block_tables=table.contiguous(),
            max_q_len=1,
            max_kv_len=ctx,
        )
        q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
        # [B, Hk, ctx, D] contiguous copies of the same K and V for the SDPA peer
        gathered = cache[table.long()].permute(2, 0, 3, 1, 4, 5).reshape(2, batch, hk, ctx, d).contiguous()
        cases.append((q, meta, gathered))
    return cache, cases, kv_bytes


def bench_decode_attention(
    batch_sizes: tuple[int, ...] = (1, 32, 128),
    contexts: tuple[int, ...] = (1024, 4096),
    head_shapes: tuple[tuple[int, int, int], ...] = HEAD_SHAPES,
    page_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    hbm_bytes_per_s: float | None = None,
    iters: int = 20,
    reps: int = 7,
    split_sweep: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    sweep_all: bool = False,
    ops: CudaOps | None = None,
) -> list[dict]:
    """W4 decode rows: µs of our kernel and of SDPA on contiguous KV, each as a fraction of HBM bandwidth.
    Each split count of split_sweep is timed where the kernel may split (B·Hk < #SMs), or everywhere with
    sweep_all; ops: a CudaOps to time (default: a new one)."""
    from rollout_service.ops.cuda_ops import CudaOps

    ops = ops or CudaOps()
    hbm = hbm_bytes_per_s or measure_hbm_bandwidth()
    rows = []
    for hq, hk, d in head_shapes:
        for ctx in contexts:
            for batch in batch_sizes:
                cache, cases, kv_bytes = _decode_case(batch, ctx, hq, hk, d, page_size, dtype)
                scale = d**-0.5
                io_bytes = kv_bytes + 2 * batch * hq * d * (torch.finfo(dtype).bits // 8)

                def ours(i: int):
                    q, meta, _ = cases[i]
                    return ops.attention(q, cache, meta, scale)

                def sdpa(i: int):
                    q, _, kv = cases[i]
                    return F.scaled_dot_product_attention(
                        q.view(batch, hq, 1, d), kv[0], kv[1], scale=scale, enable_gqa=hq != hk
                    )

                ref = sdpa(0).view(batch, hq, d).float()
                err = ((ours(0).float() - ref).norm() / ref.norm()).item()
                t_ours = _graph_time_us(ours, len(cases), iters, reps)
                t_sdpa = _peer_time_us(sdpa, len(cases), iters, reps)
                splits = ops.kernels.decode_num_splits(cases[0][0], hk, ctx)
                sweep, sweep_err = {}, {}
                if sweep_all or batch * hk < torch.cuda.get_device_properties(0).multi_processor_count:
                    for n in split_sweep:  # data for tuning decode_num_splits

                        def forced(i: int, n: int = n):
                            return ops.decode_attention(cases[i][0], cache, cases[i][1], scale, n)

                        sweep_err[n] = ((forced(0).float() - ref).norm() / ref.norm()).item()
                        sweep[n] = _graph_time_us(forced, len(cases), iters, reps)
                rows.append(dict(split_sweep_us=sweep, split_sweep_rel_err=sweep_err,
                    batch=batch, ctx=ctx, q_heads=hq, kv_heads=hk, head_dim=d, num_splits=splits,
                    kv_mb=kv_bytes / 1e6, us=t_ours, hbm_frac=io_bytes / (t_ours * 1e-6) / hbm,
                    sdpa_us=t_sdpa, sdpa_hbm_frac=io_bytes / (t_sdpa * 1e-6) / hbm, rel_err_vs_sdpa=err,
                ))
                del cache, cases
                torch.cuda.empty_cache()
    return rows


# (impl, exact P·V) of every prefill kernel variant timed; ("auto", False) is what the engine runs by default
PREFILL_VARIANTS = (("auto", False), ("auto", True), ("mma_sync", False), ("mma_sync", True))


def bench_prefill_attention(
    seq_len: int = 4096,
    batch: int = 4,
    head_shapes: tuple[tuple[int, int, int], ...] = HEAD_SHAPES,
    page_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 3,
    reps: int = 5,
) -> list[dict]:
    """Causal prefill of `batch` prompts of seq_len in one launch: TFLOP/s of ours (the engine's default: this
    GPU's best kernel, flash-style P·V) and of SDPA (contiguous), plus each other kernel variant (exact P·V,
    the mma.sync kernel) under `variants`."""
    from rollout_service.ops.cuda_ops import CudaOps

    ops = CudaOps()
    rows = []
    for hq, hk, d in head_shapes:
        pages_per_seq = seq_len // page_size
        cache = torch.randn(batch * pages_per_seq + 1, 2, hk, page_size, d, dtype=dtype, device="cuda")
        pages = (torch.randperm(batch * pages_per_seq, device="cuda") + 1).to(torch.int32)
        table = pages.view(batch, pages_per_seq)
        total = batch * seq_len
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.zeros(total, dtype=torch.int64, device="cuda"),
            positions=torch.arange(seq_len, device="cuda").repeat(batch),
            qo_indptr=torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seq_len,
            kv_indptr=torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per_seq,
            kv_indices=pages,
            kv_last_page_len=torch.full((batch,), page_size, dtype=torch.int32, device="cuda"),
            kv_lens=torch.full((batch,), seq_len, dtype=torch.int32, device="cuda"),
            block_tables=table.contiguous(),
            max_q_len=seq_len,
            max_kv_len=seq_len,
        )
        q = torch.randn(total, hq, d, dtype=dtype, device="cuda")
        kv = cache[table.long()].permute(2, 0, 3, 1, 4, 5).reshape(2, batch, hk, seq_len, d).contiguous()
        qc = q.view(batch, seq_len, hq, d).transpose(1, 2).contiguous()
        scale = d**-0.5
        flops = 4 * batch * hq * d * seq_len * (seq_len + 1) / 2

        def sdpa(_: int):
            return F.scaled_dot_product_attention(qc, kv[0], kv[1], is_causal=True, scale=scale, enable_gqa=hq != hk)

        ref = sdpa(0).transpose(1, 2).reshape(total, hq, d).float()
        variants = {}
        for impl, exact in PREFILL_VARIANTS:
            def ours(_: int, impl=impl, exact=exact):
                return ops.prefill_attention(q, cache, meta, scale, exact=exact, impl=impl)

            err = ((ours(0).float() - ref).norm() / ref.norm()).item()
            t = _graph_time_us(ours, 1, iters, reps)
            variants[f"{impl}{'_exact' if exact else ''}"] = dict(
                us=t, tflops=flops / (t * 1e-6) / 1e12, rel_err_vs_sdpa=err)
        t_sdpa = _peer_time_us(sdpa, 1, iters, reps)
        main = variants["auto"]
        rows.append(dict(
            batch=batch, seq_len=seq_len, q_heads=hq, kv_heads=hk, head_dim=d, us=main["us"], tflops=main["tflops"],
            sdpa_us=t_sdpa, sdpa_tflops=flops / (t_sdpa * 1e-6) / 1e12, rel_err_vs_sdpa=main["rel_err_vs_sdpa"],
            kernel="wgmma" if ops.kernels.prefill_sm90_available() else "mma_sync", variants=variants,
        ))
        del cache, kv, q, qc
        torch.cuda.empty_cache()
    return rows


# (name, n, k, gated) per layer of the two benchmark models; lm_head writes float32 logits.
LINEAR_SHAPES = {
    "qwen2.5-0.5b": (("qkv", 1152, 896, False), ("o_proj", 896, 896, False), ("gate_up", 4864, 896, True),
                     ("down", 896, 4864, False), ("lm_head", 151936, 896, False)),
    "llama3-8b": (("qkv", 6144, 4096, False), ("o_proj", 4096, 4096, False), ("gate_up", 14336, 4096, True),
                  ("down", 4096, 14336, False), ("lm_head", 128256, 4096, False)),
}


def bench_linear(
    batch_sizes: tuple[int, ...] = (1,), dtype: torch.dtype = torch.bfloat16, hbm_bytes_per_s: float | None = None,
    iters: int = 20, reps: int = 7,
) -> list[dict]:
    """Batch-1 linear layers: our gemv kernel vs cuBLAS (+ silu_and_mul for gate_up), as µs and % of HBM."""
    from rollout_service.ops.cuda_ops import CudaOps
    from rollout_service.ops.torch_ops import TorchOps

    ours_ops, peer_ops = CudaOps(), TorchOps()
    peer_ops.silu_and_mul = ours_ops.silu_and_mul  # the peer is cuBLAS + our fused activation, as before gemv
    hbm = hbm_bytes_per_s or measure_hbm_bandwidth()
    rows = []
    for model, shapes in LINEAR_SHAPES.items():
        for name, n, k, gated in shapes:
            out_rows = 2 * n if gated else n
            nbytes = out_rows * k * (torch.finfo(dtype).bits // 8)
            copies = max(1, min(64, math.ceil(ROTATE_BYTES / nbytes)))
            weights = [torch.randn(out_rows, k, dtype=dtype, device="cuda") / k**0.5 for _ in range(copies)]
            for batch in batch_sizes:
                x = torch.randn(batch, k, dtype=dtype, device="cuda")

                def run(ops, i: int, name=name, gated=gated):
                    if name == "lm_head":
                        return ops.logits(x, weights[i])
                    return ops.gated_linear(x, weights[i]) if gated else ops.linear(x, weights[i])

                t_ours = _graph_time_us(lambda i: run(ours_ops, i), copies, iters, reps)
                t_peer = _peer_time_us(lambda i: run(peer_ops, i), copies, iters, reps)
                rows.append(dict(model=model, layer=name, n=n, k=k, batch=batch, weight_mb=nbytes / 1e6, us=t_ours,
                                 hbm_frac=nbytes / (t_ours * 1e-6) / hbm, cublas_us=t_peer,
                                 cublas_hbm_frac=nbytes / (t_peer * 1e-6) / hbm))
            del weights
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--parts", default="decode,prefill,linear", help="comma-separated subset to run")
    args = parser.parse_args()
    parts = args.parts.split(",")
    hbm = measure_hbm_bandwidth()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  HBM copy {hbm / 1e12:.2f} TB/s")
    linear = bench_linear(hbm_bytes_per_s=hbm) if "linear" in parts else []
    for r in linear:
        print(f"linear {r['model']:>12} {r['layer']:>8} B{r['batch']} {r['n']}x{r['k']} {r['weight_mb']:>6.1f} MB: "
              f"ours {r['us']:>6.1f} us {100 * r['hbm_frac']:>3.0f}% | cuBLAS {r['cublas_us']:>6.1f} us "
              f"{100 * r['cublas_hbm_frac']:>3.0f}%")
    decode = bench_decode_attention(hbm_bytes_per_s=hbm) if "decode" in parts else []
    print(f"{'heads':>9} {'ctx':>5} {'B':>4} {'splits':>6} {'KV MB':>7} {'ours us':>8} {'%HBM':>5} "
          f"{'sdpa us':>8} {'%HBM':>5} {'err':>8}")
    for r in decode:
        print(f"{r['q_heads']:>3}/{r['kv_heads']} d{r['head_dim']:<3} {r['ctx']:>5} {r['batch']:>4} {r['num_splits']:>6} "
              f"{r['kv_mb']:>7.1f} {r['us']:>8.1f} {100 * r['hbm_frac']:>5.0f} {r['sdpa_us']:>8.1f} "
              f"{100 * r['sdpa_hbm_frac']:>5.0f} {r['rel_err_vs_sdpa']:>8.1e}  "
              + " ".join(f"{n}:{t:.1f}" for n, t in r["split_sweep_us"].items()))
    prefill = bench_prefill_attention() if "prefill" in parts else []
    for r in prefill:
        for name, v in r["variants"].items():
            print(f"  prefill variant {name}: {v['us']:.1f} us {v['tflops']:.0f} TFLOP/s "
                  f"({v['tflops'] / r['sdpa_tflops']:.2f}x SDPA) err {v['rel_err_vs_sdpa']:.1e}")
        print(f"prefill {r['q_heads']}/{r['kv_heads']} d{r['head_dim']} B{r['batch']}x{r['seq_len']}: "
              f"ours {r['us']:.0f} us {r['tflops']:.0f} TFLOP/s | sdpa {r['sdpa_us']:.0f} us "
              f"{r['sdpa_tflops']:.0f} TFLOP/s | err {r['rel_err_vs_sdpa']:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, hbm_bytes_per_s=hbm,
                           decode=decode, prefill=prefill, linear=linear), f, indent=1)


if __name__ == "__main__":
    main()
