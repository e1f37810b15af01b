"""The router's book (actors/ledger.py) and results as headers for the router and payloads for the client
(rollout_service/results/payloads.py): a stream complete but handed payload refs is kept until its client settles it;
samples the client reports lost are missing again, to be generated anew; the per-worker loads a dispatch reads are
kept up to date. Pure Python: the ledger never reads a payload, so a plain object stands in for the ObjectRef (the
round trip through Ray, with a real node lost, is tests/test_ray_nodes.py)."""
from __future__ import annotations

import asyncio
import pickle
import random

from actors.ledger import Ledger
from rollout_service.results.payloads import pack
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult, SamplingParams


def result(job: str, index: int, versions: list[int], metadata=None) -> RolloutResult:
    n = len(versions)
    return RolloutResult(job, index, [1, 2], [5] * n, [-0.5] * n, versions, "length", metadata=metadata)


def test_pack_groups_results_by_stream_and_the_headers_say_where_each_is():
    rs = [result("a#0", 0, [3, 2]), result("b#1", 0, [4]), result("a#0", 1, []), result("c#2", 0, [1])]
    headers, payload = pack(rs, {"a#0": "s1", "b#1": "s2", "a#2": "s1"}.get)
    assert [(h.job_id, h.sample_index, h.group, h.position, h.oldest_version) for h in headers] == [
        ("a#0", 0, "s1", 0, 2), ("b#1", 0, "s2", 0, 4), ("a#0", 1, "s1", 1, None), ("c#2", 0, None, 0, 1)]
    assert set(payload) == {"s1", "s2", None}
    s1 = pickle.loads(payload["s1"])  # each group on its own: a client decodes its stream's results only
    assert [(r.request_id, r.sample_index, r.token_ids) for r in s1] == [("a#0", 0, [5, 5]), ("a#0", 1, [])]


def test_pack_takes_metadata_that_only_cloudpickle_takes():
    _, payload = pack([result("a#0", 0, [1], metadata=lambda x: x * 3)], lambda job: "s")
    assert pickle.loads(payload["s"])[0].metadata(2) == 6


def requests(n: int = 2) -> list[RolloutRequest]:
    return [RolloutRequest([1, 2, 3], SamplingParams(n=n, max_tokens=2), request_id=rid) for rid in ("r0", "r1")]


def deliver_all(ledger: Ledger, ts, payload) -> None:
    for t in ts:
        job = ledger.new_job(t, 0, 0)
        headers, _ = pack([result(job.request_id, k, [0, 0]) for k in range(2)], lambda j: "sid")
        for h in headers:
            assert ledger.is_new(h.job_id, h.sample_index) is t
            ledger.deliver_ref(t, h, payload)


def test_a_stream_handed_payloads_settles_until_its_client_says_it_fetched_them():
    ledger = Ledger()
    sid, ts = ledger.open_stream(requests())
    payload = object()
    deliver_all(ledger, ts, payload)
    assert not ledger.tracked, "every sample delivered"
    whole, batches, done, _ = asyncio.run(ledger.next_results(sid, 0.01))
    assert whole == [] and done, "complete: the client needs no other read"
    [(ref, group, entries)] = batches
    assert ref is payload and group == "sid"
    assert sorted((rid, k) for _, rid, k in entries) == [("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1)]
    assert sid in ledger.streams and ledger.open_streams() == 0, "kept (a payload may yet be lost), not open"
    ledger.settle([sid, "no-such-stream"])
    assert sid not in ledger.streams


def test_an_incomplete_stream_is_not_settled_and_a_complete_one_read_again_ends():
    ledger = Ledger()
    sid, ts = ledger.open_stream(requests())
    deliver_all(ledger, ts[:1], object())
    whole, batches, done, _ = asyncio.run(ledger.next_results(sid, 0.01))
    assert not done and len(batches[0][2]) == 2
    ledger.settle([sid])
    assert sid in ledger.streams and ledger.open_streams() == 1, "r1's samples are still to come"
    deliver_all(ledger, ts[1:], object())
    assert asyncio.run(ledger.next_results(sid, 0.01))[2]
    # a client that reads once more instead of settling (nothing lost) ends it too
    assert asyncio.run(ledger.next_results(sid, 0.01)) == ([], [], True, [])
    assert sid not in ledger.streams


def test_a_settling_stream_whose_client_is_gone_is_forgotten_quietly_at_its_lease():
    ledger = Ledger()
    done_sid, ts = ledger.open_stream(requests())
    deliver_all(ledger, ts, object())
    asyncio.run(ledger.next_results(done_sid, 0.01))
    waiting_sid, _ = ledger.open_stream(requests())
    assert ledger.expired(-1.0) == [waiting_sid], "only the stream still running is for the router to cancel"
    assert done_sid not in ledger.streams and waiting_sid in ledger.streams


def test_lost_samples_are_missing_again_and_the_stream_waits_for_them():
    ledger = Ledger()
    sid, ts = ledger.open_stream(requests())
    deliver_all(ledger, ts, object())
    assert asyncio.run(ledger.next_results(sid, 0.01))[2], "complete, settling"
    again = ledger.reopen(sid, [("r1", 0), ("r1", 1), ("r9", 0)])  # (an id the stream never had: ignored)
    assert ledger.open_streams() == 1, "incomplete again: open"
    assert [t.request.request_id for t in again] == ["r1"] and again[0].missing == 2
    assert ledger.tracked["r1"] is again[0] and again[0].worker is None  # waits for a dispatch
    assert ledger.reopen(sid, [("r1", 0)]) == [], "already missing"
    whole, batches, done, _ = asyncio.run(ledger.next_results(sid, 0.01))
    assert (whole, batches, done) == ([], [], False), "two samples to come"
    deliver_all(ledger, again, object())
    ledger.settle([sid])
    assert sid in ledger.streams and ledger.open_streams() == 1, "two samples missing again: not settled"
    whole, batches, done, _ = asyncio.run(ledger.next_results(sid, 0.01))
    assert done and sorted(k for _, rid, k in batches[0][2]) == [0, 1]
    ledger.settle([sid])
    assert sid not in ledger.streams


def test_a_lost_sample_whose_id_is_in_flight_in_another_stream_ends_with_an_error():
    ledger = Ledger()
    sid, ts = ledger.open_stream(requests(n=1)[:1])
    t = ts[0]
    job = ledger.new_job(t, 0, 0)
    [h], _ = pack([result(job.request_id, 0, [0])], lambda j: sid)
    ledger.deliver_ref(t, h, object())
    asyncio.run(ledger.next_results(sid, 0.01))
    other, _ = ledger.open_stream(requests(n=1)[:1])  # "r0" again, the first one being finished
    assert ledger.reopen(sid, [("r0", 0)]) == []
    whole, batches, done, _ = asyncio.run(ledger.next_results(sid, 0.01))
    assert done and batches == [] and whole[0].finish_reason == "abort" and "in flight again" in whole[0].error


def test_token_deltas_reach_their_stream_from_the_newest_dispatch_only():
    """A delta goes to the client's stream under the client's request id, numbered by its dispatch; a delta of
    an older dispatch (the request was generated again) or of a delivered sample is late: dropped."""
    ledger = Ledger()
    sid, [t] = ledger.open_stream(requests(n=2)[:1])
    first = ledger.new_job(t, 0, 0).request_id
    ledger.deliver_delta(TokenDelta(first, 0, 0, [7, 8], [-0.1, -0.2], [0, 0]))
    second = ledger.new_job(t, 1, 0).request_id  # its worker died: generated again elsewhere
    ledger.deliver_delta(TokenDelta(first, 0, 2, [9], [-0.3], [0]))  # late, from the dead dispatch
    ledger.deliver_delta(TokenDelta(second, 1, 0, [4], [-0.4], [0]))
    [h], _ = pack([result(second, 1, [0])], lambda j: sid)
    ledger.deliver_ref(t, h, object())
    ledger.deliver_delta(TokenDelta(second, 1, 1, [5], [-0.5], [0]))  # its sample is delivered
    *_, deltas = asyncio.run(ledger.next_results(sid, 0.01))
    assert [(d.request_id, d.sample_index, d.start, d.token_ids, d.attempt) for d in deltas] == [
        ("r0", 0, 0, [7, 8], 0), ("r0", 1, 0, [4], 1)]


def test_the_loads_kept_up_to_date_match_a_count_over_the_book():
    """Per-worker loads are kept as requests are dispatched, moved, delivered, reopened, unassigned and
    forgotten; after each step of a random run they equal the sum over the book."""
    rng, ledger, streams = random.Random(0), Ledger(), []

    def counted(n: int) -> list[int]:
        loads = [0] * n
        for t in ledger.tracked.values():
            if t.worker is not None:
                loads[t.worker] += t.cost_per_sample * t.missing
        return loads

    for step in range(400):
        op = rng.randrange(6)
        live = list(ledger.tracked.values())
        if op == 0 or not live:
            reqs = [RolloutRequest([1] * rng.randint(1, 9), SamplingParams(n=rng.randint(1, 3), max_tokens=4),
                                   request_id=f"s{step}r{k}") for k in range(rng.randint(1, 3))]
            sid, ts = ledger.open_stream(reqs)
            streams.append(sid)
            for t in ts:
                ledger.new_job(t, rng.randrange(3), 0)
        elif op == 1 and any(t.jobs for t in live):  # a result delivered
            t = rng.choice([t for t in live if t.jobs])
            k = rng.choice([i for i in range(t.request.sampling.n) if i not in t.delivered])
            [h], _ = pack([result(t.jobs[-1], k, [0])], lambda j: t.stream)
            ledger.deliver_ref(t, h, object())
        elif op in (1, 2):  # (re)submitted to a worker
            ledger.new_job(rng.choice(live), rng.randrange(3), 0)
        elif op == 3:  # no worker alive: it waits
            ledger.unassign(rng.choice(live))
        elif op == 4:  # a stream closed
            ledger.close_stream(rng.choice(streams))
        else:  # a client reports delivered samples lost
            sid = rng.choice(streams)
            s = ledger.streams.get(sid)
            if s is not None:
                ledger.reopen(sid, [(rid, 0) for rid in s.requests])
        assert ledger.loads(3) == counted(3), f"step {step}, op {op}"
