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

`product(x, w)` = x @ w.T is a parameter of both so the batch-invariant ops (ops/invariant.py) can put their
row-tile products in; everything else here is row-local already.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
          product: Product = F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int32 [T, k], weights float32 [T, k]) of rows x [T, H] under router weight [E, H]."""
    probs = torch.softmax(product(x, weight).float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return ids.to(torch.int32), _renormalized(weights) if renormalize else weights


def record(table: torch.Tensor | None, slots: torch.Tensor | None, ids: torch.Tensor) -> None:
    """Routing replay's record: the rows' expert ids written at their KV slots in `table` [slots, k] (an index_put
    at device-side indices: no host sync, so a decode step stays capturable). Nothing without a table."""
    if table is not None and slots is not None:
        table[slots] = ids.to(table.dtype)


def route_weights(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, renormalize: bool,
                  product: Product = F.linear) -> torch.Tensor:
    """float32 [T, k]: route's weights of the given experts ids [T, k], differentiable (the math a learner's
    backward differentiates). With route's product, the same bits as route's where ids are route's choice: the
    gathered probabilities are the very values top-k returns, renormalised by the same adds."""
    probs = torch.softmax(product(x, weight).float(), dim=-1).gather(1, ids.long())
    return _renormalized(probs) if renormalize else probs


def _renormalized(weights: torch.Tensor) -> torch.Tensor:
    # the sum in slot order, by explicit adds: a reduction kernel may pick its order by the tensor's shape
    total = weights[:, 0]
    for s in range(1, weights.shape[1]):
        total = total + weights[:, s]
    return weights / total[:, None]


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*k]: the flat (token, slot) indices sorted by expert, stably; counts [E] int64: rows per
    expert). Row j of the grouped input is token order[j] // k."""
    flat = ids.reshape(-1).long()
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


def expert_outputs(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   product: Product = F.linear) -> torch.Tensor:
    """[T, k, H] in x's dtype: expert ids[t, s]'s gated MLP of x[t], unweighted."""
    tokens, k = ids.shape
    order, counts = group_by_expert(ids, gate_up.shape[0])
    rows = x[order // k]
    out = torch.empty(tokens * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    # a loop over experts (not tokens): one GEMM pair each. counts on the host: a sync no CUDA graph captures
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = product(rows[start:start + n], gate_up[e]).chunk(2, dim=-1)
            out[start:start + n] = product(F.silu(gate) * up, down[e])
            start += n
    per_slot = torch.empty_like(out)
    per_slot[order] = out  # back to (token, slot) order
    return per_slot.view(tokens, k, x.shape[1])  # not -1: a step may have no rows


def mix(per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, H]: sum over slots s of weights[:, s] * per_slot[:, s], in float32, added in slot order (explicit
    adds: a reduction kernel may pick its order by shape), rounded once to per_slot's dtype."""
    w = weights.float()
    acc = per_slot[:, 0].float() * w[:, :1]
    for s in range(1, per_slot.shape[1]):
        acc = acc + per_slot[:, s].float() * w[:, s:s + 1]
    return acc.to(per_slot.dtype)


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, product: Product = F.linear) -> torch.Tensor:
    """[T, H] in x's dtype: sum over slots s of weights[t, s] * expert_{ids[t, s]}(x[t])."""
    return mix(expert_outputs(x, ids, gate_up, down, product), weights)
