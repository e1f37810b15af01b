"""Elastic workers: `scale(n)` adds workers to a running service and removes them, during a rollout, losing
nothing (each sample once, seeded tokens those of an undisturbed engine); a scale the cluster cannot place fails
within its timeout and leaves the service as it was; new workers join paused as the others are; bad input is a
ValueError naming it; `rollout-service scale`. One service of the tiny model on the session's cluster (4 CPUs
in all: the workers take one each). Tests run in file order."""
from __future__ import annotations

import time

import pytest
import ray

from ray_fixtures import cpu_engine, wait_for
from rollout_service import cli
from rollout_service.client import RolloutClient
from rollout_service.api.types import RolloutRequest, SamplingParams

pytest_plugins = ["ray_fixtures"]
pytestmark = [pytest.mark.ray, pytest.mark.slow]
NAME = "svc-scale"


@pytest.fixture(scope="module")
def svc(ray_cluster, service_config):
    # (the suite's 600 s to start, as a loaded box needs; the tests that want a scale to time out say so)
    with RolloutClient.launch(service_config(name=NAME, placement={"strategy": "SPREAD", "timeout_s": 600})) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    with cpu_engine(tiny_model_dir, num_pages=256) as c:
        yield c


def requests(prefix: str, k: int, shortest: int = 30) -> list[RolloutRequest]:
    """Seeded, `shortest` to shortest + 25 (k - 1) tokens long: they finish one after another."""
    return [RolloutRequest([7 + i, 8, 9], SamplingParams(n=2, temperature=1.0, max_tokens=shortest + 25 * i,
                                                         ignore_eos=True, seed=11 + i), request_id=f"{prefix}{i}")
            for i in range(k)]


def service_groups() -> list[dict]:
    """The service's placement groups that still hold (or wait for) resources."""
    return [g for g in ray.util.placement_group_table().values()
            if g["name"].startswith(f"{NAME}-workers") and g["state"] != "REMOVED"]


def test_bad_scale_requests_are_refused_by_name(svc, reference):
    for bad, what in ((0, "num_workers=0"), (True, "num_workers=True"), ("2", "num_workers='2'")):
        with pytest.raises(ValueError, match=f"scale: {what}"):
            svc.scale(bad)
    with pytest.raises(ValueError, match="drain_s=-1"):
        svc.scale(2, drain_s=-1)
    with pytest.raises(ValueError, match="timeout_s=nan"):
        svc.scale(2, timeout_s=float("nan"))
    with pytest.raises(ValueError, match="in-process client has one engine"):
        reference.scale(2)
    assert svc.info()["num_workers"] == 2


def test_scale_up_and_down_mid_rollout_loses_nothing(svc, reference):
    first, second = requests("a", 10, 200), requests("b", 10, 250)
    want = {(r.request_id, r.sample_index): r.token_ids for r in reference.generate(first + second)}
    a = svc.stream(first)
    got = [next(a)]
    svc.scale(3)  # mid-rollout: a new worker, which takes part of the next batch
    assert svc.info()["alive"] == [True, True, True]
    b = svc.stream(second)
    wait_for(lambda: all((s["running"] or 0) > 0 for s in svc.stats()), "requests running on all three workers")
    svc.scale(1, drain_s=0.2)  # workers 1 and 2 drain briefly, then hand the rest back to worker 0
    got += list(a) + list(b)
    keys = [(r.request_id, r.sample_index) for r in got]
    assert sorted(keys) == sorted(want) and len(set(keys)) == len(keys), "each sample once, none lost"
    assert all(r.token_ids == want[(r.request_id, r.sample_index)] for r in got)
    info = svc.info()
    assert info["num_workers"] == 1 and info["alive"] == [True] and info["handed_back"] >= 1, info
    assert [g["state"] for g in service_groups()] == ["CREATED"], "the scale-up's group left with its worker"
    assert len(svc.stats()) == 1 and info["in_flight"] == 0

    svc.scale(2)  # the first group's free bundle is taken again
    assert svc.info()["alive"] == [True, True] and len(service_groups()) == 1
    assert len(svc.generate(requests("c", 6))) == 12 and all(s["generated_tokens"] > 0 for s in svc.stats())


def test_a_scale_the_cluster_can_never_hold_is_refused_at_once(svc):
    before = svc.info()
    from ray.util import placement_group_table
    for n in (8, 10**6):  # 8 CPUs or a million: the cluster has 4
        groups = len(placement_group_table())
        t0 = time.monotonic()
        with pytest.raises(ValueError) as e:
            svc.scale(n, timeout_s=300)
        # refused before any placement group exists, not after waiting for one (< 1 s on a quiet machine)
        assert time.monotonic() - t0 < 60 and len(placement_group_table()) == groups
        msg = str(e.value)
        assert msg.startswith(f"scale: cannot place {n} rollout worker(s) of CPU 1") and "\n" not in msg, msg
        assert f"they need CPU {n:g} in all, the Ray cluster has 4" in msg and msg.endswith("keeps its 2 worker(s)")
        assert len(msg) < 300
        assert svc.info()["num_workers"] == 2
    after = svc.info()
    assert {k: after[k] for k in ("num_workers", "alive", "gone")} == \
        {k: before[k] for k in ("num_workers", "alive", "gone")}


def test_a_scale_that_cannot_be_placed_now_fails_in_time_and_changes_nothing(svc):
    """The cluster could hold 4 workers, but 2 of its CPUs are taken by someone else: the new group times out."""
    from ray.util.placement_group import placement_group, remove_placement_group
    other = placement_group([{"CPU": 1}, {"CPU": 1}], name="someone-else")
    ray.get(other.ready(), timeout=30)
    try:
        before = svc.info()
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"cannot place 2 rollout worker\(s\) of CPU 1.* within 3s: the Ray "
                                             r"cluster has .*free of CPU 4.*keeps its 2 worker"):
            svc.scale(4, timeout_s=3)
        assert time.monotonic() - t0 < 30  # the 3 s timeout, plus the router's answer on a loaded machine
        after = svc.info()
        assert {k: after[k] for k in ("num_workers", "alive", "gone")} == \
            {k: before[k] for k in ("num_workers", "alive", "gone")}
        assert len(service_groups()) == 1, "the failed scale's placement group is removed"
    finally:
        remove_placement_group(other)
    assert len(svc.generate(requests("d", 4))) == 8


def test_new_workers_join_paused_as_the_others_are(svc):
    svc.pause()
    try:
        svc.scale(3)
        assert [s["paused"] for s in svc.stats()] == [True, True, True]
    finally:
        svc.resume()
    results = svc.generate(requests("e", 9))
    assert len(results) == 18 and all(s["generated_tokens"] > 0 for s in svc.stats())


def test_the_scale_command(svc, capsys):
    assert cli.main(["scale", "--name", NAME, "--num-workers", "2", "--drain-s", "5"]) == 0
    assert f"rollout service {NAME!r}: 3 -> 2 worker(s), 2 serving" in capsys.readouterr().out
    assert cli.main(["scale", "--name", NAME, "--num-workers", "0"]) == 2
    assert "num_workers=0 must be an int >= 1" in capsys.readouterr().out
    assert svc.info()["alive"] == [True, True]
