"""Tiny random transformers models for fast CPU tests (a module, not conftest: tests/gpu has its own)."""
import torch

# Mixture-of-experts sizes: 4 experts, 2 per token, each expert 32 wide.
_MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)}


def tiny_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A seeded, randomly initialised transformers CausalLM with a tiny config of the given architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False,
                initializer_range=0.25)  # peaked logits: greedy ties would make parity tests flaky
    if model_type == "qwen3":
        base["head_dim"] = 16
    base.update(_MOE.get(model_type, {}))
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
