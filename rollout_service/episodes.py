"""Multi-turn episodes: a model turn, the environment's answer, the next turn, ... inside one engine.

This module is what a user implements: the `Environment` protocol. The engine runs episodes with it
(rollout_service/engine/episode_runner.py). An episode request (RolloutRequest.episode) runs on the engine it was
sent to, so its KV stays there between
turns. Every turn is an ordinary engine request whose prompt is the episode's exact token ids so far (never
text tokenized again), so the prefix cache finds the history's full pages and only the new tokens are
prefilled. For each of the request's n samples the runner copies the environment, takes the first prompt from
`reset(metadata)`, and after every model turn appends what `step(text)` answers:

- text (str): raw text that continues the assistant's turn, e.g. a tool result after the stop string that
  ended the turn ("<calc>3*7</calc>" -> "<result>21</result>", the model goes on in the same turn);
- chat messages: the assistant's turn is closed and the messages follow, as the chat template renders them,
  with the generation prompt after them (PromptProcessor.chat_delta);
- token ids: appended as they are (for a model without a tokenizer).

The result is one RolloutResult per episode (see RolloutResult's docstring): every token after the first
prompt in `token_ids`, `loss_mask` 1 on the model's tokens and 0 on the environment's and the template's,
`turns` with each model turn's span, and the environment's last reward. An environment that raises or answers
with the wrong type ends its own episode ("abort", `error` says which environment, method and problem); the
other episodes and requests go on.
"""
from __future__ import annotations

from typing import Any, Protocol, Union, runtime_checkable

Observation = Union[str, list[dict], list[int]]


@runtime_checkable
class Environment(Protocol):
    """What an episode talks to. It is deep-copied for each sample, and pickled to a Ray worker: define it in
    an importable module. `reset(metadata)` -> the first prompt: chat messages, text (chat-templated unless
    the request has apply_chat_template=False) or token ids. `step(assistant_text)` gets the model's turn
    (its tokens decoded, special tokens left out) and returns (what to append, reward, done); what comes with
    done=True, or after the last allowed turn, is not appended."""

    def reset(self, metadata: Any) -> Observation: ...

    def step(self, assistant_text: str) -> tuple[Observation, float, bool]: ...
