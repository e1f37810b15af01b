"""routed_experts from the engine (torch backend, float32) against the experts transformers' routers choose on the
same weights and tokens (tiny random Qwen3-MoE and Mixtral): with the prefix cache on and off, n > 1 samples
sharing a prompt's pages, preemption and recompute, chunked prefill, sleep, overlap_decode on and off, and
multi-turn episodes (the environment's tokens included)."""
import numpy as np
import pytest
from routing_hf import expected_routing
from test_engine import prompts
from test_moe import moe_model
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, SamplingParams
from rollout_service.engine.engine import Engine
from rollout_service.api.types import EpisodeParams, RolloutRequest

SP = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=4, ignore_eos=True, return_routed_experts=True,
                    return_prompt_routed_experts=True)
NAMES = ["qwen3_moe-sparse_step", "mixtral"]


def engine(model, **opts) -> Engine:
    opts.setdefault("num_pages", 256)
    return Engine(model_source=model, device="cpu", dtype="float32", backend="torch", **opts)


def serve(eng: Engine, waves, sp: SamplingParams = SP) -> list:
    """Results of each wave of prompts, served after the previous one finished (a later wave may hit the prefix
    cache), in (wave, prompt, sample) order."""
    out = []
    for w, wave in enumerate(waves):
        for i, p in enumerate(wave):
            eng.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=f"{w}-{i}"))
        done = eng.run_until_done()
        out += sorted(done, key=lambda r: (int(r.request_id.split("-")[1]), r.sample_index))
    return out


def assert_routing_is_transformers(model, results) -> None:
    for r in results:
        routed, prompt = expected_routing(model, r)
        assert r.routed_experts.dtype == np.uint8 and r.routed_experts.shape == routed.shape
        assert np.array_equal(r.routed_experts, routed), f"request {r.request_id}#{r.sample_index}"
        assert np.array_equal(r.prompt_routed_experts, prompt), f"request {r.request_id}#{r.sample_index} prompt"


def shared_prefix_waves(seed: int) -> list:
    """Two waves of prompts that share a 37-token system prefix: the second wave finds its pages cached."""
    system = list(range(40, 77))
    first, second = prompts(3, seed=seed, lo=2, hi=20), prompts(3, seed=seed + 1, lo=2, hi=20)
    return [[system + p for p in first], [system + p for p in second] + [system + first[0]]]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("overlap", [True, False])
def test_routing_is_the_routers_with_the_prefix_cache_and_shared_samples(name, overlap):
    model = moe_model(name, seed=1)
    waves = shared_prefix_waves(seed=2)
    cached = engine(model, overlap_decode=overlap, page_size=8)
    with_cache = serve(cached, waves)
    assert cached.stats()["prefix_cache"]["hit_tokens"] >= 4 * 32
    assert not overlap or cached.stats()["overlapped_steps"] > 0
    without = serve(engine(model, overlap_decode=overlap, page_size=8, enable_prefix_cache=False), waves)
    assert [r.token_ids for r in with_cache] == [r.token_ids for r in without]
    assert all(np.array_equal(a.routed_experts, b.routed_experts) and
               np.array_equal(a.prompt_routed_experts, b.prompt_routed_experts) for a, b in zip(with_cache, without))
    assert len({tuple(r.token_ids) for r in with_cache[:3]}) == 3  # the samples differ, their prompt is shared
    assert_routing_is_transformers(model, with_cache)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("overlap", [True, False])
def test_routing_is_the_routers_after_preemption_and_chunked_prefill(name, overlap):
    model = moe_model(name, seed=4)
    tight = engine(model, num_pages=14, page_size=8, max_num_batched_tokens=24, overlap_decode=overlap)
    ps = prompts(6, seed=7, lo=2, hi=45)
    assert max(map(len, ps)) > 24, "a prompt was meant to be prefilled in chunks"
    results = serve(tight, [ps])
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["recomputes"] > 0, "the pool was meant to be too small"
    assert_routing_is_transformers(model, results)


def test_routing_kept_across_a_sleep_and_when_aborted_asleep():
    """Sleep preempts every sequence and frees the routing store with the KV: what was computed is kept with
    the sequence, so results finished after the wake, and ones aborted while asleep, still carry it."""
    model = moe_model("mixtral", seed=2)
    eng = engine(model)
    for i, p in enumerate(prompts(4, seed=3, lo=3, hi=30)):
        eng.add_request(RolloutRequest(prompt=p, sampling=SP, request_id=f"0-{i}"))
    for _ in range(5):
        eng.step()
    eng.sleep(1)
    aborted = eng.abort(["0-0"])
    assert {r.finish_reason for r in aborted} == {"abort"} and all(len(r.token_ids) > 0 for r in aborted)
    eng.wake_up()
    assert_routing_is_transformers(model, aborted + eng.run_until_done())


def test_uint16_ids_past_256_experts():
    model = tiny_hf_model("qwen3_moe", seed=3, num_experts=300, num_experts_per_tok=3)
    results = serve(engine(model), [prompts(2, seed=5)], SamplingParams(max_tokens=6, temperature=0.0,
                                                                        return_routed_experts=True))
    for r in results:
        assert r.routed_experts.dtype == np.uint16 and r.prompt_routed_experts is None
        assert np.array_equal(r.routed_experts, expected_routing(model, r)[0])
    assert max(int(r.routed_experts.max()) for r in results) > 255


def test_a_dense_model_refuses_the_request_and_serves_on():
    client = RolloutClient.local(tiny_hf_model("llama"), device="cpu", dtype="float32", backend="torch",
                                 num_pages=64)
    with pytest.raises(ValueError, match=r"SamplingParams.return_routed_experts: the model \(llama\) has no "
                                         "mixture-of-experts layers"):
        client.generate([[1, 2, 3]], SamplingParams(return_routed_experts=True))
    r = client.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0]
    assert len(r.token_ids) == 4 and r.routed_experts is None
    client.close()


def test_no_routing_unless_asked():
    model = moe_model("qwen3_moe", seed=1)
    r = serve(engine(model), [[[1, 2, 3]]], SamplingParams(max_tokens=3))[0]
    assert r.routed_experts is None and r.prompt_routed_experts is None


class Echo:
    """An environment of token ids: a fixed first prompt, then after each model turn 5 ids of its own."""

    def reset(self, metadata):
        return list(range(30, 52))

    def step(self, text):
        return [7, 8, 9, 10, 11], 0.0, False


@pytest.mark.parametrize("name", NAMES)
def test_an_episodes_routing_covers_the_models_and_the_environments_tokens(name):
    """Every token of an episode's token_ids, model's and environment's, in the episode's layout; the prefix cache
    serves each turn the history it already computed."""
    model = moe_model(name, seed=5)
    eng = engine(model, page_size=8)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1, ignore_eos=True, return_routed_experts=True,
                        return_prompt_routed_experts=True)
    eng.add_request(RolloutRequest(prompt=None, sampling=sp, episode=EpisodeParams(Echo(), max_turns=3)))
    results = eng.run_until_done()
    assert [r.finish_reason for r in results] == ["max_turns"] * 2 and eng.stats()["prefix_cache"]["hit_tokens"] > 0
    for r in results:
        assert len(r.token_ids) == 6 + 5 + 6 + 5 + 6 and r.loss_mask.count(0) == 10
    assert_routing_is_transformers(model, results)
    sp_plain = SamplingParams(max_tokens=4, return_routed_experts=True)
    eng.add_request(RolloutRequest(prompt=None, sampling=sp_plain, episode=EpisodeParams(Echo(), max_turns=2)))
    r = eng.run_until_done()[0]
    assert r.prompt_routed_experts is None and r.routed_experts.shape == (4 + 5 + 4, 2, 2)
