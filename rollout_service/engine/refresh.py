"""A weight refresh inside the engine: the swap at a step boundary, and what it does to the work in flight.

EngineConfig.on_refresh says what happens to sequences part-way through:
  "continue":  they keep their KV and go on with the new weights: token_versions shows the switch, and
               kv_versions shows that later tokens still attend to KV the old weights computed;
  "recompute": they keep their tokens but let go of their KV, and are prefilled again under the new weights
               before their next token (a preemption of every sequence): their later tokens' kv_versions are
               the new version, at the price of that prefill;
  "abort":     they finish now, "abort", with the tokens so far.
A completion being scored (engine/scoring.py) always starts again: a score is one version's.

A part of Engine (engine/engine.py), kept apart so the refresh reads on its own.
"""
from __future__ import annotations

from typing import Any

import torch

from rollout_service.api.checks import check_policy_version
from rollout_service.engine.heap import release_freed_memory
from rollout_service.engine.scoring import restart_partial
from rollout_service.engine.sequence import Sequence
from rollout_service.model.weight_update import apply_named_tensors, validate_manifest, validate_named_tensors
from rollout_service.results.receipts import weights_digest
from rollout_service.weights.buckets import named_items, reject_nonfinite
from rollout_service.weights.canary import reject_overflowing


class WeightRefresh:
    """Engine's refresh (a mixin: the state is the engine's)."""

    def validate_manifest(self, manifest: Any, partial: bool = False) -> None:
        """A refresh's names, shapes and dtypes (no data), checked before its bytes move."""
        validate_manifest(self.model, manifest.entries, partial)

    def check_version(self, version: Any) -> None:
        check_policy_version(version, self.policy_version)

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
        with self._lock:
            self.sleeper.before_refresh(partial)
            self._flush()  # its tokens came from the old weights and say so
            self._digest = None
            apply_named_tensors(plan)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the sources may be reused once this returns
            self.policy_version = version
            restart_partial(self.scheduler.waiting, self._release)
            if self.config.on_refresh == "recompute":
                sched = self.scheduler
                self.counters.refresh_recomputes += len(sched.running) + sum(1 for s in sched.waiting if s.pages)
                sched.preempt_all()
            self.kv.blocks.set_version(version)
            if self.config.on_refresh == "abort":
                self._outbox += self.abort(list(self._requests))
        del items, plan  # the validation's temporaries are garbage now: give their pages back (engine/heap.py)
        release_freed_memory()

    def _release(self, seq: Sequence) -> None:
        """Free a waiting sequence's pages (its routing kept, as a preemption does): it is prefilled again."""
        self.scheduler.on_preempt(seq)
        self.kv.blocks.free(seq)

    def weights_digest(self) -> str:
        """sha256 of every weight by name (rollout_service/results/receipts.py): two engines, or an engine and a learner
        holding the same tensors under the same names, hold bitwise the same weights iff their digests are
        equal. An FP8 weight counts with its scales. Kept until the next refresh."""
        with self._lock:
            if self._digest is None:
                named = list(self.model.named_parameters())
                scales = [(f"{n}.fp8_scale", p.fp8_scale) for n, p in named if getattr(p, "fp8_scale", None) is not None]
                self._digest = weights_digest(named + scales)
            return self._digest
