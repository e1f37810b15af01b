"""Token deltas (RolloutClient.stream(..., tokens=True)) in-process, on a tiny random Llama: each running sample's
new tokens come as they are sampled, in order, before its result, and are exactly the result's tokens, log-probs,
versions and top alternatives, also across preemption; bad input is refused naming the field. (Over Ray:
tests/test_ray_service.py; over HTTP: tests/test_openai_endpoint.py.)"""
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, RolloutRequest, RolloutResult, SamplingParams, TokenDelta
from rollout_service.api.types import EpisodeParams


def prompts(k: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(10, 30, (k,), generator=g)]


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama")


def check_previews(items: list, results: list[RolloutResult]) -> int:
    """Every delta is the next slice of its sample's result and comes before it; returns how many came."""
    done, seen, count = set(), {}, 0
    for x in items:
        key = (x.request_id, x.sample_index)
        if isinstance(x, RolloutResult):
            done.add(key)
            continue
        assert key not in done, f"{key}: a delta after its result"
        assert x.start == seen.get(key, 0), f"{key}: deltas out of order"
        want = next(r for r in results if (r.request_id, r.sample_index) == key)
        end = x.start + len(x.token_ids)
        assert x.token_ids == want.token_ids[x.start:end] and x.token_versions == want.token_versions[x.start:end]
        assert x.logprobs == want.logprobs[x.start:end].tolist(), "the result's log-probs, bit for bit"
        assert x.top_logprobs == (None if want.top_logprobs is None else want.top_logprobs[x.start:end])
        seen[key], count = end, count + 1
    # (the step that finishes a sample hands out its result, not a delta)
    assert all(seen.get((r.request_id, r.sample_index), 0) < len(r.token_ids) for r in results)
    return count


def test_deltas_preview_each_sample_token_by_token(llama):
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=4, ignore_eos=True, logprobs=2)
    reqs = [RolloutRequest(p, sp, request_id=f"r{i}") for i, p in enumerate(prompts(3, seed=1))]
    with RolloutClient.local(llama, num_pages=256) as c:
        items = list(c.stream(reqs, tokens=True))
        plain = c.generate(reqs)
    results = sorted((x for x in items if isinstance(x, RolloutResult)), key=lambda r: (r.request_id, r.sample_index))
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert check_previews(items, results) >= 6 * 14, "a delta per decode step of each sample"


def test_deltas_survive_preemption_and_only_streaming_requests_make_them(llama):
    """A pool too small for the batch: samples are preempted and recomputed, and what a delta showed stays
    true. A request without stream_tokens in the same stream gets its result alone."""
    sp = SamplingParams(temperature=0.8, max_tokens=40, seed=3, ignore_eos=True)
    ps = prompts(8, seed=7)
    with RolloutClient.local(llama, num_pages=12, page_size=8) as c:
        streamed = [RolloutRequest(p, sp, request_id=f"s{i}", stream_tokens=True) for i, p in enumerate(ps[:6])]
        quiet = [RolloutRequest(p, sp, request_id=f"q{i}") for i, p in enumerate(ps[6:])]
        items = list(c.stream(streamed + quiet))
        assert c.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    results = [x for x in items if isinstance(x, RolloutResult)]
    assert len(results) == 8 and check_previews(items, results) > 0
    assert not any(isinstance(x, TokenDelta) and x.request_id.startswith("q") for x in items)


def test_bad_streaming_input_is_refused_naming_it(llama):
    with pytest.raises(ValueError, match="stream_tokens=1"):
        RolloutRequest([1, 2], stream_tokens=1)
    with pytest.raises(ValueError, match="only a plain completion"):
        RolloutRequest([1, 2], completion=[3], stream_tokens=True)
    assert RolloutRequest.from_dict(RolloutRequest([1, 2], stream_tokens=True).to_dict()).stream_tokens is True

    class Env:
        def reset(self, metadata):
            return "hi"

        def step(self, text):
            return "", 0.0, True

    with RolloutClient.local(llama, num_pages=64) as c:
        with pytest.raises(ValueError, match="tokens='yes'"):
            c.stream([[1, 2]], tokens="yes")
        episode = RolloutRequest(None, SamplingParams(max_tokens=2), episode=EpisodeParams(Env()))
        with pytest.raises(ValueError, match=r"request 0 .*only a plain completion"):
            c.stream([episode], tokens=True)
        assert len(c.generate([[1, 2]], SamplingParams(max_tokens=2))) == 1  # still serving


def test_streamed_text_adds_up_to_the_decode_of_every_token_of_a_real_tokenizer(smollm2):
    """The endpoint's incremental text (openai/token_stream.py: a window of the last tokens decoded per delta) on
    the embedded model's byte-level BPE, over text whose characters span several tokens (accents, CJK, emoji) and
    deltas of 1 to 5 tokens: what it shows before the result is a prefix of the whole decode, every delta's text
    is final (the result adds only the rest), and a stop string's start is held back until it cannot be one."""
    import random

    from rollout_service.openai.token_stream import ChoiceStream

    _, tok = smollm2
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731 - the engine's decode
    ids = tok("Ça coûte 3 € — 東京で寿司 🍣🍣, naïve café!\n\nDone: 42 + 17 = 59 🎉 ünïcödé " * 3)["input_ids"]
    whole = decode(ids)
    rng = random.Random(0)
    for stops in ([], ["59 🎉"]):
        choice, at, shown = ChoiceStream(decode, stops), 0, ""
        while at < len(ids):
            k = min(rng.randint(1, 5), len(ids) - at)
            piece, _ = choice.delta(TokenDelta("r", 0, at, ids[at:at + k], [0.0] * k, [0] * k))
            shown, at = shown + piece, at + k
            assert whole.startswith(shown) and "\ufffd" not in shown
            assert not stops or "59 🎉"[:-1] not in shown[len(shown) - 3:], "a stop string's start was shown"
        assert len(shown) >= len(whole) - max(map(len, stops), default=0) - 8, "text held back for no reason"
        result = RolloutResult("r", 0, [1], ids, [0.0] * len(ids), [0] * len(ids), "length", whole)
        rest, _ = choice.finish(result, result.text)
        assert shown + rest == whole
