"""Per-expert weight names: views into the stacked expert tensors of an MoE model.

transformers (>= 5) holds each MoE layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
then up rows per expert; `mlp.experts.down_proj` [E, H, I]), and those are the model's parameter names.
Checkpoints on disk (save_pretrained writes them back so) and learners on older transformers name each
expert's projections instead; each such name is a slice of one stacked tensor:

- `model.layers.N.mlp.experts.E.gate_proj.weight` [I, H], `.up_proj.weight` [I, H], `.down_proj.weight` [H, I]
  (Qwen3-MoE);
- `model.layers.N.block_sparse_moe.experts.E.w1.weight` (gate), `.w3.weight` (up), `.w2.weight` (down), and
  `model.layers.N.block_sparse_moe.gate.weight` for the router `mlp.gate.weight` (Mixtral).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

ROLES = ("gate", "up", "down")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
_MIXTRAL_ROLES = {"1": "gate", "3": "up", "2": "down"}


@dataclass(frozen=True)
class ExpertPart:
    """One expert's gate, up or down projection inside a stacked parameter."""

    stacked: str  # the stacked parameter's name
    expert: int
    role: str  # "gate", "up" or "down"

    @property
    def name(self) -> str:
        """The per-expert name this part goes by (for messages)."""
        layer = self.stacked.split(".mlp.")[0]
        return f"{layer}.mlp.experts.{self.expert}.{self.role}_proj.weight"


def resolve(name: str) -> str | ExpertPart:
    """The parameter name `name` stands for, or the expert part it is a slice of."""
    match = _PER_EXPERT.match(name)
    if match:
        layer, expert, role = match.groups()
        return ExpertPart(_stacked_name(layer, role), int(expert), role)
    match = _MIXTRAL_EXPERT.match(name)
    if match:
        layer, expert, w = match.groups()
        role = _MIXTRAL_ROLES[w]
        return ExpertPart(_stacked_name(layer, role), int(expert), role)
    match = _MIXTRAL_ROUTER.match(name)
    return f"{match.group(1)}.mlp.gate.weight" if match else name


def _stacked_name(layer: str, role: str) -> str:
    return f"{layer}.mlp.experts.{'down_proj' if role == 'down' else 'gate_up_proj'}"


def part_view(stacked: torch.Tensor, part: ExpertPart) -> torch.Tensor:
    """The slice of `stacked` that `part` names; ValueError if the model has no such expert."""
    if part.expert >= stacked.shape[0]:
        raise ValueError(f"unknown weight name {part.name!r}: this layer has {stacked.shape[0]} experts")
    if part.role == "down":
        return stacked[part.expert]
    rows = stacked.shape[1] // 2
    return stacked[part.expert, :rows] if part.role == "gate" else stacked[part.expert, rows:]


def parts_of(name: str, param: torch.Tensor) -> list[ExpertPart]:
    """Every expert part of stacked parameter `name` (empty for any other parameter)."""
    if name.endswith(".mlp.experts.gate_up_proj"):
        roles = ("gate", "up")
    elif name.endswith(".mlp.experts.down_proj"):
        roles = ("down",)
    else:
        return []
    return [ExpertPart(name, e, role) for e in range(param.shape[0]) for role in roles]
