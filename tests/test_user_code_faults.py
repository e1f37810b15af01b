"""User code — reward functions and environments — that raises BaseException, returns what overflows, ends
the worker's process or never returns: only its own request pays (actors/quarantine.py,
rollout_service/user_code.py); its batch mates finish, and the service keeps serving."""
from __future__ import annotations

import sys
import threading
import time

import pytest
import ray

from ray_fixtures import wait_for, workers
from rollout_service.client import RolloutClient
from rollout_service.api.types import RolloutRequest, SamplingParams
from tiny_models import tiny_hf_model

pytest_plugins = ["ray_fixtures"]

EX = "rollout_service.rewards.examples"
PLAIN = SamplingParams(max_tokens=6, ignore_eos=True)
TIMEOUT_S = 3.0  # the service's user_code_timeout_s here


class Env:
    """Token-id prompts and observations (the tiny models have no tokenizer). `fault` on the first step:
    "exit" raises SystemExit, "interrupt" KeyboardInterrupt, "overflow" answers a reward of 10**400, "hang"
    never returns (it sleeps for an hour)."""

    def __init__(self, fault: str | None = None):
        self.fault = fault

    def reset(self, metadata):
        return [1, 2, 3]

    def step(self, text):
        if self.fault == "exit":
            raise SystemExit(3)
        if self.fault == "interrupt":
            raise KeyboardInterrupt
        if self.fault == "hang":
            time.sleep(3600)
        return [4, 5], 10**400 if self.fault == "overflow" else 1.0, False


def _plain_requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest([7 + i, 8, 9], PLAIN) for i in range(n)]


def _episodes_beside_plain_requests(client, env: Env, n_plain: int = 12) -> tuple[list, list]:
    """An episode of `env` and `n_plain` ordinary requests, submitted at the same time."""
    episodes: list = []
    t = threading.Thread(target=lambda: episodes.extend(
        client.run_episodes([env], SamplingParams(max_tokens=4, ignore_eos=True), max_turns=3)))
    t.start()
    plain = client.generate(_plain_requests(n_plain))
    t.join(timeout=120)
    assert not t.is_alive(), "the episode never came back"
    return episodes, plain


def _all_finished(results) -> bool:
    return all(r.finish_reason == "length" and r.error is None and len(r.token_ids) == 6 for r in results)


# ---- in-process ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local():
    c = RolloutClient.local(tiny_hf_model(), backend="torch", dtype="float32", device="cpu", num_pages=256,
                            enable_cuda_graphs=False)
    yield c
    c.close()


@pytest.mark.parametrize("fault, why", [("exit", "SystemExit: 3"), ("interrupt", "KeyboardInterrupt"),
                                        ("overflow", "reward int 1000000000")])
def test_an_environment_fault_ends_its_own_episode_in_process(local, fault, why):
    episodes, plain = _episodes_beside_plain_requests(local, Env(fault))
    (ep,) = episodes
    assert ep.finish_reason == "abort" and "Env.step()" in ep.error and why in ep.error
    assert _all_finished(plain)
    assert not local.engine.has_unfinished()  # nothing of the episode is left in the engine


def test_a_reward_raising_systemexit_marks_only_its_own_result(local):
    """Eight results finishing in one step are scored in batches of two: the sample that raises is marked,
    its batch mate is not."""
    reqs = [RolloutRequest([3, i + 1], PLAIN, reward=f"{EX}:raising_reward",
                           metadata={"raise": "SystemExit"} if i == 4 else {}) for i in range(8)]
    got = local.generate(reqs)
    assert got[4].reward is None and got[4].reward_error.startswith("SystemExit: raised by sample 0")
    assert [r.reward for i, r in enumerate(got) if i != 4] == [6.0] * 7
    assert all(r.reward_error is None for i, r in enumerate(got) if i != 4)


# ---- through Ray ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def svc(ray_cluster, service_config):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Env travels by value to the workers
    with RolloutClient.launch(service_config(name="svc-user-code", user_code_timeout_s=TIMEOUT_S, max_restarts=20)) as c:
        yield c


def _back_to_full_strength(svc) -> None:
    wait_for(lambda: all(svc.info()["alive"]), "every worker back in service", 120)


@pytest.mark.ray
@pytest.mark.parametrize("fault, why", [("exit", "SystemExit: 3"), ("overflow", "reward int 1000000000")])
def test_an_environment_fault_ends_its_own_episode_over_ray(svc, fault, why):
    deaths = svc.info()["worker_deaths"]
    episodes, plain = _episodes_beside_plain_requests(svc, Env(fault))
    (ep,) = episodes
    assert ep.finish_reason == "abort" and why in ep.error
    assert _all_finished(plain)
    assert svc.info()["worker_deaths"] == deaths and all(h["alive"] for h in _healths(svc))


def _healths(svc) -> list[dict]:
    return ray.get([w.health.remote() for w in workers(svc)])


@pytest.mark.ray
def test_a_reward_that_ends_the_worker_process_is_quarantined_after_one_death(svc):
    before = svc.info()
    culprit = RolloutRequest([5, 6], PLAIN, reward=f"{EX}:exiting_reward", metadata={"exit": True})
    got = svc.generate([*_plain_requests(3), culprit, *_plain_requests(3)])
    bad = got[3]
    assert bad.request_id == culprit.request_id and bad.finish_reason == "abort"
    assert "quarantined" in bad.error and "exiting_reward" in bad.error and "os._exit" in bad.error
    assert _all_finished(got[:3] + got[4:])
    after = svc.info()
    assert after["worker_deaths"] == before["worker_deaths"] + 1
    assert after["quarantined"] == before["quarantined"] + 1 and not any(after["gone"])
    _back_to_full_strength(svc)
    assert _all_finished(svc.generate(_plain_requests(4)))


@pytest.mark.ray
def test_a_reward_that_crashes_the_worker_is_quarantined_at_its_second_death(svc):
    """A crash (here SIGKILL, as the OOM killer or a fault in native code would end the process) cannot be
    told from a kill from outside: the request is resubmitted once, and quarantined when it crashes again."""
    _back_to_full_strength(svc)
    before = svc.info()
    culprit = RolloutRequest([5, 7], PLAIN, reward=f"{EX}:killing_reward", metadata={"kill": True})
    got = svc.generate([*_plain_requests(3), culprit, *_plain_requests(3)])
    assert got[3].finish_reason == "abort" and "quarantined" in got[3].error and "(2 deaths)" in got[3].error
    assert _all_finished(got[:3] + got[4:])
    after = svc.info()
    assert after["worker_deaths"] == before["worker_deaths"] + 2 and after["resubmitted"] > before["resubmitted"]
    _back_to_full_strength(svc)


@pytest.mark.ray
def test_a_wedged_environment_restarts_its_worker_and_is_quarantined(svc):
    _back_to_full_strength(svc)
    deaths = svc.info()["worker_deaths"]
    t0 = time.monotonic()
    episodes, plain = _episodes_beside_plain_requests(svc, Env("hang"))
    (ep,) = episodes
    assert ep.finish_reason == "abort" and "quarantined" in ep.error and "user_code_timeout_s" in ep.error
    assert time.monotonic() - t0 >= TIMEOUT_S
    assert _all_finished(plain)
    assert svc.info()["worker_deaths"] == deaths + 1
    _back_to_full_strength(svc)


@pytest.mark.ray
def test_a_dead_engine_thread_is_a_dead_worker(svc):
    """A worker whose engine thread has ended (here: its step raised SystemExit) is restarted and the
    requests it held finish on the others."""
    _back_to_full_strength(svc)
    deaths = svc.info()["worker_deaths"]

    def end_the_engine_thread(worker):
        def step():
            raise SystemExit("the engine thread ends")
        worker.engine.step = step

    ray.get(workers(svc)[0].__ray_call__.remote(end_the_engine_thread))
    got = svc.generate(_plain_requests(8))
    assert _all_finished(got)
    wait_for(lambda: svc.info()["worker_deaths"] > deaths, "the router counting the death", 30)
    _back_to_full_strength(svc)
    assert all(h["alive"] and h["error"] is None for h in _healths(svc))
