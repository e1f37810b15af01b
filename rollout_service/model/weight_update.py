"""Check and apply named tensors (HF state_dict names) to a DecoderLM: used by loading and weight refresh.

Validation is complete before anything is written, so a bad refresh leaves the old weights untouched. A
refresh's manifest (names, shapes, dtypes; no data) is checked by the same rules before its bytes move.
A name is a parameter's, or one expert's projection inside a stacked MoE tensor (model/expert_names.py): it
is copied into that slice, and a stacked tensor is complete once all its experts' parts were given.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from rollout_service.model.expert_names import ExpertPart, part_view, parts_of, resolve
from rollout_service.model.quantize import copy_quantized


@dataclass(frozen=True)
class _Target:
    param: nn.Parameter
    part: ExpertPart | None  # None: the whole parameter
    dest: torch.Tensor  # the parameter, or the part's view into it

    @property
    def key(self) -> tuple[int, ExpertPart | None]:
        return id(self.param), self.part


def _target(params: dict[str, nn.Parameter], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> _Target:
    resolved = resolve(name)
    stacked = resolved.stacked if isinstance(resolved, ExpertPart) else resolved
    param = params.get(stacked)
    if param is None:
        raise ValueError(f"unknown weight name {name!r} (expected HF state_dict names such as {next(iter(params))!r})")
    part = resolved if isinstance(resolved, ExpertPart) else None
    dest = part_view(param, part) if part else param
    if tuple(shape) != tuple(dest.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(shape)}, expected {tuple(dest.shape)}")
    if not dtype.is_floating_point:
        raise ValueError(f"weight {name!r} has dtype {dtype}, expected a floating point dtype")
    return _Target(param, part, dest)


def _missing(model: nn.Module, covered: dict[int, set]) -> list[str]:
    """Names of the weights nothing was given for: a parameter's, or the parts a stacked one still lacks."""
    missing = []
    for name, p in model.named_parameters():
        got = covered.get(id(p))
        if not got:
            missing.append(name)
        elif None not in got:
            missing += [part.name for part in parts_of(name, p) if part not in got]
    return missing


def _check_complete(missing: list[str]) -> None:
    if missing:
        raise ValueError(f"update_weights: {len(missing)} weight(s) missing, e.g. {missing[:3]}; send every "
                         "weight, or pass partial=True to change only some")


def _check_overlaps(given: dict[tuple, tuple[str, torch.Tensor]]) -> dict[int, set]:
    """Which parts of each parameter were given ({id: {None}} for whole ones); ValueError if a stacked tensor
    and one of its experts' parts were both given (which one would win is not the sender's to guess)."""
    covered: dict[int, set] = {}
    first: dict[int, str] = {}
    for (pid, part), (name, _) in given.items():
        covered.setdefault(pid, set()).add(part)
        if None in covered[pid] and len(covered[pid]) > 1:
            raise ValueError(f"weights {first[pid]!r} and {name!r} both set the same expert weights; send the "
                             "stacked tensor or its per-expert parts, not both")
        first.setdefault(pid, name)
    return covered


def resolve_named_tensors(
    model: nn.Module, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """((destination, new value) pairs, names of the weights left out); ValueError naming the first unknown
    name, wrong shape, non-float tensor, or tied / overlapping names given different values."""
    params = dict(model.named_parameters(remove_duplicate=False))
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    given: dict[tuple, tuple[str, torch.Tensor]] = {}  # target key -> the first (name, value) for it
    dests: dict[tuple, torch.Tensor] = {}
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        target = _target(params, name, tuple(tensor.shape), tensor.dtype)
        if target.key in given:
            _check_same(*given[target.key], name, tensor, target.part is None)
        else:
            given[target.key], dests[target.key] = (name, tensor), target.dest
    covered = _check_overlaps(given)
    return [(dests[key], tensor) for key, (_, tensor) in given.items()], _missing(model, covered)


def validate_named_tensors(
    model: nn.Module, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    partial: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, new value) pairs (a destination is a parameter or an expert's slice of one); ValueError
    naming the first unknown name, wrong shape or non-float tensor, or (partial=False) the weights left out.
    With tied embeddings both `model.embed_tokens.weight` and `lm_head.weight` name the same parameter: sent
    together, they must hold the same values."""
    pairs, missing = resolve_named_tensors(model, named_tensors)
    if not partial:
        _check_complete(missing)
    return pairs


def _check_same(first: str, a: torch.Tensor, second: str, b: torch.Tensor, whole: bool) -> None:
    """Two names of one weight (a tied parameter, or two names of one expert's projection): one value is
    copied, so the other must not differ from it."""
    same_storage = (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
                    and a.stride() == b.stride())
    if not same_storage and not torch.equal(a, b.to(a.device, a.dtype)):
        what = "are tied in this model (one parameter)" if whole else "name the same expert weights"
        raise ValueError(f"weights {first!r} and {second!r} {what} but were given different values; send one "
                         "of them, or equal values")


def validate_manifest(model: nn.Module, entries: Iterable, partial: bool = False) -> None:
    """The same checks on a refresh's manifest entries (name, shape, dtype name), before any bytes move."""
    params = dict(model.named_parameters(remove_duplicate=False))
    given: dict[tuple, tuple[str, None]] = {}
    for e in entries:
        dtype = getattr(torch, e.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight {e.name!r} has unknown dtype {e.dtype!r}")
        given.setdefault(_target(params, e.name, e.shape, dtype).key, (e.name, None))
    covered = _check_overlaps(given)
    if not partial:
        _check_complete(_missing(model, covered))


def current_weights(model: nn.Module, entries: Iterable) -> list[tuple[str, torch.Tensor]]:
    """What the model holds now under each manifest entry's name (live views: a parameter or an expert's slice of
    one), the base a delta refresh patches. ValueError for a weight held in another dtype than the entry's, or as
    FP8 (quantized: its bf16 values are gone)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for e in entries:
        dtype = getattr(torch, e.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight {e.name!r} has unknown dtype {e.dtype!r}")
        target = _target(params, e.name, e.shape, dtype)
        if hasattr(target.param, "fp8_scale"):
            raise ValueError(f"weight {e.name!r} is held as FP8: a delta cannot patch it")
        if target.dest.dtype != dtype:
            raise ValueError(f"weight {e.name!r} is held as {str(target.dest.dtype).removeprefix('torch.')}, the "
                             f"delta's as {e.dtype}: a delta must come in the engine's dtype")
        out.append((e.name, target.dest))
    return out


def model_dtype(model: nn.Module) -> str | None:
    """The dtype the model's weights are held in (its FP8-quantized ones aside), e.g. "bfloat16"."""
    dtype = next((p.dtype for p in model.parameters() if not hasattr(p, "fp8_scale")), None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


@torch.no_grad()
def apply_named_tensors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy validated values in place (cast to the model's dtype and device; quantized into an FP8 parameter:
    model/quantize.py), keeping parameter identity. Copies into GPU parameters are queued, not waited for: the
    caller synchronises once at the end."""
    for dest, tensor in pairs:
        if hasattr(dest, "fp8_scale"):
            copy_quantized(dest, tensor)
        else:
            dest.copy_(tensor, non_blocking=dest.is_cuda)
