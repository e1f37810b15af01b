"""Weight refresh through the Ray service, by every transport that runs on CPUs (object store, broadcast
over gloo), with real processes: a learner actor, 2 workers; plus sleep/wake. Bitwise checks compare each
worker's weight digest with an in-process engine's on the same tensors. Tests run in file order on one
service; the fault tests come last."""
from __future__ import annotations

import socket
import time

import pytest
import ray
import torch

from ray_fixtures import cpu_engine
from rollout_service.client import RolloutClient
from rollout_service.api.types import RolloutRequest, SamplingParams
from rollout_service.weights.buckets import named_items
from rollout_service.weights.push import WeightPusher

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def svc(ray_cluster, service_config):
    with RolloutClient.launch(service_config(name="svc-weights")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """digest(state) and tokens(state): an in-process engine's view of the same weights."""
    local = cpu_engine(tiny_model_dir)
    versions = iter(range(1, 10_000))

    def load(state):
        local.update_weights(state, next(versions))
        return local

    yield (lambda state: load(state).weights_digests()[0],
           lambda state: [r.token_ids for r in load(state).generate([[5, 6, 7], [9, 1]], GREEDY)])
    local.close()


def versions(client) -> list:
    return [s["policy_version"] for s in client.stats()]


def tokens(client) -> list:
    return [r.token_ids for r in client.generate([[5, 6, 7], [9, 1]], GREEDY)]


def test_object_store_refresh_is_bitwise_and_reuses_its_buckets(svc, reference, make_tiny_llama):
    digest, want_tokens = reference
    a, b = make_tiny_llama(seed=1).state_dict(), make_tiny_llama(seed=2).state_dict()
    # dense pushes (delta=False): their buckets are what is reused (deltas: tests/test_ray_delta.py)
    assert svc.update_weights(a, 1, delta=False) == "object_store"  # auto, CPU tensors, no weight group
    pusher = svc._connection.weights
    buckets = pusher.object_store.buckets
    assert svc.weights_digests() == [digest(a)] * 2 and tokens(svc) == want_tokens(a)
    assert svc.update_weights(b, 2, transport="object_store", delta=False) == "object_store"
    assert buckets is not None and pusher.object_store.buckets is buckets, "the learner's buckets were re-allocated"
    assert svc.weights_digests() == [digest(b)] * 2 and versions(svc) == [2, 2]
    assert all(r.token_versions == [2] * 6 for r in svc.generate([[1, 2]], GREEDY))


def test_explicit_transports_that_cannot_run_here_change_nothing(svc, make_tiny_llama):
    before = svc.weights_digests()
    state = make_tiny_llama(seed=3).state_dict()
    with pytest.raises(ValueError, match="'broadcast' needs a weight group: call client.init_weight_group"):
        svc.update_weights(state, 3, transport="broadcast")
    with pytest.raises(ValueError, match="'cuda_ipc' needs the workers on the learner's node"):
        svc.update_weights(state, 3, transport="cuda_ipc")  # the workers run on the two rollout nodes
    with pytest.raises(ValueError, match="transport='nccl'"):
        svc.update_weights(state, 3, transport="nccl")
    partial = dict(state)
    del partial["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="1 weight\\(s\\) missing, e.g. \\['model.layers.1.mlp.up_proj.weight'\\]"):
        svc.update_weights(partial, 3)
    assert svc.weights_digests() == before and versions(svc) == [2, 2]


def make_learner():
    """A learner in its own process (defined here so Ray ships it by value)."""
    class Learner:
        def __init__(self, name: str):
            from rollout_service import RolloutClient
            self.client = RolloutClient.connect(name)

        def init_group(self) -> None:
            self.client.init_weight_group(backend="gloo", timeout_s=30)

        def push(self, state: dict, version: int, transport: str = "broadcast", **kw) -> str:
            return self.client.update_weights(state, version, transport=transport, **kw)

        def die_mid_broadcast(self, state: dict, version: int) -> None:
            """Begin a broadcast of many buckets, send the first one, and die."""
            import os

            import torch.distributed as dist
            pusher = self.client._connection.weights
            pusher.bucket_bytes = 4096
            items = named_items(state)
            manifest = pusher.plan(items)
            pusher.fill_broadcast(manifest, items)
            err = ray.get(pusher.router.broadcast_begin.remote(pusher.broadcast_payload(manifest),
                                                              version, False, False, 30.0))
            assert err is None, err
            pusher.router.broadcast_finish.remote()  # the workers start receiving
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pusher.group._pg.broadcast([pusher.broadcast_buckets.buffers[0]], opts).wait()
            os._exit(1)

    return ray.remote(max_restarts=0, num_cpus=0)(Learner)


def test_broadcast_from_a_learner_actor_is_bitwise_and_bad_pushes_change_nothing(svc, reference, make_tiny_llama):
    digest, want_tokens = reference
    learner = make_learner().remote("svc-weights")
    ray.get(learner.init_group.remote())
    c = make_tiny_llama(seed=4).state_dict()
    assert ray.get(learner.push.remote(c, 3)) == "broadcast"
    assert svc.weights_digests() == [digest(c)] * 2 and versions(svc) == [3, 3] and tokens(svc) == want_tokens(c)
    bad = dict(c)
    bad["model.norm.weight"] = torch.ones(65)
    with pytest.raises(ValueError, match="model.norm.weight.*shape \\(65,\\)"):
        ray.get(learner.push.remote(bad, 4))
    bad["model.norm.weight"] = torch.full((64,), float("nan"))
    with pytest.raises(ValueError, match="model.norm.weight.*NaN"):
        ray.get(learner.push.remote(bad, 4))
    with pytest.raises(ValueError, match="version=3 must be an int > the current version 3"):
        ray.get(learner.push.remote(c, 3))
    assert svc.weights_digests() == [digest(c)] * 2 and versions(svc) == [3, 3]
    d = make_tiny_llama(seed=5).state_dict()
    assert ray.get(learner.push.remote(d, 4, "auto")) == "broadcast"  # a weight group exists: auto uses it
    assert svc.weights_digests() == [digest(d)] * 2
    ray.kill(learner)
    # the router passed the group's spec and the broadcasts on without loading torch (tests/test_layers.py)
    assert not ray.get(svc._connection.router.__ray_call__.remote(lambda _: "torch" in __import__("sys").modules))


def test_sleep_frees_memory_requests_wait_and_level2_needs_a_refresh(svc, reference, make_tiny_llama):
    digest, want_tokens = reference
    awake = svc.stats()
    svc.sleep(1)
    asleep = svc.stats()
    for a, s in zip(awake, asleep):
        kv = s["kv_pages_total"] + 1  # the scratch page too
        assert s["sleep_level"] == 1 and a["device_memory_bytes"] - s["device_memory_bytes"] >= kv * 1024
    it = svc.stream([RolloutRequest([3, 3, 3], SamplingParams(n=2, max_tokens=5, ignore_eos=True), request_id="zz")])
    time.sleep(0.5)
    assert sum(s["generated_tokens"] for s in svc.stats()) == sum(s["generated_tokens"] for s in asleep)
    svc.wake_up()
    assert sorted(r.sample_index for r in it) == [0, 1]

    svc.sleep(2, fail_if_asleep=True)
    assert all(s["weights"] == "dropped" and s["device_memory_bytes"] == 0 for s in svc.stats())
    with pytest.raises(ValueError, match="asleep \\(sleep level 2\\): call wake_up"):
        svc.generate([[1, 2]], GREEDY)
    with pytest.raises(ValueError, match="level=2"):
        svc.wake_up()
    e = make_tiny_llama(seed=6).state_dict()
    svc.update_weights(e, 5, transport="object_store")
    svc.wake_up()
    assert svc.weights_digests() == [digest(e)] * 2 and tokens(svc) == want_tokens(e)


def test_learner_dies_mid_broadcast_every_worker_keeps_serving_the_old_version(svc, reference, make_tiny_llama):
    digest, _ = reference
    before = svc.weights_digests()
    learner = make_learner().remote("svc-weights")
    ray.get(learner.init_group.remote())
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(learner.die_mid_broadcast.remote(make_tiny_llama(seed=7).state_dict(), 6))
    assert versions(svc) == [5, 5] and svc.weights_digests() == before
    assert len(svc.generate([[1, 2, 3]] * 4, GREEDY)) == 4
    f = make_tiny_llama(seed=8).state_dict()
    deadline = time.time() + 40  # the router ends the dead learner's broadcast once the receives fail
    while True:
        try:
            svc.update_weights(f, 6, transport="object_store")
            break
        except ValueError as e:
            assert "in flight" in str(e) and time.time() < deadline, e
            time.sleep(0.5)
    assert svc.weights_digests() == [digest(f)] * 2


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


@ray.remote
class LateRefusingRouter:
    """Stands in for a router too busy to answer at once (a real one's answer cannot be delayed on cue). It notes
    whether the group's store was already listening when the router was told where it is."""

    def weight_targets(self) -> list[dict]:
        return [{"index": 0, "device": "cpu"}]

    def form_weight_group(self, spec, members: list[int]) -> str:
        import socket  # (this class travels to its worker by value: module-level names would be imported there)
        try:
            socket.create_connection((spec.host, spec.port), timeout=5).close()
            self.told = (spec.host, spec.port, True)
        except OSError:
            self.told = (spec.host, spec.port, False)
        time.sleep(2)
        return "init_weight_group: refused, late"

    def what_it_was_told(self) -> tuple:
        return self.told


def test_a_late_refusal_of_a_weight_group_is_heard_without_waiting_on_the_group(ray_cluster):
    """The learner joins a weight group only once the router has said yes: it used to wait 0.5 s for a refusal,
    then join a group no worker would join, until the group's timeout. Its store listens before anyone is told
    its port (a port found free and bound only later could be taken meanwhile) and closes with the refusal."""
    router = LateRefusingRouter.remote()
    pusher = WeightPusher(router)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="refused, late"):
        pusher.init_group(backend="gloo", timeout_s=300)
    # ~2 s here; a learner that waited on the group would take its 300 s (the bound leaves a busy box room)
    assert time.monotonic() - started < 120, time.monotonic() - started
    assert pusher.group is None and pusher.group_args is None
    host, port, listening = ray.get(router.what_it_was_told.remote())
    assert listening and not _listening(host, port)


def test_second_refresh_while_one_is_in_flight_is_refused(svc, make_tiny_llama):
    pusher = svc._connection.weights
    svc.init_weight_group(backend="gloo", timeout_s=30)
    items = named_items(make_tiny_llama(seed=9).state_dict())
    manifest = pusher.plan(items)
    pusher.fill_broadcast(manifest, items)
    assert ray.get(pusher.router.broadcast_begin.remote(pusher.broadcast_payload(manifest), 7)) is None
    with pytest.raises(ValueError, match="another refresh is in flight"):
        svc.update_weights(make_tiny_llama(seed=10).state_dict(), 8, transport="object_store")
    finish = pusher.router.broadcast_finish.remote()
    pusher.send()
    assert ray.get(finish) is None and versions(svc) == [7, 7]


def test_worker_dies_mid_broadcast_then_rejoins_the_reformed_group(svc, reference, make_tiny_llama):
    digest, want_tokens = reference
    backend, pusher = svc._connection, svc._connection.weights
    workers = ray.get(backend.router.__ray_call__.remote(lambda router: router.workers))
    old = ray.get(workers[0].health.remote())["incarnation"]
    items = named_items(make_tiny_llama(seed=11).state_dict())
    manifest = pusher.plan(items)
    pusher.fill_broadcast(manifest, items)
    assert ray.get(pusher.router.broadcast_begin.remote(pusher.broadcast_payload(manifest), 8)) is None
    ray.kill(workers[0], no_restart=False)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait for the restart, so the dead member cannot take the bytes
        try:
            if ray.get(workers[0].health.remote(), timeout=5)["incarnation"] != old:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.2)
    finish = pusher.router.broadcast_finish.remote()
    with pytest.raises(RuntimeError):
        pusher.send()
    assert "broadcast failed" in ray.get(finish)
    before = svc.stats()[1]
    assert before["policy_version"] == 7 and before["alive"]
    while not svc._connection.info()["awaiting_weights"][0] and time.time() < deadline:
        time.sleep(0.2)
    info = svc._connection.info()
    assert info["awaiting_weights"] == [True, False], info  # restarted after a broadcast: waits for the learner
    assert all(r.token_versions == [7] * 6 for r in svc.generate([[4, 4]] * 3, GREEDY))  # worker 1 serves
    g = make_tiny_llama(seed=12).state_dict()
    assert svc.update_weights(g, 8, transport="broadcast") == "broadcast"  # the group is formed again
    assert svc.weights_digests() == [digest(g)] * 2 and versions(svc) == [8, 8]
    assert svc._connection.info()["alive"] == [True, True] and tokens(svc) == want_tokens(g)


def test_a_lone_worker_restarted_after_a_broadcast_is_healed_by_the_learner(ray_cluster, service_config, reference,
                                                                           make_tiny_llama):
    digest, _ = reference
    client = RolloutClient.launch(service_config(name="svc-heal", num_workers=1))
    try:
        client.init_weight_group(backend="gloo", timeout_s=30)
        h = make_tiny_llama(seed=13).state_dict()
        client.update_weights(h, 1)
        (worker,) = ray.get(client._connection.router.__ray_call__.remote(lambda router: router.workers))
        ray.kill(worker, no_restart=False)
        # no worker can serve until the learner re-sends: generate's result loop does it
        results = client.generate([[1, 2, 3], [4, 5]], GREEDY)
        assert [r.token_versions for r in results] == [[1] * 6] * 2
        assert client.weights_digests() == [digest(h)] and client._connection.info()["worker_deaths"] == 1
        # after a partial broadcast the learner holds only part of the current weights: no resend can heal
        # a restarted worker, which serves again once the learner pushes every weight
        client.update_weights({k: t for k, t in make_tiny_llama(seed=14).state_dict().items() if "mlp" in k}, 2,
                              partial=True)
        ray.kill(worker, no_restart=False)
        with pytest.raises(ValueError, match="last broadcast was partial.*push the full weights"):
            client.generate([[1, 2, 3]], GREEDY)
        full = make_tiny_llama(seed=15).state_dict()
        client.update_weights(full, 3)
        assert client.weights_digests() == [digest(full)]
        assert client.generate([[1, 2, 3]], GREEDY)[0].token_versions == [3] * 6
    finally:
        client.close()
