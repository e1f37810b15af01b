"""PrefixTokenizer (rollout_service/token_prefixes.py): a long prompt tokenized by its new end only gives the
tokenizer's own ids, on a growing chat (the embedded model's tokenizer), where a template rewrites the history,
where an added token could match across the cut, and for tokenizers it must not cut (rstrip tokens, Metaspace,
truncation left on the backend)."""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from rollout_service import token_prefixes
from rollout_service.prompts import PromptProcessor
from rollout_service.token_prefixes import PrefixTokenizer

PIECES = ["The sum of 17 and 25 is 42.", " héllo 🌍", "\n\n  indented\tline", "a literal <|im_end|> inside",
          "<|im_start|", "im_end|>", "x" * 300, "def f(n):\n    return n * (n + 1) // 2\n", "  ", "0123456789" * 20]


def _template_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_growing_chat_has_the_templates_ids_at_every_turn(smollm2):
    tok = smollm2[1]
    prompts, rng = PromptProcessor(tok, len(tok)), random.Random(0)
    assert prompts._prefixes.cuttable
    messages: list[dict] = []
    long_calls = 0  # calls whose prompt and the one before are long enough to keep
    for turn in range(24):
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6)))})
        if role == "user":
            assert prompts.chat_ids(messages) == _template_ids(tok, messages), turn
            before = messages[:-2]
            text = tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True) if before else ""
            long_calls += len(text) >= token_prefixes.MIN_PREFIX
    # each of those started from the one before; one prefix is kept, the conversation's newest
    assert long_calls >= 8 and prompts._prefixes.hits == long_calls and len(prompts._prefixes._entries) == 1
    # a template or client that rewrites the history: an earlier turn trimmed, another dropped
    rewritten = [dict(m) for m in messages]
    rewritten[5]["content"] = rewritten[5]["content"].strip()
    del rewritten[9:11]
    assert prompts.chat_ids(rewritten) == _template_ids(tok, rewritten)
    assert prompts.chat_ids(messages[:7]) == _template_ids(tok, messages[:7])  # a shorter one after longer ones


def _word_backend(*added: AddedToken) -> Tokenizer:
    words = ["<unk>", "x", "b", "c", "a", "<", ">", "r"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(list(added))
    return t


def test_an_added_token_that_would_match_across_the_cut_is_seen():
    """"<a>" is a cut; in the next prompt "<a>b" (another added token, longer: it wins) starts at that place."""
    backend = _word_backend(AddedToken("<a>", special=True, normalized=False),
                            AddedToken("<a>b", special=True, normalized=False))
    cached = PrefixTokenizer(backend)
    body = "x " * token_prefixes.MIN_PREFIX
    first, second = body + "<a> c", body + "<a>b c"
    for text in (first, second, first + " x", body + "<a>" + " c x"):
        assert cached.ids(text) == backend.encode(text, add_special_tokens=False).ids, text[-12:]
    assert cached._entries  # (first's prefix was kept, and refused for second)


def test_tokenizers_it_must_not_cut_are_tokenized_whole():
    stripping = _word_backend(AddedToken("<r>", special=True, normalized=False, rstrip=True))
    assert not PrefixTokenizer(stripping).cuts  # (it takes the whitespace after it: the next piece's start)
    meta = Tokenizer(models.WordLevel({"<unk>": 0, "▁x": 1}, unk_token="<unk>"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    meta.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    cached = PrefixTokenizer(meta)
    assert not cached.cuttable
    text = "x " * token_prefixes.MIN_PREFIX + "<s>x"
    for _ in range(2):
        assert cached.ids(text + " x") == meta.encode(text + " x", add_special_tokens=False).ids
    assert not cached._entries


def test_truncation_left_on_the_backend_goes_through_the_wrapper(smollm2):
    tok = smollm2[1]
    prompts = PromptProcessor(tok, len(tok))
    text = "The sum of 17 and 25 is 42. " * 200
    want = prompts.text_ids(text)
    tok.backend_tokenizer.enable_truncation(16)  # as transformers leaves it after a call that truncated
    try:
        assert not prompts._prefixes.direct
        assert prompts.text_ids(text) == want and len(want) > 16
    finally:
        tok.backend_tokenizer.no_truncation()


def test_kept_prefixes_are_bounded(monkeypatch, smollm2):
    monkeypatch.setattr(token_prefixes, "MAX_ENTRIES", 4)
    tok = smollm2[1]
    cached = PrefixTokenizer(tok.backend_tokenizer)
    for i in range(10):
        text = f"{i} " + "x" * token_prefixes.MIN_PREFIX + "<|im_end|>\n<|im_start|>user"
        assert cached.ids(text) == tok.encode(text, add_special_tokens=False)
    assert len(cached._entries) == 4 and cached._chars == sum(map(len, cached._entries))


@pytest.mark.parametrize("cut", ["<|im_start|>", "<|im_end|>"])
def test_text_after_a_cut_is_tokenized_as_in_the_whole(smollm2, cut):
    """Whitespace, a space-led word and a literal special token right after the cut: as the whole prompt."""
    tok = smollm2[1]
    cached = PrefixTokenizer(tok.backend_tokenizer)
    head = "y" * token_prefixes.MIN_PREFIX + cut
    cached.ids(head)
    for tail in ("\n", " word", "  two", "<|im_end|>", "\u00e9\u0301", ""):
        assert cached.ids(head + tail) == tok.encode(head + tail, add_special_tokens=False), repr(tail)
