"""The engine on the embedded SmolLM2-135M-Instruct against HF transformers on the same weights and tokens."""
import numpy as np
import pytest
import torch

from rollout_service import RolloutClient, SamplingParams

CHATS = [
    "What is the capital of France?",
    "Hi!",
    "Write a short poem about the sea and the wind over the harbour at night.",
    "List three primary colors.",
    "Explain in two sentences why the sky is blue, as if to a ten-year-old child who asked you at breakfast.",
    "What is 17 + 25?",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a small grey cat that likes to sleep in the sun all afternoon long.",
]


@pytest.fixture(scope="module")
def engine_client(smollm2):
    hf_model, tok = smollm2
    return RolloutClient.local(hf_model, tokenizer=tok, dtype="float32", num_pages=512)


def test_capital_of_france(engine_client):
    (r,) = engine_client.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in r.text and r.finish_reason == "stop"


def test_greedy_matches_hf_generate_on_eight_chat_prompts(engine_client, smollm2):
    hf_model, tok = smollm2
    results = engine_client.generate(CHATS, SamplingParams(temperature=0, max_tokens=64))
    assert len({len(r.prompt_token_ids) for r in results}) == len(CHATS), "prompts should differ in length"
    for prompt, r in zip(CHATS, results):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        assert ids[0].tolist() == r.prompt_token_ids
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        assert r.token_ids == ref[0, ids.shape[1]:].tolist(), f"greedy tokens differ for {prompt!r}"


def test_logprobs_match_fp32_hf_forward(engine_client, smollm2):
    hf_model, _ = smollm2
    results = engine_client.generate(CHATS[:4], SamplingParams(temperature=1.0, max_tokens=32, seed=11,
                                                               logprobs_mode="raw"))
    diffs = []
    for r in results:
        ids = torch.tensor([r.prompt_token_ids + r.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(ids).logits[0].float(), -1)
        ref = lp[len(r.prompt_token_ids) - 1:-1].gather(1, torch.tensor(r.token_ids)[:, None])[:, 0].numpy()
        diffs.append(np.abs(ref - r.logprobs))
    assert np.concatenate(diffs).mean() <= 1e-4


def test_stop_string_truncates_text(engine_client):
    (free,) = engine_client.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=20))
    word = free.text.split()[2]  # e.g. "of" in "The capital of France is Paris."
    (r,) = engine_client.generate(["What is the capital of France?"],
                                  SamplingParams(temperature=0, max_tokens=20, stop=[word]))
    assert r.finish_reason == "stop" and word not in r.text and free.text.startswith(r.text)
