"""load_format="share": an engine whose weights are a live transformers model's own tensors, not a copy.

For a learner colocated with its rollout engine in one process (one copy of the weights on the GPU, no refresh
to move them), and for the benchmark's 61 GB Qwen3-30B-A3B beside its transformers peer on one 80 GB GPU.
Every parameter whose HF tensor already has the engine's layout, dtype and device is that tensor (the stacked
experts, the embeddings, norms, o_proj, down_proj, the LM head); the fused projections (q/k/v, a dense MLP's
gate/up) are the one copy, a few percent of an MoE model. The consequences run both ways, and are the point:
training the model in place changes what the engine samples with from its next step, and a weight refresh of
the engine writes into the model.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout_service.model.decoder import DecoderLM
from rollout_service.model.weight_update import apply_named_tensors, resolve_named_tensors
from rollout_service.ops.backend import Ops
from rollout_service.ops.rope import build_cos_sin_cache


def shared_model(source: nn.Module, config: Any, dtype: torch.dtype, device: torch.device | str,
                 ops: Ops) -> DecoderLM:
    """A DecoderLM over `source`'s tensors (module docstring); ValueError when a weight is not on `device` in
    `dtype`, naming it (sharing would otherwise be a silent copy)."""
    device = torch.device(device)
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    for name, tensor in state.items():
        if tensor.dtype != dtype or tensor.device.type != device.type or (
                device.index is not None and tensor.device.index != device.index):
            raise ValueError(f"load_format='share': weight {name!r} is {str(tensor.dtype).removeprefix('torch.')} "
                             f"on {tensor.device}; the engine runs {str(dtype).removeprefix('torch.')} on {device} "
                             "(move the model there first, or load_format='auto' to copy)")
    with torch.device("meta"):
        model = DecoderLM(config, ops)
    model = model.to(dtype=dtype)
    copied = []
    for name, param in list(model.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        held = state.get(name)
        if held is not None and held.shape == param.shape and held.is_contiguous():
            module._parameters[leaf] = nn.Parameter(held, requires_grad=False)
        else:
            module._parameters[leaf] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                    requires_grad=False)
            copied.append(name)
    model.tie_embeddings()
    model.fuse_projections()  # q/k/v and gate/up become views of new fused tensors: filled below
    absent = [n for n in copied if n not in state]
    if absent:
        raise ValueError(f"load_format='share': the model has no weight {absent[0]!r} ({len(absent)} missing)")
    # what is not the model's own tensor now: the fused projections' views and the copies allocated above
    fill = [n for n, p in model.named_parameters() if p.data_ptr() != state[n].data_ptr()]
    pairs, _ = resolve_named_tensors(model, [(n, state[n]) for n in fill])
    apply_named_tensors(pairs)
    model.cos_sin = build_cos_sin_cache(config, model.max_positions, dtype, device)
    return model.eval()
