"""Staleness-first vs FIFO scheduling on a mixed stream (EngineConfig.scheduling): one in-process engine, a
refresh every `steps_per_refresh` engine steps, and after each refresh a wave of single-turn prompts and
multi-turn episodes submitted under the new version. An episode's later turns re-enter the queue behind the
prompts of newer waves; a sample is stale when, as it finishes, the current version minus the oldest version
among its tokens exceeds `max_staleness` (the service would regenerate it, or abort it at last).

`python -m benchmarks.harness.staleness` writes benchmarks/results/<date>-<hardware>-staleness.{json,md}.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from benchmarks.harness.result_files import results_dir
from benchmarks.harness.multiturn import SyntheticEnv


@dataclass(frozen=True)
class StreamShape:
    waves: int = 8
    prompts_per_wave: int = 8
    episodes_per_wave: int = 4
    steps_per_refresh: int = 16
    max_staleness: int = 2
    turns: int = 3
    prompt: int = 32
    obs: int = 8
    new: int = 8
    max_num_seqs: int = 8


def _submit_wave(engine: Any, s: StreamShape, wave: int, vocab: int) -> None:
    from rollout_service.api.types import EpisodeParams, RolloutRequest, SamplingParams
    sampling = SamplingParams(temperature=0.0, max_tokens=s.new, ignore_eos=True)
    rng = random.Random(wave)
    for i in range(s.prompts_per_wave):
        engine.add_request(RolloutRequest(prompt=[rng.randrange(vocab) for _ in range(s.prompt)], sampling=sampling,
                                          request_id=f"p{wave}.{i}"))
    for i in range(s.episodes_per_wave):
        env = SyntheticEnv(wave * 1000 + i, s.prompt, s.obs, vocab)
        engine.add_request(RolloutRequest(prompt=None, sampling=sampling, request_id=f"e{wave}.{i}",
                                          episode=EpisodeParams(env, max_turns=s.turns)))


def run_stream(make_engine: Callable[..., Any], weights: dict, s: StreamShape) -> dict:
    """Drive one engine (make_engine(**engine_options)) through the stream; the staleness of every sample."""
    engine = make_engine(max_num_seqs=s.max_num_seqs)
    vocab = engine.hf_config.vocab_size
    version, steps, staleness, t0 = 0, 0, [], time.perf_counter()
    _submit_wave(engine, s, 0, vocab)
    while engine.has_unfinished():
        for r in engine.step():
            staleness.append(version - min(r.token_versions))
        steps += 1
        if steps % s.steps_per_refresh == 0:
            version += 1
            engine.update_weights(weights, version)
            if version < s.waves:
                _submit_wave(engine, s, version, vocab)
    over = [x for x in staleness if x > s.max_staleness]
    return {"samples": len(staleness), "exceeding": len(over), "mean_staleness": sum(staleness) / len(staleness),
            "max_staleness_seen": max(staleness), "steps": steps, "versions": version,
            "preemptions": engine.scheduler.num_preemptions, "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    import torch

    from rollout_service.engine.engine import Engine

    from benchmarks.harness.models import load_bench_model
    from benchmarks.harness.service_bench import write_results
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="a label of the run, kept in its meta")
    args = p.parse_args(argv)
    shape = StreamShape()
    hf = load_bench_model(args.model, torch.device("cpu"), torch.float32).hf_model
    weights = {k: v.clone() for k, v in hf.state_dict().items()}
    rows = []
    for scheduling in ("fifo", "staleness"):
        row = {"scheduling": scheduling, **run_stream(
            lambda **o: Engine(model_source=hf, device="cpu", dtype="float32", scheduling=scheduling, **o),
            weights, shape)}
        print(row, flush=True)
        rows.append(row)
    write_results(results_dir(args.out, False), "staleness", {"shape": asdict(shape), "model": args.model}, rows, markdown, args.tag)
    return 0


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    return _markdown(rows, StreamShape(**meta["shape"]))


def _markdown(rows: list[dict], s: StreamShape) -> list[str]:
    lines = [f"Shape: {asdict(s)}; greedy, one engine on the CPU, on_refresh=continue. A sample exceeds the bound "
             f"when the version at its finish minus its oldest token's version is more than {s.max_staleness}.", "",
             "| scheduling | samples | exceeding | mean staleness | max | preemptions | steps | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scheduling']} | {r['samples']} | {r['exceeding']} | {r['mean_staleness']:.2f} | "
                     f"{r['max_staleness_seen']} | {r['preemptions']} | {r['steps']} | {r['seconds']} |")
    return lines


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
