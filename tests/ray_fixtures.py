"""Shared fixtures of the Ray tests: ONE real multi-node Ray cluster per test session (made on this
machine with ray.cluster_utils.Cluster: a head and two "rollout nodes" with a custom resource, each node
with its own raylet, object store and resources) and a tiny random Llama saved as a HF folder. Test
modules load this with `pytest_plugins`.

Every Ray test shares that cluster, so a test that kills a rollout node must leave two rollout nodes
behind it (the `rollout_nodes` fixture adds them back)."""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import ray
import torch

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_SCHEDULER_EVENTS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROLLOUT_NODE = "rollout_node"   # the custom resource cluster_configs/multi-node.yaml asks for
ROLLOUT_NODES = 2               # the session cluster's rollout nodes, which every test leaves as it found them
STORE = 120 * 2**20             # each node's object store
# A killed raylet is declared dead after 4 failed health checks 1 s apart (Ray's defaults: 5 x 3 s); a node
# would have to stall 4 checks of 5 s each to be taken for dead, which no load on this machine comes near.
# Return values over 1 KB go to the object store of the node that made them (Ray's default: 100 KB), as a
# busy worker's result payloads do in production: so the tests see them fetched across nodes, and lost with one.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 5000,
                 "health_check_failure_threshold": 4, "max_direct_call_object_size": 1024}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)


def cpu_engine(model_dir: str, num_pages: int = 64):
    """An in-process fp32 engine on the CPU (a RolloutClient; a context manager): the reference whose tokens and
    weight digests the service's workers must match."""
    from rollout_service.client import RolloutClient
    return RolloutClient.local(model=model_dir, backend="torch", dtype="float32", device="cpu", num_pages=num_pages,
                               enable_cuda_graphs=False)


def _refresh_mid_generation(service, named_tensors, version: int, timeout: float = 60.0) -> None:
    """Push a refresh while the requests just submitted are mid-generation, however fast this machine
    decodes: wait for a new token somewhere, then hold the workers between two steps (pause) so that
    none can finish before the new weights land. `service`: a RolloutClient or a RayConnection."""
    def generated() -> int:
        return sum(s.get("generated_tokens") or 0 for s in service.stats() if s.get("alive", True))
    before, deadline = generated(), time.time() + timeout
    while generated() == before and time.time() < deadline:
        time.sleep(0.01)
    if isinstance(named_tensors, dict):  # (a RayConnection takes the pairs a RolloutClient makes of a dict)
        named_tensors = list(named_tensors.items())
    service.pause()
    try:
        service.update_weights(named_tensors, version)
    finally:  # a failed refresh must not leave the shared service paused for the tests after this one
        service.resume()


def wait_for(cond, what: str, timeout: float = 300.0) -> None:
    """Poll until cond(); the bound is generous, since a Ray actor restarts in seconds on a quiet machine and
    in minutes on an oversubscribed one (passing tests never wait it out)."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"gave up waiting for: {what}"
        time.sleep(0.05)


def workers(service) -> list:
    """The worker actor handles of a service (a RolloutClient or a RayConnection)."""
    router = getattr(service, "_connection", service).router
    return ray.get(router.__ray_call__.remote(lambda router: router.workers))


def kill_worker(service, i: int, noticed_timeout: float = 120.0) -> None:
    """Kill worker i (Ray restarts it) and wait until the new one answers and the router noticed the death."""
    w, deaths = workers(service)[i], service.info()["worker_deaths"]
    old = ray.get(w.health.remote())["incarnation"]
    ray.kill(w, no_restart=False)

    def restarted() -> bool:
        try:
            return ray.get(w.health.remote(), timeout=5)["incarnation"] != old
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
    wait_for(restarted, f"Ray restarting worker {i}")
    wait_for(lambda: service.info()["worker_deaths"] > deaths, f"the router noticing worker {i}'s death",
             noticed_timeout)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="session")
def ray_cluster():
    """Head node (2 CPUs) + 2 nodes with 1 CPU and {"rollout_node": 1} each; the driver is connected."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": STORE, "include_dashboard": False, "_system_config": HEALTH_CHECKS})
    cluster.rollout_nodes = []
    for _ in range(ROLLOUT_NODES):
        add_rollout_node(cluster, wait=False)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="rollout_service_tests", log_to_driver=True)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def add_rollout_node(cluster, wait: bool = True):
    """A node like the session's rollout nodes (1 CPU, {"rollout_node": 1}, its own raylet and store)."""
    node = cluster.add_node(num_cpus=1, resources={ROLLOUT_NODE: 1}, object_store_memory=STORE)
    cluster.rollout_nodes.append(node)
    if wait:
        cluster.wait_for_nodes()
    return node


def kill_rollout_node(cluster, node) -> None:
    """End a rollout node as a crash would: SIGKILL to its raylet, object store and every worker on it."""
    cluster.rollout_nodes.remove(node)
    cluster.remove_node(node, allow_graceful=False)


def node_alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


@pytest.fixture
def rollout_nodes(ray_cluster) -> Iterator:
    """The session cluster, for a test that kills or adds rollout nodes; afterwards it has ROLLOUT_NODES
    rollout nodes again (killed ones replaced by equivalent nodes, extra ones removed). Put it before the
    test's service among the fixtures, so that the service is closed before the nodes are put back."""
    yield ray_cluster
    with contextlib.suppress(Exception):  # (a failure here must not hide the test's own)
        while len(ray_cluster.rollout_nodes) > ROLLOUT_NODES:
            ray_cluster.remove_node(ray_cluster.rollout_nodes.pop())
    while len(ray_cluster.rollout_nodes) < ROLLOUT_NODES:
        add_rollout_node(ray_cluster)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama saved with save_pretrained (no tokenizer: prompts are token ids)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(path)
    return str(path)


def tiny_service_config(model_dir: str, **overrides) -> dict:
    cfg = {
        "name": "svc", "num_workers": 2,
        "resources": {"num_cpus": 1, "num_gpus": 0},
        "engine": {"model": model_dir, "backend": "torch", "dtype": "float32", "device": "cpu",
                   "num_pages": 256, "max_num_seqs": 32, "enable_cuda_graphs": False},
        # a worker's start (a Python process importing torch and building its engine) takes seconds on a quiet
        # machine and minutes on an oversubscribed one: the tests must not fail for a busy box's sake
        "placement": {"strategy": "SPREAD", "timeout_s": 600},
    }
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def refresh_mid_generation():
    """refresh_mid_generation(service, named_tensors, version): a refresh that lands mid-generation."""
    return _refresh_mid_generation


@pytest.fixture(scope="session")
def make_tiny_llama():
    """tiny_llama(seed) -> a HF model with the same config as tiny_model_dir (for refreshes)."""
    return tiny_llama


@pytest.fixture(scope="session")
def service_config(tiny_model_dir):
    """service_config(**overrides) -> a 2-worker service config dict on the tiny model."""
    return lambda **overrides: tiny_service_config(tiny_model_dir, **overrides)


def free_ports(n: int) -> list[int]:
    """n distinct free ports below the kernel's ephemeral range and above Ray's worker ports (10002-19999 by
    default). A port the kernel picked for us (bind to port 0) could be picked again, between our choice and Ray's
    bind, by one of the many processes the other shards' Ray clusters start meanwhile (each takes random ports
    there): a head whose runtime-env agent lost its port that way died at its first actor (CI, 2026-12-07)."""
    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    high = int(range_file.read_text().split()[0]) if range_file.exists() else 32768
    pick, chosen = random.SystemRandom(), []
    while len(chosen) < n:
        port = pick.randrange(20000, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in chosen:
            chosen.append(port)
    return chosen


HEAD_PORTS = ("port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
              "runtime-env-agent-port", "metrics-export-port", "ray-client-server-port")


def start_ray_head(args: list[str], env: dict, log_path: Path, tries: int = 3) -> tuple[subprocess.Popen, dict]:
    """`ray start --head --block` on loopback with every port explicit (the session's clusters hold Ray's default
    ones on this machine) and `args`: (the process, its ports by flag name) once Ray says it started. The GCS port
    answers before the head's raylet has registered, and Ray gives that raylet 30 s (fixed), which a busy 2-core
    box can miss: then the head is stopped and started again, up to `tries` times.

    The head keeps its files in a temp dir of its own, not the machine's /tmp/ray: Ray resolves "auto" (as a job's
    entrypoint is told to connect, by the job supervisor) through the ray_current_cluster file there, which every
    `ray start` and every test cluster's head on this machine rewrites: a job's driver once joined another
    shard's cluster that way, whose router then never ran (CI, 2026-12-07)."""
    for _ in range(tries):
        ports = dict(zip(HEAD_PORTS, free_ports(len(HEAD_PORTS))))
        temp_dir = tempfile.mkdtemp(prefix="rayh-", dir="/tmp")  # short: Ray's socket paths live under it
        with open(log_path, "w") as log:
            head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                                     "--node-ip-address=127.0.0.1", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                                     *args, *(f"--{flag}={port}" for flag, port in ports.items())],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        head.temp_dir = temp_dir
        deadline = time.time() + 300
        while "Ray runtime started" not in log_path.read_text():
            if head.poll() is not None and "timed out during startup" in log_path.read_text():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(head.pid, signal.SIGKILL)  # what it started before giving up
                shutil.rmtree(temp_dir, ignore_errors=True)
                break
            assert head.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        else:
            return head, ports
    raise AssertionError(f"ray start --head timed out {tries} times: " + log_path.read_text()[-3000:])


def stop_ray_head(head: subprocess.Popen, log_path: Path) -> None:
    """Stop a head of start_ray_head; one that died before (taking the module's later tests with it) is an error
    of the fixture, with the end of its log."""
    died = head.poll()
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(head.temp_dir, ignore_errors=True)
    assert died is None, f"the Ray head exited ({died}) before its tests ended: " + log_path.read_text()[-3000:]
