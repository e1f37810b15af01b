"""W6: one GRPO step with the learner colocated with a rollout worker on one device (benchmarks/README.md).

A one-worker service is started with `colocate: true` on random weights (`load_format: dummy`), and a GRPO
learner actor is placed in the worker's bundle (`client.colocated_options(0)`), on the same GPU. The learner
builds the model from its config (seeded random weights) and pushes them, so the worker and the learner run
the same weights from step 1. Before the timed steps: one sleep/wake cycle (the first level-1 sleep pins
the host buffers it parks the weights in, once per run) and W2n through the same worker with the learner's
memory resident (the peer of the loop's rollout rate). Each step is rollout -> reward -> sleep -> learner
(bf16 forward/backward, fp32 master weights) -> refresh (CUDA IPC) -> wake; its phase times, memory and
fidelity (step 1: the learner's and the rollout's log-probs against an fp32 forward) go into the rows.

Rewards: the fraction of even token ids, a stand-in that costs nothing and differs within a group, so
every sample is trained on.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

from benchmarks.harness.context import BenchContext
from benchmarks.harness.engine_side import PAGE_SIZE, sampling
from benchmarks.harness.models import random_prompts
from benchmarks.harness.report import Cell, Row

# What fits one H200 beside a sleeping engine: an 8B model's fp32 master weights with AdamW's two moments
# (128 GB) do not; with Adafactor (factored second moments) they take 32 GB. Gradient checkpointing keeps
# the activations of a micro-batch of 8 x 768 tokens to a few GB.
LEARNER = {"llama3-8b": dict(optimizer="adafactor", micro_batch=8, gradient_checkpointing=True)}
LEARNER_DEFAULT = dict(optimizer="adamw", micro_batch=16, gradient_checkpointing=False)
LR = 1e-6  # the learner's learning rate (WD's random-weight models take it too)
FP32_REFERENCE_SEQS = 16


def parity_reward(result) -> float:
    return float(np.mean(np.asarray(result.token_ids) % 2 == 0)) if len(result.token_ids) else 0.0


def token_prompt(problem: list[int]) -> list[int]:
    return problem


def w6_rl_step(ctx: BenchContext) -> list[Row]:
    bm, s = ctx.bm, ctx.shapes
    shape = f"{s.w6_prompts} prompts x n={s.w6_n}, prompt {s.w6_prompt}, {s.w6_new} new, temperature 1.0"
    step = Row(bm.name, "W6", f"GRPO step s, learner colocated with 1 worker, {shape}", "s", False)
    share = Row(bm.name, "W6 overhead", "share of the step in refresh + sleep + wake (target <= 5% 8B, 10% 0.5B)",
                "share", False)
    rate = Row(bm.name, "W6 rollout", "rollout tok/s inside the step (other peer: W2n on the same worker)",
               "tok/s", True)
    for r in (step, share, rate):
        r.hf_generate = r.hf_generate_batch = Cell.na("no HF peer for an RL step")
    why = "skipped by --skip" if ctx.skipped("service", "W6") else None
    try:
        import ray  # noqa: F401
    except ImportError:
        why = "Ray is not installed here"
    if why:
        for r in (step, share, rate):
            r.engine = Cell.na(why)
        return [step, share, rate]
    step.engine = ctx.measure(step, "engine", lambda: _run(ctx, step, share, rate))
    return [step, share, rate]


def w6_fp8(ctx: BenchContext) -> list[Row]:
    """W6 with FP8 rollouts (e4m3 projections) and the bf16 learner's TIS correction, as slime / NeMo-RL run it:
    its step-1 mismatch (rows' details) is the one to read beside W6's."""
    if ctx.bm.moe is not None:
        return [Row(ctx.bm.name, "W6fp8", "-", "-", False, engine=Cell.na("FP8 has no mixture-of-experts path"))]
    # FP8 products round to a half dtype: the bench model's, else bf16 (the CPU's float32 run)
    dtype = str(ctx.bm.dtype).removeprefix("torch.") if ctx.bm.dtype in (torch.bfloat16, torch.float16) else "bfloat16"
    rows = w6_rl_step(replace(ctx, engine_extra={**ctx.engine_extra, "quantization": "fp8", "dtype": dtype}))
    for row in rows:
        row.relabel("W6", "W6fp8", "FP8 rollouts, rollout_correction tis")
    return rows


def _run(ctx: BenchContext, step: Row, share: Row, rate: Row) -> Cell:
    import ray

    from actors.grpo import GRPOActor
    from rollout_service import RolloutClient

    bm, s = ctx.bm, ctx.shapes
    folder = tempfile.mkdtemp(prefix="w6-config-")
    bm.config.save_pretrained(folder)
    gpu = bm.device.type == "cuda"
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, num_gpus=1 if gpu else 0, include_dashboard=False, log_to_driver=False)
    client = RolloutClient.launch(_service(ctx, folder))
    try:
        learner = GRPOActor.options(**client.colocated_options(0)).remote(
            bm.config, "w6-bench", _grpo_config(ctx), reward_fn=parity_reward, prompt_fn=token_prompt,
            namespace="rollout_service")
        t0 = time.perf_counter()
        ray.get(learner.push_weights.remote())  # the learner's weights on the worker: same weights at step 1
        step.details["first_push_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        client.sleep(1)  # the first level-1 sleep pins its host buffers: once per run, not per step
        client.wake_up()
        step.details["first_sleep_wake_s"] = round(time.perf_counter() - t0, 3)
        rate.other_peer = _w2n(ctx, client, rate)
        problems = random_prompts(s.w6_prompts, s.w6_prompt, bm.vocab_size, seed=6)
        rows = []
        for i in range(s.w6_steps):
            if i and time.monotonic() + 1.2 * rows[-1]["step_s"] > ctx.deadline:
                break  # another step would overrun the budget (a steady step is no longer than the first)
            rows.append(ray.get(learner.step.remote(problems, fp32_reference=FP32_REFERENCE_SEQS if i == 0 else 0)))
        step.details["fidelity_reports"] = client.info().get("fidelity")
    finally:
        client.close()
        if started:
            ray.shutdown()
    return _fill(ctx, rows, step, share, rate)


def _service(ctx: BenchContext, folder: str) -> dict:
    bm, s = ctx.bm, ctx.shapes
    gpu = bm.device.type == "cuda"
    # the step's rollouts and W2n (its peer, on the same worker)
    seqs, max_len = s.w6_prompts * s.w6_n, max(s.w6_prompt + s.w6_new, s.w2n_prompt + s.w2n_new)
    pages = max(seqs * (s.w6_prompt + s.w6_new), s.w2n_prompts * s.w2n_n * max_len) // PAGE_SIZE + seqs + 8
    if gpu:  # room for the learner's resident memory beside the engine (see _learner_bytes)
        total = torch.cuda.get_device_properties(bm.device).total_memory
        spare = 0.9 * total - _learner_bytes(ctx) - _params(ctx) * bm.elem_bytes - (4 << 30)
        pages = max(64, min(pages, int(spare // (bm.kv_bytes_per_token() * PAGE_SIZE))))
    batch = min(max(seqs, s.w2n_prompts * s.w2n_n), 512)
    # every decode batch in a graph: at 512 sequences the default 256-batch cap ran a 0.5B model eager (0.6x W2n)
    engine = {**dict(model=folder, load_format="dummy", backend=ctx.backend, dtype=str(bm.dtype).removeprefix("torch."),
                     device=bm.device.type, num_pages=pages, max_num_seqs=batch, cuda_graph_max_batch=batch,
                     max_model_len=max_len), **ctx.engine_extra}
    return {"name": "w6-bench", "num_workers": 1, "colocate": True, "engine": engine,
            "resources": {"num_cpus": 2 if gpu else 1, "num_gpus": 1 if gpu else 0}}


def _params(ctx: BenchContext) -> int:
    bm, c = ctx.bm, ctx.bm.config
    q = c.num_attention_heads * bm.head_dim
    layer = c.hidden_size * (2 * q + 2 * bm.num_kv_heads * bm.head_dim) + 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * layer + embed


def _learner_bytes(ctx: BenchContext) -> int:
    """Resident between steps: bf16 weights (2 B), fp32 masters (4), AdamW's moments (8) and the CUDA IPC
    buckets the refreshes reuse (2), per parameter."""
    opt = {**LEARNER_DEFAULT, **LEARNER.get(ctx.bm.name, {})}["optimizer"]
    return _params(ctx) * (2 + 4 + (8 if opt == "adamw" else 0) + 2)


def _grpo_config(ctx: BenchContext) -> dict:
    bm, s = ctx.bm, ctx.shapes
    gpu = bm.device.type == "cuda"
    fp8 = ctx.engine_extra.get("quantization") == "fp8"  # FP8 rollouts: the learner corrects with TIS
    return {"group_size": s.w6_n, "prompts_per_step": s.w6_prompts, "max_tokens": s.w6_new, "temperature": 1.0,
            "ignore_eos": True, "lr": LR, "device": "cuda" if gpu else "cpu",
            "dtype": "bfloat16" if gpu else "float32", "colocate": True, "sleep_level": 1,
            **({"rollout_correction": "tis"} if fp8 else {}), **{**LEARNER_DEFAULT, **LEARNER.get(bm.name, {})}}


def _w2n(ctx: BenchContext, client, rate: Row) -> Cell:
    s = ctx.shapes
    prompts = random_prompts(s.w2n_prompts, s.w2n_prompt, ctx.bm.vocab_size, seed=3)
    t0 = time.perf_counter()
    results = client.generate(prompts, sampling(s.w2n_new, n=s.w2n_n, temperature=1.0, seed=0))
    tokens = sum(len(r.token_ids) for r in results)
    rate.details["w2n_through_service"] = {"tokens": tokens, "s": round(time.perf_counter() - t0, 3)}
    return Cell(tokens / (time.perf_counter() - t0), "W2n, same worker, through the service")


def _fill(ctx: BenchContext, rows: list[dict], step: Row, share: Row, rate: Row) -> Cell:
    last = rows[-1]
    phases = ("rollout", "reward", "learner", "refresh", "sleep", "wake", "idle")
    for i, r in enumerate(rows, 1):
        step.details[f"step{i}"] = {
            **{f"{p}_s": round(r[f"{p}_s"], 3) for p in phases}, "step_s": round(r["step_s"], 3),
            "overhead_share": round(r["overhead_share"], 4), "rollout_tokens": r["rollout_tokens"],
            "rollout_tok_s": round(r["rollout_wait_tokens_per_s"] or 0), "mismatch_mean": r["mismatch_mean"],
            "mismatch_max": r["mismatch_max"], "kl": r["kl_rollout_learner"], "ratio_max": r["ratio_max"],
            "mismatch_tokens": r["mismatch_tokens"], "learner_memory": r["learner_memory"],
            "engine_memory_asleep": r["engine_memory_asleep"], "optimizer_state_bytes": r["optimizer_state_bytes"]}
    step.details["learner"] = {k: v for k, v in _grpo_config(ctx).items() if k in ("optimizer", "micro_batch",
                                                                                 "gradient_checkpointing", "dtype",
                                                                                 "rollout_correction")}
    step.details["steps_run"] = len(rows)
    fid = rows[0].get("fidelity_vs_fp32")
    if fid:
        step.details["step1_fidelity_vs_fp32"] = {
            "rollout_mean_abs": fid["rollout_vs_fp32"]["mean_abs"], "rollout_max_abs": fid["rollout_vs_fp32"]["max_abs"],
            "learner_mean_abs": fid["learner_vs_fp32"]["mean_abs"],
            "learner_max_abs": fid["learner_vs_fp32"]["max_abs"],
            "rollout_over_learner": fid["ratio"], "tokens": fid["rollout_vs_fp32"]["n_tokens"]}
    overhead = (last["refresh_s"] + last["sleep_s"] + last["wake_s"]) / last["step_s"]
    share.engine = Cell(overhead)
    share.details["not_rollout_or_learner_share"] = round(last["overhead_share"], 4)
    rate.engine = Cell(last["rollout_wait_tokens_per_s"])
    if rate.other_peer.value:
        rate.details["loop_over_w2n"] = round(last["rollout_wait_tokens_per_s"] / rate.other_peer.value, 3)
    return Cell(last["step_s"])
