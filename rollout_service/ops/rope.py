"""Rotary position embedding (rotate-half / NeoX style, as HF Llama) with a precomputed cos/sin table.

The table is `cos_sin [max_positions, head_dim]`: row p = cat(cos(p * inv_freq), sin(p * inv_freq)) * attention
scaling, each half head_dim / 2 wide. Frequencies come from transformers' own ROPE_INIT_FUNCTIONS so scaled
variants match HF exactly; the table is cast to the model dtype the way HF casts cos/sin to the activations.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Frequencies that depend on the current sequence length cannot live in a static position table.
_LENGTH_DEPENDENT = {"dynamic", "longrope"}


def rope_parameters(config: Any) -> dict:
    """The rope dict of a config: `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inv_freq(config: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim / 2], attention_scaling) exactly as HF's rotary embedding computes them."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full-head rotary)")
    if rope_type in _LENGTH_DEPENDENT or "dynamic" in rope_type:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported: its frequencies change with the sequence length, "
            "which a paged cache of already-rotated keys cannot follow"
        )
    dim = rope_head_dim(config)
    with torch.device("cpu"):  # callers may build the model under a meta-device context
        if rope_type == "default":
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            return inv_freq, 1.0
        if rope_type not in ROPE_INIT_FUNCTIONS:
            known = ", ".join(["default", *sorted(k for k in ROPE_INIT_FUNCTIONS if k not in _LENGTH_DEPENDENT)])
            raise ValueError(f"unknown rope_type {rope_type!r}; supported: {known}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def build_cos_sin_cache(
    config: Any,
    max_positions: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The [max_positions, head_dim] cos/sin table (see module docstring)."""
    inv_freq, scaling = rope_inv_freq(config)
    max_positions = max_positions or config.max_position_embeddings
    with torch.device("cpu"):
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        table = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
    return table.to(device=device, dtype=dtype)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by their positions [T]; returns new tensors."""
    tables = rope_tables(positions, cos_sin, q.dtype)
    return rotate(q, tables), rotate(k, tables)


def rope_tables(positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) rows of the positions [T], each [T, 1, D] full width in `dtype`: cos repeated in both halves,
    sin negated in the first half, so that rotate() is x * cos + swap_halves(x) * sin."""
    cos, sin = cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, D/2]
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, H, D] rotated by rope_tables' (cos, sin): the bits of HF's x * cos + rotate_half(x) * sin (the first
    half x1 * cos - x2 * sin, the second x2 * cos + x1 * sin: a + (-b) is a - b exactly)."""
    cos, sin = tables
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin
