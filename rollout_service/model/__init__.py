"""Decoder LMs (Llama, Mistral, Qwen2, Qwen3) over rollout_service.ops, and their loader."""
from rollout_service.model.decoder import DecoderLM
from rollout_service.model.loader import LoadedModel, embedded_model_path, load_model
from rollout_service.model.registry import ARCHITECTURES, arch_flags
from rollout_service.model.weight_update import apply_named_tensors, validate_named_tensors

__all__ = [
    "ARCHITECTURES",
    "DecoderLM",
    "LoadedModel",
    "apply_named_tensors",
    "arch_flags",
    "embedded_model_path",
    "load_model",
    "validate_named_tensors",
]
