"""RolloutClient: the one object a learner talks to, in-process (`local`) or over Ray (`launch`/`connect`).

Both modes share this class; only the backend differs. A backend has: submit(requests) -> iterator of
RolloutResults as they finish, update_weights, pause, resume, abort, stats, close.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Iterable, Iterator, Sequence as Seq

from rollout_service.config import EngineConfig
from rollout_service.types import Prompt, RolloutRequest, RolloutResult, SamplingParams


class LocalBackend:
    """An in-process engine stepped by the calling thread. pause() from another thread holds stepping at
    the next step boundary until resume(); a call made while paused fails instead of waiting forever."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._done: dict[str, list[RolloutResult]] = defaultdict(list)  # results of other callers' requests

    def submit(self, requests: list[RolloutRequest]) -> Iterator[RolloutResult]:
        if not self._unpaused.is_set():
            raise RuntimeError("the rollout client is paused: call resume() first")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request_id in one call")
        seqs = [self.engine.prepare(r) for r in requests]  # every request validated before any is queued
        for r, s in zip(requests, seqs):
            self.engine.add_request(r, s)
        return self._drain(set(ids), sum(r.sampling.n for r in requests))

    def _drain(self, ids: set[str], remaining: int) -> Iterator[RolloutResult]:
        while remaining:
            for rid in ids & self._done.keys():
                for res in self._done.pop(rid):
                    remaining -= 1
                    yield res
            if not remaining:
                break
            self._unpaused.wait()
            for res in self.engine.step():
                if res.request_id in ids:
                    remaining -= 1
                    yield res
                else:
                    self._done[res.request_id].append(res)

    def update_weights(self, named_tensors: Any, version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def pause(self) -> None:
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        return self.engine.abort(request_ids)

    def stats(self) -> list[dict]:
        return [self.engine.stats()]

    def close(self) -> None:
        self.engine = None


def _is_single_prompt(p: Any) -> bool:
    return isinstance(p, str) or (isinstance(p, list) and bool(p) and isinstance(p[0], (int, dict)))


class RolloutClient:
    def __init__(self, backend: Any):
        self._backend = backend

    @classmethod
    def local(cls, model: Any = "smollm2-135m", backend: str = "auto", dtype: str | None = None,
              tokenizer: Any = None, **engine_options: Any) -> "RolloutClient":
        """An in-process engine, no Ray. `model`: "smollm2-135m", a HF folder, a .gguf file or a live
        transformers CausalLM (pass `tokenizer=` for text prompts)."""
        from rollout_service.engine.engine import Engine
        config = EngineConfig(model=model, backend=backend, dtype=dtype, **engine_options)
        return cls(LocalBackend(Engine(config, tokenizer=tokenizer)))

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
                 apply_chat_template: bool = True, metadata: Seq[Any] | None = None) -> list[RolloutRequest]:
        """Normalise prompts (one or many; RolloutRequests pass through) into RolloutRequests."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(f"metadata has {len(metadata)} entries for {len(prompts)} prompts")
        sampling = sampling or SamplingParams()
        return [p if isinstance(p, RolloutRequest) else
                RolloutRequest(prompt=p, sampling=sampling, apply_chat_template=apply_chat_template,
                               metadata=None if metadata is None else metadata[i])
                for i, p in enumerate(prompts)]

    def stream(self, prompts: Any, sampling: SamplingParams | None = None, apply_chat_template: bool = True,
               metadata: Seq[Any] | None = None) -> Iterator[RolloutResult]:
        """Yield each sample's result as soon as it finishes."""
        return self._backend.submit(self.requests(prompts, sampling, apply_chat_template, metadata))

    def generate(self, prompts: Any, sampling: SamplingParams | None = None, apply_chat_template: bool = True,
                 metadata: Seq[Any] | None = None) -> list[RolloutResult]:
        """All results, prompt-major: prompt 0's n samples, then prompt 1's, ..."""
        reqs = self.requests(prompts, sampling, apply_chat_template, metadata)
        order = {r.request_id: i for i, r in enumerate(reqs)}
        results = list(self._backend.submit(reqs))
        return sorted(results, key=lambda r: (order[r.request_id], r.sample_index))

    def update_weights(self, named_tensors: Any, version: int) -> None:
        """Push a new policy: a dict or (name, tensor) pairs with the transformers model's parameter names."""
        if not isinstance(named_tensors, dict):
            named_tensors = list(named_tensors)
        self._backend.update_weights(named_tensors, version)

    def pause(self) -> None:
        self._backend.pause()

    def resume(self) -> None:
        self._backend.resume()

    def abort(self, request_ids: Iterable[str]) -> list[RolloutResult]:
        return self._backend.abort(list(request_ids))

    def stats(self) -> list[dict]:
        return self._backend.stats()

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
