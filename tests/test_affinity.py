"""Prefix-aware routing's choice (actors/affinity.py), without Ray: the next turn of a conversation goes back to
the worker holding its history, a prefix every worker holds leaves the choice to load, a hot prefix does not
pin every request on one worker, a session stays on its worker while it lives, a restarted worker's entries are
void, and the maps stay bounded."""
from __future__ import annotations

import random

import actors.affinity as affinity
from actors.affinity import Affinity, page_keys
from rollout_service.api.types import EpisodeParams, RolloutRequest, SamplingParams

ANSWER = 32


def req(prompt, n: int = 1, session: str | None = None) -> RolloutRequest:
    metadata = None if session is None else {"session_id": session}
    return RolloutRequest(prompt, SamplingParams(n=n, max_tokens=ANSWER), metadata=metadata)


def send(a: Affinity, r: RolloutRequest, loads: list[int], live: list[int] | None = None) -> int:
    """Dispatch as the router does: choose, then count the request's cost on that worker."""
    cost = len(r.prompt) + ANSWER
    i = a.choose(r, cost, live or list(range(len(loads))), loads)
    loads[i] += cost
    return i


def test_the_turns_of_a_conversation_go_back_to_the_worker_holding_its_history():
    a, rng = Affinity(page_size=16), random.Random(0)
    histories = [[rng.randrange(1000) for _ in range(64)] for _ in range(8)]
    owner = {}
    for turn in range(4):
        loads = [0, 0]
        for e in rng.sample(range(8), 8):  # episodes arrive in any order, each turn
            if turn:
                histories[e] += [rng.randrange(1000) for _ in range(ANSWER + 48)]  # answer + observation
            i = send(a, req(histories[e]), loads)
            assert owner.setdefault(e, i) == i, f"episode {e} turn {turn} moved from worker {owner[e]} to {i}"
    assert sorted(owner.values()).count(0) in range(3, 6), "the episodes themselves are spread by load"
    assert a.counts["by_prefix"] == 8 * 3


def test_a_prefix_every_worker_holds_leaves_the_choice_to_load():
    a, rng = Affinity(page_size=16), random.Random(1)
    system = [rng.randrange(1000) for _ in range(200)]
    loads = [0, 0, 0, 0]
    for _ in range(64):  # a GRPO batch: one system prompt, then each problem's own text
        send(a, req(system + [rng.randrange(1000) for _ in range(40)]), loads)
    assert max(loads) - min(loads) <= 2 * (240 + ANSWER), loads


def test_a_hot_prefix_does_not_pin_every_request_on_one_worker():
    a = Affinity(page_size=16)
    prompt = list(range(512))
    loads = [0, 0]
    picks = [send(a, req(prompt), loads) for _ in range(40)]  # the same long prompt, 40 times
    assert picks.count(0) in range(14, 27), picks
    assert max(loads) - min(loads) <= affinity.SLACK_REQUESTS * (len(prompt) + ANSWER), loads


def test_a_forgotten_worker_draws_no_affinity():
    a = Affinity(page_size=16)
    history = list(range(300))
    assert send(a, req(history), [0, 0]) == 0
    a.forget(0)  # restarted: its cache is empty
    assert send(a, req(history + [7] * 40), [50, 0]) == 1


def test_text_chat_episodes_and_load_only():
    text = "You are a careful assistant. " * 20
    assert len(page_keys(req(text), 16)[0]) == len(text) // 64
    chat = [{"role": "system", "content": text}, {"role": "user", "content": "2+2?"}]
    assert page_keys(req(chat), 16)[0][:5] != page_keys(req(text), 16)[0][:5]
    a = Affinity(page_size=16)
    first = send(a, req(text + "first"), [0, 0])
    assert send(a, req(text + "second"), [30, 0]) == first  # (text costs count chars / 4 here too)
    episode = RolloutRequest(None, SamplingParams(max_tokens=4), episode=EpisodeParams(_Env(), 2, 64))
    assert page_keys(episode, 16) == ([], 16)
    off = Affinity(page_size=16, enabled=False)
    loads = [0, 0]
    assert [send(off, req(list(range(64))), loads) for _ in range(4)] == [0, 1, 0, 1]
    assert off.counts["by_prefix"] == 0


class _Env:
    def reset(self, metadata):
        return [1, 2]

    def step(self, text):
        return [3], 0.0, True


def test_the_map_is_bounded(monkeypatch):
    monkeypatch.setattr(affinity, "MAX_KEYS", 100)
    a = Affinity(page_size=16)
    for k in range(50):
        send(a, req([k] * 160), [0, 0])  # 10 pages each
    assert len(a._map) == 100
    assert len(page_keys(req(list(range(20_000))), 16)[0]) == affinity.MAX_PAGES


def test_a_session_stays_on_its_worker_whatever_its_load_while_that_worker_lives():
    a, rng = Affinity(page_size=16), random.Random(2)
    history = [rng.randrange(1000) for _ in range(64)]
    first = send(a, req(history, session="agent-1"), [0, 0])
    turns = []
    for turn in range(3):  # its worker is the busiest by far: a call without a session would go elsewhere
        history += [rng.randrange(1000) for _ in range(ANSWER + 48)]
        busy = [0, 0]
        busy[first] = 10_000
        turns.append(send(a, req(history, session="agent-1"), busy))
    assert turns == [first] * 3 and a.counts["by_session"] == 3
    busy = [0, 0]
    busy[first] = 10_000
    assert send(a, req(history + [5] * 40), busy) != first, "without a session the overload bound moves it"
    a.forget(first)  # its worker restarted: an empty cache, nothing to stay for
    loads = [0, 0]
    loads[first] = 500
    moved = send(a, req(history + [6] * 40, session="agent-1"), loads)
    assert moved != first
    loads[moved] = 10_000
    assert send(a, req(history + [6] * 80, session="agent-1"), loads) == moved, "pinned again, to its new worker"
    assert send(a, req(history, session="agent-1"), [0, 0], live=[first]) == first, "its worker gone from the live"
    off = Affinity(page_size=16, enabled=False)  # routing "load": no prefix, no session
    assert [send(off, req(history, session="agent-1"), [0, 0] if k % 2 else [9, 0]) for k in range(2)] == [1, 0]


def test_the_sessions_are_bounded(monkeypatch):
    monkeypatch.setattr(affinity, "MAX_SESSIONS", 10)
    a = Affinity(page_size=16)
    for k in range(30):
        send(a, req([k] * 40, session=f"s{k}"), [0, 0])
    assert list(a._sessions) == [f"s{k}" for k in range(20, 30)]  # the least recently used went first
