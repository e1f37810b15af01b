"""The control-plane benchmark (benchmarks/harness/control_plane.py) and its fabricating engine
(benchmarks/harness/fabricated.py): the engine keeps its timing contract, and the benchmark runs end to end
through a real Ray service (the session's cluster) at tiny sizes, every result delivered once."""
from __future__ import annotations

import os

import pytest

from benchmarks.harness.control_plane import _markdown, cpu_seconds, latency, throughput
from benchmarks.harness.fabricated import Fabricate
from rollout_service.api.types import RolloutRequest, SamplingParams

pytest_plugins = ["ray_fixtures"]

ON_ROLLOUT_NODES = {"rollout_node": 0.25}  # the session cluster's custom resource: 4 fabricating workers a node


def run_engine(engine, limit: int = 100) -> list[list]:
    """The results of each step until the engine is empty."""
    steps = []
    while engine.has_unfinished() and len(steps) < limit:
        steps.append(engine.step())
    return steps


def add(engine, rid: str, n: int, max_tokens: int) -> None:
    req = RolloutRequest([1, 2, 3], SamplingParams(n=n, max_tokens=max_tokens), request_id=rid)
    engine.add_request(req, engine.prepare(req))


def test_fabricated_samples_end_after_max_tokens_steps_with_max_num_seqs_at_a_time():
    engine = Fabricate(max_num_seqs=2)({})
    add(engine, "a", n=3, max_tokens=4)
    steps = run_engine(engine)
    # two samples run at once: two end at step 4, the third (admitted at step 5) at step 8
    assert [len(s) for s in steps] == [0, 0, 0, 2, 0, 0, 0, 1]
    results = [r for s in steps for r in s]
    assert sorted(r.sample_index for r in results) == [0, 1, 2]
    assert all(len(r.token_ids) == len(r.logprobs) == 4 and r.finish_reason == "length" for r in results)
    assert engine.stats()["generated_tokens"] == 12


def test_fabricated_samples_gain_tokens_per_step_tokens_a_step():
    engine = Fabricate(max_num_seqs=2, tokens_per_step=10)({})
    add(engine, "a", n=2, max_tokens=25)
    steps = run_engine(engine)
    assert [len(s) for s in steps] == [0, 0, 2]  # 25 tokens: 3 steps of 10
    assert all(len(r.token_ids) == 25 for r in steps[-1])


def test_fabricated_abort_returns_the_waiting_and_running_samples():
    engine = Fabricate(max_num_seqs=1)({})
    add(engine, "a", n=2, max_tokens=5)
    add(engine, "b", n=1, max_tokens=5)
    engine.step()  # a#0 runs; a#1 and b wait
    aborted = engine.abort(["a"])
    assert sorted((r.request_id, r.sample_index, r.finish_reason) for r in aborted) == [("a", 0, "abort"),
                                                                                       ("a", 1, "abort")]
    assert [(r.request_id, len(r.token_ids)) for s in run_engine(engine) for r in s] == [("b", 5)]


def test_fabricated_engine_takes_token_ids_only_and_no_weights():
    engine = Fabricate()({})
    with pytest.raises(ValueError, match="token-id prompts"):
        engine.prepare(RolloutRequest("text", SamplingParams(), request_id="t"))
    with pytest.raises(ValueError, match="no weights"):
        engine.validate_manifest(None, False)


def test_cpu_seconds_reads_this_process():
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert cpu_seconds(os.getpid()) > before


@pytest.mark.ray  # (the suite's 900 s timeout: beside two busy processes its second service took over 300 s to start)
def test_the_benchmark_runs_through_the_service_every_result_once(ray_cluster):
    row = throughput(3, Fabricate(step_s=0.001, max_num_seqs=8), count=60, max_tokens=4, batch=16, n=2,
                     custom=ON_ROLLOUT_NODES, idle_s=0.5, routers=2)
    assert (row["results"], row["expected"], row["duplicates"]) == (120, 120, 0)
    assert row["results_per_s"] > 0 and row["router_cpu_s"] >= 0 and row["workers"] == 3
    assert sum(row["requests_by_router"]) == 60 and min(row["requests_by_router"]) > 0  # both routers took some
    lat = latency(5, custom=ON_ROLLOUT_NODES)
    assert 0 < lat["bare_actor_call_median_ms"] and lat["median_ms"] <= lat["p99_ms"]
    assert lat["read_now_median_ms"] > 0  # (each round also read a request's stream with its submit)
    table = _markdown(lat, [row])
    assert "read with the submit (read_now, interleaved): median" in table[0]
    assert table[-1].startswith("| 3 | 2: ") and "| 2 | 4 | 1 per 1.00 ms | 60 (16) | " in table[-1]
    assert table[-1].endswith("| 0 / 0 |")
    assert row["polls"] > 0  # (the router counts its polls)
