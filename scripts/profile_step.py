"""Where a decode step's time goes: host phases (perf_counter) against the GPU forward (CUDA events).

Runs the engine on a benchmark model at a given batch and times, per decode step: scheduling, the model
runner (inputs + launch), the sampler launches, the wait for the sampled ids, and the bookkeeping after.
Evidence for the W1/W2 figures: if host phases add up to more than the GPU forward, the step is host bound.
    usage: python scripts/profile_step.py --model qwen2.5-0.5b --batch 1 [--steps 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rollout_service.bench.models import load_bench_model, random_prompts
from rollout_service.engine.engine import Engine
from rollout_service.types import RolloutRequest, SamplingParams


def profile(model: str, batch: int, steps: int, prompt_len: int, graphs: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bm = load_bench_model(model, device)
    eng = Engine(model_source=bm.hf_model, device=str(device), max_num_seqs=batch,
                 max_model_len=prompt_len + steps + 8, num_pages=batch * ((prompt_len + steps + 8) // 16 + 2) + 8,
                 enable_cuda_graphs=graphs)
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, prompt_len, bm.vocab_size, seed=3)):
        eng.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=str(i)))
    while eng.scheduler.waiting:
        eng.step()  # prefill

    phases = {k: [] for k in ("schedule", "runner", "sampler", "wait_ids", "bookkeeping", "step", "gpu_forward")}
    runner_run, sampler_call = eng.runner.run, eng.sampler.__call__
    events = []

    def timed_runner(b):
        t = time.perf_counter()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if device.type == "cuda" else (None, None)
        if start is not None:
            start.record()
        out = runner_run(b)
        if end is not None:
            end.record()
            events.append((start, end))
        phases["runner"].append(time.perf_counter() - t)
        return out

    def timed_sampler(logits, seqs):
        t = time.perf_counter()
        out = sampler_call(logits, seqs)
        phases["sampler"].append(time.perf_counter() - t)
        t = time.perf_counter()
        out.token_ids.tolist()  # the engine's own .tolist() right after is then free
        phases["wait_ids"].append(time.perf_counter() - t)
        return out

    schedule = eng.scheduler.schedule

    def timed_schedule():
        t = time.perf_counter()
        out = schedule()
        phases["schedule"].append(time.perf_counter() - t)
        return out

    eng.runner.run, eng.sampler, eng.scheduler.schedule = timed_runner, timed_sampler, timed_schedule
    for _ in range(steps - 2):
        t = time.perf_counter()
        eng.step()
        phases["step"].append(time.perf_counter() - t)
    if device.type == "cuda":
        torch.cuda.synchronize()
        phases["gpu_forward"] = [s.elapsed_time(e) / 1e3 for s, e in events]
    n = len(phases["step"])
    for k in ("schedule", "runner", "sampler", "wait_ids"):
        phases[k] = phases[k][-n:]
    phases["bookkeeping"] = [st - sum(phases[k][i] for k in ("schedule", "runner", "sampler", "wait_ids"))
                             for i, st in enumerate(phases["step"])]
    med = {k: round(1e3 * statistics.median(v), 4) for k, v in phases.items() if v}
    return {"model": model, "batch": batch, "graphs": graphs, "backend": eng.backend, "steps": n,
            "median_ms": med, "tokens_per_s": round(batch / statistics.median(phases["step"]), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for model in args.model.split(","):
        for b in args.batch.split(","):
            rows.append(profile(model, int(b), args.steps, args.prompt_len, not args.no_graphs))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
