"""A TEST DOUBLE FOR THE CONTROL-PLANE BENCHMARK ONLY (benchmarks/harness/control_plane.py): an "engine" that
computes nothing and fabricates its results, so that many workers cost the machine almost nothing and the
router, the workers' hosts and the client are what is measured.

It is reachable only from Python, by passing `Fabricate(...)` as the router's `engine_factory`
(actors/router.py); no config key names it, so no service YAML or RolloutClient.launch call can start one.
Its results are well-formed RolloutResults of the requested lengths, with made-up tokens, log-probs and text.

Timing: every `step_s` seconds (a decode step), each running sample gains `tokens_per_step` tokens, up to
`max_num_seqs` samples at a time; a sample ends at its request's max_tokens. With max_num_seqs 256 and one token
every 2.56 ms (or 10 every 25.6 ms: the same rate for a tenth of the steps, which lets a 2-core machine fabricate
for more workers) a worker makes 100k tokens/s: W2's rate on one H200, about 390 results/s of 256 tokens.
"""
from __future__ import annotations

import hashlib
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from rollout_service.api.types import RolloutRequest, RolloutResult


@dataclass(frozen=True)
class Fabricate:
    """The engine factory the benchmark hands the router: Fabricate(...)(engine_config) -> FabricatedEngine."""
    step_s: float = 0.0
    max_num_seqs: int = 256
    text_chars_per_token: int = 4
    tokens_per_step: int = 1

    def __call__(self, engine_config: dict) -> "FabricatedEngine":
        return FabricatedEngine(self)


@dataclass
class _Seq:
    request_id: str
    sampling: Any   # the request's SamplingParams (the host reads .n)
    prompt: list[int]


class FabricatedEngine:
    device = "cpu"
    policy_version = 0
    is_sleeping = False

    def __init__(self, spec: Fabricate):
        self.spec = spec
        self.user_code = None
        self._waiting: deque[tuple[_Seq, int]] = deque()          # (request, sample index)
        self._due: dict[int, list[tuple[_Seq, int]]] = defaultdict(list)  # step -> samples ending then
        self._running = 0
        self._step = 0
        self.generated = 0

    # -- requests ---------------------------------------------------------------------------------
    def prepare(self, req: RolloutRequest) -> _Seq:
        if not isinstance(req.prompt, list) or (req.prompt and not isinstance(req.prompt[0], int)):
            raise ValueError("the fabricating engine takes token-id prompts only")
        return _Seq(req.request_id, req.sampling, list(req.prompt))

    def add_request(self, req: RolloutRequest, seq: _Seq) -> None:
        self._waiting.extend((seq, k) for k in range(seq.sampling.n))

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self._running > 0

    def token_deltas(self) -> list:
        return []  # a request with stream_tokens gets its result alone, as if it had run in one step

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        ids = set(request_ids)
        out = [self._result(s, k, 0, "abort") for s, k in self._waiting if s.request_id in ids]
        self._waiting = deque((s, k) for s, k in self._waiting if s.request_id not in ids)
        for step, due in self._due.items():
            out += [self._result(s, k, 0, "abort") for s, k in due if s.request_id in ids]
            self._due[step] = [(s, k) for s, k in due if s.request_id not in ids]
        self._running = sum(len(d) for d in self._due.values())
        return out

    def step(self) -> list[RolloutResult]:
        if self.spec.step_s:
            time.sleep(self.spec.step_s)
        while self._waiting and self._running < self.spec.max_num_seqs:
            s, k = self._waiting.popleft()
            steps = -(-max(1, s.sampling.max_tokens) // self.spec.tokens_per_step)
            self._due[self._step + steps].append((s, k))
            self._running += 1
        self._step += 1
        done = self._due.pop(self._step, [])
        self._running -= len(done)
        self.generated += (self._running + len(done)) * self.spec.tokens_per_step  # (for every sample that ran)
        return [self._result(s, k, s.sampling.max_tokens, "length") for s, k in done]

    def _result(self, s: _Seq, k: int, n: int, why: str) -> RolloutResult:
        # the fields a real engine fills for a plain sample, at their sizes: what the router and client carry
        now = time.time()
        return RolloutResult(s.request_id, k, s.prompt, [k + 1] * n, [-1.0] * n, [self.policy_version] * n, why,
                             text="x" * (n * self.spec.text_chars_per_token),
                             timings={"queued": now, "first_token": now, "finished": now})

    # -- what the host and the worker ask of an engine ----------------------------------------------
    def stats(self) -> dict:
        return {"queued": len(self._waiting), "running": self._running, "kv_pages_used": 0, "kv_pages_total": 0,
                "tokens_per_s": 0.0, "policy_version": self.policy_version, "generated_tokens": self.generated,
                "prefilled_tokens": 0, "prefix_cache": {}, "sleep_level": 0, "device": "fabricated"}

    def validate_manifest(self, manifest: Any, partial: bool) -> None:
        raise ValueError("the fabricating engine takes no weights")

    def update_weights(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("the fabricating engine takes no weights")

    def weights_digest(self) -> str:
        return hashlib.sha256(b"fabricated").hexdigest()

    def sleep(self, level: int = 1) -> None:
        raise ValueError("the fabricating engine does not sleep")

    def wake_up(self) -> None:
        pass
