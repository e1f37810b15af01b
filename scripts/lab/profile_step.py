"""Where a decode step's time goes: host phases (perf_counter) against the GPU forward (CUDA events).

Runs the engine on a benchmark model at a given batch and times, per decode step: scheduling, the model
runner (inputs + launch), the sampler launches, the wait for the sampled ids, and the bookkeeping after.
Evidence for the W1/W2 figures: if host phases add up to more than the GPU forward, the step is host bound.
With overlapped decode (the default) the wait is not timed apart (timing it would undo the overlap): the
step time against the GPU forward then shows how much host work is left in the way.
    usage: python scripts/lab/profile_step.py --model qwen2.5-0.5b --batch 1 [--steps 200] [--no-overlap] [--json out.json]
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


def kernel_table(eng: Engine, forwards: int = 5) -> list[dict]:
    """GPU time per kernel of a few eager decode forwards of the running batch (the kernels a graph replays)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    seqs = eng.scheduler.running
    inputs = eng.runner.decode_inputs
    # the running sequences' KV so far (the step that would come next may still need a new page)
    lengths = [min(s.num_tokens, len(s.pages) * eng.config.page_size) for s in seqs]
    inputs.fill([s.pages for s in seqs], [s.last_token for s in seqs], lengths, len(seqs))
    inputs.upload()
    ids, meta = inputs.batch(len(seqs))
    with torch.inference_mode():
        eng.runner._decode_logits(ids, meta)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(forwards):
                eng.runner._decode_logits(ids, meta)
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        total = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if total > 0:
            rows.append({"kernel": ev.key[:90], "calls_per_forward": ev.count / forwards,
                         "us_per_forward": round(total / forwards, 1)})
    rows.sort(key=lambda r: -r["us_per_forward"])
    return rows


def profile(model: str, batch: int, steps: int, prompt_len: int, graphs: bool, trace: bool = False,
            overlap: bool = True) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bm = load_bench_model(model, device)
    eng = Engine(model_source=bm.hf_model, device=str(device), max_num_seqs=batch,
                 max_model_len=prompt_len + steps + 8, num_pages=batch * ((prompt_len + steps + 8) // 16 + 2) + 8,
                 enable_cuda_graphs=graphs, overlap_decode=overlap)
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, prompt_len, bm.vocab_size, seed=3)):
        eng.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=str(i)))
    while eng.scheduler.waiting:
        eng.step()  # prefill

    kernels = kernel_table(eng) if trace and device.type == "cuda" else None
    phases = {k: [] for k in ("schedule", "runner", "sampler", "wait_ids", "bookkeeping", "step", "gpu_forward")}
    runner_run, sampler_call = eng.runner.run, eng.sampler.__call__
    events = []

    def timed_runner(b, input_ids=None):
        t = time.perf_counter()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if device.type == "cuda" else (None, None)
        if start is not None:
            start.record()
        out = runner_run(b, input_ids)
        if end is not None:
            end.record()
            events.append((start, end))
        phases["runner"].append(time.perf_counter() - t)
        return out

    def timed_sampler(logits, seqs, ahead=0):
        t = time.perf_counter()
        out = sampler_call(logits, seqs, ahead=ahead)
        phases["sampler"].append(time.perf_counter() - t)
        t = time.perf_counter()
        if not overlap:
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
    if not overlap:  # overlapped steps schedule ahead instead (no schedule() call) and wait elsewhere
        phases["bookkeeping"] = [st - sum(phases[k][i] for k in ("schedule", "runner", "sampler", "wait_ids"))
                                 for i, st in enumerate(phases["step"])]
    else:
        del phases["schedule"], phases["wait_ids"]
    med = {k: round(1e3 * statistics.median(v), 4) for k, v in phases.items() if v}
    out = {"model": model, "batch": batch, "graphs": graphs, "overlap": overlap, "backend": eng.backend, "steps": n,
           "median_ms": med, "tokens_per_s": round(batch / statistics.median(phases["step"]), 1)}
    if kernels is not None:
        out["kernels"] = kernels
        out["kernel_us_per_forward"] = round(sum(r["us_per_forward"] for r in kernels), 1)
        out["kernel_launches_per_forward"] = sum(r["calls_per_forward"] for r in kernels)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--kernels", action="store_true", help="also a per-kernel GPU time table (torch.profiler)")
    p.add_argument("--no-overlap", action="store_true",
                   help="only one decode step at a time (default: that, then overlapped)")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for model in args.model.split(","):
        for b in args.batch.split(","):
            for overlap in (False, True) if not args.no_overlap else (False,):
                rows.append(profile(model, int(b), args.steps, args.prompt_len, not args.no_graphs, args.kernels,
                                    overlap))
                summary = {k: v for k, v in rows[-1].items() if k != "kernels"}
                print(json.dumps(summary), flush=True)
                for r in rows[-1].get("kernels", [])[:14]:
                    print(f"   {r['us_per_forward']:9.1f} us  x{r['calls_per_forward']:5.0f}  {r['kernel']}",
                          flush=True)
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
