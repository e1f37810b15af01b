"""What transformers' MoE layers route to: hooks on each sparse block's experts module record the expert ids
they were given (the router's top-k, or a replay's), the reference the routed-experts tests compare against."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch


def moe_blocks(model) -> list:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


@contextmanager
def captured_experts(model):
    """Yields a list that each forward of `model` extends with one int64 array [batch, seq, moe_layers, top_k]:
    the expert ids every MoE layer's experts computed with."""
    calls: list = []
    layers: list = []

    def record(module, args):
        layers.append(args[1].detach().cpu())

    def new_forward(module, args, kwargs):
        layers.clear()

    def end_forward(module, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append(torch.stack(layers, 1).reshape(*ids.shape, len(layers), -1).numpy())

    handles = [b.experts.register_forward_pre_hook(record) for b in moe_blocks(model)]
    handles.append(model.register_forward_pre_hook(new_forward, with_kwargs=True))
    handles.append(model.register_forward_hook(end_forward, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def hf_routing(model, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), moe_layers, top_k]: the experts transformers routes each position of one sequence to."""
    with captured_experts(model) as calls, torch.no_grad():
        model(torch.tensor([token_ids]))
    return calls[0][0]


def expected_routing(model, result) -> tuple[np.ndarray, np.ndarray]:
    """(routed_experts, prompt_routed_experts) a result should carry, by transformers' routers on its tokens."""
    prompt = len(result.prompt_token_ids) - 1
    ids = hf_routing(model, list(result.prompt_token_ids) + list(result.token_ids))
    return ids[prompt:prompt + len(result.token_ids)], ids[:prompt]
