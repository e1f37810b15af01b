"""Messages -> token ids through the model's chat template, and token ids -> the strings OpenAI's logprobs show.

The app renders prompts itself and sends the service token ids, so that what a session records as its
prompt is exactly what the model saw (a text prompt would be rendered again on a worker).
"""
from __future__ import annotations

from typing import Any

from rollout_service.openai.schemas import ApiError
from rollout_service.prompts import PromptProcessor


def _template_error(e: Exception) -> ApiError:
    # jinja's TemplateError (e.g. "roles must alternate"), or a tokenizer's own: the messages are at fault
    return ApiError(400, f"messages: the model's chat template refused them ({type(e).__name__}: {e})", "messages",
                    "template_error")


class ChatRenderer:
    """The tokenizer's chat template and vocabulary, as the endpoints need them."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.prompts = PromptProcessor(tokenizer, vocab_size)
        self.eos_ids = set(eos_ids)

    @property
    def has_chat_template(self) -> bool:
        return self.prompts.has_chat_template

    def render(self, messages: list[dict], tools: list | None = None, tool_choice: Any = None) -> list[int]:
        """The prompt of a chat call: every message, then the generation prompt."""
        if not self.has_chat_template:
            raise ApiError(400, "messages: this model's tokenizer has no chat template: use /v1/completions",
                           "messages", "no_chat_template")
        extra = {k: v for k, v in (("tools", tools), ("tool_choice", tool_choice)) if v is not None}
        try:
            return self._checked(self.prompts.chat_ids(messages, **extra))
        except ApiError:
            raise
        except Exception as e:
            raise _template_error(e) from None

    def continuation(self, messages: list[dict], closed_by: int | None) -> list[int]:
        """The tokens that close the last assistant turn and add `messages` plus the generation prompt,
        rendered without the turn itself (PromptProcessor.chat_delta, as multi-turn episodes do), so the
        sampled tokens are never re-tokenized."""
        try:
            return self.prompts.chat_delta(messages, closed_by)
        except Exception as e:
            raise _template_error(e) from None

    def encode_text(self, text: str) -> list[int]:
        """A completions prompt: the text as the tokenizer encodes it (special tokens such as BOS included)."""
        if self.tokenizer is None:
            raise ApiError(400, "prompt: this model has no tokenizer: give token ids", "prompt")
        try:
            return self._checked(list(self.tokenizer.encode(text)), "prompt")
        except ApiError:
            raise
        except Exception as e:
            raise ApiError(400, f"prompt: the tokenizer refused it ({type(e).__name__}: {e})", "prompt") from None

    def _checked(self, ids: list[int], param: str = "messages") -> list[int]:
        """Non-empty and inside the vocabulary (a bad id would fail on a worker, after the checks here)."""
        try:
            return self.prompts._check(ids)
        except ValueError as e:
            raise ApiError(400, f"{param}: {e}", param) from None

    def check_ids(self, ids: list[int]) -> list[int]:
        return self._checked(ids, "prompt")

    def decode(self, ids: list[int]) -> str:
        """Sampled tokens as text, as the engine decodes a result's (special tokens left out)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text (a byte-level piece of a longer character decodes to U+FFFD, as in OpenAI's)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def closed_by(self, token_ids: list[int], finish_reason: str) -> int | None:
        """The EOS token that ended a turn, if one did (its text is then not rendered again after it)."""
        if finish_reason == "stop" and token_ids and token_ids[-1] in self.eos_ids:
            return token_ids[-1]
        return None


def renderer_for(client: Any, tokenizer: Any = None) -> ChatRenderer:
    """The renderer of a client's model: the in-process engine's tokenizer, or the one given (a Ray service's
    workers hold theirs; the caller loads the same one here)."""
    engine = getattr(client, "engine", None)
    if tokenizer is None and engine is not None:
        tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("openai_app: this client has no in-process engine whose tokenizer the app can use: pass "
                         "tokenizer= (the model's transformers tokenizer)")
    if engine is not None:
        return ChatRenderer(tokenizer, engine.hf_config.vocab_size, engine.eos_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return ChatRenderer(tokenizer, len(tokenizer), {eos} if isinstance(eos, int) else set(eos or ()))
