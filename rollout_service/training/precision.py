"""Mixed-precision training: a low-precision model (bf16 forward and backward) updated through fp32 master
weights, so the many small updates of RL training are not rounded away in bf16.

The model's parameters stay bf16 (they are what the rollout workers receive, as is); every trainable one
has an fp32 master copy, which the optimizer updates. Gradients of the micro-batches are summed in fp32 on
the masters (`accumulate` after each backward), and `step` copies the updated masters back into the model.
An fp32 model needs none of this: the optimizer then works on its parameters directly.

Optimizers: "adamw" (two fp32 moments per weight: 16 bytes/param with the master) and "adafactor" (torch's
Adafactor: factored second moments, no first moment, so ~4 bytes/param for the master alone; its learning
rate is relative to each weight's RMS). An 8B model with AdamW needs ~128 GB of master and moments, more
than one GPU colocated with a rollout engine can spare; with Adafactor it is ~32 GB.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

OPTIMIZERS = ("adamw", "adafactor")


class MasterWeights:
    def __init__(self, model: nn.Module, optimizer: str = "adamw", lr: float = 1e-5, weight_decay: float = 0.0):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}: choose one of {OPTIMIZERS}")
        self.model = model
        self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad]) \
            if any(p.requires_grad for p in model.parameters()) else ((), ())
        self.exact = all(p.dtype == torch.float32 for p in self.params)
        # an fp32 model is its own master; otherwise an fp32 copy of every trainable weight
        self.masters = list(self.params) if self.exact else [p.detach().float() for p in self.params]
        self.optimizer = _make_optimizer(optimizer, self.masters, lr, weight_decay)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if not self.exact:
            for m in self.masters:
                m.grad = None

    def accumulate(self) -> None:
        """After a micro-batch's backward: move its (low-precision) gradients into the fp32 sums."""
        if self.exact:
            return
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    def step(self, max_grad_norm: float | None) -> float:
        """Clip the summed gradients, update the masters, copy them into the model; returns the grad norm."""
        self.accumulate()
        with_grad = [m for m in self.masters if m.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(with_grad, max_grad_norm)) if max_grad_norm else 0.0
        self.optimizer.step()
        if not self.exact:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        self.zero_grad()
        return norm

    def nbytes(self) -> int:
        """Bytes of masters (when separate) and optimizer state."""
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if isinstance(t, torch.Tensor))
        masters = 0 if self.exact else sum(m.numel() * 4 for m in self.masters)
        return state + masters

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.masters)


def _make_optimizer(name: str, params: list, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)
    on_gpu = bool(params) and params[0].is_cuda
    # fused AdamW: one kernel for every weight instead of a dozen per weight
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if on_gpu else {}))
