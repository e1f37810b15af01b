"""WP: where a decode step's time goes, at batch 1 and at W2's and W2w's batch (benchmarks/README.md, Profiles).

The engine's own step loop runs in this process (as W1 times it). Once every prompt is prefilled, a window of
decode steps is timed plainly, then the next window runs under torch.profiler (GPU activity only, so the host
pays next to nothing for it). Every GPU kernel of the profiled window goes into one class by its name:
attention, GEMMs, the LM head (the last GEMM before each step's sampling), norms / RoPE / activations / KV
writes / FP8 quantization, sampling + log-probs, copies, other. What the kernels leave of the window's span is
GPU idle: host work the overlap loop did not hide, and launch gaps.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict

from benchmarks.harness.ceilings import decode_step_floor, sync
from benchmarks.harness.context import BenchContext
from benchmarks.harness.engine_side import open_engine, sampling
from benchmarks.harness.models import random_prompts
from benchmarks.harness.report import Cell, Row

TIMED_STEPS, PROFILED_STEPS = 48, 16
# name fragments per class, first match wins (attention before sampling: decode_reduce_kernel is attention's split
# combine, not a sampling reduce; sampling before gemm: the sampler's kernels are not GEMMs)
CLASSES = (
    ("attention", ("decode_kernel", "decode_reduce", "prefill", "flash", "attention")),
    ("sampling", ("gumbel", "argmax", "logsumexp", "topk", "softmax", "sort", "reduce_kernel")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "wgmma", "scaled_mm", "f8f8")),
    ("norm_rope_act", ("rms_norm", "rope", "silu", "fp8_quantize", "write_kv", "moe_")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in CLASSES if any(k in low for k in keys)), "other")


def breakdown(events: list[tuple[str, float, float]]) -> dict:
    """events: (name, start µs, duration µs) of the GPU work of the profiled steps. Per-class busy µs (the LM
    head split from the GEMMs), the number of sampling runs (= steps), the span, the busy union and the top
    kernels by time."""
    events = sorted(events, key=lambda e: e[1])
    classes = [kernel_class(n) for n, _, _ in events]
    last_gemm, steps = None, 0
    for i, cls in enumerate(classes):
        if cls == "gemm":
            last_gemm = i
        elif cls == "sampling" and (i == 0 or classes[i - 1] != "sampling"):
            steps += 1
            if last_gemm is not None:
                classes[last_gemm], last_gemm = "lm_head", None
    per_class: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
    busy, end = 0.0, float("-inf")
    for (name, start, dur), cls in zip(events, classes):
        per_class[cls] += dur
        per_kernel[name][0] += dur
        per_kernel[name][1] += 1
        busy += max(0.0, start + dur - max(start, end))  # the union of busy intervals
        end = max(end, start + dur)
    span = (end - events[0][1]) if events else 0.0
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:8]
    return {"steps": steps, "span_us": span, "busy_us": busy, "per_class_us": dict(per_class),
            "kernels": len(events), "top": [(n[:70], t, c) for n, (t, c) in top]}


def _gpu_events(trace_path: str) -> list[tuple[str, float, float]]:
    with open(trace_path) as f:
        trace = json.load(f)
    return [(e.get("name", "?"), float(e["ts"]), float(e.get("dur", 0.0))) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def _steps(engine, n: int) -> float:
    sync_device = engine.device
    sync(sync_device)
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    sync(sync_device)
    return time.perf_counter() - t0


def profile_decode(engine, prompts: list[list[int]], new: int) -> dict:
    """Prefill `prompts` (greedy, `new` tokens each), then time TIMED_STEPS decode steps and profile the next
    PROFILED_STEPS; the rest runs to the end unmeasured. Returns breakdown() per step plus the timings."""
    import torch
    from rollout_service import RolloutRequest

    if new < TIMED_STEPS + PROFILED_STEPS + 8:
        raise ValueError(f"WP needs at least {TIMED_STEPS + PROFILED_STEPS + 8} new tokens, got {new}")
    for p in prompts:
        engine.add_request(RolloutRequest(prompt=list(p), sampling=sampling(new)))
    for _ in range(10_000):
        if not engine.scheduler.waiting:
            break
        engine.step()
    _steps(engine, 4)  # the last prompts' first decode steps
    timed_s = _steps(engine, TIMED_STEPS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        profiled_s = _steps(engine, PROFILED_STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        found = breakdown(_gpu_events(path))
    while engine.has_unfinished():
        engine.step()
    found.update(timed_us_per_step=1e6 * timed_s / TIMED_STEPS, profiled_us_per_step=1e6 * profiled_s / PROFILED_STEPS)
    return found


def _row(ctx: BenchContext, seqs: int, label: str, extra: dict | None = None) -> Row:
    bm, s = ctx.bm, ctx.shapes
    row = Row(bm.name, "WP", f"decode µs/step at batch {seqs} ({label}: prompt {s.w2_prompt}, greedy), profiled "
                             "breakdown in the notes", "µs", False)
    na = "WP profiles the engine alone"
    row.hf_generate, row.hf_generate_batch = Cell.na(na), Cell.na(na)
    prompts = random_prompts(seqs, s.w2_prompt, bm.vocab_size, seed=11)
    found = {}

    def engine() -> Cell:
        opts = {**ctx.engine_extra, **(extra or {})}
        with open_engine(bm, ctx.backend, seqs, s.w2_prompt + s.w2_new, opts) as client:
            client.pause()  # this loop steps the engine; the client's thread must not take turns
            try:
                found.update(profile_decode(client.engine, prompts, s.w2_new))
            finally:
                client.resume()
        return Cell(found["timed_us_per_step"])

    row.engine = ctx.measure(row, "engine", engine)
    from benchmarks.harness.workloads import _compute_params, _weights_bytes
    context = s.w2_prompt + s.w2_new / 2
    row.floor = Cell(1e6 * decode_step_floor(_weights_bytes(ctx), bm.kv_bytes_per_token() * seqs * context,
                                             _compute_params(ctx), seqs, ctx.ceilings))
    if found:
        steps = max(found["steps"], 1)
        per = {k: round(v / steps, 1) for k, v in sorted(found["per_class_us"].items(), key=lambda kv: -kv[1])}
        row.details.update(
            steps_profiled=found["steps"], profiled_us_per_step=round(found["profiled_us_per_step"], 1),
            gpu_busy_us_per_step=round(found["busy_us"] / steps, 1),
            gpu_idle_us_per_step=round((found["span_us"] - found["busy_us"]) / steps, 1),
            kernels_per_step=round(found["kernels"] / steps, 1), us_per_step=per,
            top_kernels=[f"{n} {t / steps:.1f}us x{c / steps:.1f}" for n, t, c in found["top"]])
    return row


def wp_decode_profile(ctx: BenchContext) -> list[Row]:
    if ctx.device.type != "cuda":
        row = Row(ctx.bm.name, "WP", "decode µs/step, profiled", "µs", False,
                  engine=Cell.na("WP profiles GPU kernels"))
        return [row]
    rows = [_row(ctx, 1, "W1's batch"), _row(ctx, ctx.shapes.w2_seqs, "W2"), _row(ctx, ctx.shapes.w2w_seqs, "W2w")]
    if rows[1].details.get("kernels_per_step", 99) < 5:  # this profiler did not trace kernels inside graphs
        rows.append(_row(ctx, ctx.shapes.w2_seqs, "W2, CUDA graphs off: kernels untraced in graphs",
                         {"enable_cuda_graphs": False}))
    return rows
