"""Mixture-of-experts, the torch reference: router -> top-k -> the chosen experts' gated MLPs -> weighted sum.

This is the semantics every backend follows (the CUDA one fuses it: ops/cuda_ops.py). Expert weights are
stacked as transformers (>= 5) holds them: `gate_up` [E, 2I, H] (each expert's gate rows, then its up rows)
and `down` [E, H, I].

- route: router logits in the model's dtype (x @ router_weight.T, as transformers computes them), softmax in
  float32 over all experts, the top-k (largest first; torch.topk's order), optionally renormalised to sum to
  1 (Mixtral always, Qwen3-MoE when `norm_topk_prob`). The weights stay float32.
- experts: the tokens grouped by expert (sorted by expert id, a stable sort: a token's copies keep their slot
  order), each expert's rows through silu(x Wg.T) * (x Wu.T) then Wd.T (in the model's dtype, as a dense MLP),
  then each token's k outputs times their weights summed in float32 in slot order and rounded once to the
  dtype. A token's result depends only on its own row: the grouping changes which GEMM computes a row, not
  the order of the sum over its experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int32 [T, k], weights float32 [T, k]) of rows x [T, H] under router weight [E, H]."""
    probs = torch.softmax(F.linear(x, weight).float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*k]: the flat (token, slot) indices sorted by expert, stably; counts [E] int64: rows per
    expert). Row j of the grouped input is token order[j] // k."""
    flat = ids.reshape(-1).long()
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """[T, H] in x's dtype: sum over slots s of weights[t, s] * expert_{ids[t, s]}(x[t])."""
    tokens, k = ids.shape
    order, counts = group_by_expert(ids, gate_up.shape[0])
    rows = x[order // k]
    out = torch.empty(tokens * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):  # a loop over experts (not tokens): one GEMM pair each
        if n:
            gate, up = F.linear(rows[start:start + n], gate_up[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(F.silu(gate) * up, down[e])
            start += n
    per_slot = torch.empty_like(out)
    per_slot[order] = out  # back to (token, slot) order
    mixed = (per_slot.view(tokens, k, -1).float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return mixed.to(x.dtype)
