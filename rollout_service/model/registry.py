"""Supported architectures: HF model_type -> the few flags in which they differ, and the mixture-of-experts
layout of the MoE ones (Qwen3-MoE, Mixtral)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_service.api.values import is_int


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


# Qwen3-MoE's attention and dense MLP are Qwen3's; Mixtral's attention is Mistral's.
ARCHITECTURES = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3,
                 "mixtral": _mistral}
# transformers applies these models' window to every layer whenever the config sets one.
_WINDOW_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")


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
    moe_spec(config)  # an MoE layout this engine cannot run exactly -> ValueError
    return ARCHITECTURES[model_type](config)


def sliding_window(config: Any) -> int | None:
    """The window HF would apply to some layer of this config, or None for full attention everywhere."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if config.model_type in _WINDOW_EVERY_LAYER:
        return window
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", False) else None


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts layout of a config. Training-only fields (router_aux_loss_coef,
    output_router_logits, router_jitter_noise: transformers applies the jitter in training mode only) do not
    change inference and are ignored."""

    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    expert_intermediate_size: int  # each expert's gated MLP width
    renormalize: bool  # the top-k weights rescaled to sum to 1 (Mixtral always, Qwen3-MoE if norm_topk_prob)
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is the MoE block, ascending

    def moe_index(self, layer_idx: int) -> int | None:
        """Layer layer_idx's place among the MoE layers (0 .. len(sparse_layers) - 1), None if it is dense."""
        return self.sparse_layers.index(layer_idx) if layer_idx in self.sparse_layers else None


# Fields with which other MoE families add always-on shared experts: a config carrying one is refused.
_SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                         "moe_shared_expert_intermediate_size")


def moe_spec(config: Any) -> MoeSpec | None:
    """The MoE layout of an MoE config (None for a dense model or an MoE config with no sparse layer);
    ValueError naming the field this engine cannot honour exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ("qwen3_moe", "mixtral"):
        return None
    for field in _SHARED_EXPERT_FIELDS:
        if getattr(config, field, None):
            raise ValueError(f"{model_type}: shared experts ({field}={getattr(config, field)!r}) are not supported")
    if model_type == "mixtral":
        return _mixtral(config)
    return _qwen3_moe(config)


def _int_field(config: Any, field: str, low: int, high: int | None = None) -> int:
    value = getattr(config, field, None)
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise ValueError(f"{config.model_type}: {field}={value!r} must be {bound}")
    return value


def _experts(config: Any, experts_field: str, size_field: str) -> tuple[int, int, int]:
    num = _int_field(config, experts_field, 1)
    return num, _int_field(config, "num_experts_per_tok", 1, num), _int_field(config, size_field, 1)


def _mixtral(config: Any) -> MoeSpec:
    num, top_k, size = _experts(config, "num_local_experts", "intermediate_size")
    return MoeSpec(num, top_k, size, renormalize=True, sparse_layers=tuple(range(config.num_hidden_layers)))


def _qwen3_moe(config: Any) -> MoeSpec | None:
    """transformers' rule: layer i is sparse iff i is not in mlp_only_layers, num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0; every other layer is a dense MLP of intermediate_size."""
    if _int_field(config, "num_experts", 0) == 0:
        return None
    step = _int_field(config, "decoder_sparse_step", 1)
    dense = getattr(config, "mlp_only_layers", None) or []
    if not isinstance(dense, (list, tuple)) or any(not is_int(i) for i in dense):
        raise ValueError(f"qwen3_moe: mlp_only_layers={dense!r} must be a list of layer indices")
    norm = getattr(config, "norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"qwen3_moe: norm_topk_prob={norm!r} must be a bool")
    layers = tuple(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    if not layers:
        return None
    num, top_k, size = _experts(config, "num_experts", "moe_intermediate_size")
    return MoeSpec(num, top_k, size, renormalize=norm, sparse_layers=layers)
