"""The control plane, measured: the router (and the workers' hosts and the client around it) driven by many
workers whose engines cost nothing (benchmarks/harness/fabricated.py, a benchmark-only test double).

- requests/s: requests of 1-token answers, submitted in batches of `batch` per stream, fabricated at once; also
  with the request path split over 2 and 4 routers (ServiceConfig.routers: each its share of the workers and of
  the requests, by prompt), every router's CPU per request apart; and one request a stream (an agent's turn, an
  OpenAI endpoint call: each stream's own calls are then the request's) with 1, 2 and 4 routers, every stream
  open at once, and from `--agents` threads each making one call at a time, its stream read after the submit or
  with it (read_now: the router answers the submit with the first read);
- results/s: W workers each fabricating W2's rate (256 samples of 256 tokens per batch, 100k tokens/s);
- CPU per request and per result: the router's process (/proc), the workers' and the client's, over each run;
- latency added: one 1-token request at a time, submit to result, on an idle service (the engine's part is
  one fabricated step, microseconds), read after the submit and with it (interleaved), beside one bare Ray actor
  call.

`python -m benchmarks.harness.control_plane` writes benchmarks/results/<date>-<hardware>-control-plane.{json,md}; a row
replaces the older run's row of the same workers, n, tokens and speedup (configuration()), the rest of that run stays.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks.harness.result_files import results_dir
from benchmarks.harness.fabricated import Fabricate
from benchmarks.harness.service_bench import write_results

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start(workers: int, fabricate: Fabricate, name: str, custom: dict | None = None, routers: int = 1
          ) -> tuple[Any, list[int], list[int]]:
    """A service of fabricating workers: (its RayConnection, the routers' pids, the workers' pids). `custom`: the
    custom resource each worker reserves (the benchmark's own Ray instance has `bench_worker`); the workers
    take no CPU of Ray's, so 64 of them fit a 2-core machine."""
    import ray

    from rollout_service.connections.ray import RayConnection, start_routers
    from rollout_service.config import ServiceConfig

    cfg = ServiceConfig(name=name, namespace="rollout_service_bench", num_workers=workers, routers=routers,
                        resources={"num_cpus": 0, "num_gpus": 0, "custom": custom or {"bench_worker": 1}},
                        placement={"strategy": "PACK", "timeout_s": 600}, max_restarts=0)
    handles = start_routers(cfg, {"namespace": cfg.namespace, "num_cpus": 0, "max_restarts": 0}, fabricate)
    pids = ray.get([r.__ray_call__.remote(lambda r: os.getpid()) for r in handles])
    worker_pids = ray.get([w.__ray_call__.remote(lambda w: os.getpid()) for r in handles for w in ray.get(
        r.__ray_call__.remote(lambda r: r.workers))])
    return RayConnection(handles[0], name, owner=True, namespace=cfg.namespace, others=handles[1:]), pids, worker_pids


def drive(backend: Any, requests: list, batch: int) -> tuple[int, int]:
    """Submit in streams of `batch` requests (every stream open at once), then read them all: (results read,
    distinct (request_id, sample_index) among them)."""
    streams = [backend.submit(requests[k:k + batch]) for k in range(0, len(requests), batch)]
    seen, count = set(), 0
    for s in streams:
        for r in s:
            seen.add((r.request_id, r.sample_index))
            count += 1
    return count, len(seen)


def drive_agents(backend: Any, requests: list, agents: int, read_now: bool) -> tuple[int, int]:
    """`agents` threads, each submitting one request and reading its stream to the end before the next (an agent's
    turns): (results read, distinct (request_id, sample_index) among them)."""
    from concurrent.futures import ThreadPoolExecutor

    def call(request: Any) -> list:
        return [(r.request_id, r.sample_index) for r in backend.submit([request], read_now=read_now)]
    with ThreadPoolExecutor(agents) as pool:
        got = [key for keys in pool.map(call, requests) for key in keys]
    return len(got), len(set(got))


def throughput(workers: int, fabricate: Fabricate, count: int, max_tokens: int, batch: int, n: int = 1,
               custom: dict | None = None, idle_s: float = 2.0, routers: int = 1, agents: int = 0,
               read_now: bool = False) -> dict:
    """One run: `count` requests of n samples of `max_tokens` tokens through a service of `workers` workers and
    `routers` routers. The routers' CPU on the idle service over `idle_s` first (their long polls of every worker)
    is reported apart, and taken out of the per-result figure: it grows with the workers and the wall time, not
    the load. The prompts differ (a router takes the requests whose prompt hashes to it)."""
    from rollout_service.api.types import RolloutRequest, SamplingParams

    backend, router_pids, worker_pids = start(workers, fabricate, f"bench-cp-{workers}-{max_tokens}-{routers}",
                                              custom, routers)
    try:
        sampling = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        warm = [RolloutRequest([1, 2, 3, 4, 5, 6, 7, k], sampling, request_id=f"w{k}") for k in range(workers * 4)]
        def run(rs: list) -> tuple[int, int]:
            return drive_agents(backend, rs, agents, read_now) if agents else drive(backend, rs, batch)
        run(warm)
        reqs = [RolloutRequest([1, 2, 3, 4, 5, 6, 7, k], sampling, request_id=f"r{k}") for k in range(count)]
        idle0, polls0 = [cpu_seconds(p) for p in router_pids], backend.info()["polls"]
        time.sleep(idle_s)
        idle = sum(cpu_seconds(p) - c for p, c in zip(router_pids, idle0)) / idle_s
        idle_polls = (backend.info()["polls"] - polls0) / idle_s
        info0 = backend.info()
        each0 = [cpu_seconds(p) for p in router_pids]
        cpu0 = (sum(each0), sum(cpu_seconds(p) for p in worker_pids), time.process_time())
        t0 = time.perf_counter()
        results, distinct = run(reqs)
        seconds = time.perf_counter() - t0
        each1 = [cpu_seconds(p) for p in router_pids]
        cpu1 = (sum(each1), sum(cpu_seconds(p) for p in worker_pids), time.process_time())
        info1 = backend.info()
    finally:
        backend.close()
    router, worker, client = (b - a for a, b in zip(cpu0, cpu1))
    taken = [b["requests"] - a["requests"]
             for a, b in zip(info0.get("routers", [info0]), info1.get("routers", [info1]))]
    busy = max(router - idle * seconds, 0.0)  # the router's CPU for the load itself
    polls = info1["polls"] - info0["polls"]
    polled = info1["polled_results"] - info0["polled_results"]
    # results per second of router CPU: what one router could carry with a core of its own
    return {"workers": workers, "routers": routers, "requests_by_router": taken, "agents": agents,
            "read_now": read_now,
            "router_util_each": [round((b - a) / seconds, 3) for a, b in zip(each0, each1)],
            "n": n, "requests": count, "results": results, "expected": count * n,
            "duplicates": results - distinct, "max_tokens": max_tokens,
            "step_ms": fabricate.step_s * 1e3, "tokens_per_step": fabricate.tokens_per_step, "batch": batch,
            "polls": polls, "results_per_poll": round(polled / polls, 1) if polls else None,
            "router_us_per_poll": round(1e6 * router / polls) if polls else None,
            "router_idle_us_per_poll": round(1e6 * idle / idle_polls) if idle_polls else None, "seconds": round(seconds, 3),
            "requests_per_s": round(count / seconds), "results_per_s": round(results / seconds),
            "router_cpu_s": round(router, 3), "router_util": round(router / seconds, 3),
            "router_us_per_request": round(1e6 * router / count, 1),
            "router_us_per_result": round(1e6 * router / results, 1),
            "router_results_per_cpu_s": round(results / router) if router else None,
            "router_idle_cpu_share": round(idle, 3), "router_busy_us_per_result": round(1e6 * busy / results, 1),
            "workers_us_per_result": round(1e6 * worker / results, 1),
            "client_us_per_result": round(1e6 * client / results, 1)}


def latency(rounds: int, custom: dict | None = None) -> dict:
    """Submit-to-result of one 1-token request at a time on an idle 2-worker service, and a bare actor call."""
    import ray

    from rollout_service.api.types import RolloutRequest, SamplingParams

    backend, _, _ = start(2, Fabricate(), "bench-cp-latency", custom)
    try:
        one = SamplingParams(temperature=0.0, max_tokens=1)
        worker = ray.get(backend.router.__ray_call__.remote(lambda r: r.workers[0]))
        times, now, bare = [], [], []
        for k in range(rounds + 10):
            t0 = time.perf_counter()
            list(backend.submit([RolloutRequest([1, 2, 3], one, request_id=f"l{k}")]))
            t1 = time.perf_counter()
            list(backend.submit([RolloutRequest([1, 2, 3], one, request_id=f"n{k}")], read_now=True))
            t2 = time.perf_counter()
            ray.get(worker.health.remote())
            t3 = time.perf_counter()
            if k >= 10:  # (the first calls warm the paths up)
                times.append(t1 - t0)
                now.append(t2 - t1)
                bare.append(t3 - t2)
    finally:
        backend.close()
    q = statistics.quantiles(times, n=100)
    median, with_read, call = statistics.median(times), statistics.median(now), statistics.median(bare)
    return {"rounds": rounds, "median_ms": round(1e3 * median, 2), "p90_ms": round(1e3 * q[89], 2),
            "p99_ms": round(1e3 * q[98], 2), "bare_actor_call_median_ms": round(1e3 * call, 2),
            "added_ms": round(1e3 * (median - call), 2), "read_now_median_ms": round(1e3 * with_read, 2),
            "read_now_added_ms": round(1e3 * (with_read - call), 2)}


def main(argv: list[str] | None = None) -> int:
    import ray

    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="a label of the run, kept in its meta")
    p.add_argument("--workers", default="4,16,64", help="worker counts of the results/s runs (\"\": none)")
    p.add_argument("--speedup", type=int, default=1,
                   help="each fabricating worker makes this many times W2's rate (8 workers x 8: 64 workers' results "
                        "through 8 processes, for a machine that cannot run 64)")
    p.add_argument("--routers", default="2,4", help="router counts of the extra requests/s runs (8 workers, n = 1)")
    p.add_argument("--single", default="1,2,4", help="router counts of the one-request-a-stream runs (\"\": none)")
    p.add_argument("--agents", default="8", help="client threads of the one-call-at-a-time runs, each read after "
                   "the submit and with it (\"\": none)")
    p.add_argument("--skip-small", action="store_true", help="only the W2-rate runs")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",") if w]
    w2 = Fabricate(step_s=0.0256, max_num_seqs=256 * args.speedup, tokens_per_step=10)
    runs = []
    ray.init(address="local", num_cpus=os.cpu_count(), resources={"bench_worker": max(counts + [8])},
             include_dashboard=False, log_to_driver=False, namespace="rollout_service_bench")
    try:
        lat = latency(20 if args.quick else 200)
        print(lat, flush=True)
        for workers, n in () if args.skip_small else ((2, 1), (8, 1), (8, 8)):  # n = 8: per request and result apart
            runs.append(throughput(workers, Fabricate(), (2_000 if args.quick else 20_000) // n, 1, 512, n=n))
            print(runs[-1], flush=True)
        for routers in () if args.skip_small else [int(k) for k in args.routers.split(",") if k]:
            runs.append(throughput(8, Fabricate(), 2_000 if args.quick else 20_000, 1, 512, routers=routers))
            print(runs[-1], flush=True)
        for routers in [int(k) for k in args.single.split(",") if k]:
            runs.append(throughput(8, Fabricate(), 200 if args.quick else 2_000, 1, 1, routers=routers))
            print(runs[-1], flush=True)
        for agents in [int(k) for k in args.agents.split(",") if k]:
            for read_now in (False, True):
                runs.append(throughput(8, Fabricate(), 200 if args.quick else 2_000, 1, 1, agents=agents,
                                       read_now=read_now))
                print(runs[-1], flush=True)
        for workers in counts:
            count = workers * 256 * args.speedup * (1 if args.quick else 4)
            runs.append({**throughput(workers, w2, count, 256, 256), "speedup": args.speedup})
            print(runs[-1], flush=True)
    finally:
        ray.shutdown()
    write_results(results_dir(args.out, args.quick), "control-plane", {"latency": lat}, runs, markdown, args.tag, unit=configuration)
    return 0


def configuration(row: dict) -> tuple:
    """What one row measured: a newer run's row of the same configuration replaces an older one's."""
    return (row["workers"], row["n"], row["max_tokens"], row.get("speedup", 1), row.get("routers", 1), row["batch"],
            row.get("agents", 0), row.get("read_now", False))


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    return _markdown(meta["latency"], rows)


def _markdown(lat: dict, runs: list[dict]) -> list[str]:
    lines = [f"Latency, one 1-token request at a time, idle 2-worker service, submit to result: median "
             f"{lat['median_ms']} ms, p90 {lat['p90_ms']} ms, p99 {lat['p99_ms']} ms; a bare Ray actor call "
             f"{lat['bare_actor_call_median_ms']} ms; added {lat['added_ms']} ms ({lat['rounds']} rounds)"
             + (f"; read with the submit (read_now, interleaved): median {lat['read_now_median_ms']} ms, added "
                f"{lat['read_now_added_ms']} ms." if "read_now_median_ms" in lat else "."), "",
             "Fabricating engines (benchmarks/harness/fabricated.py): 1-token answers with no step time measure "
             "requests/s; 256-token answers, 256 at a time, 10 tokens every 25.6 ms, are W2's rate per worker "
             "(100k tokens/s, ~390 results/s). A busy worker's results reach the router in batches, one poll at "
             "most every max(20 ms, workers / 500 s) (actors/recovery.py), and the router reads their headers only: the payload goes "
             "to the client (rollout_service/results/payloads.py). CPU from /proc (10 ms ticks); every process shares this machine's "
             "cores, so results/s is what the whole machine sustained and the router's CPU per result is the "
             "figure that carries to other machines. router results/CPU-s: what one router could carry with a "
             "core of its own. idle: the router's CPU share on the idle service (its long polls of every worker), "
             "taken out of the net figure. Router µs/poll: its CPU over the run per poll (idle polls apart). With several routers "
             "(each its share of the workers and of the requests, by prompt) the router figures are their sum, and each "
             "router's requests and CPU share are listed.", "",
             "| workers | routers: requests, CPU share each | n | tokens/result | fabricated step | requests (a stream) | results/s | "
             "requests/s | router CPU share "
             "(idle) | router µs/request | router µs/result (net of idle) | router results/CPU-s | workers µs/result | "
             "client µs/result | polls | results/poll | router µs/poll (idle) | lost / duplicated |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['workers']} | {_routers(r)} | {r['n']} | {r['max_tokens']} | {r['tokens_per_step']} per "
                     f"{r['step_ms']:.2f} ms | {r['requests']:,} ({r['batch']}{_agents(r)}) | "
                     f"{r['results_per_s']:,} | {r['requests_per_s']:,} | {r['router_util']:.2f} "
                     f"({r['router_idle_cpu_share']:.2f}) | {r['router_us_per_request']} | "
                     f"{r['router_us_per_result']} ({r['router_busy_us_per_result']}) | "
                     f"{r['router_results_per_cpu_s']:,} | {r['workers_us_per_result']} | "
                     f"{r['client_us_per_result']} | {r['polls']:,} | {r['results_per_poll']} | "
                     f"{r['router_us_per_poll']} ({r['router_idle_us_per_poll']}) | "
                     f"{r['expected'] - r['results'] + r['duplicates']} / "
                     f"{r['duplicates']} |")
    return lines


def _agents(row: dict) -> str:
    if not row.get("agents"):
        return ""
    return f"; {row['agents']} agents, read {'with' if row['read_now'] else 'after'} the submit"


def _routers(row: dict) -> str:
    if row.get("routers", 1) == 1:
        return "1"
    return (f"{row['routers']}: {' / '.join(f'{k:,}' for k in row['requests_by_router'])}, "
            f"{' / '.join(f'{u:.2f}' for u in row['router_util_each'])}")


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
