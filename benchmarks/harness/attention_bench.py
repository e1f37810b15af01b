"""W4: paged attention of every backend present vs torch SDPA on gathered, contiguous KV.

The torch reference is timed here; the CUDA kernels through their own micro-benchmark
(benchmarks/harness/kernel_bench.py), fed this run's ceilings.

Decode: B sequences at one context length, one query each; bytes = K+V read once + q + out, so the
floor is bytes / copy bandwidth. Prefill: causal self-attention over whole prompts; FLOPs = 4 * Hq * D
* L(L+1)/2 per sequence, floor at the measured matmul rate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness.ceilings import time_fn
from benchmarks.harness.context import BenchContext
from benchmarks.harness.report import Cell, Row

HEAD_SHAPES = ((32, 8, 128), (14, 2, 64))  # llama3-8b, qwen2.5-0.5b: (q heads, kv heads, head dim)
PAGE = 16
CPU_MAX_KV_BYTES = 256 << 20  # bigger cases are left to the GPU run


def backends(device: torch.device) -> list[str]:
    names = ["torch"]
    if device.type == "cuda":
        try:
            from rollout_service.ops import select_ops
            select_ops("cuda")
            names.append("cuda")
        except Exception:  # noqa: BLE001 - no kernels built: only the reference is present
            pass
    return names


def paged_case(batch: int, q_lens: list[int], kv_lens: list[int], hkv: int, d: int, dtype, device,
               is_prefill: bool):
    """A cache with shuffled pages (as after real allocation) and the metadata to read it."""
    from rollout_service.ops import AttentionMetadata

    pages_per = [-(-n // PAGE) for n in kv_lens]
    total = sum(pages_per)
    gen = torch.Generator(device="cpu").manual_seed(0)
    order = (torch.randperm(total, generator=gen) + 1).to(torch.int32)  # page 0 stays reserved
    kv = torch.randn(total + 1, 2, hkv, PAGE, d, dtype=dtype, device=device)
    tables = torch.zeros(batch, max(pages_per), dtype=torch.int32)
    start, rows = 0, []
    for b, n in enumerate(pages_per):
        tables[b, :n] = order[start:start + n]
        rows.append(order[start:start + n])
        start += n
    slots, positions = [], []
    for b, (q, n) in enumerate(zip(q_lens, kv_lens)):
        for p in range(n - q, n):
            slots.append(int(tables[b, p // PAGE]) * PAGE + p % PAGE)
            positions.append(p)
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        qo_indptr=cum(q_lens).to(device), kv_indptr=cum(pages_per).to(device),
        kv_indices=torch.cat(rows).to(device),
        kv_last_page_len=torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, pages_per)],
                                      dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), max_q_len=max(q_lens), max_kv_len=max(kv_lens))
    return kv, meta


def _iters(device: torch.device) -> int:
    return 20 if device.type == "cuda" else 3


def decode_rows(ctx: BenchContext, dtype: torch.dtype) -> list[Row]:
    """The torch reference backend (the CUDA kernels come from kernel_bench_rows)."""
    dev, rows = ctx.device, []
    elem = torch.empty((), dtype=dtype).element_size()
    for hq, hkv, d in HEAD_SHAPES:
        for batch in ctx.shapes.w4_batches:
            for ctx_len in ctx.shapes.w4_contexts:
                kv_bytes = batch * ctx_len * 2 * hkv * d * elem
                floor = Cell(1e6 * (kv_bytes + 2 * batch * hq * d * elem) / ctx.ceilings.stream_Bps)
                name = f"W4 decode[torch] B{batch} ctx{ctx_len} {hq}/{hkv}x{d}"
                row = Row(ctx.bm.name, name, "paged decode attention µs", "µs", False, floor=floor)
                row.hf_generate = row.hf_generate_batch = Cell.na("kernel micro-benchmark")
                rows.append(row)
                if dev.type == "cpu" and kv_bytes > CPU_MAX_KV_BYTES:
                    row.engine = row.other_peer = Cell.na("too large for the CPU run")
                    continue
                kv, meta = paged_case(batch, [1] * batch, [ctx_len] * batch, hkv, d, dtype, dev, False)
                q = torch.randn(batch, hq, d, dtype=dtype, device=dev)
                row.engine = ctx.measure(row, "engine", lambda: _time_paged("torch", q, kv, meta, d, dev))
                row.other_peer = ctx.measure(row, "sdpa", lambda: _time_sdpa(q, kv, meta, hq, dev))
                for part in ("engine", "other_peer"):
                    if getattr(row, part).value:
                        row.details[f"{part}_frac_of_copy_bw"] = round(floor.value / getattr(row, part).value, 3)
                del kv, meta, q
    return rows


def _time_paged(backend: str, q, kv, meta, d: int, dev) -> Cell:
    from rollout_service.ops import select_ops

    ops = select_ops(backend)
    return Cell(1e6 * time_fn(lambda: ops.attention(q, kv, meta, d ** -0.5), dev, _iters(dev)))


def _gather(kv, meta) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous [B, Hk, L, D] K and V: the layout the peer gets for free (not timed)."""
    b, p = meta.block_tables.shape
    g = kv[meta.block_tables.long()]  # [B, P, 2, Hk, ps, D]
    g = g.permute(2, 0, 3, 1, 4, 5).reshape(2, b, kv.shape[2], p * PAGE, kv.shape[4])
    return g[0].contiguous(), g[1].contiguous()


def _time_sdpa(q, kv, meta, hq: int, dev) -> Cell:
    k, v = _gather(kv, meta)
    qq = q.unsqueeze(2)  # [B, Hq, 1, D]
    fn = lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=hq != k.shape[1])  # noqa: E731
    return Cell(1e6 * time_fn(fn, dev, _iters(dev)), "torch SDPA, contiguous KV")


def prefill_rows(ctx: BenchContext, dtype: torch.dtype) -> list[Row]:
    dev, rows = ctx.device, []
    nseq, length = ctx.shapes.w4_prefill_seqs, ctx.shapes.w4_prefill_len
    for hq, hkv, d in HEAD_SHAPES:
        flops = nseq * 4 * hq * d * length * (length + 1) / 2
        floor = Cell(ctx.ceilings.matmul_flops / 1e12)  # the peak rate is the floor of a rate
        name = f"W4 prefill[torch] {nseq}x{length} {hq}/{hkv}x{d}"
        row = Row(ctx.bm.name, name, "causal prefill attention TFLOP/s", "TFLOP/s", True, floor=floor)
        row.hf_generate = row.hf_generate_batch = Cell.na("kernel micro-benchmark")
        kv, meta = paged_case(nseq, [length] * nseq, [length] * nseq, hkv, d, dtype, dev, True)
        q = torch.randn(nseq * length, hq, d, dtype=dtype, device=dev)

        def paged() -> Cell:
            from rollout_service.ops import select_ops
            ops = select_ops("torch")
            return Cell(flops / time_fn(lambda: ops.attention(q, kv, meta, d ** -0.5), dev, _iters(dev)) / 1e12)

        def sdpa() -> Cell:
            k, v = _gather(kv, meta)
            qq = q.view(nseq, length, hq, d).transpose(1, 2)
            fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
                qq, k[:, :, :length], v[:, :, :length], is_causal=True, enable_gqa=hq != hkv)
            return Cell(flops / time_fn(fn, dev, _iters(dev)) / 1e12, "torch SDPA, contiguous KV")

        row.engine = ctx.measure(row, "engine", paged)
        row.other_peer = ctx.measure(row, "sdpa", sdpa)
        rows.append(row)
        del kv, meta, q
    return rows


def kernel_bench_rows(ctx: BenchContext) -> list[Row]:
    """CUDA-backend rows from the kernels' own micro-benchmark (benchmarks/harness/kernel_bench.py:
    CUDA-graph timed, inputs rotated past L2), against this run's copy bandwidth and matmul rate."""
    from benchmarks.harness import kernel_bench as kb

    s, rows, name = ctx.shapes, [], ctx.bm.name
    decode = kb.bench_decode_attention(batch_sizes=tuple(s.w4_batches), contexts=tuple(s.w4_contexts),
                                       hbm_bytes_per_s=ctx.ceilings.bandwidth_Bps)
    for r in decode:
        label = f"W4 decode[cuda] B{r['batch']} ctx{r['ctx']} {r['q_heads']}/{r['kv_heads']}x{r['head_dim']}"
        row = Row(name, label, "paged decode attention µs", "µs", False, engine=Cell(r["us"]),
                  other_peer=Cell(r["sdpa_us"], "torch SDPA, contiguous KV"),
                  floor=Cell(r["us"] * r["hbm_frac"]))
        row.hf_generate = row.hf_generate_batch = Cell.na("kernel micro-benchmark")
        row.details.update(engine_frac_of_copy_bw=round(r["hbm_frac"], 3),
                           other_peer_frac_of_copy_bw=round(r["sdpa_hbm_frac"], 3),
                           num_splits=r["num_splits"], rel_err_vs_sdpa=float(f"{r['rel_err_vs_sdpa']:.2g}"))
        rows.append(row)
    prefill = kb.bench_prefill_attention(seq_len=s.w4_prefill_len, batch=s.w4_prefill_seqs)
    for r in prefill:
        label = f"W4 prefill[cuda] {r['batch']}x{r['seq_len']} {r['q_heads']}/{r['kv_heads']}x{r['head_dim']}"
        row = Row(name, label, "causal prefill attention TFLOP/s", "TFLOP/s", True, engine=Cell(r["tflops"]),
                  other_peer=Cell(r["sdpa_tflops"], "torch SDPA, contiguous KV"),
                  floor=Cell(ctx.ceilings.matmul_flops / 1e12))
        row.hf_generate = row.hf_generate_batch = Cell.na("kernel micro-benchmark")
        row.details.update(rel_err_vs_sdpa=float(f"{r['rel_err_vs_sdpa']:.2g}"), kernel=r["kernel"],
                           vs_sdpa=round(r["tflops"] / r["sdpa_tflops"], 3),
                           variants_tflops={k: round(v["tflops"], 1) for k, v in r["variants"].items()})
        rows.append(row)
    return rows


def w4_kernels(ctx: BenchContext) -> list[Row]:
    """The torch reference timed here; the CUDA kernels through their own micro-benchmark."""
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    rows = decode_rows(ctx, dtype) + prefill_rows(ctx, dtype)
    if "cuda" in backends(ctx.device):
        found: list[Row] = []

        def run() -> Cell:
            found.extend(kernel_bench_rows(ctx))
            return Cell(float(len(found)))

        holder = Row(ctx.bm.name, "W4 cuda kernels", "benchmarks.harness.kernel_bench", "-", True)
        status = ctx.measure(holder, "kernel_bench", run)
        if status.value is None:
            holder.engine = status
            rows.append(holder)
        rows += found
    return rows
