"""The Python snippets of docs/ beyond the three of tests/test_readme_snippets.py: each runs as written, given the
objects its comments name, on tiny random models (token-id prompts) or on a tiny "chat" model with a word-level
tokenizer; each test then checks what the snippet's comments and the text around it claim."""
from __future__ import annotations

import math
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_engine import prompts
from test_readme_snippets import run, snippet
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, SamplingParams

QUESTIONS = ["Is the sky blue?", "Is 2 + 2 = 5?", [{"role": "user", "content": "Yes or no?"}]]


def local(model, **opts) -> RolloutClient:
    return RolloutClient.local(model, **{"backend": "torch", "dtype": "float32", "device": "cpu", "num_pages": 256,
                                         **opts})


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model()


@pytest.fixture(scope="module")
def client(llama):
    """One client for the snippets that only read (none of them refreshes its weights)."""
    with local(llama) as c:
        yield c


# -- sampling.md --------------------------------------------------------------------------------------------------
def test_seeds_snippet(client):
    scope = run("seeds", client=client, prompts=prompts(3, seed=5))
    together, apart, batched = scope["together"], scope["apart"], scope["in_a_batch"]
    assert len(together) == len(apart) == len(batched) == 8 and [r.sample_index for r in together] == list(range(8))
    assert len({tuple(r.token_ids) for r in together}) > 1  # 8 different noise streams
    for a, b, c in zip(together, apart, batched):
        assert a.token_ids == b.token_ids == c.token_ids  # sample k of seed 7 is seed 7 + k, alone or in a batch
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        np.testing.assert_allclose(a.logprobs, c.logprobs, atol=1e-4)


def test_logprob_modes_snippet(client):
    scope = run("logprob-modes", client=client, prompts=prompts(3, seed=6))
    processed, scaled, raw = scope["processed"], scope["scaled"], scope["raw"]
    assert len(processed) == len(scaled) == len(raw) == 12
    gains = []
    for p, s, r in zip(processed, scaled, raw):
        assert p.token_ids == s.token_ids == r.token_ids  # a mode only chooses what is reported
        assert np.all(p.logprobs >= s.logprobs - 1e-5)  # top-p renormalised over fewer tokens
        gains.append(float(np.max(p.logprobs - s.logprobs)))
        assert not np.allclose(s.logprobs, r.logprobs)  # temperature 0.8: scaled is not the model's own
        assert len(p.top_logprobs) == len(s.top_logprobs) == len(p.token_ids)
        for top, wide in zip(p.top_logprobs, s.top_logprobs):
            values = list(top.values())
            assert 1 <= len(top) <= 3 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            assert len(wide) == 3 and list(top) == list(wide)[:len(top)]  # the same ranking, cut by top-p
    assert max(gains) > 1e-3  # truncation did drop tokens somewhere
    first = processed[0]
    for i, (token, top) in enumerate(zip(first.token_ids, first.top_logprobs)):
        if token in top:  # the same distribution: the sampled token's log-prob is its entry
            assert top[token] == pytest.approx(float(first.logprobs[i]), abs=1e-6)


def test_recompute_snippet(client, llama):
    scope = run("recompute", client=client, prompts=prompts(3, seed=7), policy=llama)
    results, learner = scope["results"], scope["learner"]
    assert len(learner) == len(results) == 6
    for r, lp in zip(results, learner):
        np.testing.assert_allclose(lp.detach().numpy(), r.logprobs, atol=1e-4)


# -- fault-model.md -----------------------------------------------------------------------------------------------
def test_fault_reward_snippet(client):
    scope = run("fault-reward", client=client, prompts=prompts(3, seed=8))
    results = scope["results"]
    assert [r.reward for r in results] == [None, None, 8.0, 8.0]
    assert [r.reward_error for r in results] == ["RuntimeError: no reward for sample 0",
                                                 "RuntimeError: no reward for sample 1", None, None]
    assert all(r.finish_reason == "length" and r.error is None for r in results)  # the samples themselves are fine


def test_fault_refresh_snippet(llama):
    with local(llama) as c:
        before = c.weights_digests()
        scope = run("fault-refresh", client=c, policy=tiny_hf_model(seed=1))
        assert "model.norm.weight" in scope["refused"]
        assert c.info()["policy_version"] == 0 and c.weights_digests() == before  # nothing was applied
        assert all(v == 0 for r in c.generate(prompts(2, seed=9)) for v in r.token_versions)


# -- cache-and-refresh.md, service.md, grpo.md ---------------------------------------------------------------------
def test_refresh_snippet(llama):
    policy = tiny_hf_model(seed=1)  # the learner's weights after a training step
    with local(llama) as c, local(policy) as reference:
        before = c.weights_digests()
        scope = run("refresh", client=c, policy=policy, step=1)
        assert scope["digests"] == reference.weights_digests() != before  # bitwise the learner's weights now
        assert c.info()["policy_version"] == 1
        assert all(v == 1 for r in c.generate(prompts(2, seed=10)) for v in r.token_versions)


def test_service_snippet(llama):
    with local(llama) as c:
        scope = run("service", client=c, prompts=prompts(3, seed=11), policy=tiny_hf_model(seed=1), step=1)
        finished = scope["finished"]
        keys = [(r.request_id, r.sample_index) for r in finished]
        assert len(finished) == 24 and len(set(keys)) == 24  # each sample once
        assert sorted(i for _, i in keys) == sorted(list(range(8)) * 3)
        (stats,) = c.stats()
        assert stats["policy_version"] == 1 and stats["queued"] == stats["running"] == 0
        assert {"kv_pages_used", "kv_pages_total", "tokens_per_s"} <= set(stats)
        assert all(set(r.token_versions) == {0} for r in finished)  # all generated before the refresh


def test_mismatch_snippet(client, llama):
    results = client.generate(prompts(3, seed=12), SamplingParams(n=2, temperature=1.0, max_tokens=16))
    report = run("mismatch", hf_policy=llama, results=results)["report"]
    assert report["n_tokens"] == sum(len(r.token_ids) for r in results)
    assert report["mean_abs"] < 1e-4 and report["max_abs"] < 1e-3  # fp32 on both sides, the same weights
    assert 0.999 < report["ratio_mean"] and report["ratio_max"] < 1.001 and report["ratio_outside_share"] == 0.0


# -- batch-invariant.md -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def invariant():
    """(policy, results of a batch-invariant engine on the policy's weights)."""
    policy = tiny_hf_model(seed=2)
    with local(policy, batch_invariant=True) as c:
        results = c.generate(prompts(3, seed=13), SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=0,
                                                                  ignore_eos=True, logprobs_mode="scaled"))
    return policy, results


def test_invariant_logprobs_snippet(invariant):
    policy, results = invariant
    logprobs = run("invariant-logprobs", policy=policy, results=results)["logprobs"]
    assert len(logprobs) == len(results) == 6
    for lp, r in zip(logprobs, results):  # bitwise: the float32 bytes
        assert lp.detach().numpy().astype("<f4").tobytes() == r.logprobs.astype("<f4").tobytes()


def test_verify_snippet(invariant):
    policy, results = invariant
    assert all(r.receipt for r in results)
    assert run("verify", policy=policy, results=results)["bad"] == []
    edited = results[1].logprobs.copy()
    edited[2] = np.nextafter(edited[2], np.float32(0))  # one log-prob, its last bit
    bad = run("verify", policy=policy, results=[results[0], replace(results[1], logprobs=edited)])["bad"]
    assert len(bad) == 1 and bad[0].first_diff == 2 and "token 2" in bad[0].reason


# -- speculative.md ---------------------------------------------------------------------------------------------------
def test_speculative_snippet(llama):
    scope = run("speculative", model=llama, prompts=prompts(3, seed=9))
    try:
        results, plain, spec = scope["results"], scope["plain"], scope["spec"]
        assert len(results) == len(plain) == 24
        assert [r.token_ids for r in results] == [r.token_ids for r in plain]  # the same tokens, on or off
        assert spec["enabled"] and {"acceptance_rate", "tokens_per_verify", "verify_steps"} <= set(spec)
        assert scope["client"].stats()[0]["speculative"]["proposed"] == spec["proposed"]  # the opt-out drafted none
    finally:
        scope["client"].close()


# -- learner-api.md ---------------------------------------------------------------------------------------------------
def test_client_snippet():
    """The Learner API page opens with the README's tour, which test_readme_snippets.py runs as written on the
    embedded model: the two must stay the same code."""
    assert snippet("client") == snippet("tour")


# -- rl-features.md and grpo.md, on a chat model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    """A word-level tokenizer of 256 words, numbers included, with a chat template (other words are <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "<s>", "yes", "no", "system", "user", "assistant", ":", "+", "-", "?"]
    words += [str(i) for i in range(25)]  # the arithmetic tasks' numbers
    words += [f"w{i}" for i in range(256 - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}assistant :{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>",
                                   chat_template=template)


def coin_policy(tok):
    """A tiny chat model that ignores what it is asked and answers "yes" or "no" at even odds, a word a token,
    ending (EOS) about one token in four: the rewards of a group differ by chance, as a task's do early on."""
    model = tiny_hf_model("llama", seed=3, vocab_size=len(tok))
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    with torch.no_grad():
        for layer in model.model.layers:  # the blocks add nothing: the last hidden state is the input's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)  # every token alike, of unit RMS: the final norm keeps it
        head = model.lm_head.weight
        head.zero_()
        head[[yes, no]] = 20.0 / head.shape[1]  # logit 20: all but 1e-6 of the mass, with EOS
        head[tok.eos_token_id] = (20.0 + math.log(2 / 3)) / head.shape[1]
    return model


@pytest.fixture(scope="module")
def chat(tok):
    with local(coin_policy(tok), tokenizer=tok) as c:
        yield c


@pytest.fixture(scope="module")
def my_task(tmp_path_factory):
    """The docs' reward module, written as my_task/rewards.py into a folder on the Python path."""
    from rollout_service.rewards import functions

    root = tmp_path_factory.mktemp("reward_module")
    (root / "my_task").mkdir()
    (root / "my_task" / "__init__.py").write_text("")
    (root / "my_task" / "rewards.py").write_text(snippet("reward-module"))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in ("my_task.rewards", "my_task"):
        sys.modules.pop(name, None)
    functions._resolved.pop("my_task.rewards:exact_match", None)


def exact(result) -> float:
    words = result.text.split()
    return float(bool(words) and words[-1] == result.metadata)


def test_rewards_snippet(chat, my_task):
    answers = ["yes", "no", "yes"]
    results = run("rewards", client=chat, prompts=QUESTIONS, answers=answers,
                  sampling=SamplingParams(n=6, temperature=1.0, max_tokens=16, seed=1))["results"]
    assert len(results) == 18 and [r.metadata for r in results] == [a for a in answers for _ in range(6)]
    assert all(r.reward_error is None and r.reward == exact(r) for r in results)
    assert {r.reward for r in results} == {0.0, 1.0}
    assert all(set(r.text.split()) <= {"yes", "no"} for r in results)


def test_groups_snippet(chat, my_task):
    prompt_iterator = (QUESTIONS[i % 3] for i in range(1000))
    answer_iterator = ("yes" if i % 2 else "no" for i in range(1000))
    res = run("groups", client=chat, prompt_iterator=prompt_iterator, answer_iterator=answer_iterator)["res"]
    assert res.complete and res.error is None and res.kept == len(res.groups) == 64
    assert res.submitted == res.kept + res.dropped + res.failed + res.aborted and res.failed == 0
    for group in res.groups:
        assert [r.sample_index for r in group] == list(range(8)) and len({r.request_id for r in group}) == 1
        assert len({r.reward for r in group}) == 2 and all(r.reward == exact(r) for r in group)
    assert res.generated_tokens >= sum(len(r.token_ids) for g in res.groups for r in g)


def test_episodes_snippet(chat):
    results = run("episodes", client=chat)["results"]
    assert len(results) == 8
    firsts = [tuple(r.prompt_token_ids) for r in results]
    assert firsts[0::2] == firsts[1::2] and len(set(firsts)) == 4  # environment-major: 2 episodes a problem
    for r in results:
        assert r.finish_reason in ("done", "max_turns", "length") and r.error is None
        assert len(r.loss_mask) == len(r.token_ids) == len(r.logprobs)
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.loss_mask) if m == 0)
        assert 1 <= len(r.turns) <= 4 and r.turns[-1]["end"] <= len(r.token_ids)
        assert r.reward == r.turns[-1]["reward"] and len(r.prompt_token_ids) + len(r.token_ids) <= 512


def test_grpo_colocated_snippet(tok):
    from rollout_service.examples import tasks

    policy = coin_policy(tok)
    with local(policy, tokenizer=tok) as c:
        scope = run("grpo-colocated", client=c, policy=policy, problems=tasks.split()[0][:2])
        row = scope["row"]
        assert row["step"] == 1 and row["colocated"] and row["rollout_tokens"] > 0
        for phase in ("rollout", "sleep", "learner", "refresh", "wake"):
            assert row[f"{phase}_s"] > 0, phase  # each phase of the step ran
        assert row["learner_memory"]["device"] == "cpu"
        (stats,) = c.stats()
        assert stats["sleep_level"] == 0 and stats["policy_version"] == 1  # awake, on the pushed weights
