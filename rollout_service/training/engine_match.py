"""Whether a bitwise learner (InvariantForward) can reproduce the rollout workers' log-probs: what fixes each
worker's numerics, and a clear error for what cannot match."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch


def engine_numerics(client: Any) -> list[dict]:
    """Per rollout worker, what fixes its numerics: batch_invariant, dtype (a torch dtype's name), device and
    backend, from its stats (None where a worker does not say)."""
    return [{k: s.get(k) for k in ("batch_invariant", "dtype", "device", "backend")} for s in client.stats()]


def check_bitwise_engine(workers: Sequence[dict], dtype: torch.dtype, device: torch.device,
                         backend: str = "torch") -> None:
    """ValueError unless every worker can sample with the numerics of a bitwise learner in `dtype` on
    `device` with the ops `backend` (engine_numerics' dicts); a warning for what no worker reports."""
    learner_dtype = str(dtype).removeprefix("torch.")
    for i, w in enumerate(workers):
        where = f"GRPOConfig.bitwise: rollout worker {i}"
        if w["batch_invariant"] is False:
            raise ValueError(f"{where} is not batch-invariant: start the engine with batch_invariant=True (--bitwise)")
        if w["backend"] is not None and w["backend"] != backend:
            raise ValueError(f"{where} runs the {w['backend']!r} ops, the learner the {backend!r} ops: bitwise "
                             "log-probs need the same ops on both sides")
        if w["dtype"] is not None and w["dtype"] != learner_dtype:
            raise ValueError(f"{where} runs in {w['dtype']}, the learner in {learner_dtype}: the policy's weights "
                             f"must be in the engine's dtype (GRPOConfig.dtype={w['dtype']!r})")
        if w["device"] is not None and torch.device(w["device"]).type != device.type:
            raise ValueError(f"{where} runs on {w['device']}, the learner on {device}: bitwise log-probs need the "
                             "same kind of device on both sides")
    if any(w["batch_invariant"] is None for w in workers):
        logging.getLogger(__name__).warning(
            "GRPOConfig.bitwise: some workers do not report batch_invariant or dtype, so the learner cannot check "
            "them; each step's ratio_first_minibatch_max_abs_dev is 0.0 only when they match")
