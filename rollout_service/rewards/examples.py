"""Example reward functions, importable by name from any worker ("rollout_service.rewards.examples:NAME"):
for the tests, the benchmark and as templates. A reward function takes a RolloutResult and returns a float.
"""
from __future__ import annotations

import builtins
import os
import signal
import time

from rollout_service.api.types import RolloutResult


def length_reward(result: RolloutResult) -> float:
    """The number of generated tokens."""
    return float(len(result.token_ids))


def parity_reward(result: RolloutResult) -> float:
    """1.0 when the sampled token ids add up to an even number, else 0.0: differs within a group by chance."""
    return float(sum(result.token_ids) % 2 == 0)


def difficulty_reward(result: RolloutResult) -> float:
    """By the prompt's metadata {"difficulty": ...}: "easy" always 1.0 and "hard" always 0.0 (constant
    groups, which dynamic sampling drops), "medium" the parity of the sampled tokens (mixed groups)."""
    difficulty = result.metadata["difficulty"]
    if difficulty == "easy":
        return 1.0
    if difficulty == "hard":
        return 0.0
    return parity_reward(result)


def failing_reward(result: RolloutResult) -> float:
    """Raises for results whose metadata says {"fail": True}, else the length reward."""
    if isinstance(result.metadata, dict) and result.metadata.get("fail"):
        raise RuntimeError(f"no reward for sample {result.sample_index}")
    return length_reward(result)


def slow_reward(result: RolloutResult) -> float:
    """The length reward after 0.2 s (or metadata {"sleep_s": s}): a reward slower than a decode step."""
    delay = result.metadata.get("sleep_s", 0.2) if isinstance(result.metadata, dict) else 0.2
    time.sleep(delay)
    return length_reward(result)


def not_a_number_reward(result: RolloutResult) -> str:
    """Returns a string: the service marks every result with the error."""
    return "high"


def exiting_reward(result: RolloutResult) -> float:
    """Ends its process for results whose metadata says {"exit": True}: a reward actor that dies, or, without
    reward actors, a rollout worker (its request is quarantined: actors/quarantine.py). In-process it ends
    the caller."""
    if isinstance(result.metadata, dict) and result.metadata.get("exit"):
        os._exit(1)
    return length_reward(result)


def killing_reward(result: RolloutResult) -> float:
    """Kills its own process (SIGKILL) for results whose metadata says {"kill": True}: what a crash in native
    code or the OOM killer does to a rollout worker. Its request is quarantined after a second such death."""
    if isinstance(result.metadata, dict) and result.metadata.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    return length_reward(result)


def raising_reward(result: RolloutResult) -> float:
    """Raises the builtin exception that the metadata names ({"raise": "SystemExit"}, "KeyboardInterrupt",
    ...), else the length reward: BaseExceptions mark only their own result."""
    name = result.metadata.get("raise") if isinstance(result.metadata, dict) else None
    if name:
        raise getattr(builtins, name)(f"raised by sample {result.sample_index}")
    return length_reward(result)


NOT_CALLABLE = 1.0  # for the tests: a name that resolves to something that is not a function
