"""The engine's episode runner: turns of multi-turn episodes (rollout_service/episodes.py says what an episode
is and what an environment answers) queued as ordinary engine requests, the environment asked between them.

Owns: the episodes and their running turns. May call: what `TurnEngine` declares of the engine that owns it
(queue a turn, the tokenizer, limits, the policy version, how environment code is entered).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rollout_service.engine.kv_cache import pages_for
from rollout_service.engine.routed_experts import extend_episode_routing, routing_fields
from rollout_service.episodes import Observation
from rollout_service.api.types import EpisodeParams, RolloutRequest, RolloutResult, SamplingParams
from rollout_service.api.values import is_int, is_number
from rollout_service.user_code import Guard, describe_error


class TurnEngine(Protocol):
    """What the episode runner may use of its engine (engine/engine.py)."""

    max_model_len: int
    config: Any            # page_size
    kv: Any                # blocks.num_usable: whether an episode's longest KV fits
    prompts: Any           # PromptProcessor: the turns' text in and out
    eos_ids: set[int]
    user_code: Guard       # how environment code is entered

    @property
    def policy_version(self) -> int: ...

    def add_request(self, req: RolloutRequest, seq: Any = None) -> None: ...


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """The seed of one turn of one sample of a seeded episode: its own noise stream, the same in any process."""
    digest = hashlib.blake2b(f"{seed}/{sample}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63, as SamplingParams.seed


@dataclass
class EpisodeGroup:
    """An episode request as Engine.prepare checked it: one environment copy per sample and the base seed."""

    request: RolloutRequest
    params: EpisodeParams
    environments: list[Any]
    seed: int

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling


@dataclass
class _Episode:
    group: EpisodeGroup
    sample: int
    env: Any
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)  # KV provenance (RolloutResult.kv_versions)
    mask: list[int] = field(default_factory=list)
    top: list[dict] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    routing: list[np.ndarray] | None = field(default_factory=list)  # positions [0, n) in pieces (engine/routed_experts.py)
    reward: float | None = None
    turn_id: str | None = None  # the engine request of the turn now running
    t_start: float = field(default_factory=time.time)
    t_first_token: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def where(self, method: str) -> str:
        return f"environment {type(self.env).__name__}.{method}()"


class _EnvironmentFault(Exception):
    """An environment raised or answered with something unusable: its episode ends "abort" with this text."""


class EpisodeRunner:
    """The engine's episodes. Invariant: an unfinished episode always has a turn in the engine (its next
    turn is queued in the same call that finishes the previous one), so aborting the turns ends them all."""

    def __init__(self, engine: TurnEngine):
        """`engine`: the Engine that owns these episodes, whose requests their turns are."""
        self.engine = engine
        self._groups: dict[str, list[_Episode]] = {}  # episode request id -> its unfinished episodes
        self._turns: dict[str, _Episode] = {}         # running turn's request id -> its episode

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def turn_ids(self, request_ids: list[str]) -> list[str]:
        """The running turns of these episode requests (other ids are ignored)."""
        return [ep.turn_id for rid in request_ids for ep in self._groups.get(rid, ()) if ep.turn_id]

    # ---- requests ---------------------------------------------------------------------------------------
    def prepare(self, req: RolloutRequest, seed: int) -> EpisodeGroup:
        """Check an episode request (ValueError naming what is wrong) and copy its environment per sample."""
        if req.prompt is not None:
            raise ValueError("an episode's first prompt comes from its environment's reset(metadata): "
                             "leave RolloutRequest.prompt None")
        params = dataclasses.replace(req.episode)  # its fields checked again, as they are now
        limit = min(params.max_total_tokens, self.engine.max_model_len)
        usable, ps = self.engine.kv.blocks.num_usable, self.engine.config.page_size
        if pages_for(limit, ps) > usable:
            raise ValueError(f"EpisodeParams.max_total_tokens={params.max_total_tokens}: an episode may need "
                             f"{limit} tokens of KV but the whole cache holds {usable * ps}")
        try:
            with self.engine.user_code(req.request_id, f"environment {type(params.environment).__name__} copy"):
                envs = [copy.deepcopy(params.environment) for _ in range(req.sampling.n)]
        except BaseException as e:  # whatever the object's __deepcopy__ / __reduce__ raise
            raise ValueError(f"EpisodeParams.environment: {type(params.environment).__name__} cannot be copied "
                             f"for each sample ({describe_error(e)})") from None
        return EpisodeGroup(req, params, envs, seed)

    def start(self, group: EpisodeGroup) -> list[RolloutResult]:
        """Reset each sample's environment and queue its first turn; returns the episodes that ended at once."""
        episodes = [_Episode(group, k, env) for k, env in enumerate(group.environments)]
        self._groups[group.request_id] = episodes
        out: list[RolloutResult] = []
        for ep in list(episodes):  # (an episode that ends leaves the list)
            try:
                first = _call(self.engine.user_code, ep, "reset", group.request.metadata)
                first = _observation(first, ep.where("reset"))
                ep.prompt_ids = self._first_prompt(ep, first)
            except _EnvironmentFault as e:
                out += self._end(ep, "abort", str(e))
                continue
            out += self._next_turn(ep)
        return out

    def _first_prompt(self, ep: _Episode, first: Observation) -> list[int]:
        try:
            return self.engine.prompts.encode(first, ep.group.request.apply_chat_template)
        except Exception as e:  # tokenizers and templates raise errors of their own
            raise _EnvironmentFault(f"{ep.where('reset')} returned a prompt this model cannot take: "
                                    f"{type(e).__name__}: {e}") from None

    # ---- turns ------------------------------------------------------------------------------------------
    def collect(self, results: list[RolloutResult]) -> list[RolloutResult]:
        """Engine results in, results for the caller out: a finished turn moves its episode on (the next turn
        is queued, or the episode's result comes out); every other result passes through."""
        out: list[RolloutResult] = []
        for r in results:
            ep = self._turns.pop(r.request_id, None)
            if ep is None:
                out.append(r)
                continue
            try:
                out += self._after_turn(ep, r)
            except Exception as e:  # a fault of this episode's own, not caught nearer: it alone ends
                out += self._end(ep, "abort", f"the episode failed after turn {len(ep.turns) - 1}: "
                                              f"{describe_error(e)}")
        return out

    def _limit(self, ep: _Episode) -> int:
        return min(ep.group.params.max_total_tokens, self.engine.max_model_len)

    def _next_turn(self, ep: _Episode) -> list[RolloutResult]:
        room = self._limit(ep) - ep.num_tokens
        if room <= 0:
            return self._end(ep, "length")
        sp, turn = ep.group.sampling, len(ep.turns)
        try:
            # a turn's prompt routing holds the environment's tokens' (its prefill computed them)
            sampling = dataclasses.replace(sp, n=1, max_tokens=min(sp.max_tokens, room),
                                           seed=turn_seed(ep.group.seed, ep.sample, turn),
                                           return_prompt_routed_experts=sp.return_routed_experts)
            req = RolloutRequest(prompt=ep.prompt_ids + ep.token_ids, sampling=sampling, apply_chat_template=False,
                                 request_id=f"{ep.group.request_id}/{ep.sample}/{turn}",
                                 submitted_version=ep.group.request.submitted_version)
            self.engine.add_request(req)
        except ValueError as e:
            return self._end(ep, "abort", f"turn {turn} of the episode: {e}")
        ep.turn_id = req.request_id
        self._turns[req.request_id] = ep
        return []

    def _after_turn(self, ep: _Episode, r: RolloutResult) -> list[RolloutResult]:
        ep.turn_id = None
        ep.t_first_token = ep.t_first_token or r.timings.get("first_token")
        start = len(ep.token_ids)
        version = r.token_versions[0] if r.token_versions else self.engine.policy_version
        self._append(ep, r.token_ids, r.logprobs.tolist(), r.token_versions, 1, r.top_logprobs, r.kv_versions)
        if ep.group.sampling.return_routed_experts:
            ep.routing = extend_episode_routing(ep.routing, r)
        ep.turns.append({"start": start, "end": len(ep.token_ids), "version": version,
                         "finish_reason": r.finish_reason, "reward": None})
        if r.finish_reason == "abort":
            return self._end(ep, "abort", r.error)
        eos = self.engine.eos_ids
        closed_by = r.token_ids[-1] if r.finish_reason == "stop" and r.token_ids and r.token_ids[-1] in eos else None
        try:
            obs, reward, done = _step(self.engine.user_code, ep, self.engine.prompts.decode(r.token_ids))
            ep.turns[-1]["reward"] = ep.reward = reward
            if done:
                return self._end(ep, "done")
            if len(ep.turns) >= ep.group.params.max_turns:
                return self._end(ep, "max_turns")
            ids = self._encode(ep, obs, closed_by)
        except _EnvironmentFault as e:
            return self._end(ep, "abort", str(e))
        if ep.num_tokens + len(ids) >= self._limit(ep):
            return self._end(ep, "length")  # no room for the answer and a model token after it
        last = ep.versions[-1] if ep.versions else self.engine.policy_version
        self._append(ep, ids, [0.0] * len(ids), [last] * len(ids), 0, None, None)
        return self._next_turn(ep)

    def _encode(self, ep: _Episode, obs: Observation, closed_by: int | None) -> list[int]:
        prompts = self.engine.prompts
        try:
            if isinstance(obs, str):
                return prompts.text_ids(obs)
            if isinstance(obs[0], dict):
                return prompts.chat_delta(obs, closed_by)
            return prompts.encode(obs)
        except Exception as e:  # tokenizers and templates raise errors of their own
            raise _EnvironmentFault(f"{ep.where('step')} returned an observation this model cannot take: "
                                    f"{type(e).__name__}: {e}") from None

    @staticmethod
    def _append(ep: _Episode, ids: list[int], logprobs: list[float], versions: list[int], mask: int,
                top: list[dict] | None, kv_versions: list[int] | None) -> None:
        """kv_versions None: the environment's tokens, which attended to nothing; they take their versions."""
        ep.token_ids += ids
        ep.logprobs += logprobs
        ep.versions += versions
        ep.kv_versions += kv_versions if kv_versions is not None else versions
        ep.mask += [mask] * len(ids)
        if ep.group.sampling.logprobs:
            ep.top += top if top is not None else [{} for _ in ids]

    def _end(self, ep: _Episode, reason: str, error: str | None = None) -> list[RolloutResult]:
        rid = ep.group.request_id
        if ep.turn_id is not None:
            self._turns.pop(ep.turn_id, None)
        episodes = self._groups[rid]
        episodes.remove(ep)
        if not episodes:
            del self._groups[rid]
        now = time.time()
        known = np.concatenate(ep.routing) if ep.routing else None
        routing = routing_fields(known, len(ep.prompt_ids), len(ep.token_ids), ep.group.sampling)
        return [RolloutResult(
            request_id=rid, sample_index=ep.sample, prompt_token_ids=ep.prompt_ids, token_ids=ep.token_ids,
            logprobs=ep.logprobs, token_versions=ep.versions, kv_versions=ep.kv_versions, finish_reason=reason,
            # as for an engine request: a failed turn's text is left empty (decoding may be what failed)
            text=self.engine.prompts.decode(ep.token_ids) if error is None else "",
            top_logprobs=ep.top if ep.group.sampling.logprobs else None, reward=ep.reward,
            metadata=ep.group.request.metadata, error=error, loss_mask=ep.mask, turns=ep.turns,
            timings={"queued": ep.t_start, "first_token": ep.t_first_token or now, "finished": now}, **routing)]


# ---- talking to an environment -------------------------------------------------------------------------
def _call(guard: Guard, ep: _Episode, method: str, arg: Any) -> Any:
    try:
        with guard(ep.group.request_id, ep.where(method)):
            return getattr(ep.env, method)(arg)
    except BaseException as e:  # SystemExit too: the environment's own failure ends its episode, nothing else
        raise _EnvironmentFault(f"{ep.where(method)} raised {describe_error(e)}") from None


def _step(guard: Guard, ep: _Episode, text: str) -> tuple[Observation, float, bool]:
    out = _call(guard, ep, "step", text)
    where = ep.where("step")
    if not isinstance(out, tuple) or len(out) != 3:
        raise _EnvironmentFault(f"{where} returned {_describe(out)}: expected a tuple (observation, reward, done)")
    obs, reward, done = out
    if not _finite_number(reward):
        raise _EnvironmentFault(f"{where} returned reward {_describe(reward)}: expected a finite number")
    if not isinstance(done, (bool, np.bool_)):
        raise _EnvironmentFault(f"{where} returned done {done!r:.80}: expected a bool")
    return _observation(obs, where, allow_empty=True), float(reward), bool(done)


def _observation(value: Any, where: str, allow_empty: bool = False) -> Observation:
    """`value` as text, chat messages or token ids, or _EnvironmentFault saying what it is instead."""
    if isinstance(value, str) and (value or allow_empty):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):
            return value
        if all(is_int(t) for t in value):
            return [int(t) for t in value]
    raise _EnvironmentFault(f"{where} returned {_describe(value)}: expected text, a list of chat messages "
                            "(dicts with str 'role' and 'content') or a list of token ids")


def _finite_number(value: Any) -> bool:
    """A real number that is finite as a float (an int too large for one, say 10**400, is not)."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(float(value))
    except (OverflowError, ValueError, TypeError):
        return False


def _describe(value: Any) -> str:
    try:
        text = repr(value)
    except BaseException:  # a broken __repr__, or an int of more digits than Python will print
        text = "..."
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
