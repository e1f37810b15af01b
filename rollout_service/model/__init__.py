"""Decoder LMs (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) over rollout_service.ops, and their loader."""
from rollout_service.model.decoder import DecoderLM
from rollout_service.model.loader import LoadedModel, embedded_model_path, load_model
from rollout_service.model.registry import ARCHITECTURES, MoeSpec, arch_flags, moe_spec
from rollout_service.model.weight_update import apply_named_tensors, validate_named_tensors

__all__ = [
    "ARCHITECTURES",
    "DecoderLM",
    "LoadedModel",
    "MoeSpec",
    "apply_named_tensors",
    "arch_flags",
    "embedded_model_path",
    "load_model",
    "moe_spec",
    "validate_named_tensors",
]
