"""WO on Ray Serve: what the endpoint's Serve replicas (rollout_service/openai/replicas.py) cost and carry against
one uvicorn endpoint process, both in front of the same Ray service, in one run on one box.

- latency: the same greedy chat call through the Ray client (`client.generate` on the rendered ids, and on the
  messages, like for like), the uvicorn endpoint (in this process, on the same client; with httpx and with the
  `openai` package) and Serve's proxy and replicas (httpx), interleaved call by call; "added" is the median of
  each call's difference from the Ray client's call on token ids next to it, and, where the engine's own time of
  each call is known here (not Serve's), "outside the engine" each call's time less it (openai_bench.py);
- rate: `--sessions` session calls (each its own session id, so each costs the shared sessions actor its two
  round trips) from `--threads` client threads through each endpoint: calls/s, on the model's service and on a
  service of two fabricating workers (benchmarks/harness/fabricated.py: an engine that costs nothing, so the
  endpoint, the router and the sessions actor are what is measured). On a box of few cores the endpoint
  processes, Serve's proxy and the engine share them: the rate says what the box carries, not what more nodes
  would.

  python -m benchmarks.harness.openai_serve_bench [--replicas 2] [--calls 60] [--sessions 300] [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from benchmarks.harness.openai_bench import MESSAGES, TOKEN, EngineClock, interleaved, latency_table


def measure_latency(client: Any, servers: dict[str, Any], ids: list[int], calls: int, max_tokens: int) -> list[dict]:
    """The paths interleaved; the engine's own time of each call is known for the Ray client's and the uvicorn
    endpoint's (it holds this process's client: EngineClock), so their times outside the engine are compared too;
    Serve's replicas hold clients of their own."""
    import httpx
    from openai import OpenAI

    from rollout_service import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    body = {"model": "m", "messages": MESSAGES, "temperature": 0.0, "max_tokens": max_tokens}
    https = {name: httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
             for name, s in servers.items()}
    uvicorn, server = next(iter(servers.items()))  # the endpoint in this process (endpoints() puts it first)
    direct = server.app.state.runtime.svc
    clock, held = EngineClock(), direct.client
    direct.client = clock.wrap(held)
    sdk = OpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=120)
    paths: dict[str, Callable[[], list[int]]] = {
        "Ray client, token ids": lambda: clock.note(client.generate([ids], sp, apply_chat_template=False))[0]
        .token_ids,
        "Ray client, messages": lambda: clock.note(client.generate([MESSAGES], sp))[0].token_ids}
    for name, http in https.items():
        paths[f"{name}, httpx"] = lambda http=http: http.post("/chat/completions", json=body).raise_for_status(
        ).json()["choices"][0]["token_ids"]
    paths[f"{uvicorn}, openai package"] = lambda: sdk.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0, max_tokens=max_tokens).choices[0].model_extra["token_ids"]
    try:
        return interleaved(paths, calls, clock.take)
    finally:
        direct.client = held
        for http in https.values():
            http.close()


def measure_rate(name: str, url: str, sessions: int, threads: int, max_tokens: int) -> dict:
    import time

    import httpx

    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300,
                        limits=httpx.Limits(max_connections=threads))

    def call(k: int) -> int:
        body = {"model": "m", "messages": MESSAGES, "temperature": 1.0, "seed": k, "max_tokens": max_tokens,
                "session_id": f"{name}-{k}"}
        return len(http.post("/chat/completions", json=body).raise_for_status().json()["choices"][0]["token_ids"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        tokens = sum(pool.map(call, range(sessions)))
    wall = time.perf_counter() - t0
    http.close()
    return {"measure": "rate", "path": name, "sessions": sessions, "threads": threads, "tokens": tokens,
            "wall_s": round(wall, 2), "calls_per_s": round(sessions / wall, 1)}


@contextlib.contextmanager
def endpoints(client: Any, tokenizer: Any, replicas: int, port: int) -> Iterator[dict[str, Any]]:
    """The uvicorn endpoint (in this process) and `replicas` Serve replicas in front of `client`: name -> server."""
    from rollout_service.openai import serve_openai
    from rollout_service.openai.replicas import serve_openai_replicas

    direct = serve_openai(client, port=0, token=TOKEN, block=False, tokenizer=tokenizer)
    try:
        served = serve_openai_replicas(client, replicas=replicas, port=port, token=TOKEN, num_cpus=0,
                                       proxy_location="HeadOnly")
        try:
            yield {"uvicorn, 1 process": direct, f"Serve, {replicas} replicas": served}
        finally:
            served.stop()
    finally:
        direct.stop()


def rates(client: Any, servers: dict[str, Any], sessions: int, threads: int, max_tokens: int, service: str
          ) -> list[dict]:
    from rollout_service.openai import release

    rows = []
    for name, server in servers.items():
        rows.append({**measure_rate(name, server.url, sessions, threads, max_tokens), "service": service})
        release(client, [f"{name}-{k}" for k in range(sessions)])
    return rows


def main(argv: list[str] | None = None) -> int:
    import ray

    from benchmarks.harness.control_plane import start
    from benchmarks.harness.fabricated import Fabricate
    from benchmarks.harness.result_files import results_dir
    from benchmarks.harness.service_bench import write_results
    from rollout_service import RolloutClient
    from rollout_service.openai.server import tokenizer_for
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--calls", type=int, default=60, help="timed calls per path")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--sessions", type=int, default=300, help="session calls per endpoint in the rate part")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--port", type=int, default=8123, help="Serve's HTTP port")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="")
    p.add_argument("--quick", action="store_true", help="tiny counts: a smoke run")
    args = p.parse_args(argv)
    calls, sessions = (3, 16) if args.quick else (args.calls, args.sessions)
    ray.init(address="local", include_dashboard=False, num_cpus=4, resources={"bench_worker": 8},
             logging_level="ERROR")
    tok = tokenizer_for(args.model)
    cfg = {"name": "openai-serve-bench", "num_workers": 1, "resources": {"num_cpus": 1, "num_gpus": 0},
           "engine": {"model": args.model, "backend": "torch", "dtype": "float32", "device": "cpu"},
           "placement": {"timeout_s": 600}}
    try:
        with RolloutClient.launch(cfg) as client, endpoints(client, tok, args.replicas, args.port) as servers:
            ids = servers["uvicorn, 1 process"].app.state.runtime.svc.renderer.render(MESSAGES)
            rows = measure_latency(client, servers, ids, calls, args.max_tokens)
            rows += rates(client, servers, sessions, args.threads, args.max_tokens, "the model")
        conn, _, _ = start(2, Fabricate(), "openai-serve-fabricated")  # an engine that costs nothing
        with RolloutClient(conn) as client, endpoints(client, tok, args.replicas, args.port) as servers:
            rows += rates(client, servers, sessions * 4, args.threads, args.max_tokens, "fabricated")
    finally:
        ray.shutdown()
    meta = {"model": args.model, "device": "cpu", "max_tokens": args.max_tokens, "replicas": args.replicas,
            "messages": MESSAGES, "workers": 1}
    for r in rows:
        print(r)
    write_results(results_dir(args.out, args.quick), "openai-serve", meta, rows, markdown, args.tag)
    return 0 if all(r.get("same_tokens", True) for r in rows) else 1


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"One Ray service (1 CPU worker, {meta['model']} float32) behind every path; a chat call of "
             f"{meta['max_tokens']} greedy new tokens; the uvicorn endpoint runs in the benchmark's process, Serve's "
             f"{meta['replicas']} replicas and its proxy in their own. added: the median of each call's difference "
             "from the Ray client's call on token ids next to it; outside the engine: the median of each call's time "
             "less the engine's own (its result's timings, submitted to finished on the worker), and that median "
             "less the token-ids call's (n/a: Serve's replicas hold clients of their own, whose calls this process "
             "does not see).", "", *latency_table(rows)]
    rated = [r for r in rows if r["measure"] == "rate"]
    if rated:
        lines += ["", f"Session calls (one call per session id, {rated[0]['threads']} client threads), each endpoint "
                  "in turn, on the model's service and on a service of two fabricating workers (the endpoint's own "
                  "ceiling):", "", "| service | endpoint | calls | tokens | seconds | calls/s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r.get('service', '')} | {r['path']} | {r['sessions']} | {r['tokens']} | {r['wall_s']} | "
                  f"{r['calls_per_s']} |" for r in rated]
    return lines


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
