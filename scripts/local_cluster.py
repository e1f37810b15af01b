#!/usr/bin/env python
"""A Ray cluster of several nodes on this machine, to try the multi-node configs: a head node (the learner's,
no `rollout_node`) and rollout nodes with the custom resource `rollout_node` (cluster_configs/multi-node.yaml
places one worker on each), every node with its own raylet, object store and resources.

    python scripts/local_cluster.py [--rollout-nodes 2] [--cpus 1] [--store-mb 200]

It prints the cluster's address and the commands that use it, and runs until interrupted (Ctrl-C or SIGTERM);
then it stops its own nodes, and nothing else of Ray on the machine. Token authentication as for a local
instance (docs/service.md "Security"): a token is made, readable by you alone, if the machine has none.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

# Run from a source tree without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--rollout-nodes", type=int, default=2, help="nodes with the rollout_node resource")
    p.add_argument("--cpus", type=float, default=1, help="CPUs each rollout node offers")
    p.add_argument("--head-cpus", type=float, default=1, help="CPUs the head node offers (the router needs none)")
    p.add_argument("--store-mb", type=int, default=200, help="object store of each node, MiB")
    args = p.parse_args(argv)
    if args.rollout_nodes < 1:
        p.error("--rollout-nodes must be at least 1")

    from ray.cluster_utils import Cluster

    from rollout_service.connections.ray_auth import use_token_auth

    use_token_auth("local")
    store = args.store_mb * 2**20
    # the nodes take this machine's address, as `ray start` does: a client given 127.0.0.1 is sent there by Ray
    cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
        "object_store_memory": store, "num_cpus": args.head_cpus, "include_dashboard": False})
    for _ in range(args.rollout_nodes):
        cluster.add_node(wait=False, object_store_memory=store, num_cpus=args.cpus, resources={"rollout_node": 1})
    cluster.wait_for_nodes()

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    a = cluster.address
    print(f"Ray cluster of {1 + args.rollout_nodes} nodes at {a} (head + {args.rollout_nodes} with rollout_node)\n"
          f"  rollout-service serve --config cluster_configs/multi-node.yaml --address {a}\n"
          f"  rollout-service stats --address {a}\n"
          f"  rollout-service scale --num-workers 3 --address {a}   (a third rollout node: --rollout-nodes 3)\n"
          f"  rollout-service stop --address {a}\n"
          f"  python: RolloutClient.launch('cluster_configs/multi-node.yaml', address='{a}')\n"
          "Ctrl-C stops the cluster.", flush=True)
    stop.wait()
    cluster.shutdown()
    print("cluster stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
