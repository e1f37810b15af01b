"""WM: one mixture-of-experts layer's experts on the GPU, each way the cuda backend can compute them.

For the bench model's MoE shape (random bf16 weights of one layer, built here: only the config is loaded), at
T tokens of a step: the per-row gemv kernel, the grouped way (permutation kernel, torch._grouped_mm, SiLU·mul,
combine), the grouped products alone, and the torch reference (a GEMM pair per expert, the row counts read on
the host). Which one the engine takes at each T (ops/cuda_moe.py GEMV_ROWS) is chosen from these figures.

Times are CUDA-event medians over calls that cycle through ROTATE sets of tokens and routings, so the experts one
call reads are not still in L2 from the last (one layer's 8 experts fit in an H100's 50 MB). The floor is the
distinct experts the step's tokens route to, read once, plus the rows in and out, over the copy bandwidth, or the
products' FLOPs at the matmul rate, whichever takes longer.
"""
from __future__ import annotations

import statistics

import torch

from benchmarks.harness.context import BenchContext
from benchmarks.harness.report import Cell, Row

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
ROTATE = 8
CALLS = 24
GEMV_MAX_ROWS = 4096  # past this the per-row gemv (each row streams its expert) is not worth timing


def _guarded(fn) -> float | str:
    try:
        return round(fn(), 1)
    except Exception as exc:  # noqa: BLE001 - one way failing must not cost the others
        return f"error: {type(exc).__name__}: {str(exc)[:160]}"


def _timed_us(fn, sets: list) -> float:
    for args in sets[:2]:
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for i in range(CALLS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def wm_moe_layer(ctx: BenchContext) -> list[Row]:
    bm = ctx.bm
    spec = bm.moe
    if spec is None or ctx.device.type != "cuda":
        row = Row(bm.name, "WM", "one MoE layer's experts", "µs", False)
        row.engine = Cell.na("needs a mixture-of-experts model on a GPU")
        return [row]
    from rollout_service.ops import cuda_moe, moe_experts
    from rollout_service.ops.cuda_ops import CudaOps

    kernels = CudaOps().kernels
    hidden, inter, experts, k = int(bm.config.hidden_size), spec.expert_intermediate_size, spec.num_experts, spec.top_k
    g = torch.Generator(device=ctx.device).manual_seed(0)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=ctx.device, dtype=bm.dtype, generator=g) * 0.02
    down = torch.randn(experts, hidden, inter, device=ctx.device, dtype=bm.dtype, generator=g) * 0.02
    router = torch.randn(experts, hidden, device=ctx.device, dtype=bm.dtype, generator=g)
    expert_bytes = 3 * hidden * inter * bm.elem_bytes
    rows = []
    for tokens in TOKENS:
        sets = []
        for _ in range(ROTATE):
            x = torch.randn(tokens, hidden, device=ctx.device, dtype=bm.dtype, generator=g)
            ids, weights = moe_experts.route(x, router, k, spec.renormalize)
            sets.append((x, ids, weights))
        touched = statistics.mean(len(torch.unique(ids)) for _, ids, _ in sets)
        row = Row(bm.name, f"WM T={tokens}", f"µs per MoE layer's experts, {tokens} tokens x top-{k} of {experts}",
                  "µs", False)
        moved = touched * expert_bytes + 2 * tokens * hidden * bm.elem_bytes
        flops = 2 * tokens * k * 3 * hidden * inter
        row.floor = Cell(1e6 * max(moved / ctx.ceilings.stream_Bps, flops / ctx.ceilings.matmul_flops))
        row.details.update(experts_touched=round(touched, 1), rows=tokens * k, gemv_rows_limit=cuda_moe.GEMV_ROWS)
        ways = {
            "gemv": lambda x, i, w: cuda_moe.gemv_experts(kernels, x, i, w, gate_up, down),
            "grouped": lambda x, i, w: cuda_moe.grouped_experts(kernels, x, i, w, gate_up, down),
            "reference": lambda x, i, w: moe_experts.experts(x, i, w, gate_up, down),
        }
        if tokens * k > GEMV_MAX_ROWS:
            del ways["gemv"]
        for name, fn in ways.items():
            row.details[f"{name}_us"] = _guarded(lambda: _timed_us(fn, sets))
        # the two grouped products alone, on rows already in expert order
        permuted = []
        for x, ids, _ in sets:
            grouped, offsets, _ = kernels.moe_permute(x, ids, experts)
            permuted.append((grouped, offsets, torch.randn(grouped.shape[0], inter, device=ctx.device,
                                                           dtype=bm.dtype, generator=g)))
        row.details["grouped_mm_only_us"] = _guarded(lambda: _timed_us(
            lambda a, offs, act: (torch._grouped_mm(a, gate_up.transpose(1, 2), offs=offs),
                                  torch._grouped_mm(act, down.transpose(1, 2), offs=offs)), permuted))
        engine_way = "gemv" if tokens * k <= cuda_moe.GEMV_ROWS else "grouped"
        other_way = "grouped" if engine_way == "gemv" else "gemv"
        for cell_name, way in (("engine", engine_way), ("other_peer", other_way)):
            value = row.details.get(f"{way}_us")
            setattr(row, cell_name, Cell(value, way) if isinstance(value, float) else Cell.na(str(value or "not timed")))
        row.hf_generate = row.hf_generate_batch = Cell.na("not a generation workload (the torch reference: "
                                                          "details reference_us)")
        rows.append(row)
    return rows
