"""Public request/result types and their msgpack wire format.

Names follow vLLM where the concept is the same. Every field is validated at construction, so a bad
value is rejected where it enters the service, with the field named. A field set after construction, or
an object unpickled in another process, was never checked: every boundary (client, router, engine) takes
`validated()`, a checked copy, so nothing that a later step cannot handle gets past it.
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Union

import msgpack
import numpy as np

from rollout_service.api.checks import (check_completion, check_metadata, check_reward_name, check_stream_tokens,
                                        check_text)
from rollout_service.api.values import MAX_INT32, is_int, is_real
from rollout_service.api.wire import (FINISH_REASONS, WIRE_SCHEMA_VERSION, SHORT, TO_WIRE, check_result_record, checked_routing,
                                  from_i32, need, packb, reject_unknown, routing_from_wire, tuple_key, unpack_record)

LOGPROBS_MODES = ("processed", "scaled", "raw")

ChatMessage = dict[str, str]
Prompt = Union[str, list[ChatMessage], list[int]]


def _require(ok: bool, name: str, why: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r}: {why}")


@dataclass
class SamplingParams:
    """How to sample one prompt. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int = 0
    logprobs_mode: str = "processed"
    # mixture-of-experts models: each result's routed_experts (and prompt_routed_experts), see RolloutResult
    return_routed_experts: bool = False
    return_prompt_routed_experts: bool = False
    # False: this request never takes speculative steps (EngineConfig.speculative); its tokens are the same either way
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, (str, tuple)):
            self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()
        # numpy scalars pass the checks; plain numbers are what msgpack and the sampler take
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (np.integer, np.floating)):
                setattr(self, f.name, v.item())
        self.stop, self.stop_token_ids = list(self.stop), [int(t) for t in self.stop_token_ids]

    def validate(self) -> None:
        """Check every field as it is now (ValueError naming the first bad one)."""
        _require(is_int(self.n) and 1 <= self.n <= 4096, "n", "must be an int in [1, 4096]", self.n)
        # logits / a tiny temperature (or repetition penalty) overflow float32 to inf: NaN log-probs. Below
        # 0.01 (vLLM's floor too) sampling is greedy in all but name.
        _require(is_real(self.temperature) and (self.temperature == 0 or 0.01 <= self.temperature <= 100),
                 "temperature", "must be 0 (greedy) or a finite float in [0.01, 100]", self.temperature)
        _require(is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= MAX_INT32), "top_k",
                 "must be -1 (off) or an int in [1, 2**31)", self.top_k)
        _require(is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _require(is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            _require(is_real(v) and -2 <= v <= 2, name, "must be in [-2, 2]", v)
        _require(is_real(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 10, "repetition_penalty",
                 "must be in [0.01, 10]", self.repetition_penalty)
        _require(is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32, "max_tokens",
                 "must be an int in [1, 2**31)", self.max_tokens)
        _require(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
                 "must be a str or a list of non-empty strings ([] for none)", self.stop)
        for i, s in enumerate(self.stop):
            check_text(s, f"SamplingParams.stop[{i}]")
        _require(isinstance(self.stop_token_ids, list) and
                 all(is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids), "stop_token_ids",
                 "must be a list of token ids (ints in [0, 2**31))", self.stop_token_ids)
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool", self.ignore_eos)
        _require(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
                 "must be None or an int in [0, 2**63)", self.seed)
        _require(is_int(self.logprobs) and 0 <= self.logprobs <= 20, "logprobs",
                 "must be an int in [0, 20] (number of top alternatives)", self.logprobs)
        _require(isinstance(self.logprobs_mode, str) and self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode",
                 f"must be one of {LOGPROBS_MODES}", self.logprobs_mode)
        for name in ("return_routed_experts", "return_prompt_routed_experts", "speculative"):
            _require(isinstance(getattr(self, name), bool), name, "must be a bool", getattr(self, name))
        _require(self.return_routed_experts or not self.return_prompt_routed_experts, "return_prompt_routed_experts",
                 "needs return_routed_experts=True too", self.return_prompt_routed_experts)

    def validated(self) -> "SamplingParams":
        """A checked copy, independent of this object: what a boundary keeps of params a caller may change."""
        return replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "SamplingParams":
        if not isinstance(d, Mapping):
            raise ValueError(f"SamplingParams: expected a dict of fields, got {type(d).__name__}")
        reject_unknown(d, {f.name for f in fields(cls)}, "SamplingParams")
        return cls(**d)


def _checked_prompt(prompt: Any) -> Prompt:
    """The prompt, checked, as a new list (or the str): the caller's list may change later."""
    what = "RolloutRequest.prompt"
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{what}: empty string")
        check_text(prompt, what)
        return prompt
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise ValueError(f"{what}: must be a non-empty str, list of token ids or list of chat messages")
    if all(type(t) is int for t in prompt):  # the common case first: the generic check costs 3x more
        ids = list(prompt)
    elif all(is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]  # numpy ints as plain ones: msgpack packs only those
    else:
        return _checked_messages(prompt)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi > MAX_INT32:
        raise ValueError(f"{what}: token id {lo if lo < 0 else hi} is outside [0, 2**31)")
    return ids


def _checked_messages(messages: list | tuple) -> list[ChatMessage]:
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"RolloutRequest.prompt: chat messages must be dicts with str 'role' and 'content' "
                             f"(message {i} is {m!r:.80})")
        for k, v in m.items():
            if isinstance(v, str):
                check_text(v, f"RolloutRequest.prompt[{i}][{k!r}]")
    return [dict(m) for m in messages]


_REQUEST_KEYS = {"prompt", "sampling", "request_id", "metadata", "apply_chat_template", "reward", "completion",
                 "submitted_version", "stream_tokens"}


@dataclass
class EpisodeParams:
    """A multi-turn episode instead of a single completion (rollout_service/episodes.py): the prompt comes
    from `environment.reset(metadata)`, and after every model turn `environment.step(text)` answers. Each of
    the request's n samples runs on a copy of the environment. The episode ends when the environment says
    done, after `max_turns` model turns, or when its tokens would pass `max_total_tokens`."""

    environment: Any
    max_turns: int = 4
    max_total_tokens: int = 4096

    def __post_init__(self) -> None:
        env = self.environment
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise ValueError(f"EpisodeParams.environment: {type(env).__name__} has no {' or '.join(missing)}() "
                             "method (an Environment needs reset(metadata) and step(assistant_text))")
        for name in ("max_turns", "max_total_tokens"):
            v = getattr(self, name)
            if not is_int(v) or not 1 <= v <= MAX_INT32:
                raise ValueError(f"EpisodeParams.{name}={v!r}: must be an int in [1, 2**31)")


@dataclass
class RolloutRequest:
    """One prompt to roll out `sampling.n` times. `metadata` comes back untouched on every result.

    `reward`: a "module:function" name; the service calls it on each finished result (fn(result) -> float)
    and fills `RolloutResult.reward`. `episode`: run a multi-turn episode (EpisodeParams); the prompt is
    then taken from the environment and may be None. Episode requests travel pickled (Python API, Ray),
    not as msgpack.

    `completion`: token ids to score instead of generating (RolloutClient.score): the result carries their
    teacher-forced log-probs under `sampling`'s distribution (temperature, logprobs_mode, top-k), finish_reason
    "scored". `submitted_version`: the policy version the request was submitted under (the service sets it;
    engines admit and preempt the oldest first). `stream_tokens`: TokenDeltas as it runs (api/deltas.py)."""

    prompt: Prompt | None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: Any = None
    apply_chat_template: bool = True
    reward: str | None = None
    episode: EpisodeParams | None = None
    completion: list[int] | None = None
    submitted_version: int | None = None
    stream_tokens: bool = False

    def __post_init__(self) -> None:
        self.completion = check_completion(self.completion, self.sampling, self.episode)
        check_stream_tokens(self.stream_tokens, self.completion, self.episode)
        if self.submitted_version is not None and not (is_int(self.submitted_version)
                                                       and 0 <= self.submitted_version <= MAX_INT32):
            raise ValueError(f"RolloutRequest.submitted_version={self.submitted_version!r}: must be None or an int "
                             "in [0, 2**31)")
        if self.episode is not None and not isinstance(self.episode, EpisodeParams):
            raise ValueError(f"RolloutRequest.episode: must be an EpisodeParams, got {type(self.episode).__name__}")
        if self.prompt is not None or self.episode is None:
            self.prompt = _checked_prompt(self.prompt)
        self.reward = check_reward_name(self.reward, "RolloutRequest.reward")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"RolloutRequest.sampling: must be a SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"RolloutRequest.request_id={self.request_id!r}: must be a non-empty str")
        check_text(self.request_id, "RolloutRequest.request_id")
        if not isinstance(self.apply_chat_template, bool):
            raise ValueError(f"RolloutRequest.apply_chat_template={self.apply_chat_template!r}: must be a bool")
        check_metadata(self.metadata)

    def validated(self, checked: dict[int, SamplingParams] | None = None) -> "RolloutRequest":
        """A checked copy of this request as it is now (every field again, the sampling params' too; the
        prompt and the params copied, the metadata shared): ValueError naming the first bad field. `checked`:
        id(params) -> their checked copy, for a batch whose requests share params objects (checked once, the
        copy shared; the caller keeps the originals alive meanwhile, so that an id names one object)."""
        s = self.sampling
        if not isinstance(s, SamplingParams):  # so that the error names the field, not replace()
            raise ValueError(f"RolloutRequest.sampling: must be a SamplingParams, got {type(s).__name__}")
        if checked is None:
            return replace(self, sampling=s.validated())
        if id(s) not in checked:
            checked[id(s)] = s.validated()
        return replace(self, sampling=checked[id(s)])

    def to_dict(self) -> dict:
        if self.episode is not None:
            raise ValueError(f"request {self.request_id!r}: an episode request (its environment is a Python "
                             "object) travels pickled, not as a msgpack/dict record")
        return {"request_id": self.request_id, "prompt": self.prompt, "sampling": self.sampling.to_dict(),
                "metadata": self.metadata, "apply_chat_template": self.apply_chat_template, "reward": self.reward,
                "completion": self.completion, "submitted_version": self.submitted_version, "stream_tokens": self.stream_tokens}

    @classmethod
    def from_dict(cls, d: Any) -> "RolloutRequest":
        if not isinstance(d, Mapping) or "prompt" not in d:
            raise ValueError("RolloutRequest: expected a dict with a 'prompt'")
        reject_unknown(d, _REQUEST_KEYS, "RolloutRequest")
        sampling, rid = d.get("sampling"), d.get("request_id")
        return cls(prompt=d["prompt"],
                   sampling=SamplingParams() if sampling is None else SamplingParams.from_dict(sampling),
                   request_id=uuid.uuid4().hex if rid is None else rid, metadata=d.get("metadata"),
                   apply_chat_template=d.get("apply_chat_template", True), reward=d.get("reward"),
                   completion=d.get("completion"), submitted_version=d.get("submitted_version"),
                   stream_tokens=d.get("stream_tokens", False))

    def to_msgpack(self) -> bytes:
        return msgpack.packb({"schema": WIRE_SCHEMA_VERSION, "kind": "request", **self.to_dict()})

    @classmethod
    def from_msgpack(cls, data: bytes) -> "RolloutRequest":
        record = unpack_record(data, "request")
        return cls.from_dict({k: v for k, v in record.items() if k not in ("schema", "kind")})


@dataclass
class RolloutResult:
    """One sample of one request. `logprobs[i]` is the behaviour policy's log-prob of `token_ids[i]`
    (mode per SamplingParams.logprobs_mode), produced by policy version `token_versions[i]`. `error`: why
    the service gave up on the request (finish_reason "abort", the tokens so far); on a "scored" result, which
    completion tokens fall outside a truncated (top-k / top-p / min-p) distribution, log-prob -inf; None otherwise.
    `reward`: the reward function's value (None if there is none or it raised: then `reward_error` says why).

    An episode's result (RolloutRequest.episode) holds every token after the first prompt in `token_ids`:
    the model's and the environment's, in order. `loss_mask[i]` is 1 where the model produced token i, 0
    where the environment (or the chat template between turns) did; the logprobs of mask-0 tokens are 0.0
    and their versions those of the turn before them. `turns`: one dict per model turn (its token span
    [start, end) in token_ids, its policy version, the environment's reward for it).

    `routed_experts` (SamplingParams.return_routed_experts, mixture-of-experts models): uint8 (uint16 past 256
    experts) [len(token_ids), moe_layers, top_k]; row i holds the experts every MoE layer chose for the input
    token at position len(prompt_token_ids) + i - 1, i.e. in the forward that produced token i (the routing a
    learner's forward over prompt + tokens uses for log p(token i)). The last token's own position produced
    nothing and is not recorded. `prompt_routed_experts` (return_prompt_routed_experts): the same for
    positions 0 .. len(prompt_token_ids) - 2. None when not asked for, or on an "abort" result whose routing
    was never computed.

    `kv_versions[i]` (KV provenance): the oldest policy version among the KV entries token i attended to
    when it was sampled; equal to token_versions[i] unless the sample went on across a refresh on KV the
    old weights computed (EngineConfig.on_refresh "continue"), so a learner can drop or weigh those
    tokens. `receipt` (batch-invariant engines): sha256 over the producing version's weights digest, the
    prompt and token ids and the log-prob bytes (rollout_service/results/receipts.py); InvariantForward.verify
    recomputes it."""

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: np.ndarray
    token_versions: list[int]
    finish_reason: str
    text: str = ""
    top_logprobs: list[dict[int, float]] | None = None
    reward: float | None = None
    metadata: Any = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    reward_error: str | None = None
    loss_mask: list[int] | None = None
    turns: list[dict] | None = None
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None
    kv_versions: list[int] | None = None
    receipt: str | None = None

    def __post_init__(self) -> None:
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.routed_experts = checked_routing(self.routed_experts, "routed_experts", len(self.token_ids))
        self.prompt_routed_experts = checked_routing(self.prompt_routed_experts, "prompt_routed_experts",
                                                     max(0, len(self.prompt_token_ids) - 1))
        a, b = self.routed_experts, self.prompt_routed_experts
        need(a is None or b is None or (a.dtype == b.dtype and a.shape[1:] == b.shape[1:]), "prompt_routed_experts",
             "must have routed_experts' dtype, layers and top_k")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            raise ValueError("RolloutResult.loss_mask: must have one entry per token id")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"RolloutResult.finish_reason={self.finish_reason!r}: must be one of {FINISH_REASONS}")
        if not (len(self.token_ids) == len(self.logprobs) == len(self.token_versions)):
            raise ValueError("RolloutResult: token_ids, logprobs and token_versions must have equal lengths")
        if self.kv_versions is not None and len(self.kv_versions) != len(self.token_ids):
            raise ValueError("RolloutResult.kv_versions: must be None or have one entry per token id")
        if self.error is not None and not (isinstance(self.error, str) and self.finish_reason in ("abort", "scored")):
            raise ValueError(f"RolloutResult.error={self.error!r}: must be None, or a str on an \"abort\" or "
                             f"\"scored\" result")

    def to_dict(self) -> dict:
        """The wire form (arrays as little-endian bytes). ValueError naming a field that cannot be converted."""
        d = {}
        for name, convert in TO_WIRE.items():
            try:
                d[name] = convert(getattr(self, name))
            except Exception as e:  # whatever a wrong type raises inside the conversion
                raise ValueError(f"RolloutResult.{name}: cannot be encoded ({type(e).__name__}: {e})") from None
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "RolloutResult":
        """A result from its wire form, every field's type and range checked: ValueError naming the field."""
        check_result_record(d)
        top = d["top_logprobs"]
        return cls(
            request_id=d["request_id"], sample_index=d["sample_index"],
            prompt_token_ids=from_i32(d["prompt_token_ids"]), token_ids=from_i32(d["token_ids"]),
            logprobs=np.frombuffer(d["logprobs"], dtype="<f4").astype(np.float32),
            token_versions=from_i32(d["token_versions"]), finish_reason=d["finish_reason"], text=d["text"],
            top_logprobs=None if top is None else [dict(zip(k, v)) for k, v in top],
            reward=d["reward"], metadata=d["metadata"], timings=dict(d["timings"]),
            # absent from records written before they existed
            error=d.get("error"), reward_error=d.get("reward_error"),
            loss_mask=None if d.get("loss_mask") is None else list(d["loss_mask"]),
            turns=None if d.get("turns") is None else [dict(t) for t in d["turns"]],
            routed_experts=routing_from_wire(d.get("routed_experts")),
            prompt_routed_experts=routing_from_wire(d.get("prompt_routed_experts")),
            kv_versions=None if d.get("kv_versions") is None else from_i32(d["kv_versions"]),
            receipt=d.get("receipt"),
        )

    def to_msgpack(self) -> bytes:
        """One msgpack record. ValueError naming the field if a value would not load back (a wrong type,
        a reward that is not a finite number, metadata msgpack cannot encode, ...)."""
        d = self.to_dict()
        check_result_record(d)
        key = tuple_key(d["metadata"])
        need(key is None, "metadata", f"has the tuple {SHORT.repr(key)} as a dict key: msgpack writes it as an "
              "array, which cannot be a key when the record is read back")
        return packb({"schema": WIRE_SCHEMA_VERSION, "kind": "result", **d}, "RolloutResult.")

    @classmethod
    def from_msgpack(cls, data: bytes) -> "RolloutResult":
        return cls.from_dict(unpack_record(data, "result"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutResult):
            return NotImplemented
        a, b = self.to_dict(), other.to_dict()
        return a == b
