"""What a service needs of its Ray cluster, checked before anything is placed: "auto" counts resolved from the
cluster's resources, and a service (at start or at a scale) the cluster can never place refused at once, in one
line naming what was asked and what the cluster has.
"""
from __future__ import annotations

import ray

from rollout_service.config import ServiceConfig


def resolve_auto(config: ServiceConfig) -> ServiceConfig:
    """Turn num_gpus/num_workers 'auto' into numbers using the cluster's resources, then refuse at once a
    service the cluster can never place (check_resources)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    device = str(config.engine.device or "")
    if device.startswith("cuda") and not gpus and not (_autoscaler_ceiling() or {}).get("GPU"):
        raise ValueError(f"engine.device={device!r}, but this Ray cluster has no GPU: use device: cpu (or leave it "
                         "unset: cuda where the worker has a GPU, else cpu), or start Ray on GPU nodes")
    if config.resources.num_gpus == "auto":
        config.resources.num_gpus = 1 if gpus else 0
    if config.num_workers == "auto":
        per = config.resources.num_gpus
        config.num_workers = max(1, int(gpus // per)) if per else 1
    check_resources(config)
    return config


def worker_bundle(config: ServiceConfig) -> dict:
    """The resources one rollout worker reserves (its placement bundle), in Ray's names."""
    r = config.resources
    bundle = {"CPU": float(r.num_cpus), "GPU": float(r.num_gpus), **{k: float(v) for k, v in r.custom.items()}}
    if r.memory_gb:
        bundle["memory"] = float(r.memory_gb) * 2**30
    bundle = {k: v for k, v in bundle.items() if v > 0}
    if not bundle:
        raise ValueError("ServiceConfig.resources: a worker must reserve something (num_cpus, num_gpus or custom)")
    return bundle


def check_resources(config: ServiceConfig) -> None:
    """ValueError, before any placement group exists, when the cluster cannot hold the workers' bundles:
    a resource it has none of (a GPU, a custom resource), too little of one in all, or (strategy permitting)
    no way to put the bundles on its nodes. Otherwise Ray would wait placement.timeout_s, its autoscaler
    printing "No available node types can fulfill resource request" meanwhile. A cluster that an autoscaler
    may grow is judged by what it may grow to, and only by resource totals."""
    bundle, n = worker_bundle(config), int(config.num_workers)
    have, ceiling = ray.cluster_resources(), _autoscaler_ceiling()
    what = (f"cannot place {n} rollout worker(s) of {resources_text(bundle)} with strategy "
            f"{config.placement.strategy}")
    for kind, per in bundle.items():
        most = max(have.get(kind, 0.0), (ceiling or {}).get(kind, 0.0))
        if most <= 0:
            raise ValueError(f"{what}: the Ray cluster has no {kind} (it has {resources_text(have)}){_instead(kind)}")
        if most < per * n - 1e-6:
            raise ValueError(f"{what}: they need {kind} {per * n:g} in all, the Ray cluster has {most:g} "
                             f"(lower num_workers or the per-worker resources)")
    if ceiling is None:
        _check_node_fit(config, bundle, n, what)


def _check_node_fit(config: ServiceConfig, bundle: dict, n: int, what: str) -> None:
    """The bundles against each live node's total resources, as the placement strategy would lay them out."""
    fits = [min(int(node["Resources"].get(k, 0.0) / v + 1e-6) for k, v in bundle.items())
            for node in ray.nodes() if node.get("Alive")]
    strategy = config.placement.strategy
    if strategy == "STRICT_PACK" and max(fits, default=0) < n:
        why = f"STRICT_PACK puts every worker on one node, and the most any node holds is {max(fits, default=0)}"
    elif strategy == "STRICT_SPREAD" and sum(1 for f in fits if f) < n:
        why = (f"STRICT_SPREAD puts each worker on a node of its own, and only {sum(1 for f in fits if f)} "
               f"node(s) can hold one")
    elif not any(fits):
        why = "no node has all of one worker's resources"
    elif sum(fits) < n:
        why = f"the cluster's nodes hold only {sum(fits)} such bundle(s) between them"
    else:
        return
    raise ValueError(f"{what}: {why}")


def _autoscaler_ceiling() -> dict | None:
    """The most of each resource an autoscaler may bring up (its node types times their max counts), or None
    for a cluster without one (a local instance, `ray start` by hand): its nodes are all it will have."""
    try:
        from ray._private.state import state
        return state.get_max_resources_from_cluster_config()
    except Exception:  # private API: a Ray that moved it is judged without an autoscaler
        return None


def resources_text(resources: dict) -> str:
    """{'CPU': 2.0, 'memory': 3.4e9, 'node:10.0.0.1': 1.0, ...} as 'CPU 2, memory 3.2 GiB', Ray's per-node
    bookkeeping entries left out."""
    parts = []
    for k, v in sorted(resources.items()):
        if k.startswith(("node:", "accelerator_type:")) or k == "object_store_memory":
            continue
        parts.append(f"{k} {v / 2**30:.1f} GiB" if k == "memory" else f"{k} {v:g}")
    return ", ".join(parts) or "nothing"


def _instead(kind: str) -> str:
    if kind == "GPU":
        return ("; on a machine without GPUs use cluster_configs/local-cpu.yaml (or set resources.num_gpus: 0 "
                "and engine.device: cpu)")
    if kind in ("CPU", "memory"):
        return ""
    return (f"; workers go only to nodes started with it (`ray start ... --resources='{{\"{kind}\": 1}}'`, "
            f"cluster_configs/multi-node.yaml's header); on one machine use cluster_configs/local-cpu.yaml")


