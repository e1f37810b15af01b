"""A weight refresh inside the engine: the swap at a step boundary, and what it does to the work in flight.

EngineConfig.on_refresh says what happens to sequences part-way through:
  "continue":  they keep their KV and go on with the new weights: token_versions shows the switch, and
               kv_versions shows that later tokens still attend to KV the old weights computed;
  "recompute": they keep their tokens but let go of their KV, and are prefilled again under the new weights
               before their next token (a preemption of every sequence): their later tokens' kv_versions are
               the new version, at the price of that prefill;
  "abort":     they finish now, "abort", with the tokens so far.
A completion being scored (engine/scoring.py) always starts again: a score is one version's.

Owns: the policy version and the digest of its weights. May call: the model's parameters, the scheduler and
the KV blocks (what a swap does to work in flight), the sleeper (weights parked in host memory), and what the
engine hands it: its lock (a swap lands between two steps), `flush` (record the step in flight) and `abort_all`.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from rollout_service.api.checks import check_policy_version
from rollout_service.config import EngineConfig
from rollout_service.engine.heap import release_freed_memory
from rollout_service.engine.kv_cache import KVCache
from rollout_service.engine.scheduler import Scheduler
from rollout_service.engine.scoring import restart_partial
from rollout_service.engine.sequence import Sequence
from rollout_service.engine.sleep import Sleeper
from rollout_service.model.weight_update import (apply_named_tensors, current_weights, validate_manifest,
                                                  validate_named_tensors)
from rollout_service.results.receipts import weights_digest
from rollout_service.weights.buckets import TensorEntry, named_items, reject_nonfinite
from rollout_service.weights.canary import reject_overflowing
from rollout_service.weights.delta import Write, apply
from rollout_service.weights.refusals import NO_BASE


class WeightSwap:
    def __init__(self, model: torch.nn.Module, device: torch.device, config: EngineConfig, kv: KVCache,
                 scheduler: Scheduler, sleeper: Sleeper, counters: Any,
                 lock: threading.RLock, flush: Callable[[], None], abort_all: Callable[[], None]):
        self.model, self.device, self.config, self.kv = model, device, config, kv
        self.scheduler, self.sleeper, self.counters = scheduler, sleeper, counters
        self.lock, self.flush, self.abort_all = lock, flush, abort_all
        self.version = 0
        self._digest: str | None = None  # the weights digest of this version, once a receipt needed it

    def validate_manifest(self, manifest: Any, partial: bool = False) -> None:
        """A refresh's names, shapes and dtypes (no data), checked before its bytes move."""
        validate_manifest(self.model, manifest.entries, partial)

    def check_version(self, version: Any) -> None:
        check_policy_version(version, self.version)

    def update_weights(self, named_tensors: Any, version: int, partial: bool = False,
                       check_finite: bool = True) -> None:
        """Validate every tensor (name, shape, dtype, every weight present unless `partial`, finite and within
        the canary's bound unless told otherwise: weights/canary.py), then swap at a step boundary; in-flight work as on_refresh says (module docstring).
        While asleep the weights come back to the device with the new values; wake_up restores the rest."""
        self.check_version(version)
        items = named_items(named_tensors)
        plan = validate_named_tensors(self.model, items, partial)
        if check_finite:
            reject_nonfinite(items)
            reject_overflowing(items)
        with self.lock:
            self.sleeper.before_refresh(partial)
            self.flush()  # its tokens came from the old weights and say so
            self._digest = None
            apply_named_tensors(plan)
            self._swapped(version)
        del items, plan  # the validation's temporaries are garbage now: give their pages back (engine/heap.py)
        release_freed_memory()

    def patch_weights(self, writes: list[Write], entries: list[TensorEntry], base_version: int,
                      version: int) -> None:
        """A delta refresh (weights/delta.py): `writes`, decoded and checked against this engine's weights of
        `base_version`, done in place at a step boundary; only the changed elements move. `entries`: the
        manifest's, naming what the writes' names refer to. ValueError if this engine no longer runs the base,
        or slept its weights away (level 2) since."""
        self.check_version(version)
        with self.lock:
            if self.version != base_version:
                raise ValueError(f"update_weights: {NO_BASE}: this engine runs version {self.version}, the delta "
                                 f"applies to version {base_version}")
            self.sleeper.before_refresh(partial=True)
            self.flush()
            self._digest = None
            with torch.no_grad():
                apply(writes, dict(current_weights(self.model, entries)))
            self._swapped(version)

    def _swapped(self, version: int) -> None:
        """The new weights are written (queued, on a GPU): the version moves and work in flight follows
        on_refresh."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sources may be reused once this returns
        self.version = version
        restart_partial(self.scheduler.waiting, self._release)
        if self.config.on_refresh == "recompute":
            sched = self.scheduler
            self.counters.refresh_recomputes += len(sched.running) + sum(1 for s in sched.waiting if s.pages)
            sched.preempt_all()
        self.kv.blocks.set_version(version)
        if self.config.on_refresh == "abort":
            self.abort_all()

    def _release(self, seq: Sequence) -> None:
        """Free a waiting sequence's pages (its routing kept, as a preemption does): it is prefilled again."""
        self.scheduler.on_preempt(seq)
        self.kv.blocks.free(seq)

    def weights_digest(self) -> str:
        """sha256 of every weight by name (rollout_service/results/receipts.py): two engines, or an engine and a learner
        holding the same tensors under the same names, hold bitwise the same weights iff their digests are
        equal. An FP8 weight counts with its scales. Kept until the next refresh."""
        with self.lock:
            if self._digest is None:
                named = list(self.model.named_parameters())
                scales = [(f"{n}.fp8_scale", p.fp8_scale) for n, p in named if getattr(p, "fp8_scale", None) is not None]
                self._digest = weights_digest(named + scales)
            return self._digest
