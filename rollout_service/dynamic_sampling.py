"""Dynamic sampling (DAPO): over-sample groups of n samples and keep those a filter passes, by default
those whose rewards are not all equal (a constant group gives GRPO no advantage to learn from).

Groups stream back as their n samples finish and are judged at once. Prompts are drawn from the source (a
list or any iterator) only as they are needed, but enough groups are kept in flight that the engine stays
busy: as many as are expected to give the groups still missing at the keep rate seen so far, with a
margin; never more than ceil(max_oversample * target_groups) in all, nor more than IN_FLIGHT_PER_WORKER
samples per worker at a time (so a huge target draws prompts in bounded chunks). Once enough are kept, the
groups still in flight are aborted, and their tokens counted.

Failures never lose what was paid for. Before any group is submitted, an error is raised (nothing ran).
After that, a source that fails (the prompt or metadata iterator raises or runs short, a drawn prompt is
refused) ends the drawing, and the groups in flight still finish and are judged; a `keep` that fails (raises,
or returns anything but a bool) or a stream that fails ends the call at once, the groups in flight aborted.
Either way the GroupsResult comes back with what was gathered, `error` the exception and `reason` naming it.

Works over any RolloutClient (in-process or Ray) through its own stream() and abort(): every submission is
one stream, read by a thread of its own into one queue.
"""
from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from rollout_service.prompts import prompts_with_metadata
from rollout_service.api.types import RolloutRequest, RolloutResult, SamplingParams
from rollout_service.api.values import is_int, is_number

Group = list[RolloutResult]

MARGIN = 1.25          # groups kept in flight, over those expected to give the groups still missing
DRAIN_TIMEOUT_S = 60.0  # after an abort, how long the aborted groups' streams may take to end
# Samples in flight per worker at most: a few times what an engine runs at once (max_num_seqs, 256 by
# default), so its queue never runs dry, while a target of millions of groups is drawn and submitted in
# chunks of a few hundred groups rather than all at once.
IN_FLIGHT_PER_WORKER = 1024
NO_LIMIT = 2**62       # a count of groups no run reaches


def nonconstant(group: Group) -> bool:
    """The group's rewards are not all equal."""
    missing = [r for r in group if r.reward is None]
    if missing:
        raise ValueError(f"keep='nonconstant': request {missing[0].request_id!r} has results without a reward "
                         "(name a reward function: generate_groups(..., reward=...) or the service's default)")
    return len({r.reward for r in group}) > 1


KEEP_FILTERS: dict[str, Callable[[Group], bool]] = {"nonconstant": nonconstant}


@dataclass
class GroupsResult:
    """What generate_groups returns. `groups`: the kept groups in the order they were kept, each its n
    results in sample_index order. Groups: submitted = kept + dropped (by the filter) + failed (a sample
    aborted or failed, or a reward error) + aborted (in flight when enough were kept, or when the call
    ended otherwise). Tokens: every result's (generated_tokens), and those of the dropped, failed and
    aborted groups (an aborted group's tokens so far). `aborted_requests`: the requests of the aborted
    groups, never judged (a learner may submit them again later). `complete`: target_groups were kept;
    otherwise `reason` says why not.

    `error`: the exception that ended the drawing of prompts or the call (None if none did; `reason` names
    it when the call ended incomplete). `unsubmitted`: the (prompt, metadata) pairs drawn from the source
    but never submitted, because the chunk they were drawn in was refused. `unjudged`: the group `keep`
    failed on (counted as failed)."""

    groups: list[Group] = field(default_factory=list)
    target_groups: int = 0
    submitted: int = 0
    kept: int = 0
    dropped: int = 0
    failed: int = 0
    aborted: int = 0
    generated_tokens: int = 0
    dropped_tokens: int = 0
    failed_tokens: int = 0
    aborted_tokens: int = 0
    seconds: float = 0.0
    complete: bool = False
    reason: str | None = None
    aborted_requests: list[RolloutRequest] = field(default_factory=list)
    error: BaseException | None = None
    unsubmitted: list[tuple[Any, Any]] = field(default_factory=list)
    unjudged: list[Group] = field(default_factory=list)


def generate_groups(client: Any, prompts: Any, sampling: SamplingParams, keep: Any = "nonconstant", *,
                    target_groups: int, max_oversample: float = 4.0, reward: str | None = None,
                    apply_chat_template: bool = True, metadata: Any = None) -> GroupsResult:
    """See RolloutClient.generate_groups. `prompts`: a list or an iterator of prompts or RolloutRequests
    (a RolloutRequest keeps its own sampling, n >= 2 too, and its own reward if it names one); `metadata`:
    None, or a list or iterator with one entry per prompt. Raises (ValueError for bad input) only before any
    group was submitted; after that, failures come back on the GroupsResult (module docstring)."""
    keep_fn = _keep_filter(keep)
    _check_counts(target_groups, max_oversample)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"generate_groups: sampling must be a SamplingParams, got {type(sampling).__name__}")
    _check_group_size(sampling.n, "sampling")
    source = prompts_with_metadata(prompts, metadata, target_groups, "generate_groups")
    info = client.info()
    default_reward = info.get("reward") if keep_fn is nonconstant else None
    cap = max(2, int(info.get("num_workers") or 1) * IN_FLIGHT_PER_WORKER // sampling.n)

    def build(items: list[tuple[Any, Any]]) -> list[RolloutRequest]:
        reqs = client.requests([p for p, _ in items], sampling, apply_chat_template, [m for _, m in items], reward)
        for r in reqs:
            _check_group_size(r.sampling.n, f"request {r.request_id!r}: sampling")
            if keep_fn is nonconstant and r.reward is None and default_reward is None:
                raise ValueError("generate_groups: keep='nonconstant' compares rewards, and none would be "
                                 "computed: pass reward='module:function' or start the service with a default "
                                 "reward (ServiceConfig.reward / RolloutClient.local(reward=...))")
        return reqs

    return _Run(client, source, build, keep_fn, target_groups, _budget(max_oversample, target_groups), cap).run()


def _budget(max_oversample: float, target_groups: int) -> int:
    """ceil(max_oversample * target_groups): the groups a call may submit (NO_LIMIT past what a run reaches,
    where the product would overflow a float)."""
    if target_groups >= NO_LIMIT or max_oversample >= NO_LIMIT / target_groups:
        return NO_LIMIT
    return math.ceil(max_oversample * target_groups - 1e-9)  # (4.0 * 3 is 12, not 12.000000000000002)


def _keep_filter(keep: Any) -> Callable[[Group], bool]:
    if isinstance(keep, str) and keep in KEEP_FILTERS:
        return KEEP_FILTERS[keep]
    if callable(keep) and not isinstance(keep, str):
        return keep
    raise ValueError(f"generate_groups: keep={keep!r}: must be a callable keep(group) -> bool or one of "
                     f"{sorted(KEEP_FILTERS)}")


def _check_counts(target_groups: Any, max_oversample: Any) -> None:
    if not is_int(target_groups) or target_groups < 1:
        raise ValueError(f"generate_groups: target_groups={target_groups!r} must be an int >= 1")
    if (not is_number(max_oversample)
            or (isinstance(max_oversample, float) and not math.isfinite(max_oversample)) or max_oversample < 1):
        raise ValueError(f"generate_groups: max_oversample={max_oversample!r} must be a number >= 1 (groups "
                         "submitted at most, per group wanted)")


def _check_group_size(n: int, what: str) -> None:
    if n < 2:
        raise ValueError(f"generate_groups: {what}.n={n}: a group needs n >= 2 samples to compare")


@dataclass
class _Group:
    request: RolloutRequest
    results: dict[int, RolloutResult] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.results) == self.request.sampling.n

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results.values())

    def ordered(self) -> Group:
        return [self.results[i] for i in sorted(self.results)]


@dataclass
class _End:
    """A stream ended (with the exception that ended it, if one did)."""

    error: BaseException | None = None


class _Stop(Exception):
    """Nothing more can be judged (keep failed, or a stream did): the call ends now."""

    def __init__(self, why: str, error: BaseException):
        super().__init__(why)
        self.why, self.error = why, error


class _Run:
    def __init__(self, client: Any, source: Iterator, build: Callable[[list], list[RolloutRequest]],
                 keep: Callable[[Group], bool], target: int, budget: int, cap: int):
        self.client, self.source, self.build, self.keep = client, source, build, keep
        self.target, self.budget, self.cap = target, budget, cap
        self.out = GroupsResult(target_groups=target)
        self.in_flight: dict[str, _Group] = {}
        self.events: queue.Queue = queue.Queue()
        self.streams = 0        # streams whose reading thread has not ended yet
        self.exhausted = False  # the source has no more prompts (or failed)
        self.drawn = 0          # prompts drawn from the source
        self.why: str | None = None  # why the source failed, or the call ended early

    def run(self) -> GroupsResult:
        t0 = time.perf_counter()
        try:
            self._loop()
        except _Stop as stop:
            self._fail(stop.why, stop.error)
            self._stop(quiet=True)  # (the service may be what failed: the abort must not hide why)
        except BaseException:
            self._stop(quiet=True)  # nothing of this call stays running
            raise
        else:
            self._stop()
        out = self.out
        out.seconds = time.perf_counter() - t0
        out.complete = out.kept >= self.target
        if not out.complete:
            out.reason = self.why or (f"the prompts ran out after {out.submitted} groups" if self.exhausted else
                                      f"max_oversample allowed {self.budget} groups, all submitted")
        return out

    def _loop(self) -> None:
        while self.out.kept < self.target:
            self._top_up()
            if not self.in_flight:
                break
            self._on_event(self.events.get())
            # judge everything that has arrived before the next top-up: results come in bursts (a batch
            # finishes together), and a keep rate from the first few groups of one is noise
            while self.out.kept < self.target and not self.events.empty():
                self._on_event(self.events.get())

    def _fail(self, why: str, error: BaseException) -> None:
        if self.out.error is None:
            self.out.error, self.why = error, why

    # -- submitting ---------------------------------------------------------------------------------
    def _wanted(self) -> int:
        """Groups to have in flight: those expected to give the ones still missing, at the keep rate so far
        (Laplace's rule: one half before any group has finished), with a margin; at most `cap`."""
        out = self.out
        missing = min(self.target - out.kept, self.cap)
        rate = (out.kept + 1) / (out.kept + out.dropped + out.failed + 2)
        return min(max(missing, math.ceil(missing / rate * MARGIN)), self.cap)

    def _top_up(self) -> None:
        wanted = self._wanted()
        more = min(wanted - len(self.in_flight), self.budget - self.out.submitted)
        if more <= 0 or self.exhausted:
            return
        # no dribbles of one group per submission while enough are in flight to finish (or, capped, to keep
        # the engine busy: then top up by an eighth of the cap at least)
        busy = min(self.target - self.out.kept, wanted - wanted // 8)
        if more < max(1, wanted // 8) and len(self.in_flight) >= busy:
            return
        items, error = self._draw(more)
        if items:
            try:
                self._submit(items)
            except Exception as e:
                if not self.out.submitted:
                    raise  # nothing ran yet: the call itself is refused
                self.out.unsubmitted += items
                self.exhausted = True
                first = self.drawn - len(items)
                return self._fail(f"prompts {first}..{self.drawn - 1} of the source, drawn as one chunk, were "
                                  f"refused: {type(e).__name__}: {e}", e)
        if error is not None:
            if not self.out.submitted:
                raise error
            self.exhausted = True
            self._fail(f"the prompt source failed after {self.drawn} prompts: {type(error).__name__}: {error}",
                       error)

    def _draw(self, k: int) -> tuple[list[tuple[Any, Any]], BaseException | None]:
        """Up to k (prompt, metadata) pairs, and the exception the source raised, if it did (the pairs drawn
        before it are kept)."""
        items: list[tuple[Any, Any]] = []
        try:
            for item in itertools.islice(self.source, k):
                items.append(item)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # the source's own failure, SystemExit too
            self.drawn += len(items)
            return items, e
        self.drawn += len(items)
        self.exhausted = len(items) < k
        return items, None

    def _submit(self, items: list[tuple[Any, Any]]) -> None:
        reqs = self.build(items)
        stream = self.client.stream(reqs)
        self.in_flight.update((r.request_id, _Group(r)) for r in reqs)
        self.out.submitted += len(reqs)
        self.streams += 1
        threading.Thread(target=self._read, args=(stream,), name="dynamic-sampling-stream", daemon=True).start()

    def _read(self, stream: Iterator[RolloutResult]) -> None:
        try:
            for r in stream:
                self.events.put(r)
        except BaseException as e:
            self.events.put(_End(e))
        else:
            self.events.put(_End())

    # -- judging ------------------------------------------------------------------------------------
    def _on_event(self, ev: RolloutResult | _End) -> None:
        if isinstance(ev, _End):
            self.streams -= 1
            if ev.error is not None:
                raise _Stop(f"a stream failed: {type(ev.error).__name__}: {ev.error}", ev.error)
            return
        g = self.in_flight.get(ev.request_id)
        if g is None:
            return
        g.results[ev.sample_index] = ev
        if g.complete:
            del self.in_flight[ev.request_id]
            self._judge(g)

    def _judge(self, g: _Group) -> None:
        out, group, tokens = self.out, g.ordered(), g.tokens
        out.generated_tokens += tokens
        if any(r.finish_reason == "abort" or r.error is not None or r.reward_error is not None for r in group):
            out.failed += 1
            out.failed_tokens += tokens
        elif self._keeps(group):
            out.kept += 1
            out.groups.append(group)
        else:
            out.dropped += 1
            out.dropped_tokens += tokens

    def _keeps(self, group: Group) -> bool:
        """keep(group), which must be a bool; a keep that fails ends the call (the group counted as failed).
        keep judges a copy: a kept group is always all n samples, whatever keep did to the list it got."""
        try:
            verdict = self.keep(list(group))
            if not isinstance(verdict, (bool, np.bool_)):
                raise ValueError(f"keep returned {verdict!r:.80} (a {type(verdict).__name__}), not a bool")
        except KeyboardInterrupt:  # Ctrl-C in the caller's process: the caller's, not keep's
            raise
        except BaseException as e:  # SystemExit too: keep's own failure
            self.out.failed += 1
            self.out.failed_tokens += sum(len(r.token_ids) for r in group)
            self.out.unjudged.append(group)
            raise _Stop(f"keep failed on request {group[0].request_id!r}: {type(e).__name__}: {e}", e) from e
        return bool(verdict)

    # -- stopping -----------------------------------------------------------------------------------
    def _stop(self, quiet: bool = False) -> None:
        """Abort the groups in flight, collect what they had generated, and wait for every stream to end.
        `quiet`: another exception is on its way out; do not let one from here replace it."""
        aborting, self.in_flight = self.in_flight, {}
        try:
            if aborting:
                for r in self.client.abort(list(aborting)):
                    if r.request_id in aborting:
                        aborting[r.request_id].results.setdefault(r.sample_index, r)
            self._drain(aborting)
        except Exception:
            if not quiet:
                raise
        for g in aborting.values():
            self.out.aborted_requests.append(g.request)
            self.out.aborted += 1
            self.out.aborted_tokens += g.tokens
            self.out.generated_tokens += g.tokens

    def _drain(self, aborting: dict[str, _Group]) -> None:
        """The streams deliver the aborted groups' results too (and those that finished before the abort):
        read them until every stream has ended."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.streams:
            try:
                ev = self.events.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:  # a stream that does not end: its thread reads on, unheeded
                return
            if isinstance(ev, _End):
                self.streams -= 1
            elif ev.request_id in aborting:
                aborting[ev.request_id].results.setdefault(ev.sample_index, ev)
