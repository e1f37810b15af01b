"""Check and apply named tensors (HF state_dict names) to a DecoderLM: used by loading and weight refresh.

Validation is complete before anything is written, so a bad refresh leaves the old weights untouched. A
refresh's manifest (names, shapes, dtypes; no data) is checked by the same rules before its bytes move.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn


def _check(params: dict[str, nn.Parameter], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    param = params.get(name)
    if param is None:
        raise ValueError(f"unknown weight name {name!r} (expected HF state_dict names such as {next(iter(params))!r})")
    if tuple(shape) != tuple(param.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(shape)}, expected {tuple(param.shape)}")
    if not dtype.is_floating_point:
        raise ValueError(f"weight {name!r} has dtype {dtype}, expected a floating point dtype")
    return param


def _check_complete(model: nn.Module, covered: set[int]) -> None:
    missing = [name for name, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ValueError(f"update_weights: {len(missing)} weight(s) missing, e.g. {missing[:3]}; send every "
                         "weight, or pass partial=True to change only some")


def validate_named_tensors(
    model: nn.Module, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    partial: bool = True,
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(parameter, new value) pairs; ValueError naming the first unknown name, wrong shape or non-float tensor,
    or (partial=False) the weights left out. With tied embeddings both `model.embed_tokens.weight` and
    `lm_head.weight` name the same parameter: sent together, they must hold the same values."""
    params = dict(model.named_parameters(remove_duplicate=False))
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    given: dict[int, tuple[str, torch.Tensor]] = {}  # id(parameter) -> the first (name, value) for it
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        param = _check(params, name, tuple(tensor.shape), tensor.dtype)
        if id(param) in given:
            _check_tied(*given[id(param)], name, tensor)
        else:
            given[id(param)] = (name, tensor)
    pairs = [(params[name], tensor) for name, tensor in given.values()]
    if not partial:
        _check_complete(model, set(given))
    return pairs


def _check_tied(first: str, a: torch.Tensor, second: str, b: torch.Tensor) -> None:
    """Two names of one (tied) parameter: one value is copied, so the other must not differ from it."""
    same_storage = (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
                    and a.stride() == b.stride())
    if not same_storage and not torch.equal(a, b.to(a.device, a.dtype)):
        raise ValueError(f"weights {first!r} and {second!r} are tied in this model (one parameter) but were "
                         "given different values; send one of them, or equal values")


def validate_manifest(model: nn.Module, entries: Iterable, partial: bool = False) -> None:
    """The same checks on a refresh's manifest entries (name, shape, dtype name), before any bytes move."""
    params = dict(model.named_parameters(remove_duplicate=False))
    covered = set()
    for e in entries:
        dtype = getattr(torch, e.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight {e.name!r} has unknown dtype {e.dtype!r}")
        covered.add(id(_check(params, e.name, e.shape, dtype)))
    if not partial:
        _check_complete(model, covered)


@torch.no_grad()
def apply_named_tensors(pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Copy validated values in place (cast to the model's dtype and device), keeping parameter identity.
    Copies into GPU parameters are queued, not waited for: the caller synchronises once at the end."""
    for param, tensor in pairs:
        param.copy_(tensor, non_blocking=param.is_cuda)
