"""Prompts: a call's prompts as a list of them (`prompt_items`); prompt -> token ids (chat template via
transformers) and token ids -> text; the template's tokens between the turns of a multi-turn episode
(`chat_delta`)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

from rollout_service.api.types import Prompt, RolloutRequest
from rollout_service.token_prefixes import PrefixTokenizer

_TURN = "\u2063assistant turn\u2063"  # stands for the model's text in chat_delta's renderings (found by rindex)


def _is_single_prompt(p: Any) -> bool:
    return isinstance(p, str) or (isinstance(p, list) and bool(p) and isinstance(p[0], (int, dict)))


def prompt_items(prompts: Any, what: str = "prompts") -> Iterable:
    """One prompt (or RolloutRequest) or many, as an iterable of them (not read yet: it may be an iterator);
    ValueError naming `what` for anything else."""
    if isinstance(prompts, RolloutRequest) or _is_single_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (bytes, Mapping)) or not isinstance(prompts, Iterable):
        raise ValueError(f"{what}: expected a prompt, a RolloutRequest or a list of them, got "
                         f"{type(prompts).__name__}")
    return prompts


def prompts_with_metadata(prompts: Any, metadata: Any, at_least: int, what: str) -> Iterator[tuple[Any, Any]]:
    """(prompt, metadata) pairs, drawn lazily from a list or iterator of prompts (prompt_items) and None or a
    list or iterator alongside. Sized sources are checked now: at least `at_least` prompts, as many metadata;
    metadata that runs out before the prompts is a ValueError when it does. `what` names the caller."""
    prompts = prompt_items(prompts, f"{what}: prompts")
    if isinstance(prompts, Sized) and len(prompts) < at_least:
        raise ValueError(f"{what}: target_groups={at_least} but only {len(prompts)} prompts")
    if metadata is None:
        return ((p, None) for p in prompts)
    if isinstance(metadata, (str, bytes, Mapping)) or not isinstance(metadata, Iterable):
        raise ValueError(f"{what}: metadata must be None or a list or iterator with one entry per prompt, got "
                         f"{type(metadata).__name__}")
    if isinstance(prompts, Sized) and isinstance(metadata, Sized) and len(metadata) != len(prompts):
        raise ValueError(f"{what}: metadata has {len(metadata)} entries for {len(prompts)} prompts")
    return _paired(iter(prompts), iter(metadata), what)


def _paired(prompts: Iterator, metadata: Iterator, what: str) -> Iterator[tuple[Any, Any]]:
    missing = object()
    for p in prompts:
        m = next(metadata, missing)
        if m is missing:
            raise ValueError(f"{what}: metadata ran out before the prompts")
        yield p, m


class PromptProcessor:
    def __init__(self, tokenizer: Any | None, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own
        self._prefixes = PrefixTokenizer(backend) if backend is not None else None

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
        return self.chat_ids(messages)

    def chat_ids(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        """A conversation and the generation prompt as the template renders them (`template_kwargs`: tools, ...),
        then tokenized as apply_chat_template(tokenize=True) does: the text without special tokens added."""
        return self.text_ids(self._render(messages, True, **template_kwargs))

    def text_ids(self, text: str) -> list[int]:
        """Raw text continuing a sequence: its tokens, with no BOS or template around them."""
        if self.tokenizer is None:
            raise ValueError("text needs a tokenizer to become tokens; this model has none (give token ids)")
        if self._prefixes is not None and self._prefixes.direct:  # the same ids, less of a prompt's latency
            return self._prefixes.ids(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_delta(self, messages: list[dict], closed_by: int | None = None) -> list[int]:
        """The tokens that end an assistant turn and add `messages` plus the generation prompt, as the chat
        template renders them after an assistant message. Taken as the difference of two renderings of a
        fixed conversation (with and without the messages), so the model's own tokens are never rendered
        again (re-tokenizing them could change them). `closed_by`: the EOS token the turn ended with, whose
        text is then left out of the closing (it is already in the sequence); None for a turn that ended
        otherwise (length, stop string), which the template's closing then ends."""
        if not self.has_chat_template:
            raise ValueError("chat messages need a tokenizer with a chat template; this one has none")
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN}]
        before = self._render(base, False)
        after = self._render(base + list(messages), True)
        if not after.startswith(before):
            raise ValueError("the chat template renders an assistant turn differently once messages follow it: "
                             "cannot add messages to an episode with this template")
        closing = before[before.rindex(_TURN) + len(_TURN):]
        if closed_by is not None:
            eos = self.tokenizer.decode([closed_by], skip_special_tokens=False)
            closing = closing.removeprefix(eos)
        return self._check(self.text_ids(closing + after[len(before):]))

    def _render(self, messages: list[dict], add_generation_prompt: bool, **template_kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **template_kwargs)

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
