"""Weights before and after an update, for delta encoding tests on the CPU and on a GPU."""
from __future__ import annotations

import torch


def before_and_after(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per tensor none, a few (gaps past both escape widths), some (moves far enough to go raw) or all of its
    elements changed, by the seed; empty and one-element tensors; signed zeros."""
    g = torch.Generator().manual_seed(seed)
    old = {f"t{i}": torch.randn(n, generator=g) * 0.02 for i, n in enumerate([5, 300_000, 70_000, 4096, 1, 0, 999])}
    new = {}
    for i, (k, v) in enumerate(old.items()):
        density = [0.0, 1e-5, 0.01, 0.3, 1.0][(i + seed) % 5]
        pick = torch.rand(v.shape, generator=g) < density
        far = torch.rand(v.shape, generator=g) < 0.1
        new[k] = torch.where(pick, v + torch.where(far, 1.0, 1e-4) * torch.randn(v.shape, generator=g), v)
    new["t1"][[0, 299_999]] = -0.0
    return old, new
