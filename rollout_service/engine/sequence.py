"""One sample being generated: its tokens, where its KV lives, and what it has produced so far."""
from __future__ import annotations

import enum
import itertools
import time

from rollout_service.api.types import SamplingParams

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # needs (re)prefill: no KV, or a prefix of its KV
    RUNNING = "running"      # all tokens but the last have KV; next step decodes
    FINISHED = "finished"


class Sequence:
    """A sample of a request. `num_computed` tokens have KV in `pages`; the rest are prefilled next.

    A request with n > 1 starts as one sequence (the prompt is prefilled once) and forks into n after
    its prefill; preemption frees the pages and resets `num_computed` so the tokens are recomputed.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, seed: int,
                 sample_index: int = 0, num_samples: int = 1, arrival: float | None = None,
                 score_from: int | None = None, submitted_version: int = 0):
        self.seq_id = next(_ids)
        self.submitted_version = submitted_version  # the scheduler's staleness order (engine/scheduler.py)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[dict[int, float]] = []
        self.token_versions: list[int] = []
        self.kv_versions: list[int] = []          # kv_version when each output token was sampled
        self.score_from = score_from
        self.scores: list[float] = []            # log-prob of completion token j, scoring sequences only
        self.score_top: list[dict[int, float]] = []
        self.sampling = sampling
        self.seed = seed
        self.sample_index = sample_index
        # samples still to fork from this sequence once its prompt is prefilled (n > 1 only)
        self.num_samples = num_samples
        self.pages: list[int] = []
        self.page_keys: list[int] = []  # prefix-cache keys of the leading full pages (kv_cache.BlockManager)
        self.kv_version = 0             # the oldest policy version among its pages' KV (kv_cache.BlockManager)
        self.num_computed = 0
        # routing of positions [0, len) kept when a preemption freed its pages (engine/routed_experts.py)
        self.routing_prefix = None
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_text_end: int | None = None
        self.t_arrival = arrival if arrival is not None else time.time()
        self.t_first_token: float | None = None
        self.t_finished: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def num_reusable(self) -> int:
        """How many leading tokens may take their KV from the prefix cache: all but the last (its logits give
        the next token), or for a scoring sequence those before the position that predicts the completion."""
        return self.num_tokens - 1 if self.score_from is None else self.score_from - 1

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_slice(self, start: int, end: int) -> list[int]:
        """(prompt + output tokens)[start:end] without concatenating the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n):end - n]

    def append(self, token_id: int, logprob: float, version: int, top: dict[int, float] | None) -> None:
        if self.t_first_token is None:
            self.t_first_token = time.time()
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.token_versions.append(version)
        self.kv_versions.append(self.kv_version)
        if top is not None:
            self.output_top.append(top)

    def fork(self, sample_index: int) -> "Sequence":
        """A sibling sample sharing this sequence's prompt (pages are shared by the caller)."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.sampling, self.seed, sample_index,
                         arrival=self.t_arrival, submitted_version=self.submitted_version)
        child.num_computed = self.num_computed
        child.routing_prefix = self.routing_prefix  # never written in place: shared
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}#{self.sample_index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed}, {self.status.value})")
