"""Prefix-aware routing: a request goes where the start of its prompt is likely cached, as far as load allows
(actors/dispatch.py asks `choose` for each request it sends).

The router does not tokenize (the workers do), so it reads a prompt's prefix as the client wrote it: token ids
in pages of the engine's `page_size` (the prefix cache hits whole pages), text in pages of 4 x page_size
characters (about page_size tokens), chat messages as their roles and contents in order, as text. A page's
key hashes the key before it with the page, so one key names a whole prefix. The map key -> {worker: epoch}
says which workers were sent that prefix; it holds at most MAX_KEYS keys, least recently used dropped first
(a stale entry costs a cache miss, never a wrong result), and a request records at most MAX_PAGES pages.

Choice: among the live workers that are not overloaded (outstanding tokens more than the least-loaded worker's
plus SLACK_SHARE of the mean load or the request's own cost, whichever is more), the one that was sent the
longest prefix of the prompt, the least loaded of those; with no prefix anywhere, the least loaded. So the next turn of an agent loop run by the client (its whole history as
the prompt) goes back to the worker holding that history, and a prefix every worker has seen (one system prompt
over a whole GRPO batch) leaves the choice to load. A hot prefix fills one worker only up to the overload
bound; the next request goes elsewhere and records the prefix there too. Episodes (run_episodes) run whole on
one worker already: their prompt comes from the environment there, and they go by load.

Sessions (the OpenAI endpoint's calls carry `metadata["session_id"]`): a session's first call is placed as above,
and its later calls go to the same worker whatever its load, while that worker lives, so the session's history
is always in that worker's cache and no prefill of it is repeated elsewhere. Pinning cannot pile work up by
itself (a session runs one call at a time) and the first calls are spread by load. The map session -> worker holds
at most MAX_SESSIONS sessions, least recently used dropped first (a dropped one is placed anew, by its prefix).

A worker that restarts or is replaced comes back with an empty cache: `forget(i)` bumps its epoch, which voids
its entries and its sessions at once (their next call is placed anew).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from rollout_service.api.types import RolloutRequest

MAX_KEYS = 1 << 17    # prefixes remembered (~10 MB of router memory when full)
MAX_PAGES = 512       # pages of one prompt recorded: 8192 tokens at page size 16
MAX_SESSIONS = 1 << 16  # sessions pinned to a worker (~13 MB of router memory when full, 40-character ids)
SLACK_SHARE = 0.5     # a worker this share of the mean load above the least-loaded one is overloaded ...
SLACK_REQUESTS = 1    # ... or this many times the request's cost above it, whichever is more (a burst of a
                      # few requests sharing a prefix still spreads: parallel work beats a short prefill)
CHARS_PER_TOKEN = 4   # text prompts: the router's estimate (as actors/ledger.cost_estimate)


def page_keys(request: RolloutRequest, page_size: int) -> tuple[list[int], int]:
    """The chained keys of the prompt's whole pages (at most MAX_PAGES) and the tokens one page stands for;
    no keys for an episode (its prompt comes from its environment)."""
    p = request.prompt
    if request.episode is not None or not p:
        return [], page_size
    if isinstance(p, str):
        return _chain(p, page_size * CHARS_PER_TOKEN), page_size
    if isinstance(p[0], dict):
        text = "".join(f"\x1e{m.get('role')}\x1f{m.get('content')}" for m in p)
        return _chain(text, page_size * CHARS_PER_TOKEN), page_size
    return _chain(p, page_size), page_size


def _chain(seq: Any, step: int) -> list[int]:
    keys, key = [], 0
    for start in range(0, min(len(seq) // step, MAX_PAGES) * step, step):
        key = hash((key, seq[start:start + step] if isinstance(seq, str) else tuple(seq[start:start + step])))
        keys.append(key)
    return keys


def session_of(request: RolloutRequest) -> str | None:
    """The session a request belongs to (`metadata["session_id"]`, as the OpenAI endpoint sets it), if any."""
    session = request.metadata.get("session_id") if isinstance(request.metadata, dict) else None
    return session if isinstance(session, str) else None


class Affinity:
    def __init__(self, page_size: int, enabled: bool = True):
        self.page_size, self.enabled = page_size, enabled
        self._map: OrderedDict[int, dict[int, int]] = OrderedDict()
        self._sessions: OrderedDict[str, tuple[int, int]] = OrderedDict()  # session -> (worker, its epoch)
        self._epoch: dict[int, int] = {}
        self.counts = {"by_session": 0, "by_prefix": 0, "by_load": 0, "overloaded": 0}

    def choose(self, request: RolloutRequest, cost: int, live: list[int], loads: list[int]) -> int:
        """The worker among `live` (non-empty) for `request`, whose outstanding-token cost is `cost`; records its
        prefix (and its session) there."""
        keys, tokens_per_page = page_keys(request, self.page_size) if self.enabled else ([], 0)
        session = session_of(request) if self.enabled else None
        pinned = self._pinned(session, live)
        if pinned is not None:
            self.counts["by_session"] += 1
            self._record(keys, pinned)
            return pinned
        best = self._by_prefix(keys, tokens_per_page, cost, live, loads)
        self._record(keys, best)
        if session is not None:
            self._pin(session, best)
        return best

    def _by_prefix(self, keys: list[int], tokens_per_page: int, cost: int, live: list[int], loads: list[int]) -> int:
        matched = self._matched(keys, tokens_per_page)
        least, mean = min(loads[j] for j in live), sum(loads[j] for j in live) / len(live)
        bound = least + max(SLACK_SHARE * mean, SLACK_REQUESTS * cost)
        fit = [j for j in live if loads[j] <= bound]
        best = max(fit, key=lambda j: (matched.get(j, 0), -loads[j]))  # (ties: the lowest index)
        self.counts["by_prefix" if matched.get(best, 0) else "by_load"] += 1
        if any(matched.get(j, 0) > matched.get(best, 0) for j in live if j not in fit):
            self.counts["overloaded"] += 1
        return best

    def _pinned(self, session: str | None, live: list[int]) -> int | None:
        """The worker the session is pinned to, if it still serves with the cache it had (not restarted)."""
        worker, epoch = self._sessions.get(session, (None, None)) if session is not None else (None, None)
        if worker is None or worker not in live or epoch != self._epoch.get(worker, 0):
            return None
        self._sessions.move_to_end(session)
        return worker

    def _pin(self, session: str, worker: int) -> None:
        self._sessions.pop(session, None)
        self._sessions[session] = (worker, self._epoch.get(worker, 0))
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def forget(self, i: int) -> None:
        """Worker i's cache is empty now (restarted, replaced, removed)."""
        self._epoch[i] = self._epoch.get(i, 0) + 1

    def _matched(self, keys: list[int], tokens_per_page: int) -> dict[int, int]:
        """Per worker, the tokens of the longest prefix of these keys it was sent (and has not forgotten)."""
        matched: dict[int, int] = {}
        for depth, key in enumerate(keys, 1):
            for j, epoch in self._map.get(key, {}).items():
                if epoch == self._epoch.get(j, 0):
                    matched[j] = depth * tokens_per_page
        return matched

    def _record(self, keys: list[int], worker: int) -> None:
        epoch = self._epoch.get(worker, 0)
        for key in keys:
            holders = self._map.pop(key, None) or {}
            holders[worker] = epoch
            self._map[key] = holders  # most recently used last
        while len(self._map) > MAX_KEYS:
            self._map.popitem(last=False)
