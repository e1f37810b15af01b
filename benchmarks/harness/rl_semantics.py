"""What the RL semantics cost, on one in-process engine and the same model object in transformers:

- score: teacher-forced log-probs of `prompts x n` completions (client.score's engine path: prefill only, the
  n completions of a prompt sharing its prefill) vs the learner's recompute in transformers (a forward over
  prompt + completion, `batch` sequences at a time, log_softmax and gather in float32); the largest |Δ|
  between the two is reported beside the speed;
- refresh: W2n's shape (prompts x n, sampled) with a refresh every `refresh_every` decode steps, on_refresh
  "continue" vs "recompute" (every in-flight sequence's KV prefilled again under the new weights).

`python -m benchmarks.harness.rl_semantics [--model smollm2-135m] [--device cpu|cuda] [--quick]` writes
benchmarks/results/<date>-<hardware>-rl-semantics.{json,md}.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    score_prompts: int = 8
    score_n: int = 8
    score_prompt: int = 256
    score_completion: int = 768
    score_batch: int = 8          # the learner's recompute: sequences per transformers forward
    w2n_prompts: int = 4
    w2n_n: int = 8
    w2n_prompt: int = 128
    w2n_new: int = 256
    refresh_every: int = 64       # decode steps between refreshes


def _sequences(s: Shape, vocab: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(s.score_prompts):
        prompt = torch.randint(0, vocab, (s.score_prompt,), generator=g).tolist()
        out += [(prompt, torch.randint(0, vocab, (s.score_completion,), generator=g).tolist())
                for _ in range(s.score_n)]
    return out


@torch.no_grad()
def _hf_scores(hf: Any, seqs: list, batch: int) -> list[torch.Tensor]:
    out = []
    for i in range(0, len(seqs), batch):
        chunk = seqs[i:i + batch]
        ids = torch.tensor([p + c for p, c in chunk], device=hf.device)
        logits = hf(ids).logits[:, len(chunk[0][0]) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(2, ids[:, len(chunk[0][0]):, None])[..., 0]
        out += list(lp.cpu())  # (the copy waits for the device: the timing covers the work)
    return out


def score(hf: Any, make_engine: Any, s: Shape) -> dict:
    from rollout_service.api.types import RolloutRequest, SamplingParams
    seqs = _sequences(s, hf.config.vocab_size)
    tokens = sum(len(c) for _, c in seqs)
    t0 = time.perf_counter()
    ref = _hf_scores(hf, seqs, s.score_batch)
    hf_s = time.perf_counter() - t0
    engine = make_engine()
    t0 = time.perf_counter()
    for i, (p, c) in enumerate(seqs):
        engine.add_request(RolloutRequest(prompt=p, completion=c, sampling=SamplingParams(temperature=1.0),
                                          request_id=f"s{i}"))
    got = {r.request_id: r for r in engine.run_until_done()}
    engine_s = time.perf_counter() - t0
    dev = max(float((torch.from_numpy(got[f"s{i}"].logprobs) - ref[i]).abs().max()) for i in range(len(seqs)))
    return {"sequences": len(seqs), "scored_tokens": tokens, "engine_s": round(engine_s, 2), "hf_s": round(hf_s, 2),
            "engine_tok_s": round(tokens / engine_s, 1), "hf_tok_s": round(tokens / hf_s, 1),
            "speedup": round(hf_s / engine_s, 2), "max_abs_dev": dev,
            "prefilled_tokens": engine.counters.prefilled_tokens}


def refresh(make_engine: Any, weights: dict, s: Shape, on_refresh: str) -> dict:
    from rollout_service.api.types import RolloutRequest, SamplingParams
    engine = make_engine(on_refresh=on_refresh)
    g = torch.Generator().manual_seed(1)
    sampling = SamplingParams(n=s.w2n_n, temperature=1.0, max_tokens=s.w2n_new, ignore_eos=True, seed=7)
    for i in range(s.w2n_prompts):
        prompt = torch.randint(0, engine.hf_config.vocab_size, (s.w2n_prompt,), generator=g).tolist()
        engine.add_request(RolloutRequest(prompt=prompt, sampling=sampling, request_id=f"w{i}"))
    t0, version, decodes, out = time.perf_counter(), 0, 0, []
    while engine.has_unfinished():
        c = engine.counters
        before = c.steps - c.prefill_steps
        out += engine.step()
        decodes += c.steps - c.prefill_steps - before
        if decodes >= s.refresh_every and engine.has_unfinished():
            decodes, version = 0, version + 1
            engine.update_weights(weights, version)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in out)
    return {"on_refresh": on_refresh, "refreshes": version, "tokens": tokens, "seconds": round(seconds, 2),
            "tok_s": round(tokens / seconds, 1), "prefilled_tokens": engine.counters.prefilled_tokens,
            "refresh_recomputes": engine.counters.refresh_recomputes,
            "stale_kv_tokens": sum(sum(k < t for k, t in zip(r.kv_versions, r.token_versions)) for r in out)}


def main(argv: list[str] | None = None) -> int:
    from rollout_service.engine.engine import Engine

    from benchmarks.harness.models import load_bench_model
    from benchmarks.harness.result_files import results_dir
    from benchmarks.harness.service_bench import write_results
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="a label of the run, kept in its meta")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    args = p.parse_args(argv)
    shape = Shape(score_prompts=2, score_n=2, score_prompt=16, score_completion=48, w2n_prompts=2, w2n_n=2,
                  w2n_new=24, refresh_every=8) if args.quick else Shape()
    bm = load_bench_model(args.model, torch.device(args.device))  # float32 on the CPU, bf16 on a GPU
    hf = bm.hf_model
    weights = {k: v.clone() for k, v in hf.state_dict().items()}

    def make_engine(**o: Any) -> Any:
        return Engine(model_source=hf, device=args.device, dtype=str(bm.dtype).removeprefix("torch."),
                      kv_cache_memory_gb=4.0, **o)

    rows = [{"measure": "score", **score(hf, make_engine, shape)}]
    print(rows[-1], flush=True)
    for mode in ("continue", "recompute"):
        rows.append({"measure": "refresh", **refresh(make_engine, weights, shape, mode)})
        print(rows[-1], flush=True)
    meta = {"shape": asdict(shape), "model": args.model, "device": args.device, "dtype": str(bm.dtype)}
    if args.device == "cuda":
        meta["hardware"] = torch.cuda.get_device_name()
    write_results(results_dir(args.out, args.quick), "rl-semantics", meta, rows, markdown, args.tag)
    return 0


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    return _markdown(rows, Shape(**meta["shape"]))


def _markdown(rows: list[dict], s: Shape) -> list[str]:
    sc = rows[0]
    lines = [f"Shape: {asdict(s)}; one in-process engine and the same model object in transformers (float32 on "
             "a CPU, bf16 on a GPU).", "",
             "| score | sequences | tokens | engine s | transformers s | engine / transformers | max abs dev |",
             "|---|---|---|---|---|---|---|",
             f"| | {sc['sequences']} | {sc['scored_tokens']:,} | {sc['engine_s']} | {sc['hf_s']} | "
             f"{sc['speedup']}x | {sc['max_abs_dev']:.2e} |", "",
             "| refresh (W2n shape) | refreshes | tok/s | prefilled tokens | recomputed sequences | tokens on stale KV |",
             "|---|---|---|---|---|---|"]
    for r in rows[1:]:
        lines.append(f"| {r['on_refresh']} | {r['refreshes']} | {r['tok_s']} | {r['prefilled_tokens']:,} | "
                     f"{r['refresh_recomputes']} | {r['stale_kv_tokens']} |")
    return lines


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
