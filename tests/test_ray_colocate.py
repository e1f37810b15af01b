"""Colocated training, the service's side: a learner actor placed in a worker's bundle on the half the
worker leaves, a sleep that lasts only while the client that asked for it lives, a worker that dies while
asleep, and the learner's fidelity reports. One 2-worker service with `colocate: true` and a 3 s client
lease; tests run in file order on it, the worker kill last."""
from __future__ import annotations

import threading
import time

import pytest
import ray

from rollout_service.connections.capacity import worker_bundle
from actors.placement import colocated_share
from actors.router import RouterActor
from ray_fixtures import cpu_engine, kill_worker, wait_for, workers
from rollout_service.client import RolloutClient
from rollout_service.fidelity import fidelity_line
from rollout_service.config import ServiceConfig
from rollout_service.connections.ray import RayConnection
from rollout_service.api.types import SamplingParams

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray

NAME, NAMESPACE, LEASE_S = "svc-colocate", "rollout_service", 3.0
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[i, 2, 3] for i in range(1, 9)]  # enough to reach both workers


@pytest.fixture(scope="module")
def svc(ray_cluster, service_config):
    cfg = service_config(name=NAME, namespace=NAMESPACE, colocate=True, client_lease_s=LEASE_S)
    with RolloutClient.launch(cfg) as c:
        yield c


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    with cpu_engine(tiny_model_dir, num_pages=64) as c:
        yield c


def actors():
    """(Probe, SleepyClient), defined here so that Ray ships them by value."""
    class Probe:
        def ready(self) -> bool:
            return True

    class SleepyClient:
        """A client in a process of its own, to be killed."""

        def __init__(self, name: str, namespace: str):
            from rollout_service.client import RolloutClient
            self.client = RolloutClient.connect(name, namespace=namespace)

        def sleep(self, level: int) -> None:
            self.client.sleep(level)
    return ray.remote(num_cpus=0)(Probe), ray.remote(num_cpus=0)(SleepyClient)


def where(actor) -> dict:
    """The placement group, node and resources of an actor, as it sees them."""
    def inside(_) -> dict:  # (a local function: Ray ships it by value)
        import ray
        ctx = ray.get_runtime_context()
        return {"pg": ctx.get_placement_group_id(), "node": ctx.get_node_id(),
                "resources": ctx.get_assigned_resources()}
    return ray.get(actor.__ray_call__.remote(inside))


def sleep_levels(svc: RolloutClient) -> list:
    return [s.get("sleep_level") for s in svc.stats()]


def kill(svc: RolloutClient, i: int) -> None:
    """Kill worker i (Ray restarts it) and wait until the router has it back in service."""
    kill_worker(svc, i, noticed_timeout=60.0)
    wait_for(lambda: svc.info()["alive"][i], f"worker {i} back in service")


# -- placement -----------------------------------------------------------------------------------------

def test_a_colocated_learner_shares_a_workers_bundle_half_and_half(svc):
    info = svc.info()
    assert info["colocate"] is True and info["client_lease_s"] == LEASE_S
    w0, w1 = where(workers(svc)[0]), where(workers(svc)[1])
    assert w0["resources"] == w1["resources"] == {"CPU": 0.5}, "each worker takes half of its bundle {CPU: 1}"
    opts = svc.colocated_options(0)
    assert (opts["num_cpus"], opts["num_gpus"]) == (0.5, 0.0)
    Probe, _ = actors()
    learner = Probe.options(**opts).remote()
    try:
        got = where(learner)
        assert got["pg"] == w0["pg"] == w1["pg"] is not None and got["resources"] == {"CPU": 0.5}
        assert got["node"] == w0["node"] != w1["node"]  # (SPREAD: the two bundles are on two nodes)
        bundle0 = f"CPU_group_0_{got['pg']}"
        # (Ray's view of what is free lags behind the placements by up to a second or so)
        wait_for(lambda: ray.available_resources().get(bundle0, 0) == 0, "bundle 0 full: worker + learner", 10)
    finally:
        ray.kill(learner)

    for bad in (2, -1, "0", True, 0.0):
        with pytest.raises(ValueError, match=r"colocated_options: worker=.* must be an int"):
            svc.colocated_options(bad)


def test_each_party_of_a_colocated_bundle_takes_half_of_its_cpus_and_gpus():
    cfg = ServiceConfig.load(None, colocate=True, resources={"num_cpus": 2, "num_gpus": 1, "custom": {"node": 1}})
    assert colocated_share(cfg) == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert worker_bundle(cfg) == {"CPU": 2.0, "GPU": 1.0, "node": 1.0}  # the bundle itself is as without colocate


def test_colocated_options_need_a_colocated_service(ray_cluster, service_config, local):
    cfg = ServiceConfig.load(service_config(name="svc-not-colocated", namespace=NAMESPACE))
    router = RouterActor.options(num_cpus=0).remote(cfg)  # (not started: no workers needed to refuse)
    try:
        with pytest.raises(ValueError, match="'svc-not-colocated' was not started with colocate: true"):
            RolloutClient(RayConnection(router, cfg.name, owner=False)).colocated_options(0)
    finally:
        ray.kill(router)
    with pytest.raises(ValueError, match="an in-process engine shares the caller's process already"):
        local.colocated_options(0)
    assert local.info()["colocate"] is False


# -- the sleep lease -----------------------------------------------------------------------------------

def test_a_sleep_ends_when_the_client_that_asked_for_it_dies(svc):
    version = svc.info()["policy_version"]
    _, SleepyClient = actors()
    client = SleepyClient.remote(NAME, NAMESPACE)
    ray.get(client.sleep.remote(1))
    assert sleep_levels(svc) == [1, 1] and svc.info()["asleep"] == 1
    ray.kill(client)
    t0 = time.time()
    wait_for(lambda: sleep_levels(svc) == [0, 0], "the workers waking", timeout=LEASE_S + 5)
    assert time.time() - t0 > LEASE_S / 2, "woken before the lease ran out"
    info = svc.info()
    assert info["sleep_expired"] == 1 and info["asleep"] == 0
    results = svc.generate(PROMPTS, GREEDY)
    assert len(results) == 8 and all(r.token_versions == [version] * 4 for r in results)


def test_a_live_client_keeps_the_service_asleep_past_the_lease(svc):
    svc.sleep(1)
    time.sleep(2 * LEASE_S)
    assert sleep_levels(svc) == [1, 1] and svc.info()["asleep"] == 1 and svc.info()["sleep_expired"] == 1
    svc.wake_up()
    assert sleep_levels(svc) == [0, 0]
    assert len(svc.generate(PROMPTS[:2], GREEDY)) == 2


def test_an_orphaned_level2_sleep_waits_for_a_full_refresh_and_then_wakes(svc, local, make_tiny_llama):
    version, expired = svc.info()["policy_version"], svc.info()["sleep_expired"]
    _, SleepyClient = actors()
    client = SleepyClient.remote(NAME, NAMESPACE)
    ray.get(client.sleep.remote(2))
    ray.kill(client)
    wait_for(lambda: svc.info()["sleep_expired"] == expired + 1, "the sleep lease running out", LEASE_S + 5)
    assert sleep_levels(svc) == [2, 2], "the weights were dropped: waking cannot bring them back"
    tasks = ray.get(svc._connection.router.__ray_call__.remote(lambda r: [t.done() for t in r._tasks]))
    assert tasks == [False] * 3, "the poll loops and the lease loop run on"
    state = make_tiny_llama(seed=8).state_dict()
    svc.update_weights(state, version + 1)
    assert sleep_levels(svc) == [0, 0] and svc.info()["asleep"] == 0
    local.update_weights(state, version + 1)
    assert svc.weights_digests() == local.weights_digests() * 2
    assert all(r.token_versions == [version + 1] * 4 for r in svc.generate(PROMPTS, GREEDY))


def test_racing_sleep_and_wake_from_two_clients_leave_the_router_and_the_workers_agreeing(svc):
    """Two clients sleep and wake the service at the same moment, ten times: whichever lands last wins, and
    the router's sleep level is always the workers' (before the fix 3 rounds in 10 ended with the router
    awake and the workers asleep, and a generate then hung)."""
    other = RolloutClient.connect(NAME, namespace=NAMESPACE)
    try:
        for k in range(10):
            start = threading.Barrier(2)
            calls = [lambda: svc.sleep(1), other.wake_up] if k % 2 else [other.wake_up, lambda: svc.sleep(1)]
            threads = [threading.Thread(target=lambda f=f: (start.wait(), f())) for f in calls]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            levels = sleep_levels(svc)
            assert len(set(levels)) == 1 and svc.info()["asleep"] == levels[0], f"round {k}: workers at {levels}, " \
                                                                              f"router at {svc.info()['asleep']}"
        other.wake_up()
        assert sleep_levels(svc) == [0, 0] and svc.info()["asleep"] == 0
        assert len(svc.generate(PROMPTS, GREEDY)) == len(PROMPTS)
    finally:
        other.close()


# -- fidelity reports ----------------------------------------------------------------------------------

REPORT = {"mean_abs": 1.2e-4, "max_abs": 3.1e-2, "kl": 2e-6, "ratio_max": 1.03, "n_tokens": 4096,
          "versions": [3], "note": None}
BAD = [((-1, {}), r"version=-1 must be an int >= 0"),
       ((True, {}), r"version=True must be an int"),
       ((1, [("kl", 1.0)]), r"report must be a dict, got list"),
       ((1, {2: 1.0}), r"report key 2"),
       ((1, {"version": 1}), r"report key 'version'"),
       ((1, {"kl": {"a": 1}}), r"report\['kl'\] holds a dict"),
       ((1, {"kl": [[1.0]]}), r"report\['kl'\] holds a list")]


def test_fidelity_reports_round_trip_and_bad_ones_are_named(svc, local):
    for client in (svc, local):
        client.report_fidelity(3, REPORT)
        client.report_fidelity(4, {"kl": 0.5})
        assert client.info()["fidelity"][-2:] == [{"version": 3, **REPORT}, {"version": 4, "kl": 0.5}]
        for args, message in BAD:
            with pytest.raises(ValueError, match=message):
                client.report_fidelity(*args)
        assert len(client.info()["fidelity"]) == 2
    # the router checks what it is sent, whoever sends it
    assert "version=-1" in ray.get(svc._connection.router.report_fidelity.remote(-1, {}))
    for v in range(300):
        local.report_fidelity(v, {"kl": 0.0})
    kept = local.info()["fidelity"]
    assert len(kept) == 256 and kept[0]["version"] == 300 - 256 and kept[-1]["version"] == 299
    assert fidelity_line({"version": 3, **REPORT}) == \
        "fidelity of version 3: mean |dlogp| 1.2e-04, max 3.1e-02, KL 2e-06, max ratio 1.03 over 4096 tokens"


# -- a worker that dies while asleep (kills a worker: last) ----------------------------------------------

def test_a_worker_that_dies_while_asleep_sleeps_on_takes_the_refresh_and_wakes(svc, local, make_tiny_llama):
    version, expired = svc.info()["policy_version"], svc.info()["sleep_expired"]
    svc.sleep(1)
    kill(svc, 0)
    assert sleep_levels(svc) == [1, 1], "the restarted worker sleeps as its peer does"
    assert where(workers(svc)[0])["resources"] == {"CPU": 0.5}, "the restarted worker keeps its half"
    state = make_tiny_llama(seed=7).state_dict()
    assert svc.update_weights(state, version + 1) == "object_store"
    assert sleep_levels(svc) == [1, 1]
    svc.wake_up()
    local.update_weights(state, version + 1)
    assert svc.weights_digests() == local.weights_digests() * 2
    before = [s["generated_tokens"] for s in svc.stats()]
    results = svc.generate(PROMPTS, GREEDY)
    assert all(r.token_versions == [version + 1] * 4 for r in results)
    assert all(s["generated_tokens"] > b for s, b in zip(svc.stats(), before)), "both workers serve"
    assert svc.info()["sleep_expired"] == expired, "the live client's sleep lasted until its wake_up"
