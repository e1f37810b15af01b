"""Generation workloads W1 (latency), W2 (rollout), W2w (wide rollout), W2n (n samples per prompt), W2p (long
prompts), W5 (CUDA graphs), and W1fp8 / W2fp8 (W1 and W2 with FP8 rollouts).

Each returns Rows; the engine and the HF peers run the same prompts on the same live model object.
Every runner gets one small warm-up call first, so no one pays one-time set-up inside the timing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from benchmarks.harness.ceilings import decode_step_floor, prefill_floor
from benchmarks.harness.context import BenchContext
from benchmarks.harness.engine_side import engine_facts, engine_generate, engine_ms_per_step, open_engine
from benchmarks.harness.models import random_prompts
from benchmarks.harness.peers import decode_ms_per_step, has_generate_batch, hf_generate, hf_generate_batch, hf_static_compiled
from benchmarks.harness.report import Cell, Row


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence's tokens before the first disagreement (1.0 = identical)."""
    fracs = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fracs.append(k / max(len(x), 1))
    return sum(fracs) / max(len(fracs), 1)


def _fp8(ctx: BenchContext) -> bool:
    return ctx.engine_extra.get("quantization") == "fp8"


def _weights_bytes(ctx: BenchContext) -> float:
    """Weight bytes a dense decode step reads; with FP8 rollouts the projections' are one byte each."""
    bm = ctx.bm
    if _fp8(ctx):
        return (bm.decode_params() - bm.projection_params()) * bm.elem_bytes + bm.projection_params()
    return bm.decode_params() * bm.elem_bytes


def _compute_params(ctx: BenchContext) -> float:
    """Parameters a token multiplies by, counted at the bf16 rate the matmul ceiling measures: an FP8 product
    counts half (FP8 tensor cores run at twice the bf16 rate)."""
    bm = ctx.bm
    return bm.active_params() - (bm.projection_params() / 2 if _fp8(ctx) else 0)


def _step_weight_bytes(ctx: BenchContext, experts_read: float) -> float:
    """Weight bytes one decode step reads: every weight of a dense model; of an MoE model the dense ones and
    `experts_read` experts (summed over its MoE layers: the distinct experts the step's tokens route to)."""
    bm = ctx.bm
    if bm.moe is None:
        return _weights_bytes(ctx)
    return (bm.dense_decode_params() + experts_read * bm.expert_params()) * bm.elem_bytes


def experts_read_per_step(routed: list) -> float | None:
    """The distinct experts a batch's decode steps route to, summed over the MoE layers and averaged over the
    steps: counted at each generated-token index across the sequences (routed: each one's [tokens, layers, k]
    ids; the first token came from the prefill and is left out). None without routing."""
    if not routed or any(r is None for r in routed):
        return None
    steps = min(len(r) for r in routed)
    if steps < 2:
        return None
    layers = routed[0].shape[1]
    experts = 1 + max(int(r.max()) for r in routed)
    seen = np.zeros((steps - 1, layers, experts), dtype=bool)
    step, layer = np.arange(steps - 1)[:, None, None], np.arange(layers)[None, :, None]
    for r in routed:
        seen[step, layer, r[1:steps].astype(np.int64)] = True
    return float(seen.sum(axis=(1, 2)).mean())


def _moe_floor_details(ctx: BenchContext, row: Row, experts_read: float, counted: bool) -> None:
    spec = ctx.bm.moe
    if spec is not None:
        row.details["floor_experts_read_per_layer"] = round(experts_read / len(spec.sparse_layers), 2)
        row.details["floor_experts_basis"] = ("counted from the engine's routed experts" if counted else
                                              "expected for uniform routing")


def warm_generate_batch(ctx: BenchContext, prompts: list[list[int]]) -> None:
    """Each generate_batch call builds a fresh manager, which on a GPU warms itself up (graph capture,
    outside the timed span); a separate warm-up call would only repeat that, so it runs on the CPU only."""
    if ctx.device.type != "cuda":
        hf_generate_batch(ctx.bm, prompts, 2)


def _static_wanted(ctx: BenchContext) -> str | None:
    """None if the static-cache peer should run, else the reason it does not."""
    if ctx.static_peer == "off":
        return "static+compile peer off (--static-peer off)"
    if ctx.static_peer == "auto" and ctx.device.type != "cuda":
        return "static+compile peer runs on the GPU only (--static-peer on forces it)"
    return None


def w1_latency(ctx: BenchContext) -> list[Row]:
    bm, s = ctx.bm, ctx.shapes
    prompt = random_prompts(1, s.w1_prompt, bm.vocab_size, seed=1)[0]
    row = Row(bm.name, "W1", f"decode ms/step, batch 1, prompt {s.w1_prompt}, {s.w1_new} new", "ms", False)
    runs = {}

    def engine() -> Cell:
        with open_engine(bm, ctx.backend, 1, s.w1_prompt + s.w1_new, ctx.engine_extra) as client:
            engine_generate(client, bm, [prompt[:8]], 2)
            ms, runs["engine"] = engine_ms_per_step(client, bm, prompt, s.w1_new)
            row.details.update(engine_facts(client))
        return Cell(ms)

    def generate() -> Cell:
        hf_generate(bm, [prompt[:8]], 2)
        runs["hf"] = hf_generate(bm, [prompt], ctx.peer_tokens(s.w1_new))
        return Cell(decode_ms_per_step(runs["hf"]))

    def generate_batch() -> Cell:
        if not has_generate_batch(bm):
            return Cell.na("this transformers version has no generate_batch")
        warm_generate_batch(ctx, [prompt[:8]])
        run = hf_generate_batch(bm, [prompt], s.w1_new)
        if len(run.step_times) >= 2:
            return Cell(decode_ms_per_step(run))
        # No per-token stamps in this version: difference of two runs, as for the engine.
        first = hf_generate_batch(bm, [prompt], 1).seconds
        return Cell(1000 * (run.seconds - first) / (s.w1_new - 1))

    def static() -> Cell:
        why = _static_wanted(ctx)
        if why:
            return Cell.na(why)
        first_s, run = hf_static_compiled(bm, prompt, s.w1_new)
        row.details["hf_static_first_call_s"] = round(first_s, 1)
        return Cell(decode_ms_per_step(run), "HF static cache + compile")

    row.engine = ctx.measure(row, "engine", engine, repeat=True)
    row.hf_generate = ctx.measure(row, "hf_generate", generate, repeat=True)
    row.other_peer = ctx.measure(row, "hf_static", static)
    row.hf_generate_batch = ctx.measure(row, "hf_generate_batch", generate_batch, repeat=True)
    row.floor = Cell(1000 * _batch1_floor_s(ctx, row))
    if ctx.peer_tokens(s.w1_new) < s.w1_new:
        row.details["hf_new_tokens"] = ctx.peer_tokens(s.w1_new)
    if "engine" in runs and "hf" in runs:
        row.details["greedy_agreement_with_hf_generate"] = round(
            prefix_agreement(runs["engine"].token_ids, runs["hf"].token_ids), 3)
    return [row]


def _batch1_floor_s(ctx: BenchContext, row: Row) -> float:
    """One batch-1 decode step at the floor (W1, W5): an MoE token reads its k experts in every MoE layer."""
    bm, s = ctx.bm, ctx.shapes
    spec = bm.moe
    experts_read = 0 if spec is None else len(spec.sparse_layers) * spec.top_k
    _moe_floor_details(ctx, row, experts_read, counted=False)
    kv = bm.kv_bytes_per_token() * (s.w1_prompt + s.w1_new / 2)
    return decode_step_floor(_step_weight_bytes(ctx, experts_read), kv, _compute_params(ctx), 1, ctx.ceilings)


def _rollout_floor(ctx: BenchContext, row: Row, prompts: int, prompt_len: int, seqs: int, new: int,
                   routed: list | None) -> float:
    """Output tokens/s at the floor: prefill every distinct prompt once (every weight read), then `new` decode
    steps of `seqs` sequences reading the shared prompt KV once and each sequence's own generated KV, and of an
    MoE model the experts its tokens route to (counted from `routed`, else expected for uniform routing)."""
    bm = ctx.bm
    t = prefill_floor(_weights_bytes(ctx), _compute_params(ctx), prompts * prompt_len, ctx.ceilings)
    kv = bm.kv_bytes_per_token() * (prompts * prompt_len + seqs * new / 2)
    experts_read, spec = experts_read_per_step(routed or []), bm.moe
    counted = experts_read is not None
    if spec is not None and not counted:
        experts_read = len(spec.sparse_layers) * spec.num_experts * (1 - (1 - spec.top_k / spec.num_experts) ** seqs)
    _moe_floor_details(ctx, row, experts_read or 0, counted)
    t += new * decode_step_floor(_step_weight_bytes(ctx, experts_read or 0), kv, _compute_params(ctx), seqs,
                                 ctx.ceilings)
    return seqs * new / t


def _throughput_row(ctx: BenchContext, name: str, metric: str, prompts: list[list[int]], new: int,
                    n: int, temperature: float) -> Row:
    bm = ctx.bm
    row = Row(bm.name, name, metric, "tok/s", True)
    total = len(prompts) * n * new
    runs = {}
    warm = [p[:8] for p in prompts[:2]]

    def engine() -> Cell:
        with open_engine(bm, ctx.backend, len(prompts) * n, len(prompts[0]) + new, ctx.engine_extra, n,
                         len(prompts[0])) as client:
            engine_generate(client, bm, warm, 2)
            runs["engine"] = engine_generate(client, bm, prompts, new, n, temperature, seed=0)
            row.details.update(engine_facts(client))
        return Cell(total / runs["engine"].seconds)

    peer_new = ctx.peer_tokens(new)
    peer_total = len(prompts) * n * peer_new
    if peer_new < new:
        row.details["hf_new_tokens"] = peer_new

    def generate() -> Cell:
        hf_generate(bm, warm, 2)
        runs["hf"] = hf_generate(bm, prompts, peer_new, n, temperature)
        # One padded call prefills every sample's copy of its prompt, so long prompts make it the slow
        # part of a run: its wall time (the best run's, as the cell's) is what a time budget must fit.
        secs = round(runs["hf"].seconds, 2)
        row.details["hf_generate_s"] = min(secs, row.details.get("hf_generate_s", secs))
        return Cell(peer_total / runs["hf"].seconds)

    def generate_batch() -> Cell:
        if not has_generate_batch(bm):
            return Cell.na("this transformers version has no generate_batch")
        warm_generate_batch(ctx, warm)
        run = hf_generate_batch(bm, prompts, peer_new, n, temperature)
        row.details.update(hf_generate_batch_call_s=round(run.call_seconds, 2), hf_generate_batch_timed=run.basis)
        return Cell(peer_total / run.seconds)

    row.engine = ctx.measure(row, "engine", engine, repeat=True)
    row.hf_generate = ctx.measure(row, "hf_generate", generate, repeat=True)
    row.hf_generate_batch = ctx.measure(row, "hf_generate_batch", generate_batch, repeat=True)
    row.other_peer = Cell.na("none for this workload")
    routed = runs["engine"].routed if "engine" in runs else None
    row.floor = Cell(_rollout_floor(ctx, row, len(prompts), len(prompts[0]), len(prompts) * n, new, routed))
    if temperature == 0 and "engine" in runs and "hf" in runs:
        row.details["greedy_agreement_with_hf_generate"] = round(
            prefix_agreement(runs["engine"].token_ids, runs["hf"].token_ids), 3)
    return row


def w2_rollout(ctx: BenchContext) -> list[Row]:
    s = ctx.shapes
    prompts = random_prompts(s.w2_seqs, s.w2_prompt, ctx.bm.vocab_size, seed=2)
    metric = f"output tok/s, {s.w2_seqs} seqs, prompt {s.w2_prompt}, {s.w2_new} new, greedy"
    return [_throughput_row(ctx, "W2", metric, prompts, s.w2_new, 1, 0.0)]


def w2w_wide(ctx: BenchContext) -> list[Row]:
    """W2 at the batch sizes RL rollouts run (1024 sequences by default): the engine's graphs must cover it."""
    s = ctx.shapes
    prompts = random_prompts(s.w2w_seqs, s.w2_prompt, ctx.bm.vocab_size, seed=9)
    metric = f"output tok/s, {s.w2w_seqs} seqs, prompt {s.w2_prompt}, {s.w2_new} new, greedy"
    return [_throughput_row(ctx, "W2w", metric, prompts, s.w2_new, 1, 0.0)]


def _fp8_row(ctx: BenchContext, runner, name: str) -> list[Row]:
    """`runner`'s engine with quantization='fp8' (floors from FP8 weight bytes); its HF peers are the model-dtype
    row's, run in the same process, so they are not run twice."""
    if ctx.bm.moe is not None:
        row = Row(ctx.bm.name, name, "-", "-", True, engine=Cell.na("FP8 has no mixture-of-experts path"))
        return [row]
    skip = ctx.skip | {"hf_generate", "hf_generate_batch", "hf_static"}
    # FP8 products round to the model dtype: the engine runs the bench model's (bf16 unless --dtype says)
    dtype = str(ctx.bm.dtype).removeprefix("torch.")
    fp8_ctx = replace(ctx, engine_extra={"dtype": dtype, **ctx.engine_extra, "quantization": "fp8"}, skip=skip)
    rows = runner(fp8_ctx)
    base = name.removesuffix("fp8")
    for row in rows:
        row.relabel(base, name, "FP8 rollouts (e4m3 projections)")
        for peer in ("hf_generate", "hf_generate_batch", "other_peer"):
            setattr(row, peer, Cell.na(f"see {base}: the same peers"))
    return rows


def w1_fp8(ctx: BenchContext) -> list[Row]:
    return _fp8_row(ctx, w1_latency, "W1fp8")


def w2_fp8(ctx: BenchContext) -> list[Row]:
    return _fp8_row(ctx, w2_rollout, "W2fp8")


def w2n_samples(ctx: BenchContext) -> list[Row]:
    s = ctx.shapes
    prompts = random_prompts(s.w2n_prompts, s.w2n_prompt, ctx.bm.vocab_size, seed=3)
    metric = (f"output tok/s, {s.w2n_prompts} prompts x n={s.w2n_n}, prompt {s.w2n_prompt}, "
              f"{s.w2n_new} new, temperature 1.0")
    return [_throughput_row(ctx, "W2n", metric, prompts, s.w2n_new, s.w2n_n, 1.0)]


def w2p_long_prompts(ctx: BenchContext) -> list[Row]:
    """Prefill-heavy sampling: few new tokens after a long prompt shared by n samples."""
    s = ctx.shapes
    prompts = random_prompts(s.w2p_prompts, s.w2p_prompt, ctx.bm.vocab_size, seed=8)
    metric = (f"output tok/s, {s.w2p_prompts} prompts x n={s.w2p_n}, prompt {s.w2p_prompt}, "
              f"{s.w2p_new} new, temperature 1.0")
    row = _throughput_row(ctx, "W2p", metric, prompts, s.w2p_new, s.w2p_n, 1.0)
    row.details["target"] = "engine >= 15x HF generate (H200, default shapes)"
    return [row]


def w5_graphs(ctx: BenchContext) -> list[Row]:
    bm, s = ctx.bm, ctx.shapes
    row = Row(bm.name, "W5", "decode ms/step, batch 1, CUDA graphs on (engine) vs off (other peer)", "ms", False)
    na = "HF peers do not apply: W5 compares the engine with itself"
    row.hf_generate, row.hf_generate_batch = Cell.na(na), Cell.na(na)
    row.floor = Cell(1000 * _batch1_floor_s(ctx, row))
    if ctx.device.type != "cuda":
        row.engine = row.other_peer = Cell.na("CUDA graphs need a GPU")
        return [row]
    prompt = random_prompts(1, s.w1_prompt, bm.vocab_size, seed=1)[0]

    def run(graphs: bool) -> Cell:
        extra = {**ctx.engine_extra, "enable_cuda_graphs": graphs}
        with open_engine(bm, ctx.backend, 1, s.w1_prompt + s.w1_new, extra) as client:
            engine_generate(client, bm, [prompt[:8]], 2)
            ms, _ = engine_ms_per_step(client, bm, prompt, s.w1_new)
            row.details.update(engine_facts(client))
        return Cell(ms, "engine, graphs off" if not graphs else "")

    row.engine = ctx.measure(row, "engine", lambda: run(True))
    row.other_peer = ctx.measure(row, "engine_no_graphs", lambda: run(False))
    return [row]

