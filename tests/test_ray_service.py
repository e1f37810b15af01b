"""The Ray rollout service on a real local Ray cluster: 2 CPU workers with a tiny random Llama.

Tests run in file order on one service: the fault test (which restarts a worker) comes last."""
from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import ray
import torch

from ray_fixtures import cpu_engine
from test_token_stream import check_previews
from rollout_service.client import RolloutClient
from rollout_service.api.types import RolloutRequest, RolloutResult, SamplingParams

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def client(ray_cluster, service_config):
    with RolloutClient.launch(service_config(name="svc-main")) as c:
        yield c


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    with cpu_engine(tiny_model_dir, num_pages=256) as c:
        yield c


def _prompts(k: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(k)]


def _requests(prompts, **sampling) -> list[RolloutRequest]:
    return [RolloutRequest(p, SamplingParams(seed=100 + i, **sampling), request_id=f"q{i}")
            for i, p in enumerate(prompts)]


def test_seeded_results_equal_local_client(client, local):
    torch.manual_seed(0)
    prompts = _prompts(12)
    for sampling in (dict(n=3, temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True),
                     dict(n=1, temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)):
        got = client.generate(_requests(prompts, **sampling))
        want = local.generate(_requests(prompts, **sampling))
        assert [(r.request_id, r.sample_index) for r in got] == [(r.request_id, r.sample_index) for r in want]
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids and g.prompt_token_ids == w.prompt_token_ids
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
            assert g.token_versions == [0] * len(g.token_ids) and g.finish_reason == w.finish_reason
            assert (g.top_logprobs is None) == (w.top_logprobs is None)
    # least-outstanding-tokens dispatch used both workers
    assert all(s["generated_tokens"] > 0 for s in client.stats())


def test_score_through_the_service_equals_local(client, local):
    """client.score over Ray: the workers' prefill scores of rollouts and pairs, in order, as in-process."""
    rollouts = client.generate(_requests(_prompts(4, seed=3), n=2, temperature=1.0, max_tokens=8, ignore_eos=True))
    pairs = [(p, list(range(5, 5 + len(p) % 7 + 1))) for p in _prompts(3, seed=4)]
    sampling = SamplingParams(temperature=0.7, logprobs=2)
    got, want = client.score(rollouts + pairs, sampling), local.score(rollouts + pairs, sampling)
    assert len(got) == len(want) == 11
    for g, w in zip(got, want):
        assert g.finish_reason == "scored" and (g.prompt_token_ids, g.token_ids) == (w.prompt_token_ids, w.token_ids)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
        assert set(g.token_versions) == {0} and list(g.top_logprobs[0]) == list(w.top_logprobs[0])
    with pytest.raises(ValueError, match="n=3"):
        client.score(pairs, SamplingParams(n=3))
    assert client.score(pairs[:1])[0].finish_reason == "scored"  # still serving


def test_stream_yields_each_result_once_as_it_finishes(client):
    short = [RolloutRequest(p, SamplingParams(n=2, max_tokens=2, ignore_eos=True), request_id=f"s{i}")
             for i, p in enumerate(_prompts(4, seed=1))]
    long = [RolloutRequest(p, SamplingParams(n=1, max_tokens=300, ignore_eos=True), request_id=f"l{i}")
            for i, p in enumerate(_prompts(2, seed=2))]
    arrivals = []
    for r in client.stream(long + short):
        arrivals.append((r, time.time()))
    keys = [(r.request_id, r.sample_index) for r, _ in arrivals]
    assert sorted(keys) == sorted([(f"s{i}", j) for i in range(4) for j in range(2)] + [("l0", 0), ("l1", 0)])
    assert len(set(keys)) == len(keys)
    first_long_done = min(r.timings["finished"] for r, _ in arrivals if r.request_id.startswith("l"))
    short_seen = [t for r, t in arrivals if r.request_id.startswith("s")]
    assert max(short_seen) < first_long_done, "short results must reach the client before the long ones finish"
    assert all(len(r.token_ids) == 300 for r, _ in arrivals if r.request_id.startswith("l"))


def test_token_deltas_come_through_the_router_before_their_results(client, local):
    """stream(..., tokens=True) over Ray: the workers' deltas reach the client in order, before their results,
    and are the results' slices; the results are those of the in-process engine."""
    reqs = _requests(_prompts(4, seed=5), n=2, temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=1)
    items = list(client.stream(reqs, tokens=True))
    results = sorted((x for x in items if isinstance(x, RolloutResult)), key=lambda r: (r.request_id, r.sample_index))
    assert [r.token_ids for r in results] == [r.token_ids for r in local.generate(reqs)]
    assert check_previews(items, results) >= 8, "deltas came while the samples ran"


def test_pause_resume_abort(client):
    client.pause()
    it = client.stream([RolloutRequest([5, 6, 7], SamplingParams(max_tokens=4), request_id="p0"),
                        RolloutRequest([8, 9], SamplingParams(n=2, max_tokens=400, ignore_eos=True),
                                       request_id="p1")])
    time.sleep(0.3)
    s1 = client.stats()
    time.sleep(0.3)
    s2 = client.stats()
    assert all(s["paused"] for s in s2) and sum(s["queued"] + s["running"] for s in s2) == 2
    assert [s["steps"] for s in s1] == [s["steps"] for s in s2], "a paused service must not step"
    client.resume()
    first = next(it)
    assert first.request_id == "p0" and len(first.token_ids) == 4
    aborted = client.abort(["p1", "unknown-id"])
    rest = list(it)
    assert sorted(r.sample_index for r in rest) == [0, 1] and all(r.finish_reason == "abort" for r in rest)
    assert all(len(r.token_ids) < 400 for r in rest)
    assert sorted((r.request_id, r.sample_index) for r in aborted) == [("p1", 0), ("p1", 1)]
    assert sum(s["running"] + s["queued"] for s in client.stats()) == 0


def _bad_records(rng: np.random.Generator, k: int) -> list:
    """k malformed requests: fuzzed sampling values, empty/over-long/out-of-vocab prompts, garbage bytes."""
    bad_values = {"n": [0, -3, 1.5, "2", 10**9], "temperature": [-1.0, float("nan"), float("inf"), 1e9, "hot"],
                  "top_p": [0.0, -0.5, 1.5], "top_k": [0, -2, 2.5], "max_tokens": [0, -1, None],
                  "min_p": [-0.1, 2.0], "repetition_penalty": [0.0, -1.0], "logprobs": [-1, 21],
                  "seed": [-5, 2**63], "logprobs_mode": ["bogus"], "stop": [[""], [3]], "bogus_field": [1]}
    out = []
    for i in range(k):
        kind = i % 6
        if kind == 0:
            field = list(bad_values)[rng.integers(len(bad_values))]
            vals = bad_values[field]
            rec = {"prompt": [1, 2, 3], "sampling": {field: vals[rng.integers(len(vals))]}}
            out.append(msgpack.packb({"schema": 1, "kind": "request", **rec}))
        elif kind == 1:
            out.append({"prompt": [] if i % 2 else ""})
        elif kind == 2:
            out.append({"prompt": rng.integers(1, 256, 600).tolist()})       # longer than max_model_len 512
        elif kind == 3:
            out.append({"prompt": [1, 2, int(rng.integers(256, 10**6))]})   # out of vocabulary
        elif kind == 4:
            out.append(rng.bytes(int(rng.integers(0, 64))))                  # garbage msgpack
        else:
            out.append(msgpack.packb({"schema": 1, "kind": "request", "prompt": [1], "sampling": 7}))
    return out


def test_fuzzed_bad_requests_get_clear_errors_and_good_ones_return(client):
    rng = np.random.default_rng(0)
    bad = _bad_records(rng, 1000)
    good_streams = []
    for i, rec in enumerate(bad):
        with pytest.raises(ValueError) as e:
            client._connection.submit([rec])
        assert str(e.value).startswith("request 0: ") and len(str(e.value)) > 15, str(e.value)
        if i % 100 == 0:  # good requests interleaved with the bad ones, still in flight meanwhile
            req = RolloutRequest([1 + i % 200, 2, 3], SamplingParams(n=2, max_tokens=8, ignore_eos=True),
                                 request_id=f"good{i}")
            good_streams.append(client._connection.submit([req.to_msgpack()]))
    results = [r for s in good_streams for r in s]
    assert sorted((r.request_id, r.sample_index) for r in results) == \
        sorted((f"good{i}", j) for i in range(0, 1000, 100) for j in range(2))
    assert all(len(r.token_ids) == 8 and r.finish_reason == "length" for r in results)
    # a batch with one bad request is refused as a whole, naming it
    with pytest.raises(ValueError, match="request 1: .*temperature"):
        client._connection.submit([{"prompt": [1, 2]}, {"prompt": [1], "sampling": {"temperature": -2}}])
    info = client._connection.info()
    assert info["in_flight"] == 0 and info["streams"] == 0, info


def test_a_one_request_stream_takes_one_read_and_the_router_forgets_it_when_told(client, monkeypatch):
    """Its result comes as a payload to fetch: the read that completes the stream ends it for the client, and the
    client's lease thread tells the router, which keeps the stream till then (a lost payload is reported on a read)."""
    from rollout_service.results import stream as streams
    reads, take = [], streams.ResultStream.take  # per read: (results in it, stream complete)
    monkeypatch.setattr(streams.ResultStream, "take",
                        lambda s, reply: reads.append((len(reply[0]) + len(reply[1]), reply[2])) or take(s, reply))
    conn = client._connection
    s = conn.submit([RolloutRequest([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), request_id="one")])
    [r] = list(s)
    assert (r.request_id, len(r.token_ids)) == ("one", 4)
    # (a read may time out empty on a busy box first; the one that brings the result must be the last)
    assert reads[-1] == (1, True) and all(got == 0 and not done for got, done in reads[:-1]), reads
    assert conn.info()["streams"] == 0, "read whole: not open"
    deadline = time.monotonic() + 60
    while ray.get(conn.router.__ray_call__.remote(lambda router, sid=s.sid: sid in router.ledger.streams)):
        assert time.monotonic() < deadline, "the router never heard the stream was read"
        time.sleep(0.1)


def test_a_call_that_reads_at_once_gets_its_first_read_with_the_submit(client, monkeypatch):
    """generate() reads at once: the router answers its submit with the stream's first read too, so a one-request
    call needs no read of its own (on a busy box that first read may time out empty: then reads follow). A
    stream() kept for later reads as before."""
    from rollout_service.results import stream as streams
    events, ask, take = [], streams.ResultStream.ask, streams.ResultStream.take
    monkeypatch.setattr(streams.ResultStream, "ask", lambda s: events.append("ask") or ask(s))
    monkeypatch.setattr(streams.ResultStream, "take",
                        lambda s, reply: events.append(len(reply[0]) + len(reply[1])) or take(s, reply))
    [r] = client.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(r.token_ids) == 4
    assert events[0] != "ask" and (events == [1] or events[0] == 0), events
    events.clear()
    assert len(list(client.stream([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True)))) == 1
    assert events[0] == "ask", events


def test_refresh_bad_is_refused_everywhere_good_one_switches_version(client, local, make_tiny_llama,
                                                                   refresh_mid_generation):
    new = make_tiny_llama(seed=1).state_dict()
    before = client.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    bad = dict(new)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    with pytest.raises(ValueError, match="up_proj.*shape"):
        client.update_weights(bad, 1)
    assert [s["policy_version"] for s in client.stats()] == [0, 0]
    again = client.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert again[0].token_ids == before[0].token_ids

    # a good refresh lands while long requests are in flight: they continue, token_versions show it
    it = client.stream([RolloutRequest([9, 8, 7], SamplingParams(max_tokens=400, ignore_eos=True),
                                       request_id=f"inflight{i}") for i in range(2)])
    refresh_mid_generation(client, new, 1)
    inflight = list(it)
    assert [s["policy_version"] for s in client.stats()] == [1, 1]
    for r in inflight:
        v = r.token_versions
        assert v == sorted(v) and v[-1] == 1 and set(v) <= {0, 1}
    assert any(r.token_versions[0] == 0 for r in inflight), "the refresh should land mid-generation"

    after = client.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert after[0].token_versions == [1] * 8 and after[0].token_ids != before[0].token_ids
    local.update_weights(new, 1)
    want = local.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert after[0].token_ids == want[0].token_ids
    with pytest.raises(ValueError, match="version"):
        client.update_weights(new, 1)  # versions only go forward
    # the router passed refreshes and results on without loading torch (tests/test_layers.py says why)
    router = client._connection.router
    assert not ray.get(router.__ray_call__.remote(lambda _: "torch" in __import__("sys").modules))


def test_worker_killed_mid_batch_all_results_once_and_restarted_worker_catches_up(client, make_tiny_llama):
    backend = client._connection
    version = backend.info()["policy_version"] + 1
    client.update_weights(make_tiny_llama(seed=2).state_dict(), version)  # the restarted worker must catch up
    workers = ray.get(backend.router.__ray_call__.remote(lambda router: router.workers))
    lengths = [20 + 30 * i for i in range(10)]  # staggered: the first result comes while the rest still run
    reqs = [RolloutRequest(p, SamplingParams(n=2, max_tokens=lengths[i], ignore_eos=True, seed=i), request_id=f"k{i}")
            for i, p in enumerate(_prompts(10, seed=3))]
    it = client.stream(reqs, tokens=True)  # (the deltas of a request generated again: tests/test_ledger.py)
    items = []
    while not any(isinstance(x, RolloutResult) for x in items):
        items.append(next(it))
    ray.kill(workers[0], no_restart=False)  # Ray restarts it (max_restarts) with an empty engine
    items += list(it)
    got = [x for x in items if isinstance(x, RolloutResult)]
    newest = {}
    for d in (x for x in items if not isinstance(x, RolloutResult)):
        newest[d.request_id, d.sample_index] = max(d.attempt, newest.get((d.request_id, d.sample_index), 0))
    assert max(newest.values()) >= 1, "the requests of the killed worker streamed again from their next attempt"
    check_previews([x for x in items if isinstance(x, RolloutResult)
                    or x.attempt == newest[x.request_id, x.sample_index]], got)
    keys = [(r.request_id, r.sample_index) for r in got]
    assert len(keys) == len(set(keys)) == 20
    assert all(len(r.token_ids) == lengths[int(r.request_id[1:])] for r in got)
    info = backend.info()
    assert info["worker_deaths"] >= 1 and info["resubmitted"] >= 1
    deadline = time.time() + 60
    while not all(backend.info()["alive"]) and time.time() < deadline:
        time.sleep(0.5)
    stats = client.stats()
    assert all(s["alive"] for s in stats) and [s["policy_version"] for s in stats] == [version, version]
    more = client.generate(_requests(_prompts(6, seed=4), n=1, max_tokens=4))
    assert len(more) == 6 and all(r.token_versions == [version] * 4 for r in more)


def test_on_refresh_abort_ends_in_flight_requests(ray_cluster, service_config, make_tiny_llama, refresh_mid_generation):
    from rollout_service.connections.ray import RayConnection
    cfg = service_config(name="svc-abort-on-refresh", num_workers=1)
    cfg["engine"] = {**cfg["engine"], "on_refresh": "abort"}
    backend = RayConnection.start_service(cfg)
    try:
        it = backend.submit([RolloutRequest([4, 5, 6], SamplingParams(n=2, max_tokens=400, ignore_eos=True),
                                            request_id="r")])
        refresh_mid_generation(backend, make_tiny_llama(seed=5).state_dict(), 1)
        results = list(it)
        assert sorted(r.sample_index for r in results) == [0, 1]
        assert all(r.finish_reason == "abort" and 0 < len(r.token_ids) < 400 for r in results)
        assert all(set(r.token_versions) == {0} for r in results)
        fresh = list(backend.submit([RolloutRequest([4, 5, 6], SamplingParams(max_tokens=3))]))
        assert fresh[0].token_versions == [1, 1, 1] and fresh[0].finish_reason == "length"
    finally:
        backend.close()
