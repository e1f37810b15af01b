"""Tiny random HF models and page bookkeeping for the GPU model-level tests."""
from __future__ import annotations

import math

import torch

from rollout_service.ops.attention import AttentionMetadata, make_metadata

PAGE = 16


def tiny_hf_model(model_type: str):
    """A 2-layer random transformers model; head_dim 64 (llama) or 128 (qwen3, with q/k norm)."""
    import transformers

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    if model_type == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if model_type == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=128, **common))
    raise ValueError(model_type)


def load(hf, backend: str):
    from rollout_service.model.loader import load_model

    return load_model(hf, dtype=torch.bfloat16, device="cuda", backend=backend).model


def random_caches(model, num_pages: int) -> list[torch.Tensor]:
    layers, hk, d = model.kv_cache_spec()
    return [torch.randn(num_pages, 2, hk, PAGE, d, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]


class Pages:
    """Sequence b owns pages 1 + b * per_seq ... (page 0 is the scratch page)."""

    def __init__(self, per_seq: int):
        self.per_seq = per_seq

    def table(self, seq: int, kv_len: int) -> list[int]:
        return list(range(1 + seq * self.per_seq, 1 + seq * self.per_seq + math.ceil(kv_len / PAGE)))

    def meta(self, seqs: list[int], q_lens: list[int], kv_lens: list[int], is_prefill: bool) -> AttentionMetadata:
        tables = [self.table(s, n) for s, n in zip(seqs, kv_lens)]
        return make_metadata(tables, q_lens, kv_lens, PAGE, is_prefill=is_prefill, device="cuda")
