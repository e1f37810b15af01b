"""What a client can make the service keep is bounded, and what it sends is checked where it is sent:
fidelity reports (keys, values, strings, and their log line), request metadata (it must pickle, within
MAX_METADATA_BYTES), in-process and through Ray; and a local client closed while another thread reads one
of its streams ends that stream with an error saying so."""
from __future__ import annotations

import threading
import time

import pytest
import ray

from rollout_service.api.checks import MAX_METADATA_BYTES
from rollout_service.client import RolloutClient
from rollout_service.fidelity import (FIDELITY_LINE_MAX, FIDELITY_MAX_KEYS, FIDELITY_MAX_STR, FIDELITY_MAX_VALUES,
                                      check_fidelity, fidelity_line)
from rollout_service.api.types import RolloutRequest, SamplingParams
from tiny_models import tiny_hf_model

pytest_plugins = ["ray_fixtures"]

SP = SamplingParams(n=2, temperature=1.0, max_tokens=4, ignore_eos=True, seed=1)


def _local() -> RolloutClient:
    return RolloutClient.local(tiny_hf_model(), backend="torch", dtype="float32", device="cpu", num_pages=256,
                               enable_cuda_graphs=False)


@pytest.fixture(scope="module")
def local():
    c = _local()
    yield c
    c.close()


@pytest.fixture(scope="module")
def service(ray_cluster, service_config):
    with RolloutClient.launch(service_config(name="svc-client-limits", num_workers=1)) as c:
        yield c


# -- fidelity reports -----------------------------------------------------------------------------------
OVERSIZED_REPORTS = [
    ({"per_token": [0.0] * 1_000_000}, f"takes the report past {FIDELITY_MAX_VALUES} values"),
    ({f"k{i}": 1.0 for i in range(FIDELITY_MAX_KEYS + 1)}, f"{FIDELITY_MAX_KEYS + 1} keys, at most {FIDELITY_MAX_KEYS}"),
    ({"note": "x" * (FIDELITY_MAX_STR + 1)}, f"string of {FIDELITY_MAX_STR + 1} characters"),
    ({"x" * 1000: 1.0}, "report key 'x.*x' is a string of 1000 characters"),
    ({"a": [1.0] * 200, "b": [1.0] * 57}, r"report\['b'\] takes the report past 256 values"),
    ({"n": 10**30}, "an int outside"),
    ({"note": "lone \ud800"}, "not valid Unicode"),
]


def _check_fidelity_bounds(client: RolloutClient) -> None:
    before = client.info()["fidelity"]
    for report, match in OVERSIZED_REPORTS:
        with pytest.raises(ValueError, match=match) as e:
            client.report_fidelity(1, report)
        assert "the service keeps the last 256 reports" in str(e.value) or "int" in match or "Unicode" in match
    with pytest.raises(ValueError, match=r"version=2147483648 must be an int >= 0 \(and < 2\*\*31\)"):
        client.report_fidelity(2**31, {"kl": 0.0})
    assert client.info()["fidelity"] == before  # nothing refused was kept
    largest = {f"k{i}": [0.5] * (FIDELITY_MAX_VALUES // FIDELITY_MAX_KEYS) for i in range(FIDELITY_MAX_KEYS)}
    client.report_fidelity(7, largest)
    assert client.info()["fidelity"][-1] == {"version": 7, **largest}


def test_fidelity_reports_are_bounded_locally(local):
    _check_fidelity_bounds(local)


@pytest.mark.ray
def test_fidelity_reports_are_bounded_through_ray(service):
    _check_fidelity_bounds(service)
    router = service._connection.router
    err = ray.get(router.report_fidelity.remote(3, {"per_token": [0.0] * 100_000}))  # the router checks too
    assert err is not None and f"past {FIDELITY_MAX_VALUES} values" in err
    assert service.info()["fidelity"][-1]["version"] == 7


def test_the_fidelity_log_line_is_bounded():
    widest = {f"{i:03d}" + "k" * (FIDELITY_MAX_STR - 3): ["v" * FIDELITY_MAX_STR] * (FIDELITY_MAX_VALUES // FIDELITY_MAX_KEYS)
              for i in range(FIDELITY_MAX_KEYS)}
    line = fidelity_line(check_fidelity(1, widest))
    assert len(line) <= FIDELITY_LINE_MAX and line.startswith("fidelity of version 1: 000kkk") and line.endswith("...")
    # one unchecked entry as the router might hold (a report from before the bounds): still one short line
    assert len(fidelity_line({"version": 1, "per_token": [0.25] * 1_000_000})) <= FIDELITY_LINE_MAX


# -- request metadata -----------------------------------------------------------------------------------
class _Env:
    def reset(self, metadata):
        return [1, 2]

    def step(self, text):
        return [3], 0.0, True


def _check_metadata(client: RolloutClient) -> None:
    prompts = [[1, 2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"prompt 1: RolloutRequest.metadata: cannot be pickled.*_thread.lock"):
        client.generate(prompts, SP, metadata=[{}, {"lock": threading.Lock()}, {}])
    big = "x" * MAX_METADATA_BYTES
    with pytest.raises(ValueError, match=rf"prompt 2: RolloutRequest.metadata: over {MAX_METADATA_BYTES} bytes "
                                         r"\(1 MiB\) pickled, the bound on one request's metadata \(the service holds"):
        client.generate(prompts, SP, metadata=[{}, {}, big])
    with pytest.raises(ValueError, match=r"request 0 \('mine'\): RolloutRequest.metadata: cannot be pickled"):
        req = RolloutRequest([1, 2], SP, request_id="mine")
        req.metadata = threading.Lock()  # (set after construction: checked again at the client)
        client.generate([req])
    with pytest.raises(ValueError, match=r"metadata\[0\] \(environment 0\): cannot be pickled"):
        client.run_episodes([_Env()], SP, metadata=[threading.Lock()])
    assert client.info()["in_flight"] == 0
    # what does pickle is accepted, a lambda too (as Ray's cloudpickle takes it), up to the bound
    results = client.generate(prompts, SP, metadata=[lambda x: x + 1, "y" * (MAX_METADATA_BYTES // 2), None])
    assert len(results) == 6 and results[1].metadata(1) == 2 and len(results[3].metadata) == MAX_METADATA_BYTES // 2
    assert results[5].metadata is None


def test_metadata_is_checked_locally(local):
    _check_metadata(local)


@pytest.mark.ray
def test_metadata_is_checked_through_ray(service):
    _check_metadata(service)
    # the router refuses what a client did not check (a request dict sent straight to it), keeping nothing
    router = service._connection.router
    reply = ray.get(router.submit.remote([{"prompt": [1, 2], "metadata": "z" * (2 * MAX_METADATA_BYTES)}]))
    assert "errors" in reply and f"over {MAX_METADATA_BYTES} bytes" in reply["errors"][0][1]
    assert service.info()["in_flight"] == 0 and len(service.generate([[1, 2]], SP)) == 2


# -- closing a local client while another thread reads ----------------------------------------------------
def _read_in_thread(stream, got_one: threading.Event) -> dict:
    outcome: dict = {"results": 0}

    def read():
        try:
            for _ in stream:
                outcome["results"] += 1
                got_one.set()
        except BaseException as e:
            outcome["error"] = e
        got_one.set()
    outcome["thread"] = threading.Thread(target=read, daemon=True)
    outcome["thread"].start()
    return outcome


def test_close_while_another_thread_reads_a_stream_ends_it_with_a_clear_error():
    client = _local()
    short = SamplingParams(n=1, max_tokens=1, ignore_eos=True)
    long = SamplingParams(n=2, max_tokens=400, ignore_eos=True)
    stream = client.stream([RolloutRequest([1, 2], short), RolloutRequest([3, 4], long)])
    got_one = threading.Event()
    outcome = _read_in_thread(stream, got_one)
    assert got_one.wait(60), "the reader got no result"
    client.close()
    outcome["thread"].join(30)
    assert not outcome["thread"].is_alive(), "the reader still waits after close()"
    error = outcome.get("error")
    assert isinstance(error, RuntimeError), f"the reader saw {error!r}"
    assert "the rollout client was closed while this stream was read: 2 of its results never came" in str(error)
    assert outcome["results"] == 1


def test_close_while_another_thread_waits_on_a_paused_client():
    client = _local()
    stream = client.stream([[1, 2]], SamplingParams(max_tokens=4, ignore_eos=True))
    client.pause()
    got_one = threading.Event()
    outcome = _read_in_thread(stream, got_one)
    time.sleep(0.3)  # the reader waits for resume()
    assert not got_one.is_set()
    client.close()
    outcome["thread"].join(30)
    assert not outcome["thread"].is_alive(), "the reader still waits after close()"
    assert isinstance(outcome.get("error"), RuntimeError) and "was closed" in str(outcome["error"])
