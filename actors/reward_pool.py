"""Reward actors (`reward_workers: k`): slow or CPU-heavy reward functions run in k Ray actors of their own
instead of in the rollout workers' threads, so that they compete with no engine for its process.

The router starts them with the workers and hands them to every worker; a worker splits the results
that one engine step finished into one batch per actor, each to the next actor in turn. An actor that dies
fails only the results it held (each gets a `reward_error`); Ray restarts it and the results after go on. The actors reserve no CPU: Ray pins none
anyway, and a reservation would compete with the workers' bundles for the nodes' CPUs.
"""
from __future__ import annotations

import itertools
from concurrent.futures import Future

import ray

from rollout_service.connections.remote_errors import error_text, is_down
from rollout_service.connections.ray_cluster import actor_env
from rollout_service.config import ServiceConfig
from rollout_service.rewards.functions import score_all
from rollout_service.api.types import RolloutResult


class RewardActor:
    def score(self, name: str, results: list[RolloutResult]) -> list[tuple[float | None, str | None]]:
        return score_all(name, results)


RewardActorRemote = ray.remote(RewardActor)


def create_reward_actors(config: ServiceConfig) -> list:
    """`config.reward_workers` reward actors (none when 0), restarted by Ray however often they die; a
    call in flight when one dies is not retried (its result gets the error instead)."""
    return [RewardActorRemote.options(num_cpus=0, max_restarts=-1, max_task_retries=0, name=None,
                                      runtime_env=actor_env()).remote()
            for _ in range(int(config.reward_workers))]


class RewardPool:
    """A worker's side of the reward actors: `start` is a RewardRunner starter (one batch per actor call)."""

    def __init__(self, actors: list):
        if not actors:
            raise ValueError("RewardPool: no reward actors")
        self.actors = list(actors)
        self._turn = itertools.count()

    def start(self, name: str, results: list[RolloutResult]) -> Future:
        actor = self.actors[next(self._turn) % len(self.actors)]
        out: Future = Future()

        def done(f: Future) -> None:
            try:
                out.set_result(f.result())
            except Exception as e:
                why = (f"the reward actor died while computing it ({type(e).__name__})" if is_down(e)
                       else f"the reward actor failed: {error_text(e)}")
                out.set_result([(None, why)] * len(results))

        actor.score.remote(name, results).future().add_done_callback(done)
        return out


def kill_reward_actors(actors: list) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass  # already gone
