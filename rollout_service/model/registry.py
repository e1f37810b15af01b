"""Supported architectures: HF model_type -> the few flags in which they differ."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchFlags:
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool  # bias on gate/up/down projections
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)


def _llama(config: Any) -> ArchFlags:
    attn_bias = bool(getattr(config, "attention_bias", False))
    return ArchFlags(attn_bias, attn_bias, bool(getattr(config, "mlp_bias", False)), qk_norm=False)


def _mistral(config: Any) -> ArchFlags:
    return ArchFlags(False, False, False, qk_norm=False)


def _qwen2(config: Any) -> ArchFlags:
    return ArchFlags(True, False, False, qk_norm=False)


def _qwen3(config: Any) -> ArchFlags:
    attn_bias = bool(getattr(config, "attention_bias", False))
    return ArchFlags(attn_bias, attn_bias, False, qk_norm=True)


ARCHITECTURES = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3}


def arch_flags(config: Any) -> ArchFlags:
    """Flags for a HF config; ValueError for anything this engine cannot run exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {model_type!r}; supported model_type values: {', '.join(ARCHITECTURES)}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type}: hidden_act {act!r} is not supported (only 'silu')")
    window = sliding_window(config)
    if window is not None and window < config.max_position_embeddings:
        raise ValueError(
            f"{model_type}: sliding-window attention (window {window} < max_position_embeddings "
            f"{config.max_position_embeddings}) is not supported; only full causal attention is"
        )
    return ARCHITECTURES[model_type](config)


def sliding_window(config: Any) -> int | None:
    """The window HF would apply to some layer of this config, or None for full attention everywhere."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if config.model_type == "mistral":  # Mistral applies its window to every layer whenever it is set
        return window
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", False) else None
