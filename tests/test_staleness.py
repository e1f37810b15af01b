"""Staleness-first scheduling (EngineConfig.scheduling): waiting sequences are admitted, and running ones kept,
by the policy version their request was submitted under, oldest first, then arrival; "fifo" by arrival alone."""
import pytest
from tiny_models import tiny_hf_model

from rollout_service import RolloutRequest, SamplingParams
from benchmarks.harness.staleness import StreamShape, run_stream
from rollout_service.engine.engine import Engine


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama", seed=7)


def engine(model, scheduling: str, **opts) -> Engine:
    opts.setdefault("num_pages", 128)
    return Engine(model_source=model, device="cpu", scheduling=scheduling, **opts)


def request(rid: str, version: int | None, max_tokens: int = 3) -> RolloutRequest:
    return RolloutRequest(prompt=[5, 6, 7, 8, 9, 10, 11, 12], request_id=rid, submitted_version=version,
                          sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("scheduling,order", [("staleness", "bdca"), ("fifo", "abcd")])
def test_admission_follows_submitted_version_then_arrival(llama, scheduling, order):
    eng = engine(llama, scheduling, max_num_seqs=1)
    for rid, v in zip("abcd", (2, 0, 1, 0)):
        eng.add_request(request(rid, v))
    assert "".join(r.request_id for r in eng.run_until_done()) == order


@pytest.mark.parametrize("scheduling,first", [("staleness", "old"), ("fifo", "new")])
def test_preemption_takes_the_newest_version_first(llama, scheduling, first):
    """`new` (version 1) runs first; `old` (version 0, say an episode's next turn) arrives later. When the
    pages run out one of them must wait: by staleness the newer version, by fifo the later arrival."""
    eng = engine(llama, scheduling, num_pages=5, page_size=16, enable_prefix_cache=False)
    eng.add_request(request("new", 1, max_tokens=40))
    eng.step()
    eng.add_request(request("old", 0, max_tokens=40))
    done = eng.run_until_done()
    assert eng.scheduler.num_preemptions >= 1
    assert [r.request_id for r in done][0] == first
    assert all(len(r.token_ids) == 40 for r in done)


def test_in_process_requests_are_stamped_with_the_version_served(llama):
    eng = engine(llama, "staleness")
    weights = {k: v.clone() for k, v in llama.state_dict().items()}
    eng.update_weights(weights, version=3)
    seq = eng.prepare(request("x", None))
    assert seq.submitted_version == 3
    assert eng.prepare(request("y", 1)).submitted_version == 1


def test_config_refuses_an_unknown_order():
    with pytest.raises(ValueError, match="scheduling"):
        Engine(model_source=tiny_hf_model("llama"), device="cpu", scheduling="lifo")


def test_mixed_stream_exceeds_the_bound_less_by_version(llama):
    """Episodes whose later turns queue behind prompts submitted under newer weights: by version they go
    first, so fewer samples end more than max_staleness versions behind."""
    shape = StreamShape(waves=4, prompts_per_wave=8, episodes_per_wave=4, steps_per_refresh=16, max_staleness=2)
    weights = {k: v.clone() for k, v in llama.state_dict().items()}
    by_version = run_stream(lambda **o: engine(llama, "staleness", **o), weights, shape)
    fifo = run_stream(lambda **o: engine(llama, "fifo", **o), weights, shape)
    assert by_version["samples"] == fifo["samples"] > 0
    assert by_version["exceeding"] < fifo["exceeding"]
