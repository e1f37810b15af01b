"""Check and apply named tensors (HF state_dict names) to a DecoderLM: used by loading and weight refresh.

Validation is complete before anything is written, so a bad refresh leaves the old weights untouched.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn


def validate_named_tensors(
    model: nn.Module, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, new value) pairs; ValueError naming the first unknown name, wrong shape or non-float tensor.

    A partial set of names is allowed (the rest keep their values). With tied embeddings both
    `model.embed_tokens.weight` and `lm_head.weight` name the same parameter.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    pairs = []
    for name, tensor in items:
        param = params.get(name)
        if param is None:
            raise ValueError(f"unknown weight name {name!r} (expected HF state_dict names such as {next(iter(params))!r})")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, expected a floating point dtype")
        pairs.append((param, tensor))
    return pairs


@torch.no_grad()
def apply_named_tensors(pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Copy validated values in place (cast to the model's dtype and device), keeping parameter identity."""
    for param, tensor in pairs:
        param.copy_(tensor)
