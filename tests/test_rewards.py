"""Rewards computed by the service (rollout_service/rewards/runner.py): in-process and through Ray, in the workers'
threads and in reward actors; a reward that raises marks only its results, a name that cannot be imported is
a ValueError at the client (and a request error at a worker), and the service keeps serving."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import ray

from ray_fixtures import wait_for
from rollout_service.client import RolloutClient
from rollout_service.config import ServiceConfig
from rollout_service.rewards.functions import resolve, score
from rollout_service.api.types import RolloutRequest, RolloutResult, SamplingParams
from tiny_models import tiny_hf_model

pytest_plugins = ["ray_fixtures"]

EX = "rollout_service.rewards.examples"
SP = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)


@pytest.fixture(scope="module")
def local():
    c = RolloutClient.local(tiny_hf_model(), backend="torch", dtype="float32", device="cpu", num_pages=256,
                            enable_cuda_graphs=False, reward=f"{EX}:length_reward")
    yield c
    c.close()


@pytest.fixture(scope="module")
def service(ray_cluster, service_config):
    """One worker, rewards in its threads, the length reward by default."""
    with RolloutClient.launch(service_config(name="svc-rewards", num_workers=1, reward=f"{EX}:length_reward")) as c:
        yield c


def _parity(r: RolloutResult) -> float:
    return float(sum(r.token_ids) % 2 == 0)


# -- resolving and scoring ----------------------------------------------------------------------------
@pytest.mark.parametrize("name, why", [
    ("rollout_service.no_such_module:f", "cannot import module 'rollout_service.no_such_module'"),
    (f"{EX}:no_such_function", f"module '{EX}' has no attribute 'no_such_function'"),
    (f"{EX}:NOT_CALLABLE", "'NOT_CALLABLE' is a float, not a function"),
    ("no_colon", "must be an importable \"module:function\" name"),
    ("os.path :join", "must be an importable \"module:function\" name"),
    ("builtins:id", "'id' is a builtin_function_or_method, not a function fn(result) -> float defined with def"),
    ("builtins:sorted", "not a function fn(result) -> float defined with def"),
    ("shutil:copyfile", "copyfile() must take one argument, the result; it needs 2"),
    ("this:s", "module 'this' has no attribute 's' that is a function defined with def"),
    ("http.server:test", "test() must take one argument, the result; it needs 0"),
])
def test_unimportable_names_are_value_errors_naming_why(local, name, why):
    with pytest.raises(ValueError, match="reward") as e:
        resolve(name)
    assert why in str(e.value) and name in str(e.value)
    for call in (lambda: local.generate([[1, 2, 3]], SP, reward=name),
                 lambda: local.stream([[1, 2, 3]], SP, reward=name),
                 lambda: local.generate([RolloutRequest([1, 2, 3], SP, reward=name)]),
                 lambda: ServiceConfig(reward=name),
                 lambda: RolloutClient.local("no-such-model", reward=name)):  # (the reward is checked first)
        with pytest.raises(ValueError, match="reward") as e:
            call()
        assert why in str(e.value)
    assert local.info()["in_flight"] == 0  # nothing was queued


def test_a_name_is_checked_before_its_module_runs():
    """A module not yet imported is read, not run, to check the name: importing `this` prints the Zen of Python,
    and http.server:test would open a listener on port 8000."""
    code = ("import sys\nfrom rollout_service.rewards.functions import resolve\n"
            "for name in ('this:s', 'http.server:test', 'json.tool:main'):\n"
            "    try:\n        resolve(name)\n    except ValueError as e:\n        print(e)\n"
            "print(sorted(m for m in ('this', 'http.server', 'json.tool', 'json') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and "Beautiful is better" not in out.stdout, out.stdout
    assert "test() must take one argument" in lines[1] and "main() must take one argument" in lines[2]
    assert lines[3] == "[]"  # not even the package json was run


def test_a_reward_is_found_outside_the_repository_and_through_an_import_finder(tmp_path):
    """From another directory (the package installed, not on the working directory's path), and a module of a
    package that an import hook finds, as `pip install -e` installs one (a finder on sys.meta_path), neither
    module run."""
    pkg = tmp_path / "src" / "hooked_task"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the package ran')\n")
    (pkg / "rewards.py").write_text("def exact(result):\n    return 1.0\n")
    code = ("import importlib.machinery, sys\n"
            "class Hook:\n"
            "    @classmethod\n"
            "    def find_spec(cls, name, path=None, target=None):\n"
            f"        if name == 'hooked_task':\n"
            f"            return importlib.machinery.PathFinder.find_spec(name, [{str(pkg.parent)!r}])\n"
            "sys.meta_path.append(Hook)\n"
            "from rollout_service.rewards.functions import _check_source, resolve\n"
            "print(resolve('rollout_service.rewards.examples:length_reward').__name__)\n"
            "_check_source('hooked_task.rewards', 'exact', 'reward')\n"
            "print('hooked_task' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["length_reward", "False"], out.stderr[-2000:]


def test_score_marks_what_is_not_a_finite_float():
    r = RolloutResult("r", 0, [1], [2, 4], [-0.5, -0.5], [0, 0], "length")
    assert score(f"{EX}:length_reward", r) == (2.0, None)
    assert score(f"{EX}:not_a_number_reward", r) == (None, "ValueError: the reward function returned a str, "
                                                           "not a float")
    r.metadata = {"fail": True}
    assert score(f"{EX}:failing_reward", r) == (None, "RuntimeError: no reward for sample 0")


def test_service_config_reward_fields():
    cfg = ServiceConfig(reward=f"{EX}:length_reward", reward_workers=2)
    assert cfg.to_dict()["reward"] == f"{EX}:length_reward" and cfg.reward_workers == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"ServiceConfig.reward_workers=.*must be an int >= 0"):
            ServiceConfig(reward_workers=bad)


# -- in-process ---------------------------------------------------------------------------------------
def _check_rewards(client, default_is_length: bool = True) -> None:
    """Default reward, a per-call one, a raising one next to good ones, a non-float: each marked alone."""
    got = client.generate([[1, 2, 3], [4, 5]], SP)
    assert len(got) == 4 and all(r.reward == 6.0 and r.reward_error is None for r in got)
    got = client.generate([[1, 2, 3], [4, 5]], SP, reward=f"{EX}:parity_reward")
    assert all(r.reward == _parity(r) for r in got)
    got = client.generate([[1, 2, 3], [4, 5], [6]], SP, reward=f"{EX}:failing_reward",
                          metadata=[None, {"fail": True}, {}])
    failed = [r for r in got if r.reward_error is not None]
    assert [(r.metadata, r.reward) for r in failed] == [({"fail": True}, None)] * 2
    assert all(e.reward_error.startswith("RuntimeError: no reward for sample") for e in failed)
    assert all(r.reward == 6.0 and len(r.token_ids) == 6 for r in got if r.metadata != {"fail": True})
    got = client.generate([[7, 8]], SP, reward=f"{EX}:not_a_number_reward")
    assert all(r.reward is None and "returned a str" in r.reward_error and len(r.token_ids) == 6 for r in got)
    # a request's own reward wins over the call's
    got = client.generate([RolloutRequest([9, 9], SP, reward=f"{EX}:parity_reward"), [9, 9]], SP,
                          reward=f"{EX}:length_reward")
    assert [r.reward for r in got] == [_parity(got[0]), _parity(got[1]), 6.0, 6.0]
    assert client.generate([[1, 2]], SP)[0].reward == 6.0  # still serving


def _check_slow_reward_does_not_hold_up_generation(client) -> None:
    """A 1 s reward on a one-token request; a 16-token request (the default reward), in the same batch,
    comes back first: the engine went on while the reward was computed."""
    slow = RolloutRequest([1, 2], SamplingParams(max_tokens=1, ignore_eos=True), metadata={"sleep_s": 1.0},
                          reward=f"{EX}:slow_reward")
    long = RolloutRequest([3, 4], SamplingParams(max_tokens=16, ignore_eos=True), reward=None)
    t0 = time.monotonic()
    order = [(r.request_id, r.reward, time.monotonic() - t0) for r in client.stream([slow, long])]
    assert [o[0] for o in order] == [long.request_id, slow.request_id], order
    assert order[1][1] == 1.0 and order[1][2] >= 1.0


def test_local_rewards(local):
    _check_rewards(local)
    assert local.info()["reward"] == f"{EX}:length_reward"


def test_local_slow_reward_runs_off_the_stepping_thread(local):
    _check_slow_reward_does_not_hold_up_generation(local)


def test_local_abort_while_a_reward_is_computed(local):
    """An abort takes back a finished result whose reward is still being computed, marked as such; its
    stream ends with it."""
    req = RolloutRequest([1, 2], SamplingParams(max_tokens=2, ignore_eos=True), metadata={"sleep_s": 0.5},
                     reward=f"{EX}:slow_reward")
    it = local.stream([req])
    wait_for(lambda: local.stats()[0]["rewards_pending"], "the result's reward being computed")
    (got,) = local.abort([req.request_id])
    assert got.finish_reason == "length" and got.reward is None
    assert got.reward_error == "aborted before its reward was computed"
    assert list(it) == [got]


# -- through Ray --------------------------------------------------------------------------------------
@pytest.mark.ray
def test_ray_rewards_in_the_workers(service):
    _check_rewards(service)
    assert service.info()["reward"] == f"{EX}:length_reward"
    with pytest.raises(ValueError, match="cannot import module"):
        service.generate([[1, 2]], SP, reward="rollout_service.no_such_module:f")


@pytest.mark.ray
def test_ray_worker_answers_an_unimportable_reward_with_a_request_error(service):
    """Past the client's check (a raw request record): the worker refuses the batch, naming the reward,
    and serves on."""
    bad = {"prompt": [1, 2], "request_id": "bad-reward", "reward": "rollout_service.no_such_module:f"}
    with pytest.raises(ValueError, match=r"request 0: request 'bad-reward': reward='rollout_service.no_such_"
                                         r"module:f': cannot import module"):
        service._connection.submit([bad])
    assert [r.reward for r in service.generate([[1, 2]], SP)] == [6.0, 6.0]
    assert all(s["alive"] for s in service.stats())


@pytest.mark.ray
def test_ray_worker_refuses_a_name_that_is_not_a_reward_before_importing_it(service):
    """A raw request record naming `this:s` (past the client's check): the worker refuses it having only read
    the module's source; `this` never ran there."""
    from ray_fixtures import workers
    bad = {"prompt": [1, 2], "request_id": "zen", "reward": "this:s"}
    with pytest.raises(ValueError, match=r"request 'zen': reward='this:s': module 'this' has no attribute 's'"):
        service._connection.submit([bad])
    assert not any(ray.get([w.__ray_call__.remote(lambda w: "this" in __import__("sys").modules)
                            for w in workers(service)]))
    assert [r.reward for r in service.generate([[1, 2]], SP)] == [6.0, 6.0]


@pytest.mark.ray
def test_ray_slow_reward_does_not_hold_up_the_engine(service):
    _check_slow_reward_does_not_hold_up_generation(service)


def _restarted(actor, old_pid: int) -> bool:
    try:
        return ray.get(actor.__ray_call__.remote(lambda a: __import__("os").getpid()), timeout=10) != old_pid
    except ray.exceptions.RayError:
        return False  # still dead or restarting


@pytest.mark.ray
def test_ray_reward_actors(ray_cluster, service_config):
    """reward_workers=1: rewards computed in a reward actor (the per-request name; no default). One that
    dies fails only the results it held, and the next rewards are computed again."""
    c = RolloutClient.launch(service_config(name="svc-reward-actors", num_workers=1, reward_workers=1))
    try:
        assert [r.reward for r in c.generate([[1, 2]], SP)] == [None, None]  # no default reward
        got = c.generate([[1, 2, 3], [4, 5]], SP, reward=f"{EX}:parity_reward")
        assert all(r.reward == _parity(r) and r.reward_error is None for r in got)
        got = c.generate([[1, 2, 3], [4, 5]], SP, reward=f"{EX}:failing_reward", metadata=[{"fail": True}, {}])
        assert [r.reward for r in got] == [None, None, 6.0, 6.0] and got[0].reward_error.startswith("RuntimeError")
        (actor,) = ray.get(c._connection.router.__ray_call__.remote(lambda router: router.reward_actors))
        pid = ray.get(actor.__ray_call__.remote(lambda a: __import__("os").getpid()))
        got = c.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True), reward=f"{EX}:exiting_reward",
                         metadata=[{"exit": True}])
        assert got[0].reward is None and "the reward actor died while computing it" in got[0].reward_error
        assert len(got[0].token_ids) == 3 and got[0].finish_reason == "length"
        # Ray restarts the actor; a call sent before it has noticed the death fails like the one in flight (seen
        # on a loaded 2-core machine), so the next batch goes once the new process answers
        wait_for(lambda: _restarted(actor, pid), "the reward actor restarted", 120)
        got = c.generate([[1, 2, 3]], SP, reward=f"{EX}:length_reward")
        assert [r.reward for r in got] == [6.0, 6.0]
        assert c.info()["reward_workers"] == 1
    finally:
        c.close()
