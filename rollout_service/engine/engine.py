"""The engine: requests in, RolloutResults out, one device.

add_request -> Scheduler -> ModelRunner -> Sampler -> finished sequences become RolloutResults.
All mutation happens under one lock, so a weight refresh or an abort from another thread lands between
two steps.

The engine is a facade over collaborators, each owning its state and told what it may call (each file's
docstring says): the request table and outbox (requests.py), the scheduler, the decode loop (decode_loop.py:
plain and overlapped steps), the token recorder (recorder.py: tokens, stops, forks), fault isolation
(isolation.py), the weight swap (weight_swap.py: the policy version), the sleeper and the episode runner
(episode_runner.py).

A request is checked again when it is added and the sequence keeps a copy of its sampling params, so a
caller changing the request afterwards cannot reach a step. A step that raises anyway loses no request:
engine/isolation.py finds the request at fault (it finishes with its error, its batch mates go on).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_service.api.checks import check_request_ids, engine_device
from rollout_service.config import EngineConfig
from rollout_service.engine.episode_runner import EpisodeGroup, EpisodeRunner
from rollout_service.engine.decode_loop import DecodeLoop
from rollout_service.engine.isolation import FaultIsolation
from rollout_service.engine.kv_cache import pages_for, sized_kv_cache
from rollout_service.engine.model_runner import ModelRunner
from rollout_service.engine.recorder import StopRules, TokenRecorder
from rollout_service.engine.weight_swap import WeightSwap
from rollout_service.engine.requests import RequestTable
from rollout_service.engine.routed_experts import check_routing_request, keep_routing, result_routing
from rollout_service.engine.sampler import Sampler
from rollout_service.engine.scheduler import Scheduler
from rollout_service.engine.sequence import Sequence
from rollout_service.engine.sleep import Sleeper, process_gpu_bytes
from rollout_service.engine.drafter import SuffixDrafter
from rollout_service.engine.speculation import DRY_STEPS, Speculator
from rollout_service.model.loader import load_model
from rollout_service.ops.backend import resolve_backend
from rollout_service.prompts import PromptProcessor
from rollout_service.results.receipts import receipt_of
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult
from rollout_service.user_code import Guard, unguarded

log = logging.getLogger(__name__)


@dataclass
class EngineCounters:
    steps: int = 0
    prefill_steps: int = 0
    prompt_prefills: int = 0      # prompts prefilled for the first time (once per request, whatever n)
    recomputes: int = 0           # prefills redone after preemption
    refresh_recomputes: int = 0   # sequences whose KV a refresh dropped to recompute (on_refresh="recompute")
    overlapped_steps: int = 0     # decode steps launched before the previous step's tokens were read
    prefilled_tokens: int = 0     # tokens run through prefill (a prefix-cache hit is not)
    generated_tokens: int = 0
    scored_sequences: int = 0     # completions scored (RolloutRequest.completion)
    scored_tokens: int = 0        # completion tokens scored, each time a chunk scored it
    spec_verify_steps: int = 0    # decode steps run as verify steps (engine/speculation.py)
    spec_drafts: int = 0          # drafts verified (one per sequence per verify step that had one)
    spec_proposed: int = 0        # draft tokens verified
    spec_accepted: int = 0        # of those, tokens plain decoding would have sampled too
    spec_tokens: int = 0          # tokens the verify steps gave (accepted + one per sequence)
    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (time, tokens) for tokens/s


def _decode_rows(config: EngineConfig) -> int:
    """Rows a decode step may have: one per sequence, or a verify step's one per drafted token too."""
    if config.speculative is None:
        return config.max_num_seqs
    return max(config.max_num_seqs,
               min(config.max_num_seqs, config.speculative_max_batch) * (config.num_speculative_tokens + 1))


def _dry_steps(config: EngineConfig, device: torch.device) -> int:
    """Decode steps between asking the drafter again after a step with no draft: asking needs the step's tokens
    recorded, which stops the next decode step from being launched ahead of them. That costs only where a step
    runs on the device while the host goes on (CUDA); on the CPU a launched step has already run, and asking at
    every step costs a table lookup per sequence against tens of ms of decoding."""
    return DRY_STEPS if config.overlap_decode and device.type == "cuda" else 0


class Engine:
    def __init__(self, config: EngineConfig | None = None, model_source: Any = None, tokenizer: Any = None,
                 **overrides: Any):
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.config = config
        self.device = engine_device(config.device)
        self.backend = resolve_backend(config.backend, self.device)
        dtype = getattr(torch, config.dtype) if config.dtype else None
        source = model_source if model_source is not None else config.model
        loaded = load_model(source, dtype=dtype, device=self.device, backend=self.backend, tokenizer=tokenizer,
                            load_format=config.load_format,
                            exact_prefill_attention=config.exact_prefill_attention,
                            batch_invariant=config.batch_invariant, quantization=config.quantization)
        self.model, self.hf_config, self.tokenizer = loaded.model, loaded.hf_config, loaded.tokenizer
        if config.batch_invariant and self.backend == "cuda":
            self.model.ops.check_model(self.hf_config, next(self.model.parameters()).dtype, config.page_size)
        self.max_model_len = min(config.max_model_len or 1 << 30, self.hf_config.max_position_embeddings)
        self.prompts = PromptProcessor(self.tokenizer, self.hf_config.vocab_size)
        self.eos_ids = self.prompts.eos_ids(self.hf_config)
        self.kv = sized_kv_cache(self.model, config, self.device, self.max_model_len)
        self.scheduler = Scheduler(self.kv.blocks, config.page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.scheduling == "staleness")
        self.scheduler.on_preempt = lambda seq: keep_routing(self.kv.routing, seq)
        # Graphs fix every buffer at its largest shape; only the CUDA kernels read the pages through CSR
        # indices whose cost follows the real lengths (the torch reference gathers whole padded tables).
        use_graphs = config.enable_cuda_graphs and self.backend == "cuda"
        blocker = self.model.cuda_graph_blocker()
        if use_graphs and blocker:
            log.warning("CUDA graphs off, decoding eagerly: %s", blocker)
            use_graphs = False
        self.runner = ModelRunner(self.model, self.kv, self.device, self.max_model_len, _decode_rows(config),
                                  use_graphs, config.cuda_graph_max_batch)
        self.sampler = Sampler(self.model.ops)
        self.sleeper = Sleeper(self.model, self.kv, self.runner, self.scheduler, self.device)
        self.counters = EngineCounters()
        self._lock = threading.RLock()
        self.requests = RequestTable(self._result, self.scheduler.finish)
        self.recorder = TokenRecorder(self.model, self.sampler, self.scheduler, self.kv.blocks, self.requests,
                                      self.counters, StopRules(self.eos_ids, self.prompts, self.max_model_len))
        self.speculator = None if config.speculative is None else Speculator(
            SuffixDrafter(), config.num_speculative_tokens, config.speculative_max_batch,
            min(config.max_num_batched_tokens, self.runner.verify_rows), self.runner, self.sampler,
            self.recorder, self.kv.blocks, self.counters, config.max_num_seqs, _dry_steps(config, self.device))
        self.loop = DecodeLoop(config.overlap_decode, self.scheduler, self.runner, self.sampler, self.recorder,
                               self.counters, lambda: self.swap.version, self.speculator)
        self.isolation = FaultIsolation(self.scheduler, self.requests, self.loop)
        self.swap = WeightSwap(self.model, self.device, config, self.kv, self.scheduler, self.sleeper,
                                     self.counters, self._lock, self.isolation.flush,
                                     lambda: self.requests.post(self.abort(self.requests.ids())))
        self.episodes = EpisodeRunner(self)  # multi-turn episode requests (rollout_service/episodes.py)
        # how environment code is entered: a Ray worker tells its router first (actors/quarantine.py)
        self.user_code: Guard = unguarded
        self._seed_rng = random.Random(config.seed)

    @property
    def policy_version(self) -> int:
        """The version of the weights served now (the last refresh's)."""
        return self.swap.version

    # ---- requests -----------------------------------------------------------------------------------
    def prepare(self, req: RolloutRequest) -> Sequence | EpisodeGroup:
        """Validate and tokenize a request without enqueuing it (ValueError naming the request on bad
        input). The sequence holds a checked copy of the request's sampling params; an episode request
        becomes an EpisodeGroup (its environment copied for each sample)."""
        if not isinstance(req, RolloutRequest):
            raise ValueError(f"expected a RolloutRequest, got {type(req).__name__}")
        try:
            req = req.validated()
            if req.submitted_version is None:  # in-process: submitted now, under the weights served now
                req.submitted_version = self.policy_version
            return self._prepare(req)
        except ValueError as e:
            raise ValueError(f"request {req.request_id!r}: {e}") from None

    def _prepare(self, req: RolloutRequest) -> Sequence | EpisodeGroup:
        if req.request_id in self.requests or req.request_id in self.episodes:
            raise ValueError("this request_id is already in flight")
        check_routing_request(req.sampling, self.model)
        if req.episode is not None:
            seed = req.sampling.seed if req.sampling.seed is not None else self._seed_rng.getrandbits(63)
            return self.episodes.prepare(req, seed)
        try:
            ids = self.prompts.encode(req.prompt, req.apply_chat_template)
        except ValueError:
            raise
        except Exception as e:  # tokenizers reject what they cannot encode with errors of their own
            raise ValueError(f"the tokenizer rejected the prompt ({type(e).__name__}: {e})") from None
        if req.completion is not None:
            return self._prepare_scoring(req, ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(room for at least one new token is needed)")
        longest = min(len(ids) + req.sampling.max_tokens, self.max_model_len)
        if pages_for(longest, self.config.page_size) > self.kv.blocks.num_usable:
            raise ValueError(f"request needs up to {longest} tokens of KV but the whole cache holds "
                             f"{self.kv.blocks.num_usable * self.config.page_size}")
        seed = req.sampling.seed if req.sampling.seed is not None else self._seed_rng.getrandbits(63)
        return Sequence(req.request_id, ids, req.sampling, seed, num_samples=req.sampling.n,
                        submitted_version=req.submitted_version)

    def _prepare_scoring(self, req: RolloutRequest, ids: list[int]) -> Sequence:
        """A scoring sequence: prompt + completion, prefilled, never sampled (engine/scoring.py)."""
        bad = [t for t in req.completion if t >= self.hf_config.vocab_size]
        if bad:
            raise ValueError(f"completion token id {bad[0]} out of range [0, {self.hf_config.vocab_size})")
        total = len(ids) + len(req.completion)
        if total > self.max_model_len:
            raise ValueError(f"prompt + completion have {total} tokens; max_model_len is {self.max_model_len}")
        if pages_for(total, self.config.page_size) > self.kv.blocks.num_usable:
            raise ValueError(f"prompt + completion need {total} tokens of KV but the whole cache holds "
                             f"{self.kv.blocks.num_usable * self.config.page_size}")
        return Sequence(req.request_id, ids + req.completion, req.sampling, 0, score_from=len(ids),
                        submitted_version=req.submitted_version)

    def add_request(self, req: RolloutRequest, seq: Sequence | EpisodeGroup | None = None) -> None:
        """Queue a request; `seq`: what prepare(req) returned (prepared here when None)."""
        with self._lock:
            seq = self.prepare(req) if seq is None else seq
            if seq.request_id != req.request_id:
                raise ValueError(f"add_request: the sequence was prepared for request {seq.request_id!r}, "
                                 f"not {req.request_id!r}")
            if seq.request_id in self.requests or seq.request_id in self.episodes:
                raise ValueError(f"request {seq.request_id!r}: this request_id is already in flight")
            if isinstance(seq, EpisodeGroup):
                self.requests.post(self.episodes.start(seq))  # episodes whose environment failed at once
                return
            self.requests.add(seq, req.metadata, req.stream_tokens)
            self.scheduler.add(seq)

    @property
    def num_requests(self) -> int:
        """Requests in flight (an episode's running turns count as its requests)."""
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(len(self.requests) or self.requests.has_output() or self.episodes.has_unfinished())

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Finish the given requests now (finish_reason "abort", tokens so far); unknown ids are ignored. An
        episode request's running turns are aborted, which ends its episodes."""
        request_ids = check_request_ids(request_ids)
        out: list[RolloutResult] = []
        with self._lock:
            self.isolation.flush()  # the tokens of the step in flight are the sequences' too
            self.requests.take_through(self.episodes.collect)  # turns that just finished move their episodes on
            for rid in request_ids + self.episodes.turn_ids(request_ids):
                for seq in self.requests.seqs(rid):
                    if not seq.is_finished:
                        out += self.requests.finish(seq, "abort")
            return self.episodes.collect(out)

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RolloutResult]:
        with self._lock, self.runner.threads():
            if self.sleeper.level:
                raise RuntimeError(f"the engine is asleep (level {self.sleeper.level}): call wake_up() first")
            try:
                self.loop.step()
            except Exception as e:
                self.isolation.isolate(e)
            return self.episodes.collect(self.requests.take())  # finished turns move their episodes on

    def token_deltas(self) -> list[TokenDelta]:
        """New tokens of the running samples of requests with stream_tokens, since the last call."""
        with self._lock:
            return self.requests.deltas()

    def run_until_done(self) -> list[RolloutResult]:
        out: list[RolloutResult] = []
        while self.has_unfinished():
            out += self.step()
        return out

    def _result(self, seq: Sequence, metadata: Any, sample_index: int, error: str | None) -> RolloutResult:
        # a failed request's text is left empty: decoding its tokens may be what failed (a scored one's error
        # is a note on its log-probs: scoring.outside_kept_set)
        text = self.prompts.decode(seq.output_token_ids) if error is None or seq.finish_reason == "scored" else ""
        if seq.stop_text_end is not None:
            text = text[:seq.stop_text_end]
        result = RolloutResult(
            request_id=seq.request_id, sample_index=sample_index, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), logprobs=seq.output_logprobs,
            token_versions=list(seq.token_versions), kv_versions=list(seq.kv_versions), finish_reason=seq.finish_reason, text=text,
            top_logprobs=list(seq.output_top) if seq.sampling.logprobs else None, metadata=metadata,
            timings={"queued": seq.t_arrival, "first_token": seq.t_first_token or seq.t_finished,
                     "finished": seq.t_finished}, error=error, **result_routing(self.kv.routing, seq),
        )
        if self.config.batch_invariant and error is None:  # rollout_service/results/receipts.py
            result.receipt = receipt_of(result, self.weights_digest(), self.config.receipt_key)
        return result

    # ---- weights (engine/weight_swap.py) -----------------------------------------------------------------
    def validate_manifest(self, manifest: Any, partial: bool = False) -> None:
        self.swap.validate_manifest(manifest, partial)

    def check_version(self, version: Any) -> None:
        self.swap.check_version(version)

    def update_weights(self, named_tensors: Any, version: int, partial: bool = False,
                       check_finite: bool = True) -> None:
        """Swap the weights at a step boundary after checking every tensor (engine/weight_swap.py)."""
        self.swap.update_weights(named_tensors, version, partial, check_finite)

    def patch_weights(self, writes: Any, entries: Any, base_version: int, version: int) -> None:
        """A delta refresh's checked writes into the weights of `base_version`, in place (engine/weight_swap.py)."""
        self.swap.patch_weights(writes, entries, base_version, version)

    def weights_digest(self) -> str:
        return self.swap.weights_digest()

    # ---- sleep / wake (engine/sleep.py) --------------------------------------------------------------
    @property
    def sleep_level(self) -> int:
        return self.sleeper.level

    @property
    def is_sleeping(self) -> bool:
        return self.sleeper.level > 0

    def sleep(self, level: int = 1) -> None:
        """Free the device memory for a colocated learner. Level 1 parks the weights in host memory, level 2
        drops them (the next update_weights must bring every weight). Sequences in flight are preempted and
        recomputed after wake; requests added meanwhile wait. A deeper level may follow a lighter one."""
        with self._lock:
            self.isolation.flush()
            self.sleeper.sleep(level)

    def wake_up(self) -> None:
        """Weights, KV cache and CUDA graphs back on the device. ValueError if sleep(2) dropped the weights
        and no refresh brought them back; RuntimeError if the KV cache no longer fits. Either way the engine
        stays asleep."""
        with self._lock:
            self.sleeper.wake()

    # ---- introspection ------------------------------------------------------------------------------
    def _prefix_cache_stats(self) -> dict:
        b = self.kv.blocks
        return {"enabled": b.enable_cache, "hit_rate": b.stats.hit_rate, "hit_tokens": b.stats.hit_tokens,
                "queried_tokens": b.stats.queried_tokens, "cached_pages": b.num_cached,
                "evictions": b.stats.evictions, "across_versions": b.across_versions}

    def stats(self) -> dict:
        c, recent = self.counters, list(self.counters.recent)
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        return {
            "queued": len(self.scheduler.waiting), "running": len(self.scheduler.running),
            "kv_pages_used": self.kv.blocks.num_used, "kv_pages_total": self.kv.blocks.num_usable,
            "prefilled_tokens": c.prefilled_tokens, "prefix_cache": self._prefix_cache_stats(),
            "tokens_per_s": sum(n for _, n in recent[1:]) / span if span > 0 else 0.0,
            "policy_version": self.policy_version, "steps": c.steps, "prompt_prefills": c.prompt_prefills,
            "recomputes": c.recomputes, "refresh_recomputes": c.refresh_recomputes, "preemptions": self.scheduler.num_preemptions,
            "overlapped_steps": c.overlapped_steps,
            "generated_tokens": c.generated_tokens, "scored_sequences": c.scored_sequences,
            "scored_tokens": c.scored_tokens, "backend": self.backend, "device": str(self.device),
            "batch_invariant": self.config.batch_invariant, "quantization": self.config.quantization,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "sleep_level": self.sleeper.level, "weights": self.sleeper.parking.state,
            "device_memory_bytes": self.sleeper.device_memory(), "graph_capture_s": self.runner.capture_s,
            "process_gpu_bytes": process_gpu_bytes() if self.device.type == "cuda" else None,
            "speculative": self._speculative_stats(),
        }

    def _speculative_stats(self) -> dict:
        c = self.counters
        return {"enabled": self.speculator is not None, "verify_steps": c.spec_verify_steps,
                "proposed": c.spec_proposed, "accepted": c.spec_accepted,
                "acceptance_rate": c.spec_accepted / c.spec_proposed if c.spec_proposed else 0.0,
                "tokens_per_verify": c.spec_tokens / c.spec_verify_steps if c.spec_verify_steps else 0.0,
                "tokens_per_draft": (c.spec_accepted + c.spec_drafts) / c.spec_drafts if c.spec_drafts else 0.0}

