"""A greedy step's tokens, their logits and the rows' log-sum-exp in one C read of the logits on the CPU
(csrc/cpu_greedy.c): torch's x.max(dim=1) and x.logsumexp(dim=1), with the sum in another order."""
from __future__ import annotations

import torch

from rollout_service.ops import cpu_ext


def applies(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1 and cpu_ext.takes(x)


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], values [B], lse [B]) of rows x [B, V] (see TorchOps.argmax_logsumexp)."""
    rows, vocab = x.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    values, lse = torch.empty(rows), torch.empty(rows)
    cpu_ext.load().rs_argmax_logsumexp(x.data_ptr(), rows, vocab, x.stride(0), tokens.data_ptr(), values.data_ptr(),
                                       lse.data_ptr(), torch.get_num_threads())
    return tokens, values, lse
