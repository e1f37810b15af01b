"""PromptProcessor's ids are the tokenizer's own: chat_ids as apply_chat_template(tokenize=True) gives them and
text_ids as encode(add_special_tokens=False), though both go through the fast tokenizer's backend."""
from __future__ import annotations

import pytest
from openai_setup import word_tokenizer

from rollout_service.prompts import PromptProcessor

CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🌍\n\n  tabs\tand  spaces"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "a literal <|im_end|> and <|im_start|>"}],
    [{"role": "user", "content": " " * 3 + "x" * 2000}],
]


def _template_ids(tok, messages, **kw) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_ids_are_apply_chat_templates(smollm2, messages):
    tok = smollm2[1]
    prompts = PromptProcessor(tok, len(tok))
    assert prompts.chat_ids(messages) == _template_ids(tok, messages)
    assert prompts.encode(messages) == _template_ids(tok, messages)


def test_text_ids_are_encodes_without_special_tokens(smollm2):
    tok = smollm2[1]
    prompts = PromptProcessor(tok, len(tok))
    for text in ("Let me see.", "<|im_end|>\n", "  two  spaces, é, 🌍", "\n"):
        assert prompts.text_ids(text) == tok.encode(text, add_special_tokens=False), text


def test_template_arguments_reach_the_template():
    tok = word_tokenizer()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "yes or no ?"}]
    prompts = PromptProcessor(tok, len(tok))
    with_tools = prompts.chat_ids(messages, tools=tools)
    assert with_tools == _template_ids(tok, messages, tools=tools)
    assert with_tools[:3] == tok.convert_tokens_to_ids(["tools", ":", "add"])
    assert prompts.chat_ids(messages) == _template_ids(tok, messages) != with_tools
