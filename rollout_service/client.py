"""RolloutClient: the one object a learner talks to, in-process (`local`) or over Ray (`launch`/`connect`).

Both modes share this class; only the backend differs. A backend has: submit(requests) -> iterator of
RolloutResults as they finish, update_weights, init_weight_group, release_weight_buffers, sleep, wake_up,
pause, resume, abort, stats, info, colocated_options, report_fidelity, close.
"""
from __future__ import annotations

import logging
import numbers
import reprlib
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence as Seq

from rollout_service.config import EngineConfig
from rollout_service.rewards import RewardBook, RewardRunner, resolve
from rollout_service.types import (MAX_INT32, EpisodeParams, Prompt, RolloutRequest, RolloutResult, SamplingParams,
                                   _check_text, check_metadata, check_request_ids)
from rollout_service.weights.buckets import named_items
from rollout_service.weights.sender import TRANSPORTS

if TYPE_CHECKING:
    from rollout_service.dynamic_sampling import GroupsResult


FIDELITY_KEPT = 256  # fidelity reports a service keeps (the newest)
# What one report may hold. The service keeps FIDELITY_KEPT of them and returns them all with every info(),
# so these bound its memory and info()'s cost (a few numbers is what a report is for).
FIDELITY_MAX_KEYS = 32
FIDELITY_MAX_VALUES = 256  # numbers, strings and None in all, each item of a list counted
FIDELITY_MAX_STR = 128     # characters of a key or a string value
FIDELITY_LINE_MAX = 400    # characters of the log line of one report
_WHY_BOUNDED = (f"the service keeps the last {FIDELITY_KEPT} reports and returns them with every info(): "
                "report summary numbers, not per-token data")
_SHORT = reprlib.Repr()
_SHORT.maxlist, _SHORT.maxstring, _SHORT.maxother = 6, 40, 40


def _json_scalar(v: Any) -> Any:
    """v as a plain JSON value (numpy scalars become Python numbers), or ValueError saying what it is."""
    if v is None:
        return v
    if isinstance(v, str):
        _check_text(v, "a string")
        if len(v) > FIDELITY_MAX_STR:
            raise ValueError(f"a string of {len(v)} characters (at most {FIDELITY_MAX_STR}: {_WHY_BOUNDED})")
        return v
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        if not -2**63 <= v < 2**63:
            raise ValueError("an int outside [-2**63, 2**63)")
        return int(v)
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return float(v)
    raise ValueError(f"a {type(v).__name__}; values are numbers, strings, None or lists of those")


def check_fidelity(version: Any, report: Any) -> dict:
    """A fidelity report as the service keeps it: {"version": version, **report}, every value a plain JSON
    number, string, None or list of those, within the FIDELITY_MAX_* bounds. ValueError naming what is wrong
    (checked before anything is copied: an oversized report costs little to refuse)."""
    if not isinstance(version, numbers.Integral) or isinstance(version, bool) or not 0 <= version <= MAX_INT32:
        raise ValueError(f"report_fidelity: version={version!r} must be an int >= 0 (and < 2**31)")
    if not isinstance(report, Mapping):
        raise ValueError(f"report_fidelity: report must be a dict, got {type(report).__name__}")
    if len(report) > FIDELITY_MAX_KEYS:
        raise ValueError(f"report_fidelity: report has {len(report)} keys, at most {FIDELITY_MAX_KEYS} "
                         f"({_WHY_BOUNDED})")
    entry: dict = {"version": int(version)}
    values = 0
    for k, v in report.items():
        if not isinstance(k, str) or k == "version":
            raise ValueError(f"report_fidelity: report key {_SHORT.repr(k)}: keys are strings other than 'version' "
                             "(the version is its own argument)")
        try:
            _json_scalar(k)
        except ValueError as e:
            raise ValueError(f"report_fidelity: report key {_SHORT.repr(k)} is {e}") from None
        values += len(v) if isinstance(v, (list, tuple)) else 1
        if values > FIDELITY_MAX_VALUES:
            raise ValueError(f"report_fidelity: report[{_SHORT.repr(k)}] takes the report past "
                             f"{FIDELITY_MAX_VALUES} values (list items counted; {_WHY_BOUNDED})")
        try:
            entry[k] = [_json_scalar(x) for x in v] if isinstance(v, (list, tuple)) else _json_scalar(v)
        except ValueError as e:
            raise ValueError(f"report_fidelity: report[{_SHORT.repr(k)}] holds {e}") from None
    return entry


def fidelity_line(entry: dict) -> str:
    """One log line of at most FIDELITY_LINE_MAX characters: "fidelity of version 3: mean |dlogp| 1.2e-04,
    max 3.1e-02, KL 2e-06, max ratio 1.03 over 4096 tokens" from the keys of
    rollout_service.mismatch.logprob_mismatch (a report with none of them is written as key=value, long
    values abridged)."""
    known = {"mean_abs": "mean |dlogp| {:.1e}", "max_abs": "max {:.1e}", "kl": "KL {:.0e}",
             "ratio_max": "max ratio {:.3g}"}
    parts = [fmt.format(entry[k]) for k, fmt in known.items() if isinstance(entry.get(k), (int, float))]
    parts = parts or [f"{k}={_SHORT.repr(v)}" for k, v in entry.items() if k not in ("version", "n_tokens")]
    tokens = f" over {entry['n_tokens']} tokens" if entry.get("n_tokens") is not None else ""
    line = f"fidelity of version {entry['version']}: {', '.join(parts) or 'no measurements'}{tokens}"
    return line if len(line) <= FIDELITY_LINE_MAX else line[:FIDELITY_LINE_MAX - 3] + "..."


class LocalBackend:
    """An in-process engine stepped by the threads that read its streams (one at a time; the others pick
    up what its steps finished for them). pause() from another thread holds stepping at the next step
    boundary until resume(); a call made while paused fails instead of waiting forever. Rewards are
    computed in this process's reward threads, off the stepping thread (rollout_service/rewards.py)."""

    def __init__(self, engine: Any, reward: str | None = None):
        self.engine = engine
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._stepping = threading.Lock()
        self._cv = threading.Condition()  # guards _done and _open; notified when results are posted
        self._done: dict[str, list[RolloutResult]] = defaultdict(list)  # results not yet read by their stream
        self._open: dict[str, object] = {}  # request id -> the stream (a token) that reads its results
        self._forgotten: deque[tuple[list[str], object]] = deque()  # streams gone (filled by finalizers)
        self._reward_of = RewardBook(reward)
        self._rewards = RewardRunner(self._post)
        self.fidelity: deque[dict] = deque(maxlen=FIDELITY_KEPT)

    @property
    def reward(self) -> str | None:
        return self._reward_of.default

    def submit(self, requests: list[RolloutRequest]) -> Iterator[RolloutResult]:
        if not self._unpaused.is_set():
            raise RuntimeError("the rollout client is paused: call resume() first")
        if self.engine.is_sleeping:
            raise RuntimeError(f"the engine is asleep (sleep level {self.engine.sleep_level}): call wake_up() first")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request_id in one call")
        names = [self._reward_of.name_for(r) for r in requests]
        seqs = [self.engine.prepare(r) for r in requests]  # every request validated before any is queued
        token = object()
        with self._cv:
            self._open.update((rid, token) for rid in ids)
        for r, s, name in zip(requests, seqs, names):
            self._reward_of.add(r.request_id, name, s.sampling.n)  # before another thread can step it
            self.engine.add_request(r, s)
        stream = self._drain(set(ids), sum(s.sampling.n for s in seqs))
        # a stream gone (read or dropped) stops collecting results (deque.append: finalizers may run anywhere)
        weakref.finalize(stream, self._forgotten.append, (ids, token))
        return stream

    def _drain(self, ids: set[str], remaining: int) -> Iterator[RolloutResult]:
        while remaining:
            with self._cv:
                got = [res for rid in ids & self._done.keys() for res in self._done.pop(rid)]
            for res in got:
                remaining -= 1
                yield res
            if remaining and not got:
                if self.engine is None:
                    raise RuntimeError(f"the rollout client was closed while this stream was read: {remaining} "
                                       "of its results never came")
                self._advance(ids)

    def _advance(self, ids: set[str]) -> None:
        """Step the engine, or wait while another thread steps it (or while rewards are computed, or while
        paused or asleep: in short waits, so that a close() from another thread is seen)."""
        engine = self.engine  # (one reference for the whole step: close() may drop the backend's meanwhile)
        if engine is None or not self._unpaused.wait(0.05):
            return
        if engine.is_sleeping:  # another thread put the engine to sleep: wait for wake_up
            time.sleep(0.01)
            return
        if self._stepping.acquire(blocking=False):
            try:
                idle = not engine.has_unfinished()
                if not idle:
                    self._finished(engine.step())
            finally:
                self._stepping.release()
            if not idle:
                return
        with self._cv:  # nothing to step, or another thread steps: wait for results
            if not ids & self._done.keys():
                self._cv.wait(0.01)

    def _finished(self, results: list[RolloutResult]) -> None:
        self._post(self._rewards.finished(results, self._reward_of))

    def _post(self, results: list[RolloutResult]) -> None:
        """Hand results to the streams that read them (results nobody reads any more are dropped)."""
        with self._cv:
            while self._forgotten:
                ids, token = self._forgotten.popleft()
                for rid in ids:
                    if self._open.get(rid) is token:  # (not a later request that reuses the id)
                        del self._open[rid]
                        self._done.pop(rid, None)
            for r in results:
                if r.request_id in self._open:
                    self._done[r.request_id].append(r)
            self._cv.notify_all()

    def update_weights(self, named_tensors: Any, version: int, transport: str = "auto", partial: bool = False,
                       check_finite: bool = True) -> str:
        """The engine is in this process: every transport is an in-place copy, except a broadcast, which
        needs a weight group (there is none in-process)."""
        if transport == "broadcast":
            raise ValueError("update_weights: transport 'broadcast' needs a weight group; an in-process engine "
                             "has none (use transport='auto')")
        self.engine.update_weights(named_tensors, version, partial, check_finite)
        return "in_process"

    def init_weight_group(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("init_weight_group: an in-process engine takes weights directly; no group is needed")

    def release_weight_buffers(self) -> None:
        pass  # an in-process refresh keeps no buffers

    def weights_digests(self) -> list[str]:
        return [self.engine.weights_digest()]

    def sleep(self, level: int = 1, fail_if_asleep: bool = False) -> None:
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def pause(self) -> None:
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """As over Ray: the "abort" results (and those whose reward was still being computed) are returned
        and also end the requests' streams."""
        results = self.engine.abort(request_ids)
        for r in results:
            self._reward_of.take(r)  # (an aborted sample gets no reward; this counts it as out)
        results += self._rewards.cancel(request_ids)
        self._post(results)
        return results

    def stats(self) -> list[dict]:
        return [self.engine.stats()]

    def info(self) -> dict:
        return {"policy_version": self.engine.policy_version, "num_workers": 1, "in_flight": len(self.engine._requests),
                "colocate": False, "fidelity": [dict(e) for e in self.fidelity], "reward": self.reward,
                "reward_workers": 0}

    def colocated_options(self, worker: int) -> dict:
        raise ValueError("colocated_options: an in-process engine shares the caller's process already; "
                         "there is no worker bundle to place a learner in")

    def report_fidelity(self, version: int, report: dict) -> None:
        entry = check_fidelity(version, report)
        self.fidelity.append(entry)
        logging.getLogger(__name__).info(fidelity_line(entry))

    def close(self) -> None:
        """Drop the engine. A stream another thread is reading ends with a RuntimeError saying so (at its
        next step; a step under way finishes first), rather than looking complete with results missing."""
        self._rewards.close()
        self.engine = None
        with self._cv:
            self._cv.notify_all()


def _is_single_prompt(p: Any) -> bool:
    return isinstance(p, str) or (isinstance(p, list) and bool(p) and isinstance(p[0], (int, dict)))


def prompt_items(prompts: Any, what: str = "prompts") -> Iterable:
    """One prompt (or RolloutRequest) or many, as an iterable of them (not read yet: it may be an iterator);
    ValueError naming `what` for anything else."""
    if isinstance(prompts, RolloutRequest) or _is_single_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (bytes, Mapping)) or not isinstance(prompts, Iterable):
        raise ValueError(f"{what}: expected a prompt, a RolloutRequest or a list of them, got "
                         f"{type(prompts).__name__}")
    return prompts


def _checked_request(i: int, prompt: Any, sampling: SamplingParams, apply_chat_template: bool, metadata: Any,
                     reward: str | None) -> RolloutRequest:
    """Prompt i of a call as a checked RolloutRequest (one given as such: checked again); ValueError naming
    its index. Its metadata must pickle within the bound here, in-process too: the same call then works
    through Ray, where it travels pickled to the router and the workers."""
    try:
        if isinstance(prompt, RolloutRequest):
            return prompt.validated()
        return RolloutRequest(prompt=prompt, sampling=sampling, apply_chat_template=apply_chat_template,
                              metadata=metadata, reward=reward)
    except ValueError as e:
        what = f"request {i} ({prompt.request_id!r})" if isinstance(prompt, RolloutRequest) else f"prompt {i}"
        raise ValueError(f"{what}: {e}") from None


class RolloutClient:
    """Every argument is checked here, in the caller's process: bad input is a ValueError naming it."""

    def __init__(self, backend: Any):
        self._backend = backend

    @property
    def _open(self) -> Any:
        if self._backend is None:
            raise ValueError("the rollout client is closed")
        return self._backend

    @classmethod
    def local(cls, model: Any = "smollm2-135m", backend: str = "auto", dtype: str | None = None,
              tokenizer: Any = None, reward: str | None = None, **engine_options: Any) -> "RolloutClient":
        """An in-process engine, no Ray. `model`: "smollm2-135m", a HF folder, a .gguf file or a live
        transformers CausalLM (pass `tokenizer=` for text prompts). `reward`: the default reward function
        ("module:function") for requests that name none, as ServiceConfig.reward."""
        from rollout_service.engine.engine import Engine
        if reward is not None:
            resolve(reward)
        config = EngineConfig(model=model, backend=backend, dtype=dtype, **engine_options)
        return cls(LocalBackend(Engine(config, tokenizer=tokenizer), reward=reward))

    @classmethod
    def launch(cls, config: Any, **overrides: Any) -> "RolloutClient":
        """Start a Ray rollout service (YAML path, dict or ServiceConfig) on the current Ray cluster, or on a
        local Ray instance if there is none."""
        from rollout_service.service import RayBackend
        return cls(RayBackend.launch(config, **overrides))

    @classmethod
    def connect(cls, name: str = "rollout_service", namespace: str = "rollout_service",
                address: str | None = None) -> "RolloutClient":
        """Attach to a running, named service."""
        from rollout_service.service import RayBackend
        return cls(RayBackend.connect(name, namespace=namespace, address=address))

    @property
    def engine(self) -> Any:
        """The in-process engine (local mode only)."""
        return getattr(self._backend, "engine", None)

    def requests(self, prompts: Prompt | Seq[Prompt | RolloutRequest], sampling: SamplingParams | None = None,
                 apply_chat_template: bool = True, metadata: Seq[Any] | None = None,
                 reward: str | None = None) -> list[RolloutRequest]:
        """Normalise prompts (one or many; RolloutRequests, checked again, pass through) into RolloutRequests.
        `reward` ("module:function", imported here: ValueError if it cannot be) goes on every request built
        here and on every RolloutRequest that names no reward of its own."""
        prompts = list(prompt_items(prompts))
        if not prompts:
            raise ValueError("prompts: the list is empty")
        if metadata is not None and (not isinstance(metadata, (list, tuple)) or len(metadata) != len(prompts)):
            raise ValueError(f"metadata: expected a list with one entry per prompt ({len(prompts)}), got "
                             f"{len(metadata) if isinstance(metadata, (list, tuple)) else type(metadata).__name__}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
        sampling = (sampling or SamplingParams()).validated()
        if reward is not None:
            resolve(reward)
        reqs = [_checked_request(i, p, sampling, apply_chat_template, None if metadata is None else metadata[i],
                                 reward) for i, p in enumerate(prompts)]
        for i, r in enumerate(reqs):
            if r.reward is None and reward is not None:
                reqs[i] = r = replace(r, reward=reward)
            if r.reward is not None:
                resolve(r.reward, f"request {r.request_id!r}: reward")  # (cached: once per name)
        return reqs

    def stream(self, prompts: Any, sampling: SamplingParams | None = None, apply_chat_template: bool = True,
               metadata: Seq[Any] | None = None, reward: str | None = None) -> Iterator[RolloutResult]:
        """Yield each sample's result as soon as it finishes. `reward`: a reward function
        ("module:function") the service runs on each finished result (RolloutResult.reward)."""
        return self._open.submit(self.requests(prompts, sampling, apply_chat_template, metadata, reward))

    def generate(self, prompts: Any, sampling: SamplingParams | None = None, apply_chat_template: bool = True,
                 metadata: Seq[Any] | None = None, reward: str | None = None) -> list[RolloutResult]:
        """All results, prompt-major: prompt 0's n samples, then prompt 1's, ... `reward`: as stream()."""
        return self._in_order(self.requests(prompts, sampling, apply_chat_template, metadata, reward))

    def _in_order(self, reqs: list[RolloutRequest]) -> list[RolloutResult]:
        """Every result of `reqs`, request-major (in their order), each request's samples by index."""
        order = {r.request_id: i for i, r in enumerate(reqs)}
        results = list(self._open.submit(reqs))
        return sorted(results, key=lambda r: (order[r.request_id], r.sample_index))

    def generate_groups(self, prompts: Any, sampling: SamplingParams, keep: Any = "nonconstant", *,
                        target_groups: int, max_oversample: float = 4.0, reward: str | None = None,
                        apply_chat_template: bool = True, metadata: Any = None) -> "GroupsResult":
        """Dynamic sampling (DAPO): roll out each prompt as a group of `sampling.n` (>= 2) samples and keep
        the groups that pass `keep` ("nonconstant": rewards not all equal; or keep(group) -> bool) until
        `target_groups` are kept, drawing prompts from `prompts` (a list or any iterator of prompts or
        RolloutRequests; `metadata`: a list or iterator alongside) as needed, never more than
        ceil(max_oversample * target_groups) groups, nor more than 1024 samples per worker in flight at a time
        (prompts are drawn in bounded chunks). Groups still in flight then are aborted. Returns the kept groups
        and counts (rollout_service/dynamic_sampling.py).

        Raises (ValueError for bad input) only before any group is submitted. After that, nothing gathered is
        lost: a prompt source that fails (raises, runs short of metadata, yields a prompt that is refused)
        ends the drawing and the groups in flight are still judged; a `keep` that fails (raises, or returns
        anything but a bool) or a stream that fails ends the call. The GroupsResult then comes back with
        complete=False (unless the target was reached anyway), `reason` naming the error and `error` the
        exception."""
        from rollout_service.dynamic_sampling import generate_groups
        return generate_groups(self, prompts, sampling, keep, target_groups=target_groups,
                               max_oversample=max_oversample, reward=reward,
                               apply_chat_template=apply_chat_template, metadata=metadata)

    def run_episodes(self, envs_or_factory: Any, sampling: SamplingParams | None = None, max_turns: int = 4,
                     max_total_tokens: int = 4096, n: int | None = None, metadata: Seq[Any] | None = None,
                     reward: str | None = None, apply_chat_template: bool = True) -> list[RolloutResult]:
        """Multi-turn episodes (rollout_service/episodes.py), each run on one worker, which keeps its KV between
        turns. `envs_or_factory`: a list of environments, or a factory f(i) -> Environment called for i in
        range(n). `sampling` applies to every turn (max_tokens: one turn's answer) and runs sampling.n episodes
        per environment, each on its own copy. An episode ends when its environment says done, after
        `max_turns` model turns, or when its tokens (first prompt included) would pass `max_total_tokens`.
        `metadata`: one per environment, passed to reset() and returned on its results; `reward`: a
        "module:function" reward (RolloutRequest.reward). A seeded call gives environment i the seed
        seed + i * sampling.n, as if its episodes were samples of one request: no two episodes share a noise
        stream. Results are environment-major: environment 0's sampling.n episodes, then environment 1's, ..."""
        from rollout_service.episodes import Environment

        if isinstance(envs_or_factory, (list, tuple)) and envs_or_factory:
            envs = list(envs_or_factory)
            if n is not None and n != len(envs):
                raise ValueError(f"run_episodes: n={n!r} but {len(envs)} environments were given")
        elif callable(envs_or_factory) and not isinstance(envs_or_factory, Environment):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"run_episodes: n={n!r}: a factory needs the number of environments, an int >= 1")
            envs = [envs_or_factory(i) for i in range(n)]
        else:
            raise ValueError(f"run_episodes: expected a non-empty list of environments or a factory f(i) -> "
                             f"Environment, got {type(envs_or_factory).__name__}")
        bad = next((i for i, e in enumerate(envs) if not isinstance(e, Environment)), None)
        if bad is not None:
            raise ValueError(f"run_episodes: environment {bad} is a {type(envs[bad]).__name__}, which lacks "
                             "reset(metadata) or step(assistant_text)")
        if metadata is not None and (not isinstance(metadata, (list, tuple)) or len(metadata) != len(envs)):
            raise ValueError(f"metadata: expected a list with one entry per environment ({len(envs)})")
        for i, m in enumerate(metadata or ()):
            check_metadata(m, f"metadata[{i}] (environment {i})")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
        sampling = (sampling or SamplingParams()).validated()
        seed = sampling.seed
        reqs = [RolloutRequest(None, replace(sampling, seed=None if seed is None else (seed + i * sampling.n) % 2**63),
                               reward=reward, metadata=None if metadata is None else metadata[i],
                               apply_chat_template=apply_chat_template,
                               episode=EpisodeParams(env, max_turns, max_total_tokens))
                for i, env in enumerate(envs)]
        return self._in_order(reqs)

    def update_weights(self, named_tensors: Any, version: int, transport: str = "auto", *, partial: bool = False,
                       check_finite: bool = True) -> str:
        """Push a new policy: a dict or (name, tensor) pairs with the transformers model's parameter names.

        Every name, shape and dtype is checked on every worker before any worker swaps; the swap lands
        between two engine steps. `transport`: "auto" (CUDA IPC when the tensors are on a GPU of the workers'
        node, else a broadcast when init_weight_group() was called, else the object store), "object_store",
        "cuda_ipc" or "broadcast". `partial=True` allows a subset of the weights; `check_finite=False` lets
        NaN/inf through. Returns the transport used."""
        backend = self._open
        if not isinstance(transport, str) or transport not in TRANSPORTS:
            raise ValueError(f"update_weights: transport={transport!r}; choose one of {TRANSPORTS}")
        for name, flag in (("partial", partial), ("check_finite", check_finite)):
            if not isinstance(flag, bool):
                raise ValueError(f"update_weights: {name}={flag!r} must be a bool")
        return backend.update_weights(named_items(named_tensors), version, transport, partial, check_finite)

    def init_weight_group(self, master_address: str | None = None, backend: str = "auto",
                          timeout_s: float = 300.0) -> None:
        """Form the broadcast group: this process (rank 0) and every worker. `master_address`: this host's
        address as the workers reach it (default: the IP Ray knows this node by). `backend`: "nccl" (GPUs),
        "gloo" (CPUs, or GPUs through host memory) or "auto"."""
        self._open.init_weight_group(master_address, backend, timeout_s)

    def release_weight_buffers(self) -> None:
        """Free the buffers refreshes keep between steps (IPC and broadcast buckets, pinned host buckets,
        the workers' staging and mappings). A worker restarted afterwards waits for the next refresh."""
        self._open.release_weight_buffers()

    def weights_digests(self) -> list[str | None]:
        """Per worker, the sha256 of the weights it runs (None: worker down). Equal digests = bitwise equal
        weights: compare with `RolloutClient.local(model).weights_digests()` on the learner's weights."""
        return self._open.weights_digests()

    def sleep(self, level: int = 1, fail_if_asleep: bool = False) -> None:
        """Free the workers' device memory while a colocated learner trains. Level 1 keeps the weights in
        host memory; level 2 drops them (update_weights must come before wake_up). Sequences in flight are
        preempted and finish after wake; requests submitted meanwhile wait, or are refused with
        `fail_if_asleep=True`. Over Ray the service sleeps only while this client's process lives: if it
        dies (or this client is closed) without wake_up(), the service wakes itself `client_lease_s` later."""
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep: level={level!r} must be 1 (weights kept in host memory) or 2 (dropped)")
        if not isinstance(fail_if_asleep, bool):
            raise ValueError(f"sleep: fail_if_asleep={fail_if_asleep!r} must be a bool")
        self._open.sleep(level, fail_if_asleep)

    def wake_up(self) -> None:
        self._open.wake_up()

    def pause(self) -> None:
        self._open.pause()

    def resume(self) -> None:
        self._open.resume()

    def abort(self, request_ids: Iterable[str]) -> list[RolloutResult]:
        """Finish these requests now: their results (finish_reason "abort", tokens so far)."""
        return self._open.abort(check_request_ids(request_ids))

    def stats(self) -> list[dict]:
        """Per worker: queued, running, KV pages, tokens/s, policy version, sleep level, memory."""
        return self._open.stats()

    def info(self) -> dict:
        """The service as a whole: policy_version, num_workers, in_flight requests, colocate, fidelity (the
        last 256 reports, oldest first); over Ray also: streams, alive/awaiting/gone workers, resubmission
        counters, client_lease_s, sleep_expired (sleeps ended because their client was gone)."""
        return self._open.info()

    def colocated_options(self, worker: int = 0) -> dict:
        """Keyword arguments for `SomeActor.options(**kw)` that place an actor (a learner) in rollout worker
        `worker`'s placement-group bundle, on the half of its CPUs and GPUs that a service started with
        `colocate: true` leaves: {"num_cpus", "num_gpus", "scheduling_strategy"}. The two then share a GPU,
        taking turns with sleep() / wake_up()."""
        if not isinstance(worker, int) or isinstance(worker, bool):
            raise ValueError(f"colocated_options: worker={worker!r} must be an int")
        return self._open.colocated_options(worker)

    def report_fidelity(self, version: int, report: dict) -> None:
        """Tell the service how closely the rollouts of policy `version` match the learner's log-probs (e.g.
        rollout_service.mismatch.logprob_mismatch: mean_abs, max_abs, kl, ratio_max, n_tokens): logged in
        one line and kept, the last 256, in info()["fidelity"]. `report`: str keys; numbers, strings, None
        or lists of those."""
        check_fidelity(version, report)
        self._open.report_fidelity(version, report)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
