"""DecoderLM on the embedded SmolLM2-135M-Instruct vs HF transformers on the same weights and tokens."""
import os

import pytest
import torch
from numerics import assert_as_close_as_the_reference, float64_copy

from rollout_service.model import embedded_model_path, load_model
from rollout_service.model.gguf_cache import read_gguf
from rollout_service.model.loader import gguf_file
from test_model import PagedRunner

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    _, tok = smollm2
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def test_embedded_model_path_points_at_a_gguf():
    folder, gguf = embedded_model_path()
    assert gguf.endswith(".gguf") and os.path.isfile(os.path.join(folder, gguf))


def test_prefill_and_greedy_decode_match_hf(smollm2, prompt_ids):
    hf, tok = smollm2
    model = load_model(hf, tokenizer=tok).model
    with torch.no_grad():
        ref = hf(torch.tensor([prompt_ids])).logits[0].float()
        exact = float64_copy(hf)(torch.tensor([prompt_ids])).logits[0]
        hf_tokens = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False)[0, len(prompt_ids):]
    runner = PagedRunner(model, num_pages=16)
    got = runner.step({0: prompt_ids})[0]
    # within a few times HF's own float32 error (the engine's CPU products are oneDNN's, HF's MKL's)
    assert len(prompt_ids) >= 20
    assert_as_close_as_the_reference(got, ref, exact, "prefill logits")
    tokens = [int(got[-1].argmax())]
    for _ in range(5):  # paged decode of the greedy continuation
        tokens.append(int(runner.step({0: [tokens[-1]]}, is_prefill=False)[0][-1].argmax()))
    assert tokens == hf_tokens.tolist()
    assert "Paris" in tok.decode(tokens)


def test_load_by_name_matches_a_direct_read_of_the_embedded_gguf(smollm2, prompt_ids):
    # load_model and the fixture read the cached conversion; transformers' own GGUF parse is the reference.
    _, state, tok = read_gguf(gguf_file("smollm2-135m"))
    loaded = load_model("smollm2-135m")
    assert loaded.hf_config.model_type == "llama" and loaded.tokenizer is not None
    chat = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
    assert loaded.tokenizer.apply_chat_template(MESSAGES, **chat) == tok.apply_chat_template(MESSAGES, **chat)
    assert loaded.tokenizer.apply_chat_template(MESSAGES, **chat) == prompt_ids
    hf, _ = smollm2
    for name, tensor in state.items():
        assert torch.equal(loaded.model.get_parameter(name), tensor), name
        assert torch.equal(hf.get_parameter(name), tensor), name
