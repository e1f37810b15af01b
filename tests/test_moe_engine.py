"""Mixture-of-experts models through the Engine (torch backend, float32) against HF transformers on the same
weights and tokens: greedy tokens, log-probs, and batching (ragged prompts, n > 1, chunked prefill,
preemption) changing no greedy token."""
import pytest
import torch
from test_engine import hf_greedy, prompts
from test_moe import CONFIGS, moe_model

from rollout_service import RolloutClient, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def client(model, **opts) -> RolloutClient:
    opts.setdefault("num_pages", 256)
    return RolloutClient.local(model, device="cpu", dtype="float32", backend="torch", **opts)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_match_hf(name):
    model = moe_model(name, seed=1)
    ps = prompts(4, seed=2)
    for p, r in zip(ps, client(model).generate(ps, GREEDY)):
        assert r.token_ids == hf_greedy(model, p, GREEDY.max_tokens), f"{name}: prompt of {len(p)} tokens differs"


def logprob_errors(model, results) -> torch.Tensor:
    """|engine log-prob - HF forward's| of every sampled token."""
    diffs = []
    for r in results:
        ids = torch.tensor([r.prompt_token_ids + r.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        ref = lp[len(r.prompt_token_ids) - 1:-1].gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        diffs.append((ref - torch.from_numpy(r.logprobs)).abs())
    return torch.cat(diffs)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe-sparse_step", "mixtral"])
def test_logprobs_match_hf_forward(name):
    model = moe_model(name, seed=3)
    ps = prompts(4, seed=3)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5, logprobs_mode="raw", ignore_eos=True)
    err = logprob_errors(model, client(model).generate(ps, sp))
    print(f"{name}: |Δ log-prob| vs HF over {err.numel()} tokens: mean {err.mean():.2e}, max {err.max():.2e}")
    assert err.mean() <= 1e-4


@pytest.mark.parametrize("name", ["qwen3_moe-norm_topk_prob", "mixtral"])
def test_batching_chunking_and_preemption_change_no_greedy_token(name):
    model = moe_model(name, seed=4)
    ps = prompts(8, seed=7, lo=2, hi=45)
    alone = [client(model).generate([p], GREEDY)[0].token_ids for p in ps]
    assert alone == [hf_greedy(model, p, GREEDY.max_tokens) for p in ps]
    tight = client(model, num_pages=14, page_size=8, max_num_batched_tokens=32)
    together = tight.generate(ps, SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True))
    assert tight.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert [r.token_ids for r in together] == [t for t in alone for _ in range(3)]
    assert tight.engine.kv.blocks.num_used == 0
