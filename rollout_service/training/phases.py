"""The clock of one RL step: wall time split into named phases, the rest counted as idle.

A step of a colocated learner is rollout -> reward -> sleep (the engine hands over its GPU memory) ->
learner (forward, backward, optimizer) -> refresh (new weights to the workers) -> wake. What users judge is
the step time and how much of it is neither generation nor training: `overhead_share`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("rollout", "reward", "learner", "refresh", "sleep", "wake")


class StepClock:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown step phase {name!r}; phases: {PHASES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def row(self) -> dict:
        """{step_s, <phase>_s..., idle_s, overhead_share}: idle is the step's time in no phase; the overhead
        share is everything but rollout and learner compute, over the step."""
        step = time.perf_counter() - self.start
        out = {"step_s": step, **{f"{k}_s": v for k, v in self.seconds.items()}}
        out["idle_s"] = max(0.0, step - sum(self.seconds.values()))
        out["overhead_share"] = (step - self.seconds["rollout"] - self.seconds["learner"]) / step if step > 0 else 0.0
        return out
