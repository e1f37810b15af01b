"""The mixture-of-experts block of Qwen3-MoE and Mixtral decoder layers, over the ops interface.

Parameters are named and shaped as transformers (>= 5) holds them, so `hf_model.state_dict()` maps 1:1:
`mlp.gate.weight` [E, H] (the router), `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then
its up rows) and `mlp.experts.down_proj` [E, H, I]. Per-expert checkpoint names are views into these
(model/expert_names.py).

Routing is computed in one place, `route`, and each block knows its place among the model's MoE layers
(`moe_index`). An engine gives each block its view of a routing store (`routed`, engine/routed_experts.py): the forward
then writes each row's expert ids at the step's KV slots, as attention writes the rows' K/V.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout_service.model.registry import MoeSpec
from rollout_service.ops.backend import Ops
from rollout_service.ops.cuda_moe import invariant_blocker


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoeBlock(nn.Module):
    """forward(x [T, H]) -> [T, H]: each token through its top-k experts, mixed by the router's weights."""

    def __init__(self, hidden: int, spec: MoeSpec, moe_index: int, ops: Ops):
        super().__init__()
        self.ops = ops
        self.top_k = spec.top_k
        self.renormalize = spec.renormalize
        self.moe_index = moe_index  # 0 .. num_moe_layers - 1, in layer order
        self.gate = Router(spec.num_experts, hidden)
        self.experts = Experts(spec.num_experts, hidden, spec.expert_intermediate_size)
        self.routed: torch.Tensor | None = None  # [num_slots, top_k] expert ids, a view into the engine's store

    def fuse(self) -> None:
        """Nothing to fuse: the experts' weights are stacked already."""

    def route(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids int32 [T, k], weights float32 [T, k]) of this layer for rows x; with slots (and a store),
        the ids are also recorded there."""
        record = self.routed if slots is not None else None
        return self.ops.moe_route(x, self.gate.weight, self.top_k, self.renormalize, record, slots)

    def forward(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """slots: the rows' KV slots (int64 [T]), where their expert ids are recorded when there is a store."""
        ids, weights = self.route(x, slots)
        return self.ops.moe_experts(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)


def check_moe_backend(spec: MoeSpec | None, config: Any, backend: str, batch_invariant: bool,
                      dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
    """ValueError for batch_invariant on the cuda backend with MoE layers it cannot make invariant: its experts run
    as grouped products (ops/cuda_moe.py), which need bfloat16 and a Hopper GPU; the torch backend's invariant
    MoE runs anywhere."""
    if spec is None or not batch_invariant or backend != "cuda":
        return
    why = invariant_blocker(config.hidden_size, spec.expert_intermediate_size, spec.num_experts, spec.top_k, dtype,
                            device)
    if why:
        raise ValueError(f"batch_invariant on the cuda backend does not cover this mixture-of-experts model "
                         f"({config.model_type}: {len(spec.sparse_layers)} MoE layers): {why}; use backend 'torch' "
                         "(slower) or batch_invariant off")
