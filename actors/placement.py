"""Where the workers run: one placement group with one resource bundle per worker.

With `colocate: true` a bundle is shared by a worker and one learner: each takes half of its CPUs and GPUs
(custom resources and memory stay with the worker), so the two land on the same node and the same GPU.
"""
from __future__ import annotations

import asyncio

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout_service.config import ServiceConfig


def worker_bundle(config: ServiceConfig) -> dict:
    r = config.resources
    bundle = {"CPU": float(r.num_cpus), "GPU": float(r.num_gpus), **{k: float(v) for k, v in r.custom.items()}}
    if r.memory_gb:
        bundle["memory"] = float(r.memory_gb) * 2**30
    bundle = {k: v for k, v in bundle.items() if v > 0}
    if not bundle:
        raise ValueError("ServiceConfig.resources: a worker must reserve something (num_cpus, num_gpus or custom)")
    return bundle


def colocated_share(config: ServiceConfig) -> dict:
    """The CPUs and GPUs that one party (the worker, or its learner) of a colocated bundle takes: half."""
    bundle = worker_bundle(config)
    return {"num_cpus": bundle.get("CPU", 0) / 2, "num_gpus": bundle.get("GPU", 0) / 2}


def learner_options(config: ServiceConfig, pg: object, i: int) -> dict:
    """`SomeActor.options(**kw)` that put an actor in worker i's bundle, on the half the worker leaves."""
    return {**colocated_share(config),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}


async def create_workers(config: ServiceConfig, reward_actors: list | None = None) -> tuple[list, object]:
    """Reserve the bundles (or fail with what the cluster lacks), then start one worker per bundle. Each
    worker gets the service's default reward and the reward actors (actors/reward_pool.py), if any."""
    from actors.rollout_worker import RolloutWorkerActor

    n, bundle = int(config.num_workers), worker_bundle(config)
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=config.placement.strategy,
                         name=f"{config.name}-workers")
    try:
        await asyncio.wait_for(asyncio.wrap_future(pg.ready().future()), config.placement.timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(pg)
        raise ValueError(
            f"cannot place {n} rollout worker(s) of {bundle} with strategy {config.placement.strategy} "
            f"within {config.placement.timeout_s}s; cluster resources: {ray.cluster_resources()}")
    # (Ray restarts an actor with the options it was created with: a restarted worker keeps its share)
    share = colocated_share(config) if config.colocate else {"num_cpus": bundle.get("CPU", 0),
                                                             "num_gpus": bundle.get("GPU", 0)}
    workers = []
    for i in range(n):
        opts = dict(**share,
                    resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                    max_restarts=config.max_restarts, max_task_retries=0,
                    max_concurrency=config.max_concurrency, name=None,
                    # transformers' GGUF conversion bar is plain tqdm; through Ray's log forwarding its
                    # carriage returns become blank "(RolloutWorker pid=...)" lines. tqdm reads this at import.
                    runtime_env={"env_vars": {"TQDM_DISABLE": "1"}})
        if "memory" in bundle:
            opts["memory"] = bundle["memory"]
        engine = config.engine.to_dict() if isinstance(config.engine.model, str) else vars(config.engine)
        workers.append(RolloutWorkerActor.options(**opts).remote(dict(engine), i, reward=config.reward,
                                                                 reward_actors=list(reward_actors or [])))
    return workers, pg
