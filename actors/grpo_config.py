"""The GRPO learner's settings (actors/grpo.py says what a step does with them), each checked when the config is
made: a bad value is a ValueError naming the field, before any actor starts. A service YAML's `grpo:` section
holds the same fields (scripts/grpo_demo.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_service.config import DTYPE_NAMES
from rollout_service.training import OPTIMIZERS
from rollout_service.training.importance import MODES as CORRECTIONS
from rollout_service.api.values import is_int


@dataclass
class GRPOConfig:
    group_size: int = 8
    prompts_per_step: int = 8
    lr: float = 2e-5
    clip_eps: float = 0.2
    tis_cap: float = 2.0
    temperature: float = 1.0
    max_tokens: int = 16
    micro_batch: int = 16
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"                # "cuda", "cuda:1", "auto" (a GPU when there is one)
    dtype: str = "float32"             # "bfloat16": bf16 forward/backward through fp32 master weights
    optimizer: str = "adamw"           # or "adafactor" (memory-saving: no first moment, factored second)
    gradient_checkpointing: bool = False
    colocate: Any = "auto"             # sleep the workers around the learner phase; "auto": if the service is colocated
    sleep_level: int = 1               # 1: the workers park their weights in host memory (they can serve the last
                                       # version if the learner dies mid-step); 2: dropped, the refresh brings them
    ignore_eos: bool = False           # fixed-length rollouts (benchmarks)
    memory_limit_gb: float | None = None  # cap on the GPU memory the learner's allocator may take (from a shared GPU)
    stop: list[str] = field(default_factory=list)  # stop strings of every rollout (a tool call's end: "</calc>")
    max_turns: int = 4                 # episodes (env_fn given): model turns per episode
    max_total_tokens: int = 1024       # episodes: tokens per episode, first prompt included
    bitwise: bool = False              # recompute with the batch-invariant engine's numerics (actors/grpo.py):
                                       # needs EngineConfig.batch_invariant and the engine's dtype and device type
    verify_receipts: int = 4           # bitwise mode: results per step whose receipt and log-probs the learner
                                       # checks (InvariantForward.verify), those sampled by the weights it holds
    receipt_key: str | None = field(default=None, repr=False)  # the service's EngineConfig.receipt_key
    routing_replay: bool = False       # mixture-of-experts policies: rollouts return their routed experts (prompt
                                       # included) and the learner's forward replays them (training/routing_replay.py)
    rollout_correction: str | None = None  # "tis" | "mis": weigh each token by the learner's and the engine's
                                           # probability ratio (training/importance.py), PPO's ratio taken against
                                           # the learner's own recompute; None: PPO against the rollout log-probs
    correction_cap: float = 2.0        # the ratio band [1/c, c] of rollout_correction and of the fidelity report

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_tokens", "micro_batch", "max_turns", "max_total_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GRPOConfig.{name}={v!r}: must be an int >= 1")
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size={self.group_size}: GRPO needs >= 2 samples per prompt")
        for name in ("lr", "clip_eps", "temperature", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r}: must be > 0")
        if not self.tis_cap >= 1:
            raise ValueError(f"GRPOConfig.tis_cap={self.tis_cap!r}: must be >= 1")
        if self.rollout_correction not in (None, *CORRECTIONS):
            raise ValueError(f"GRPOConfig.rollout_correction={self.rollout_correction!r}: must be null or one of "
                             f"{CORRECTIONS}")
        if not (isinstance(self.correction_cap, (int, float)) and 1 < self.correction_cap < float("inf")):
            raise ValueError(f"GRPOConfig.correction_cap={self.correction_cap!r}: must be a finite number > 1")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"GRPOConfig.dtype={self.dtype!r}: must be one of {DTYPE_NAMES}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"GRPOConfig.optimizer={self.optimizer!r}: choose one of {OPTIMIZERS}")
        if self.colocate not in (True, False, "auto"):
            raise ValueError(f"GRPOConfig.colocate={self.colocate!r}: must be true, false or 'auto'")
        if self.receipt_key is not None and not (isinstance(self.receipt_key, str) and self.receipt_key):
            raise ValueError("GRPOConfig.receipt_key: must be None or a non-empty str")
        if not is_int(self.verify_receipts) \
                or self.verify_receipts < 0:
            raise ValueError(f"GRPOConfig.verify_receipts={self.verify_receipts!r}: must be an int >= 0")
        for name in ("bitwise", "routing_replay"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r}: must be true or false")
        if self.bitwise and self.gradient_checkpointing:
            # InvariantForward calls the layers' weights itself: transformers' checkpointing never runs
            raise ValueError("GRPOConfig.bitwise with gradient_checkpointing: the bitwise recompute runs its own "
                             "forward, which does not checkpoint; turn one of them off")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"GRPOConfig.sleep_level={self.sleep_level!r}: must be 1 or 2")
        if self.memory_limit_gb is not None and not (isinstance(self.memory_limit_gb, (int, float))
                                                     and self.memory_limit_gb > 0):
            raise ValueError(f"GRPOConfig.memory_limit_gb={self.memory_limit_gb!r}: must be None or a number > 0")
        try:
            torch.device("cuda" if self.device == "auto" else self.device)
        except RuntimeError:
            raise ValueError(f"GRPOConfig.device={self.device!r}: not a torch device") from None

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"GRPOConfig.device={self.device!r}: no CUDA device is visible to the learner")
        return device
