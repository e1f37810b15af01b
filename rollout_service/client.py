"""RolloutClient: the one object a learner talks to, in-process (`local`) or over Ray (`launch`/`connect`).

Both modes share this class; only the connection differs (rollout_service/connections: the `Connection` protocol,
an in-process engine, a Ray service). This facade checks every argument in the caller's process and builds the
requests; the connection runs them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence as Seq

from rollout_service.connections import Connection
from rollout_service.api.checks import check_metadata, check_request_ids
from rollout_service.config import EngineConfig
from rollout_service.fidelity import check_fidelity
from rollout_service.prompts import prompt_items
from rollout_service.rewards.functions import resolve
from rollout_service.score_requests import score_requests
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import EpisodeParams, Prompt, RolloutRequest, RolloutResult, SamplingParams
from rollout_service.api.values import is_int, is_number
from rollout_service.weights.buckets import named_items
from rollout_service.weights.delta_sender import check_delta
from rollout_service.weights.transport import TRANSPORTS

if TYPE_CHECKING:
    from rollout_service.dynamic_sampling import GroupsResult


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


def _streaming(i: int, req: RolloutRequest) -> RolloutRequest:
    try:
        return replace(req, stream_tokens=True)
    except ValueError as e:
        raise ValueError(f"request {i} ({req.request_id!r}): {e}") from None


def _check_seconds(what: str, v: Any, least: float) -> None:
    if not is_number(v) or not least <= v < 1e9:  # (NaN fails too)
        raise ValueError(f"{what}={v!r} must be a number of seconds >= {least:g}")


class RolloutClient:
    """Every argument is checked here, in the caller's process: bad input is a ValueError naming it."""

    def __init__(self, connection: Connection):
        self._connection: Connection | None = connection

    @property
    def _open(self) -> Connection:
        if self._connection is None:
            raise ValueError("the rollout client is closed")
        return self._connection

    @classmethod
    def local(cls, model: Any = "smollm2-135m", backend: str = "auto", dtype: str | None = None,
              tokenizer: Any = None, reward: str | None = None, **engine_options: Any) -> "RolloutClient":
        """An in-process engine, no Ray. `model`: "smollm2-135m", a HF folder, a .gguf file or a live
        transformers CausalLM (pass `tokenizer=` for text prompts). `reward`: the default reward function
        ("module:function") for requests that name none, as ServiceConfig.reward."""
        from rollout_service.connections.local import LocalConnection
        from rollout_service.engine.engine import Engine
        if reward is not None:
            resolve(reward)
        config = EngineConfig(model=model, backend=backend, dtype=dtype, **engine_options)
        return cls(LocalConnection(Engine(config, tokenizer=tokenizer), reward=reward))

    @classmethod
    def launch(cls, config: Any, **overrides: Any) -> "RolloutClient":
        """Start a Ray rollout service (YAML path, dict or ServiceConfig) on the current Ray cluster, or on a
        local Ray instance if there is none."""
        from rollout_service.connections.ray import RayConnection
        return cls(RayConnection.start_service(config, **overrides))

    @classmethod
    def connect(cls, name: str = "rollout_service", namespace: str = "rollout_service",
                address: str | None = None) -> "RolloutClient":
        """Attach to a running, named service."""
        from rollout_service.connections.ray import RayConnection
        return cls(RayConnection.connect(name, namespace=namespace, address=address))

    @property
    def engine(self) -> Any:
        """The in-process engine (local mode only)."""
        return getattr(self._connection, "engine", None)

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
               metadata: Seq[Any] | None = None, reward: str | None = None, *, tokens: bool = False,
               read_now: bool = False) -> Iterator[RolloutResult | TokenDelta]:
        """Yield each sample's result as soon as it finishes. `reward`: a reward function
        ("module:function") the service runs on each finished result (RolloutResult.reward). `tokens`: also
        yield each running sample's new tokens as TokenDeltas, a few per engine step (per worker poll over
        Ray), before its result; the result is what counts (a sample generated again after a worker died
        starts over with the next `attempt`). `read_now`: the stream is read at once, so over Ray the call waits
        for its first results as a read would (up to a second) and saves a call to the service; leave it off
        for a stream kept for later."""
        if not isinstance(tokens, bool):
            raise ValueError(f"tokens={tokens!r}: must be a bool")
        reqs = self.requests(prompts, sampling, apply_chat_template, metadata, reward)
        if tokens:
            reqs = [_streaming(i, r) for i, r in enumerate(reqs)]
        return self._open.submit(reqs, read_now=read_now)

    def generate(self, prompts: Any, sampling: SamplingParams | None = None, apply_chat_template: bool = True,
                 metadata: Seq[Any] | None = None, reward: str | None = None) -> list[RolloutResult]:
        """All results, prompt-major: prompt 0's n samples, then prompt 1's, ... `reward`: as stream()."""
        return self._in_order(self.requests(prompts, sampling, apply_chat_template, metadata, reward))

    def score(self, sequences: Any, sampling: SamplingParams | None = None, *, apply_chat_template: bool = True,
              metadata: Seq[Any] | None = None) -> list[RolloutResult]:
        """Teacher-forced log-probs of given completions, prefill only, on the service's workers beside the
        rollouts (through the prefix cache: the completions of one prompt prefill it once). `sequences`: a
        RolloutResult or a (prompt, completion_ids) tuple, or a list of them (a result's metadata comes
        along). `sampling` (n=1, no penalties) picks the distribution as for rollouts: temperature,
        logprobs_mode, `logprobs` for top-k. One result per sequence, in their order, finish_reason
        "scored": `logprobs[i]` of completion token i, computed by the one policy version its
        `token_versions` name (the current one; a refresh during scoring starts that sequence again)."""
        return self._in_order(score_requests(sequences, sampling, apply_chat_template,
                                             None if metadata is None else list(metadata)))

    def _in_order(self, reqs: list[RolloutRequest]) -> list[RolloutResult]:
        """Every result of `reqs`, request-major (in their order), each request's samples by index."""
        order = {r.request_id: i for i, r in enumerate(reqs)}
        results = list(self._open.submit(reqs, read_now=True))
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
            if not is_int(n) or n < 1:
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
                       check_finite: bool = True, delta: bool | str = "auto") -> str:
        """Push a new policy: a dict or (name, tensor) pairs with the transformers model's parameter names.

        Every name, shape and dtype is checked on every worker before any worker swaps; the swap lands
        between two engine steps. `transport`: "auto" (CUDA IPC when the tensors are on a GPU of the workers'
        node, else a broadcast when init_weight_group() was called, else the object store), "object_store",
        "cuda_ipc" or "broadcast". `partial=True` allows a subset of the weights. Before anything moves, every
        tensor must be finite and pass the canary (each weight on a fixed unit-RMS input gives outputs within
        1e6: a finite 3e38 would turn every later token NaN; rollout_service/weights/canary.py);
        `check_finite=False` skips both. `delta`: "auto" (the object store and a broadcast send, in the engine's
        dtype, only the elements that changed since the learner's last push, bit for bit the same weights, unless
        dense pushes have been faster on this service, as on one box they can be; the learner keeps a copy of that
        push: rollout_service/weights/delta_sender.py), True (a delta whenever the base allows; refused where a
        delta can never go: partial, CUDA IPC, FP8 engines) or False (dense, as given; frees that copy). In-process the
        weights are copied in place whatever `delta` says. Returns the transport used."""
        connection = self._open
        if not isinstance(transport, str) or transport not in TRANSPORTS:
            raise ValueError(f"update_weights: transport={transport!r}; choose one of {TRANSPORTS}")
        for name, flag in (("partial", partial), ("check_finite", check_finite)):
            if not isinstance(flag, bool):
                raise ValueError(f"update_weights: {name}={flag!r} must be a bool")
        check_delta(delta)
        return connection.update_weights(named_items(named_tensors), version, transport, partial, check_finite, delta)

    # -- OpenAI-compatible endpoint (rollout_service/openai, docs/openai.md) -----------------------------
    def openai_app(self, **options: Any) -> Any:
        """An OpenAI-compatible FastAPI app in front of this client (rollout_service/openai/app.py)."""
        from rollout_service.openai import openai_app
        return openai_app(self, **options)

    def serve_openai(self, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> Any:
        """openai_app() under uvicorn (rollout_service/openai/server.py; blocks unless block=False)."""
        from rollout_service.openai import serve_openai
        return serve_openai(self, host=host, port=port, **options)

    def trajectories(self, session_ids: Any) -> list[RolloutResult]:
        """The OpenAI sessions' token-exact trajectories, one RolloutResult each (docs/openai.md)."""
        from rollout_service.openai import trajectories
        return trajectories(self, session_ids)

    def set_reward(self, session_id: str, value: float | None) -> None:
        """The reward of an OpenAI session's trajectory, returned by trajectories()."""
        from rollout_service.openai import set_reward
        set_reward(self, session_id, value)

    def release_sessions(self, session_ids: Any) -> int:
        """Forget finished OpenAI sessions (they also expire when idle); returns how many were held."""
        from rollout_service.openai import release
        return release(self, session_ids)

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

    def scale(self, num_workers: int, *, drain_s: float = 60.0, timeout_s: float | None = None) -> None:
        """Run `num_workers` rollout workers from now on (a Ray service). New ones (and replacements of workers
        given up, e.g. with their node) are placed, catch up with the current weights and join paused or asleep
        as the others are before they serve; if they cannot all be started within `timeout_s` (default: the
        config's placement.timeout_s), none is and this raises ValueError, the service as it was. Removed ones
        (the last ones first) get no new requests and finish theirs for up to `drain_s` seconds, then hand the
        rest to the other workers; nothing is lost."""
        if not is_int(num_workers) or num_workers < 1:
            raise ValueError(f"scale: num_workers={num_workers!r} must be an int >= 1")
        _check_seconds("scale: drain_s", drain_s, 0.0)
        if timeout_s is not None:
            _check_seconds("scale: timeout_s", timeout_s, 1e-3)
        self._open.scale(num_workers, float(drain_s), None if timeout_s is None else float(timeout_s))

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
        if not is_int(worker):
            raise ValueError(f"colocated_options: worker={worker!r} must be an int")
        return self._open.colocated_options(worker)

    def report_fidelity(self, version: int, report: dict) -> None:
        """Tell the service how closely the rollouts of policy `version` match the learner's log-probs (e.g.
        rollout_service.training.mismatch.logprob_mismatch: mean_abs, max_abs, kl, ratio_max, n_tokens): logged in
        one line and kept, the last 256, in info()["fidelity"]. `report`: str keys; numbers, strings, None
        or lists of those."""
        check_fidelity(version, report)
        self._open.report_fidelity(version, report)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
