"""Prompt -> token ids (chat template via transformers) and token ids -> text."""
from __future__ import annotations

from typing import Any

from rollout_service.types import Prompt


class PromptProcessor:
    def __init__(self, tokenizer: Any | None, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt, apply_chat_template: bool = True) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self._check(self._chat(prompt))
        if isinstance(prompt, list):
            return self._check([int(t) for t in prompt])
        if self.tokenizer is None:
            raise ValueError("prompt is text but this model has no tokenizer: pass token ids")
        if apply_chat_template and self.has_chat_template:
            return self._check(self._chat([{"role": "user", "content": prompt}]))
        return self._check(list(self.tokenizer.encode(prompt)))

    def _chat(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("prompt is a list of chat messages but the tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _check(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("prompt encodes to zero tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} out of range [0, {self.vocab_size})")
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def eos_ids(self, hf_config: Any) -> set[int]:
        """End-of-sequence ids from the model config and the tokenizer (either may be an int or a list)."""
        ids: set[int] = set()
        for v in (getattr(hf_config, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)
        return ids
