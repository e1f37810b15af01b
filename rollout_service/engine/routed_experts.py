"""Routing replay's engine side: which experts every mixture-of-experts layer chose, per KV slot, beside the KV
cache, and what a sequence's result reports of it (RolloutResult.routed_experts / prompt_routed_experts).

Every MoE layer writes its top-k expert ids at the step's slot mapping (model/moe.py) in the forward that writes
the slot's K/V, so a slot's routing is always that of the computation whose KV sits there: a page found in the
prefix cache brings the routing of the request that computed it, the n samples of a prompt share it (the
partial last page is copied with its K/V), and CUDA-graph padding rows land in the scratch page as their K/V do.

A preemption frees a sequence's pages and the recompute rewrites its positions. What the sequence had then is
kept on the host first (Sequence.routing_prefix), so each position reports the forward that first computed it:
the one that produced the token after it. The recompute's routing is the same except where a router near-tie
falls the other way under another batch shape (never in batch-invariant mode).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout_service.engine.sequence import Sequence

MAX_EXPERTS = 1 << 16  # ids travel as uint16 at most


class RoutingStore:
    """Expert ids [num_pages * page_size, moe_layers, top_k]: uint8 for up to 256 experts, else int16 holding
    uint16 bits (torch has no index_put for uint16)."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, top_k: int, num_experts: int,
                 device: torch.device | str):
        if num_experts > MAX_EXPERTS:
            raise ValueError(f"routed experts: {num_experts} experts per layer do not fit uint16 ids")
        wide = num_experts > 256
        self.host_dtype = np.dtype(np.uint16 if wide else np.uint8)
        self.page_size = page_size
        self.table = torch.zeros(num_pages * page_size, num_layers, top_k, device=device,
                                 dtype=torch.int16 if wide else torch.uint8)

    @classmethod
    def for_model(cls, model: Any, num_pages: int, page_size: int, device: torch.device) -> "RoutingStore | None":
        """The store of a DecoderLM's MoE layers, each block given its view to write (None for a dense model)."""
        if model.moe is None:
            return None
        store = cls(num_pages, page_size, model.num_moe_layers, model.moe.top_k, model.moe.num_experts, device)
        for block in model.moe_layers():
            block.routed = store.table[:, block.moe_index]
        return store

    @staticmethod
    def bytes_per_page(model: Any, page_size: int) -> int:
        if model.moe is None:
            return 0
        return page_size * model.num_moe_layers * model.moe.top_k * (1 if model.moe.num_experts <= 256 else 2)

    def read(self, pages: list[int], start: int, end: int) -> np.ndarray:
        """[end - start, moe_layers, top_k] on the host: positions [start, end) of a sequence holding `pages`."""
        positions = np.arange(start, end)
        slots = np.asarray(pages, dtype=np.int64)[positions // self.page_size] * self.page_size
        index = torch.from_numpy(slots + positions % self.page_size).to(self.table.device)
        return self.table[index].cpu().numpy().view(self.host_dtype)

    def copy_page(self, src: int, dst: int) -> None:
        ps = self.page_size
        self.table[dst * ps:(dst + 1) * ps].copy_(self.table[src * ps:(src + 1) * ps])

    @property
    def nbytes(self) -> int:
        return self.table.untyped_storage().nbytes()

    def capacity_bytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def release(self) -> None:
        self.table.untyped_storage().resize_(0)  # the blocks' views share this storage: they follow it back

    def reallocate(self) -> None:
        if self.nbytes != self.capacity_bytes():
            self.table.untyped_storage().resize_(self.capacity_bytes())


def check_routing_request(sampling: Any, model: Any) -> None:
    """ValueError for a request asking for routed experts from a model without MoE layers."""
    if sampling.return_routed_experts and model.moe is None:
        raise ValueError(f"SamplingParams.return_routed_experts: the model ({model.config.model_type}) has no "
                         "mixture-of-experts layers")


def known_routing(store: RoutingStore, seq: Sequence) -> np.ndarray:
    """Routing of seq's positions [0, n) as far as it is known: what was kept at its last preemption, then
    what the pages it holds have for the positions computed since."""
    kept = seq.routing_prefix
    start = 0 if kept is None else len(kept)
    held = seq.num_computed if seq.pages else 0
    if held <= start:  # (the store itself may be released: asleep)
        return kept if kept is not None else np.zeros((0, *store.table.shape[1:]), store.host_dtype)
    fresh = store.read(seq.pages, start, held)
    return fresh if kept is None else np.concatenate([kept, fresh])


def keep_routing(store: RoutingStore | None, seq: Sequence) -> None:
    """Before seq's pages are freed by a preemption: keep what they hold of its routing, if it asked for it."""
    if store is not None and seq.sampling.return_routed_experts:
        seq.routing_prefix = known_routing(store, seq)


def result_routing(store: RoutingStore | None, seq: Sequence) -> dict[str, np.ndarray | None]:
    """RolloutResult's routed_experts / prompt_routed_experts fields for seq (none for a model without MoE
    layers or a request that did not ask)."""
    if store is None or not seq.sampling.return_routed_experts:
        return {}
    return routing_fields(known_routing(store, seq), len(seq.prompt_token_ids), seq.num_output_tokens,
                          seq.sampling)


def routing_fields(known: np.ndarray | None, prompt_len: int, num_tokens: int,
                   sampling: Any) -> dict[str, np.ndarray | None]:
    """The result fields from the routing of positions [0, len(known)) of prompt + tokens; a field whose positions
    are not all known (an aborted prompt never computed) is None."""
    if not sampling.return_routed_experts:
        return {}
    have, prompt = 0 if known is None else len(known), prompt_len - 1
    end = prompt + num_tokens  # token i came from position prompt + i; the last one produced nothing
    return {"routed_experts": known[prompt:end] if have >= end else None,
            "prompt_routed_experts": known[:prompt] if sampling.return_prompt_routed_experts and have >= prompt
            else None}


def extend_episode_routing(parts: list[np.ndarray] | None, turn: Any) -> list[np.ndarray] | None:
    """An episode's routing so far (the positions [0, n) of its tokens, in pieces; None once a turn brought none)
    and a finished turn's result: the turn's prompt was the episode's tokens so far, so the positions the
    episode lacks (the environment's tokens, and the previous turn's last token) come from the turn's prefill,
    then the turn's own tokens' positions."""
    if parts is None or turn.routed_experts is None or turn.prompt_routed_experts is None:
        return None
    have = sum(len(p) for p in parts)
    return parts + [turn.prompt_routed_experts[have:], turn.routed_experts]
