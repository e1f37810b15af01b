"""Tokenize a long prompt by its new end only: the ids of text already tokenized, up to a special token, are kept.

An agent's chat history grows by a turn a call and is sent (and rendered) whole each time; tokenizing all of it
cost 26 ms a call at 23k tokens on the embedded model's tokenizer. A fast tokenizer first cuts its input at its
added tokens (`<|im_start|>`, `<|im_end|>`, ...), then tokenizes each piece between them on its own. So where a
new prompt starts with text tokenized before up to the end `b` of such a token, its ids are the earlier ids up to
that token followed by the ids of the text after `b`, provided the cut at `b` is one the tokenizer would make
in the new prompt too:
- the token there matches exactly its text (no `rstrip` or `single_word`, which look past it; not a normalized
  one, which is matched only inside pieces), and its text does not end in whitespace (a later token's `lstrip`
  could take it);
- no added token's text occurs in the new prompt across `b` (it would win the match there, leftmost and longest);
- the tokenizer truncates, pads and splits special tokens nowhere (`encode_special_tokens` off), and has no
  Metaspace step (SentencePiece-style: it may treat the prompt's first piece apart).
Anything else is tokenized whole. The ids are the tokenizer's own in every case (tests/test_token_prefixes.py).
"""
from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from typing import Any

MAX_ENTRIES = 1024         # prefixes kept, least recently used dropped first (one a conversation: the newest)
MAX_CHARS = 1 << 24        # and at most this many characters in all: 16 MB of ASCII text, ~16 MB of its ids
MIN_PREFIX = 1024          # characters: a shorter prompt costs less to tokenize than to look up


class PrefixTokenizer:
    """A fast tokenizer's backend (`tokenizers.Tokenizer`) whose `ids(text)` reuses the ids of earlier prompts'
    text (without special tokens added, as apply_chat_template(tokenize=True) tokenizes). Thread-safe."""

    def __init__(self, backend: Any):
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.added = sorted({t.content for t in added.values() if t.content}, key=len)
        self.cuts = {i: t.content for i, t in added.items()
                     if t.content and not (t.rstrip or t.single_word or t.normalized) and not t.content[-1].isspace()}
        self._entries: OrderedDict[str, array] = OrderedDict()  # prefix text -> its ids (4 bytes each, not 36)
        self._chars = 0
        self.hits = 0  # prompts that started with a kept prefix
        self._lock = threading.Lock()
        # Metaspace's prepend_scheme "first" treats a prompt's first piece apart (a piece tokenized alone would be
        # its first); every other step acts on each piece alike
        steps = [step.__getstate__() for step in (backend.normalizer, backend.pre_tokenizer) if step is not None]
        self.cuttable = bool(self.cuts) and not getattr(backend, "encode_special_tokens", False) and \
            not any(b'"Metaspace"' in state for state in steps)

    @property
    def direct(self) -> bool:
        """The backend tokenizes as asked now: no truncation or padding left set on it (transformers sets those
        per call of its own, and they stay)."""
        return self.backend.truncation is None and self.backend.padding is None

    def ids(self, text: str) -> list[int]:
        """text's ids (call where `direct`)."""
        if len(text) < MIN_PREFIX or not self.cuttable:
            return self._encode(text).ids
        start, head = self._longest_prefix(text)
        enc = self._encode(text[start:])
        ids = head + enc.ids
        self._remember(text, start, enc, ids, len(head))
        return ids

    def _encode(self, text: str) -> Any:
        # encode_batch lets go of the GIL while it runs (encode does not)
        return self.backend.encode_batch([text], add_special_tokens=False)[0]

    def _longest_prefix(self, text: str) -> tuple[int, list[int]]:
        """(b, ids of text[:b]) for the longest kept prefix of text that is a safe cut in it; (0, []) if none."""
        with self._lock:
            found = [(p, ids) for p, ids in self._entries.items() if len(p) <= len(text) and text.startswith(p)]
        for p, ids in sorted(found, key=lambda e: -len(e[0])):
            if not self._spans(text, len(p)):
                with self._lock:
                    self.hits += 1
                    if p in self._entries:
                        self._entries.move_to_end(p)
                return len(p), ids.tolist()
        return 0, []

    def _spans(self, text: str, b: int) -> bool:
        """Whether some added token's text occurs in `text` across position b."""
        for a in self.added:
            s = text.find(a, max(0, b - len(a) + 1), b + len(a) - 1)
            if s != -1 and s < b:
                return True
        return False

    def _remember(self, text: str, start: int, enc: Any, ids: list[int], n_head: int) -> None:
        """Keep text up to the end of its last token that can be cut at, where that lies past `start` (`enc`: the
        encoding of text[start:]; `ids`: text's, the first n_head of them text[:start]'s)."""
        new = enc.ids
        j = next((j for j in range(len(new) - 1, -1, -1) if new[j] in self.cuts), None)
        if j is None:
            return
        a, b = enc.offsets[j]
        if text[start + a:start + b] != self.cuts[new[j]]:
            return  # (offsets that do not show the token's text: keep nothing rather than guess)
        prefix = text[:start + b]
        with self._lock:
            if prefix in self._entries:
                self._entries.move_to_end(prefix)
                return
            # the prefix it grew from goes: a conversation keeps its newest prefix, not one a call
            if start and self._entries.pop(text[:start], None) is not None:
                self._chars -= start
            self._entries[prefix] = array("i", ids[:n_head + j + 1])
            self._chars += len(prefix)
            while len(self._entries) > 1 and (len(self._entries) > MAX_ENTRIES or self._chars > MAX_CHARS):
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old)
