"""Prefix-aware routing vs load-only routing on a Ray service of 2 CPU workers (real engines, the tiny random
Llama): tokens prefilled per new token and each worker's prefix-cache hit rate, on

- W7's episode shape driven by the client: each turn of each episode is its own request whose prompt is the
  whole history so far (an agent loop outside the service); a turn's requests go together, in a seeded order;
- W7's episode shape with run_episodes: each episode runs whole on one worker whatever the routing;
- a GRPO batch: every prompt one shared system prompt plus a problem of its own, n samples each, two steps.

`python -m benchmarks.harness.prefix_routing` writes benchmarks/results/<date>-<hardware>-prefix-routing.{json,md}.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from benchmarks.harness.result_files import results_dir
from benchmarks.harness.multiturn import SyntheticEnv
from benchmarks.harness.service_bench import bench_cluster, tiny_model_dir, write_results


@dataclass(frozen=True)
class Shape:
    episodes: int = 64
    turns: int = 4
    prompt: int = 256
    obs: int = 256
    new: int = 128
    grpo_prompts: int = 64
    grpo_system: int = 256
    grpo_problem: int = 64
    grpo_n: int = 8
    grpo_new: int = 64
    vocab: int = 512


def conversations(client: Any, s: Shape, seed: int = 0, sessions: bool = False) -> int:
    """W7's shape as an agent loop run by the client; returns the new tokens (the first prompts, observations
    and each earlier turn's last sampled token, which never had KV), as W7 counts them. `sessions`: each
    episode's requests name it as their session (metadata), as the OpenAI endpoint's calls do."""
    from rollout_service.api.types import SamplingParams

    envs = [SyntheticEnv(e, s.prompt, s.obs, s.vocab) for e in range(s.episodes)]
    histories = [env.tokens(0) for env in envs]
    order, sampling = random.Random(seed), SamplingParams(temperature=0.0, max_tokens=s.new, ignore_eos=True)
    for turn in range(s.turns):
        ids = order.sample(range(s.episodes), s.episodes)  # clients finish their turns in any order
        metadata = [{"session_id": f"episode-{e}"} for e in ids] if sessions else None
        for e, r in zip(ids, client.generate([histories[e] for e in ids], sampling, metadata=metadata)):
            histories[e] = histories[e] + r.token_ids
            if turn + 1 < s.turns:
                histories[e] = histories[e] + envs[e].tokens(turn + 1)
    return s.episodes * (s.prompt + (s.turns - 1) * (s.obs + 1))


def engine_episodes(client: Any, s: Shape) -> int:
    from rollout_service.api.types import SamplingParams

    total = s.prompt + s.turns * s.new + (s.turns - 1) * s.obs
    client.run_episodes([SyntheticEnv(e, s.prompt, s.obs, s.vocab) for e in range(s.episodes)],
                        SamplingParams(temperature=0.0, max_tokens=s.new, ignore_eos=True), max_turns=s.turns,
                        max_total_tokens=total)
    return s.episodes * (s.prompt + (s.turns - 1) * (s.obs + 1))


def grpo_batches(client: Any, s: Shape, steps: int = 2) -> int:
    """Two GRPO steps' batches: one system prompt shared by every prompt; returns the tokens a perfect cache
    would prefill (the system prompt once, each problem once)."""
    from rollout_service.api.types import SamplingParams

    rng = random.Random(1)
    system = [rng.randrange(s.vocab) for _ in range(s.grpo_system)]
    sampling = SamplingParams(n=s.grpo_n, temperature=1.0, max_tokens=s.grpo_new, ignore_eos=True, seed=0)
    for _ in range(steps):
        client.generate([system + [rng.randrange(s.vocab) for _ in range(s.grpo_problem)]
                         for _ in range(s.grpo_prompts)], sampling)
    return s.grpo_system + steps * s.grpo_prompts * s.grpo_problem


WORKLOADS: dict[str, Callable[[Any, Shape], int]] = {
    "W7 turns by the client": conversations,
    "W7 turns by the client, in sessions": lambda client, s: conversations(client, s, sessions=True),
    "W7 run_episodes": engine_episodes, "GRPO shared system prompt": grpo_batches}
# (workers, routing) each workload runs with; sessions stick only under prefix routing
CONFIGS = {name: ((1, "load"), (2, "load"), (2, "prefix")) for name in WORKLOADS}
CONFIGS["W7 turns by the client, in sessions"] = ((2, "prefix"),)


def measure(client: Any, run: Callable[[], int]) -> dict:
    """Prefilled tokens per new token and per-worker hit rates over one run (counter deltas)."""
    before = client.stats()
    t0 = time.perf_counter()
    new = run()
    seconds = time.perf_counter() - t0
    after = client.stats()
    per_worker = []
    for a, b in zip(after, before):
        hit = a["prefix_cache"]["hit_tokens"] - b["prefix_cache"]["hit_tokens"]
        asked = a["prefix_cache"]["queried_tokens"] - b["prefix_cache"]["queried_tokens"]
        per_worker.append({"prefilled": a["prefilled_tokens"] - b["prefilled_tokens"],
                           "hit_rate": round(hit / asked, 3) if asked else None})
    prefilled = sum(w["prefilled"] for w in per_worker)
    return {"prefilled": prefilled, "new": new, "prefilled_per_new": round(prefilled / new, 3),
            "hit_rates": [w["hit_rate"] for w in per_worker], "seconds": round(seconds, 2),
            "routed": client.info().get("routing")}


def run(shape: Shape, workers: int, routing: str, model_dir: str, workload: str) -> dict:
    from rollout_service.client import RolloutClient

    total = shape.prompt + shape.turns * shape.new + (shape.turns - 1) * shape.obs
    pages = 2 * (shape.episodes * total // workers // 16 + 64)  # every episode's KV, twice: nothing evicted
    cfg = {"name": f"bench-routing-{routing}-{workers}", "num_workers": workers, "routing": routing,
           "resources": {"num_cpus": 1}, "placement": {"strategy": "PACK", "timeout_s": 120},
           "engine": {"model": model_dir, "backend": "torch", "dtype": "float32", "device": "cpu",
                      "num_pages": pages, "max_num_seqs": 256, "max_model_len": max(total, 1024),
                      "enable_cuda_graphs": False}}
    with RolloutClient.launch(cfg) as client:
        return measure(client, lambda: WORKLOADS[workload](client, shape))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="a label of the run, kept in its meta")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    args = p.parse_args(argv)
    shape = Shape(episodes=4, turns=3, prompt=32, obs=32, new=8, grpo_prompts=4, grpo_system=32,
                  grpo_problem=16, grpo_n=2, grpo_new=8) if args.quick else Shape()
    rows = []
    with bench_cluster(num_cpus=2), tiny_model_dir(shape.vocab) as model_dir:
        for workload in WORKLOADS:
            for workers, routing in CONFIGS[workload]:
                row = {"workload": workload, "workers": workers, "routing": routing,
                       **run(shape, workers, routing, model_dir, workload)}
                print(row, flush=True)
                rows.append(row)
    write_results(results_dir(args.out, args.quick), "prefix-routing", {"shape": asdict(shape)}, rows, markdown, args.tag)
    return 0


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    return _markdown(rows, Shape(**meta["shape"]))


def _markdown(rows: list[dict], shape: Shape) -> list[str]:
    lines = [f"Shape: {asdict(shape)}. Tiny random Llama (hidden 64, 2 layers), float32, 1 CPU per worker; "
             "prefilled/new: tokens run through prefill per new token (W7's measure; GRPO: per token a perfect "
             "cache would prefill).", "",
             "| workload | workers | routing | prefilled | new | prefilled/new | hit rate per worker | "
             "calls by session / prefix / load | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['workers']} | {r['routing']} | {r['prefilled']:,} | {r['new']:,} | "
                     f"{r['prefilled_per_new']:.3f} | {', '.join(str(h) for h in r['hit_rates'])} | "
                     f"{_routed(r.get('routed'))} | {r['seconds']} |")
    return lines


def _routed(counts: dict | None) -> str:
    if not counts:
        return "-"
    return " / ".join(str(counts.get(k, 0)) for k in ("by_session", "by_prefix", "by_load"))


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
