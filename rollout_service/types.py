"""Public request/result types and their msgpack wire format.

Names follow vLLM where the concept is the same. Every field is validated at construction, so a bad
value is rejected where it enters the service, with the field named, and never reaches an engine.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Union

import msgpack
import numpy as np

LOGPROBS_MODES = ("processed", "scaled", "raw")
FINISH_REASONS = ("stop", "length", "abort")
WIRE_SCHEMA_VERSION = 1

ChatMessage = dict[str, str]
Prompt = Union[str, list[ChatMessage], list[int]]


def _require(ok: bool, name: str, why: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r}: {why}")


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        _require(_is_int(self.n) and 1 <= self.n <= 4096, "n", "must be an int in [1, 4096]", self.n)
        _require(_is_real(self.temperature) and 0 <= self.temperature <= 100, "temperature",
                 "must be a finite float in [0, 100]", self.temperature)
        _require(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
                 "must be -1 (off) or an int >= 1", self.top_k)
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            _require(_is_real(v) and -2 <= v <= 2, name, "must be in [-2, 2]", v)
        _require(_is_real(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty",
                 "must be in (0, 10]", self.repetition_penalty)
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1",
                 self.max_tokens)
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings", self.stop)
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be ints >= 0", self.stop_token_ids)
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool", self.ignore_eos)
        _require(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
                 "must be None or an int in [0, 2**63)", self.seed)
        _require(_is_int(self.logprobs) and 0 <= self.logprobs <= 20, "logprobs",
                 "must be an int in [0, 20] (number of top alternatives)", self.logprobs)
        _require(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", f"must be one of {LOGPROBS_MODES}",
                 self.logprobs_mode)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"SamplingParams: unknown field(s) {sorted(unknown)}")
        return cls(**d)


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("RolloutRequest.prompt: empty string")
        return
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise ValueError("RolloutRequest.prompt: must be a non-empty str, list of token ids or list of chat messages")
    if all(_is_int(t) for t in prompt):
        if min(prompt) < 0:
            raise ValueError("RolloutRequest.prompt: negative token id")
        return
    for m in prompt:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError("RolloutRequest.prompt: chat messages must be dicts with str 'role' and 'content'")


@dataclass
class RolloutRequest:
    """One prompt to roll out `sampling.n` times. `metadata` comes back untouched on every result."""

    prompt: Prompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: Any = None
    apply_chat_template: bool = True

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)
        if isinstance(self.prompt, tuple):
            self.prompt = list(self.prompt)
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError("RolloutRequest.sampling: must be a SamplingParams")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("RolloutRequest.request_id: must be a non-empty str")

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "prompt": self.prompt, "sampling": self.sampling.to_dict(),
                "metadata": self.metadata, "apply_chat_template": self.apply_chat_template}

    @classmethod
    def from_dict(cls, d: dict) -> "RolloutRequest":
        if not isinstance(d, dict) or "prompt" not in d:
            raise ValueError("RolloutRequest: expected a dict with a 'prompt'")
        return cls(prompt=d["prompt"], sampling=SamplingParams.from_dict(d.get("sampling") or {}),
                   request_id=d.get("request_id") or uuid.uuid4().hex, metadata=d.get("metadata"),
                   apply_chat_template=bool(d.get("apply_chat_template", True)))

    def to_msgpack(self) -> bytes:
        return msgpack.packb({"schema": WIRE_SCHEMA_VERSION, "kind": "request", **self.to_dict()})

    @classmethod
    def from_msgpack(cls, data: bytes) -> "RolloutRequest":
        return cls.from_dict(_unpack(data, "request"))


@dataclass
class RolloutResult:
    """One sample of one request. `logprobs[i]` is the behaviour policy's log-prob of `token_ids[i]`
    (mode per SamplingParams.logprobs_mode), produced by policy version `token_versions[i]`."""

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

    def __post_init__(self) -> None:
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"RolloutResult.finish_reason={self.finish_reason!r}: must be one of {FINISH_REASONS}")
        if not (len(self.token_ids) == len(self.logprobs) == len(self.token_versions)):
            raise ValueError("RolloutResult: token_ids, logprobs and token_versions must have equal lengths")

    @property
    def min_version(self) -> int | None:
        return min(self.token_versions) if self.token_versions else None

    def to_dict(self) -> dict:
        top = None
        if self.top_logprobs is not None:
            top = [[list(d.keys()), [float(v) for v in d.values()]] for d in self.top_logprobs]
        return {
            "request_id": self.request_id, "sample_index": self.sample_index,
            "prompt_token_ids": _i32(self.prompt_token_ids), "token_ids": _i32(self.token_ids),
            "logprobs": self.logprobs.astype("<f4").tobytes(), "token_versions": _i32(self.token_versions),
            "finish_reason": self.finish_reason, "text": self.text, "top_logprobs": top, "reward": self.reward,
            "metadata": self.metadata, "timings": dict(self.timings),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RolloutResult":
        try:
            top = d["top_logprobs"]
            return cls(
                request_id=d["request_id"], sample_index=int(d["sample_index"]),
                prompt_token_ids=_from_i32(d["prompt_token_ids"]), token_ids=_from_i32(d["token_ids"]),
                logprobs=np.frombuffer(d["logprobs"], dtype="<f4").astype(np.float32),
                token_versions=_from_i32(d["token_versions"]), finish_reason=d["finish_reason"],
                text=d["text"], top_logprobs=None if top is None else [dict(zip(k, v)) for k, v in top],
                reward=d["reward"], metadata=d["metadata"], timings=dict(d["timings"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed result record ({type(e).__name__}: {e})") from None

    def to_msgpack(self) -> bytes:
        return msgpack.packb({"schema": WIRE_SCHEMA_VERSION, "kind": "result", **self.to_dict()})

    @classmethod
    def from_msgpack(cls, data: bytes) -> "RolloutResult":
        return cls.from_dict(_unpack(data, "result"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutResult):
            return NotImplemented
        a, b = self.to_dict(), other.to_dict()
        return a == b


def _i32(xs: Iterable[int]) -> bytes:
    return np.asarray(list(xs), dtype="<i4").tobytes()


def _from_i32(b: bytes) -> list[int]:
    if not isinstance(b, (bytes, bytearray)) or len(b) % 4:
        raise ValueError("RolloutResult: int32 array field is not a whole number of 4-byte values")
    return np.frombuffer(b, dtype="<i4").tolist()


def _unpack(data: bytes, kind: str) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected msgpack bytes for a {kind}, got {type(data).__name__}")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"corrupt msgpack {kind}: {type(e).__name__}: {e}") from None
    return _check_record(d, kind)


def _check_record(d: Any, kind: str) -> dict:
    if not isinstance(d, dict) or d.get("kind") != kind:
        raise ValueError(f"msgpack payload is not a {kind} record")
    if d.get("schema") != WIRE_SCHEMA_VERSION:
        raise ValueError(f"unsupported {kind} schema version {d.get('schema')!r} (expected {WIRE_SCHEMA_VERSION})")
    return d


def save_results(path: str | Path, results: Iterable[RolloutResult]) -> int:
    """Write results as a stream of msgpack records (one per result); returns how many were written."""
    n = 0
    with open(path, "wb") as f:
        for r in results:
            f.write(r.to_msgpack())
            n += 1
    return n


def load_results(path: str | Path) -> list[RolloutResult]:
    data = Path(path).read_bytes()
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    try:
        records = list(unpacker)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"{path}: corrupt msgpack stream: {type(e).__name__}: {e}") from None
    if unpacker.tell() != len(data):
        raise ValueError(f"{path}: truncated msgpack stream ({len(data) - unpacker.tell()} trailing bytes)")
    return [RolloutResult.from_dict(_check_record(r, "result")) for r in records]
