"""ShardedStream: one submission whose requests went to several routers (ServiceConfig.routers > 1), read as one
iterator: a read is outstanding on every router at once, and results come in the order they reach this process.
"""
from __future__ import annotations

from typing import Any, Iterator

import ray

from rollout_service.api.types import RolloutResult
from rollout_service.results.stream import ResultStream


class ShardedStream(Iterator[RolloutResult]):
    def __init__(self, streams: list[ResultStream]):
        self.streams = streams
        self._reads: dict[Any, ResultStream] = {}  # an outstanding read (ObjectRef) -> its stream

    def __iter__(self) -> "ShardedStream":
        return self

    def __next__(self) -> RolloutResult:
        while True:
            for s in self.streams:
                if (r := s.pop()) is not None:
                    return r
            waiting = set(self._reads.values())
            for s in self.streams:
                if not s.finished and s not in waiting:
                    self._reads[s.ask()] = s
            if not self._reads:
                raise StopIteration
            (ready,), _ = ray.wait(list(self._reads), num_returns=1)
            self._reads.pop(ready).take(ray.get(ready))

    @property
    def open(self) -> bool:
        return any(s.open for s in self.streams)

    def close(self) -> None:
        """Stop every router's part now (each forgets it and aborts what still runs for it)."""
        for s in self.streams:
            s.close()
