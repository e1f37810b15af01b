"""What a RolloutClient talks to: the `Connection` protocol, implemented by an in-process engine (local.py) and
by a Ray rollout service (ray.py). Every argument reaches a connection already checked by the client.
("backend" means one thing in this project: the kernels an engine runs, EngineConfig.backend.)"""
from __future__ import annotations

from typing import Any, Iterator, Protocol

from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult


class Connection(Protocol):
    def submit(self, requests: list[RolloutRequest], read_now: bool = False
               ) -> Iterator[RolloutResult | TokenDelta]:
        """Queue the requests, all or none (ValueError naming a bad one); then yield each sample's result as it
        finishes, each (request_id, sample_index) once, and before it, for a request with stream_tokens, its
        TokenDeltas. A stream dropped unread stops its requests. `read_now`: the caller reads at once, so the submit
        may wait for the first results as a read would (over Ray, one call to the service less)."""

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Finish these requests now: their "abort" results (tokens so far), which also end their streams."""

    def update_weights(self, named_tensors: list[tuple[str, Any]], version: int, transport: str, partial: bool,
                       check_finite: bool, delta: bool | str = "auto") -> str:
        """A new policy version, every weight checked before any is applied; returns the transport used. `delta`:
        whether only the changed elements may be sent (rollout_service/weights/delta_sender.py)."""

    def init_weight_group(self, master_address: str | None, backend: str, timeout_s: float) -> None:
        """Form the broadcast group of this process and the workers (ValueError where there is none to form)."""

    def release_weight_buffers(self) -> None:
        """Free what refreshes keep between steps."""

    def weights_digests(self) -> list[str | None]:
        """Per worker, the sha256 of the weights it runs (None: worker down)."""

    def sleep(self, level: int, fail_if_asleep: bool) -> None:
        """Free the device memory for a colocated learner (level 1: weights kept on the host; 2: dropped)."""

    def wake_up(self) -> None: ...

    def scale(self, num_workers: int, drain_s: float, timeout_s: float | None) -> None:
        """num_workers workers from now on (ValueError, nothing changed, if they cannot all be placed in time)."""

    def pause(self) -> None:
        """Hold every engine at its next step boundary until resume()."""

    def resume(self) -> None: ...

    def stats(self) -> list[dict]:
        """Per worker: its engine's counters."""

    def info(self) -> dict:
        """The service as a whole: policy_version, num_workers, in_flight, colocate, fidelity, reward, ..."""

    def colocated_options(self, worker: int) -> dict:
        """Actor options that place a learner in worker `worker`'s bundle (ValueError where there is none)."""

    def report_fidelity(self, version: int, report: dict) -> None:
        """Keep and log a learner's fidelity report (rollout_service/fidelity.py)."""

    def close(self) -> None:
        """End this client's streams and release what it holds; a launched service is shut down."""
