"""Where a worker runs: the resource bundle it reserves (actors/slots.py holds the placement groups of those
bundles), and the actor started in one.

With `colocate: true` a bundle is shared by a worker and one learner: each takes half of its CPUs and GPUs
(custom resources and memory stay with the worker), so the two land on the same node and the same GPU.
"""
from __future__ import annotations

from typing import Any, Callable

from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout_service.connections.capacity import worker_bundle
from rollout_service.connections.ray_cluster import actor_env
from actors.slots import Slot
from rollout_service.config import ServiceConfig


def colocated_share(config: ServiceConfig) -> dict:
    """The CPUs and GPUs that one party (the worker, or its learner) of a colocated bundle takes: half."""
    bundle = worker_bundle(config)
    return {"num_cpus": bundle.get("CPU", 0) / 2, "num_gpus": bundle.get("GPU", 0) / 2}


def learner_options(config: ServiceConfig, slot: Slot) -> dict:
    """`SomeActor.options(**kw)` that put an actor in a worker's bundle, on the half the worker leaves."""
    return {**colocated_share(config),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(slot.group,
                                                                    placement_group_bundle_index=slot.bundle)}


def start_worker(config: ServiceConfig, slot: Slot, i: int, reward_actors: list,
                 engine_factory: Callable[[dict], Any] | None = None) -> Any:
    """Worker i's actor, in `slot`'s bundle, with the service's default reward and the reward actors
    (actors/reward_pool.py). `engine_factory`: benchmarks only (benchmarks/harness/fabricated.py)."""
    from actors.rollout_worker import RolloutWorkerActor

    bundle = worker_bundle(config)
    # (Ray restarts an actor with the options it was created with: a restarted worker keeps its share)
    share = colocated_share(config) if config.colocate else {"num_cpus": bundle.get("CPU", 0),
                                                             "num_gpus": bundle.get("GPU", 0)}
    opts = dict(**share,
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(slot.group, placement_group_bundle_index=slot.bundle),
                max_restarts=config.max_restarts, max_task_retries=0,
                max_concurrency=config.max_concurrency, name=None,
                # transformers' GGUF conversion bar is plain tqdm; through Ray's log forwarding its
                # carriage returns become blank "(RolloutWorker pid=...)" lines. tqdm reads this at import.
                runtime_env=actor_env(TQDM_DISABLE="1"))
    if "memory" in bundle:
        opts["memory"] = bundle["memory"]
    engine = config.engine.to_dict() if isinstance(config.engine.model, str) else vars(config.engine)
    extra = {"engine_factory": engine_factory} if engine_factory is not None else {}
    return RolloutWorkerActor.options(**opts).remote(dict(engine), i, reward=config.reward,
                                                     reward_actors=list(reward_actors), **extra)
