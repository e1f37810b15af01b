"""Delta refreshes through the Ray service (bf16 engine weights on the CPU, 2 workers, one service for the module,
tests in file order): real Adam steps sent as deltas over the object store and the gloo broadcast, bit for bit a
dense push's weights; a worker restarted mid-chain; a missing base falling back to dense; corrupt deltas refused
on every worker before any swaps. Then a worker stopped (SIGSTOP) mid-refresh, on each transport: the refresh
fails within its deadline naming it, the other keeps its version, the router restarts it and the next push lands."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import time
import uuid

import pytest
import ray
import torch

from ray_fixtures import kill_worker, wait_for
from rollout_service.client import RolloutClient
from rollout_service.weights.buckets import named_items, plan
from rollout_service.weights.delta import encode

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray

NAME = "svc-delta"
BF16 = {"backend": "torch", "dtype": "bfloat16", "device": "cpu", "num_pages": 64, "max_num_seqs": 8,
        "enable_cuda_graphs": False}


@pytest.fixture(scope="module")
def svc(ray_cluster, service_config, tiny_model_dir):
    # (worker 0 is restarted four times here; the stall tests shorten the refresh deadline while they run)
    cfg = service_config(name=NAME, max_restarts=8, refresh_stall_s=240)
    cfg["engine"].update(BF16)
    with RolloutClient.launch(cfg) as c:
        c._connection.weights.bucket_bytes = 64 << 10  # several buckets: some go sparse, some may go dense
        yield c



def test_the_refresh_deadline_is_the_configs(svc):
    """ServiceConfig.refresh_stall_s reaches the router (the stall tests below shorten it for themselves)."""
    router = svc._connection.router
    assert ray.get(router.__ray_call__.remote(lambda r: r.refresh.stall_s)) == 240

@pytest.fixture(scope="module")
def digest(tiny_model_dir):
    """digest(state): an in-process bf16 engine's weights digest after a dense push of `state`."""
    local = RolloutClient.local(model=tiny_model_dir, **BF16)
    versions = iter(range(1, 10_000))

    def of(state) -> str:
        local.update_weights(state, next(versions), delta=False)
        return local.weights_digests()[0]
    yield of
    local.close()


@pytest.fixture(scope="module")
def learner(make_tiny_llama):
    """next(learner): the state dict after one more Adam step at lr 1e-6 on a tiny Llama (fp32 master weights)."""
    model = make_tiny_llama(seed=1).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)

    def steps():
        yield {k: v.detach().clone() for k, v in model.state_dict().items()}
        while True:
            ids = torch.randint(0, 256, (4, 16), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            yield {k: v.detach().clone() for k, v in model.state_dict().items()}
    return steps()


def push(svc, state, **kw) -> dict:
    """A push as a delta wherever its base allows (delta=True: "auto" would pick by timing, tested apart)."""
    version = svc.info()["policy_version"] + 1
    svc.update_weights(state, version, **{"delta": True, **kw})
    return dict(svc._connection.weights.last_push)


def test_ten_adam_steps_as_deltas_equal_a_dense_push_bit_for_bit(svc, digest, learner):
    first = push(svc, next(learner))
    assert not first["delta"] and first["wire_bytes"] == first["dense_bytes"]  # no base yet
    assert first["dense_bytes"] < 300_000  # sent in bf16, not the learner's fp32
    base = svc._connection.weights.deltas.base
    for _ in range(10):
        state = next(learner)
        sent = push(svc, state)
        assert sent["delta"] and sent["wire_bytes"] * 10 < sent["dense_bytes"], sent
    assert svc._connection.weights.deltas.base is base  # patched in place, not re-allocated
    assert svc.weights_digests() == [digest(state)] * 2
    assert [s["policy_version"] for s in svc.stats()] == [11, 11]


def test_a_worker_restarted_mid_chain_replays_the_base_and_its_deltas(svc, digest, learner):
    for _ in range(3):
        state = next(learner)
        assert push(svc, state)["delta"]
    kill_worker(svc, 0)
    wait_for(lambda: svc.info()["alive"] == [True, True], "worker 0 back in service")
    assert svc.weights_digests() == [digest(state)] * 2
    state = next(learner)
    assert push(svc, state)["delta"]  # the restarted worker copied its base from its replayed weights
    assert svc.weights_digests() == [digest(state)] * 2


def test_a_delta_whose_base_is_missing_goes_dense_to_every_worker(svc, digest, learner):
    other = RolloutClient.connect(NAME)
    try:
        state = next(learner)
        other.update_weights(state, svc.info()["policy_version"] + 1, delta=False)
        state = next(learner)
        assert not push(svc, state)["delta"]  # the service ran another client's version: dense
        assert svc.weights_digests() == [digest(state)] * 2
        other.release_weight_buffers()  # no replay log: a restarted worker waits for the next push
    finally:
        other.close()
    kill_worker(svc, 0)
    wait_for(lambda: svc.info()["awaiting_weights"] == [True, False], "worker 0 waiting for weights")
    state = next(learner)
    assert not push(svc, state)["delta"]  # worker 0 runs its checkpoint, not the base: dense for both
    assert svc.info()["awaiting_weights"] == [False, False]
    assert svc.weights_digests() == [digest(state)] * 2
    state = next(learner)
    assert push(svc, state)["delta"]
    assert svc.weights_digests() == [digest(state)] * 2


def test_auto_sends_a_delta_or_dense_whichever_has_been_faster(svc, digest, learner):
    pusher = svc._connection.weights
    push(svc, next(learner), transport="object_store")
    pace = pusher.paces["object_store"]  # (timings set by hand: the test must not hang on this box's speed)
    pace.seconds, pace.last_probe = {True: 60.0, False: 1.0}, pace.pushes  # deltas have been slower
    state = next(learner)
    assert not push(svc, state, transport="object_store", delta="auto")["delta"]
    assert svc.weights_digests() == [digest(state)] * 2
    pace.seconds, pace.last_probe = {True: 0.001, False: 60.0}, pace.pushes
    state = next(learner)
    assert push(svc, state, transport="object_store", delta="auto")["delta"]  # the dense push kept the base current
    assert svc.weights_digests() == [digest(state)] * 2


@pytest.mark.parametrize("corrupt, message", [
    ("index", "a position \\(260\\) lies past its 64 elements"),
    ("count", "counts 1 changed elements but its position codes hold 2"),
    ("nan", "a value is NaN or inf"),
    ("huge", "a value is 1e\\+30, beyond the canary's bound"),
])
def test_a_corrupt_delta_is_refused_on_every_worker_before_any_swaps(svc, corrupt, message):
    pusher = svc._connection.weights
    base, version = pusher.deltas.base, pusher.deltas.version
    assert version == svc.info()["policy_version"]
    before = svc.weights_digests()
    weights = {n: t.float() for n, t in base.views()}
    weights["model.norm.weight"][[5, 60]] += 0.5  # two changed elements: position codes 6, 55
    items = named_items(weights)
    manifest = plan(items, pusher.bucket_bytes, torch.bfloat16)
    delta, buffers = encode(manifest, items, base, version)
    k = next(k for k, e in enumerate(manifest.entries) if e.name == "model.norm.weight")
    b = manifest.entries[k].bucket
    code, buf = delta.buckets[b], buffers[b].clone()
    j, s = next((j, s) for j, s in enumerate(code.sparse) if s.entry == k)
    assert (s.count, s.width, s.codes) == (2, 1, 2)
    if corrupt == "index":
        buf[s.codes_at + 1] = 255  # the second position: 5 + 255, past the 64 elements
    elif corrupt == "count":
        s = dataclasses.replace(s, count=1)
    else:
        buf[s.values_at:s.values_at + 2].view(torch.bfloat16)[0] = float("nan") if corrupt == "nan" else 1e30
    codes = list(delta.buckets)
    codes[b] = dataclasses.replace(code, sparse=code.sparse[:j] + (s,) + code.sparse[j + 1:])
    buffers = buffers[:b] + [buf] + buffers[b + 1:]
    payload = {"transport": "object_store", "manifest": manifest, "refresh_id": uuid.uuid4().hex,
               "refs": [ray.put(x.numpy()) for x in buffers],
               "delta": dataclasses.replace(delta, buckets=tuple(codes))}
    err = ray.get(pusher.router.update_weights.remote(payload, version + 1))
    assert err is not None and "rejected the refresh" in err and "nothing was changed" in err, err
    assert "the delta for 'model.norm.weight' is corrupt" in err and re.search(message, err), err
    assert svc.weights_digests() == before and svc.info()["policy_version"] == version
    payload.update(delta=delta, refs=[ray.put(x.numpy()) for x in encode(manifest, items, base, version)[1]],
                   refresh_id=uuid.uuid4().hex)
    assert ray.get(pusher.router.update_weights.remote(payload, version + 1)) is None  # the intact one is taken
    pusher.deltas.commit(pusher.deltas.wire(manifest, items, delta=False), version + 1, items)  # (the learner's base too)
    assert svc.weights_digests()[0] != before[0]


def test_deltas_over_the_gloo_broadcast(svc, digest, learner):
    svc.init_weight_group(backend="gloo", timeout_s=30)
    for _ in range(2):
        state = next(learner)
        sent = push(svc, state)  # auto: the weight group
        assert svc._connection.weights.last_timings["transport"] == "broadcast"
        assert sent["delta"] and sent["wire_bytes"] * 10 < sent["dense_bytes"], sent
    assert svc.weights_digests() == [digest(state)] * 2
    state = next(learner)
    assert push(svc, state, transport="object_store")["delta"]
    assert svc.weights_digests() == [digest(state)] * 2


# -- a worker that stops answering mid-refresh (SIGSTOP: alive to Ray, silent) ----------------------------------

STALL_S = 3.0  # the router's deadline for a worker's refresh call, shortened from its 300 s for the test
SLACK_S = 30.0  # what the rest of a refresh may take on a busy box: far under the 300 s a stall used to cost


@contextlib.contextmanager
def stopped(svc, i: int):
    """Worker i's process stopped (SIGSTOP) until the router restarts it (or the block ends: SIGCONT)."""
    pid = next(s["pid"] for s in svc.stats() if s["worker"] == i)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def deadline(svc, seconds: float) -> float:
    """Set the router's refresh deadline (ServiceConfig.refresh_stall_s); returns what it was."""
    router = svc._connection.router

    def swap(r):
        was, r.refresh.stall_s = r.refresh.stall_s, seconds
        return was
    return ray.get(router.__ray_call__.remote(swap))


def back(svc, deaths: int) -> bool:
    """Worker 0 restarted and serving, or waiting for the learner's next push."""
    info = svc.info()
    return info["worker_deaths"] > deaths and (info["alive"][0] or info["awaiting_weights"][0])


def test_a_worker_stopped_during_an_object_store_refresh_fails_it_in_time(svc, digest, learner):
    deadline(svc, STALL_S)
    before, version, deaths = svc.weights_digests(), svc.info()["policy_version"], svc.info()["worker_deaths"]
    t0 = time.monotonic()
    with stopped(svc, 0):
        with pytest.raises(ValueError, match=f"worker 0 did not answer weights_prepare within {STALL_S:g} s: it is "
                                             f"alive but stalled.*restarted and every worker keeps version {version}"):
            svc.update_weights(next(learner), version + 1, transport="object_store")
        assert time.monotonic() - t0 < STALL_S + SLACK_S
        assert [s["policy_version"] for s in svc.stats()][1:] == [version]
        wait_for(lambda: back(svc, deaths), "the router restarting worker 0")
    state = next(learner)
    svc.update_weights(state, version + 1, transport="object_store")
    assert svc.weights_digests() == [digest(state)] * 2 != before
    assert svc.info()["alive"] == [True, True]


def test_a_worker_stopped_mid_broadcast_fails_it_in_time_and_the_next_push_succeeds(svc, digest, learner):
    pusher, router = svc._connection.weights, svc._connection.router
    deadline(svc, STALL_S)
    svc.init_weight_group(backend="gloo", timeout_s=STALL_S)
    before, version, deaths = svc.weights_digests(), svc.info()["policy_version"], svc.info()["worker_deaths"]
    items = named_items(next(learner))
    manifest = pusher.plan(items)
    pusher.fill_broadcast(manifest, items)
    assert ray.get(router.broadcast_begin.remote(pusher.broadcast_payload(manifest), version + 1, False, False,
                                                 STALL_S)) is None  # every worker prepared
    with stopped(svc, 0):
        t0 = time.monotonic()
        finish = router.broadcast_finish.remote()
        with contextlib.suppress(RuntimeError):  # the stopped member reads nothing: the send may time out
            pusher.send()
        err = ray.get(finish, timeout=2 * STALL_S + SLACK_S)
        assert time.monotonic() - t0 < 2 * STALL_S + SLACK_S
        # (the group's timeout + the router's deadline: its peer's receive, blocked behind it, timed out first)
        assert f"the broadcast failed on worker 0 (worker 0 did not answer weights_receive within {2 * STALL_S:g} " \
               "s: it is alive but stalled" in err, err
        assert err.endswith(f"every worker keeps version {version}"), err
        assert svc.weights_digests()[1] == before[1]
        wait_for(lambda: back(svc, deaths), "the router restarting worker 0")
    state = next(learner)
    assert svc.update_weights(state, version + 1) == "broadcast"  # the group is formed again, worker 0 in it
    assert svc.weights_digests() == [digest(state)] * 2 and svc.info()["alive"] == [True, True]
