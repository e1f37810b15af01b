"""Exact speculative decoding on the cuda backend: a verify step is a decode step of more rows, replayed in the
decode graphs. In batch-invariant mode every row's arithmetic is the row's alone, so the results with
speculation are bitwise those without, whatever the drafts; in the default mode the tokens are those of plain
decoding wherever the logits agree to bf16 rounding (a different batch shape may round them differently,
as any change of batch does)."""
import numpy as np
import pytest
import torch
from kv_utils import requires_cuda

from rollout_service.api.types import RolloutRequest, SamplingParams
from rollout_service.engine.engine import Engine

pytestmark = pytest.mark.skipif(**requires_cuda)


def model():
    import transformers

    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=False)
    torch.manual_seed(1)
    m = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)  # less flat logits
    return m


@pytest.fixture(scope="module")
def llama():
    return model()


REQUESTS = [(list(range(5, 5 + 37 * i, 3)), SamplingParams(**sp)) for i, sp in enumerate([
    dict(temperature=0, max_tokens=60, ignore_eos=True),
    dict(temperature=1.0, n=4, max_tokens=50, seed=3, ignore_eos=True, logprobs=2),
    dict(temperature=0.8, top_p=0.9, max_tokens=40, seed=5, ignore_eos=True),
], start=1)]


class Replay:
    def __init__(self, results, wrong=False):
        self.tokens = {(r.request_id, r.sample_index): r.token_ids for r in results}
        self.wrong = wrong

    def propose(self, seq, k):
        n = seq.num_output_tokens
        draft = self.tokens.get((seq.request_id, seq.sample_index), [])[n:n + k]
        return [(t + 1) % 4096 for t in draft] if self.wrong else draft

    def forget(self, seq):
        pass


def run(model, drafter=None, **config):
    eng = Engine(model_source=model, device="cuda", dtype="bfloat16", backend="cuda", num_pages=1024,
                 max_num_seqs=16, speculative="suffix" if drafter else None, **config)
    assert eng.runner.graphs is not None and not eng.runner.graphs.disabled
    if drafter:
        eng.speculator.rates.always, eng.speculator.drafter = True, drafter
    for i, (p, sp) in enumerate(REQUESTS):
        eng.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=str(i)))
    return eng, sorted(eng.run_until_done(), key=lambda r: (r.request_id, r.sample_index))


def test_batch_invariant_results_are_bitwise_plain_decodings(llama):
    _, plain = run(llama, batch_invariant=True)
    for wrong in (False, True):
        eng, spec = run(llama, Replay(plain, wrong), batch_invariant=True)
        s = eng.stats()["speculative"]
        assert s["verify_steps"] > 0 and (s["accepted"] == 0 if wrong else s["tokens_per_draft"] > 3), s
        for x, y in zip(plain, spec):
            assert x.token_ids == y.token_ids
            assert np.asarray(x.logprobs, np.float32).tobytes() == np.asarray(y.logprobs, np.float32).tobytes()


def test_default_mode_keeps_plain_decodings_tokens(llama):
    _, plain = run(llama)
    eng, spec = run(llama, Replay(plain))
    assert eng.stats()["speculative"]["accepted"] > 0
    same = [x.token_ids[:10] == y.token_ids[:10] for x, y in zip(plain, spec)]
    assert sum(same) >= len(same) - 1  # bf16 rounding of a wider batch may flip a near-tie, as any batch change
    for x, y in zip(plain, spec):
        k = next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), len(x.token_ids))
        np.testing.assert_allclose(x.logprobs[:k], y.logprobs[:k], atol=0.05)
