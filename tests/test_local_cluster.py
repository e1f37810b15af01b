"""scripts/local_cluster.py, the README's way to try the multi-node configs on one machine: it starts a head and
rollout nodes (each its own raylet with `rollout_node`), a process of another user of the cluster joins it at the
printed address as `rollout-service` does, and SIGTERM stops it."""
from __future__ import annotations

import json
import os
import re
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ray  # (a cluster of its own, but Ray all the same: scripts/test.sh runs it with the Ray tests)

JOIN = """
import json, sys
import ray
from rollout_service.connections.ray_cluster import ensure_ray
ensure_ray(sys.argv[1])
print(json.dumps(sorted(n["Resources"].get("rollout_node", 0) for n in ray.nodes() if n["Alive"])))
"""


def line_reader(proc: subprocess.Popen) -> Callable[[], str]:
    """A function giving the script's next line of output, or "" if none comes within 180 s (a hung start
    fails the test rather than hanging it). A thread reads the pipe: select() on the file would not see
    lines already in its read buffer."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")], daemon=True).start()

    def readline() -> str:
        try:
            return lines.get(timeout=180.0)
        except queue.Empty:
            return ""
    return readline


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_cluster_starts_three_nodes_that_a_client_joins_and_stops_on_sigterm():
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "scripts/local_cluster.py", "--store-mb", "80"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        readline = line_reader(proc)
        first = readline()
        m = re.match(r"Ray cluster of 3 nodes at (\S+) ", first)
        assert m, f"unexpected first line: {first!r}"
        printed = first + "".join(readline() for _ in range(6))
        assert f"rollout-service serve --config cluster_configs/multi-node.yaml --address {m[1]}" in printed
        joined = subprocess.run([sys.executable, "-c", JOIN, m[1]], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=120)
        assert joined.returncode == 0, joined.stderr[-2000:]
        assert json.loads(joined.stdout.strip().splitlines()[-1]) == [0, 1.0, 1.0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 0 and readline() == "cluster stopped\n"
