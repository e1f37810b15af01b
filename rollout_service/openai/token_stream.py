"""Token-by-token streaming of a call's choices: the text each choice has shown, grown from the TokenDeltas the
service hands out while its sample runs, and the rest of it from the sample's result, which is what counts.

Text goes out only once it cannot change: a token that ends inside a multi-byte character waits for the next
one, and with stop strings the last (longest stop - 1) characters wait, since the engine cuts the text where a
stop string begins and that string may still be forming. So the chunks of a choice add up to its result's text.
The one case where they cannot: a sample generated again (its worker died, or its tokens went stale) whose new
text does not extend what was shown; the call then ends with an error (ChoiceStream.finish raises Diverged) and
its session records nothing.

A chat call that may call tools (the common <tool_call> convention: tool_calls.py) streams the turn's content
while it is surely content: up to the first <tool_call> or what may be its start, less trailing whitespace. The
last chunk carries the rest of the content and the calls read from the finished text, so the chunks again add up
to the answer a call without `stream` gets.
"""
from __future__ import annotations

from typing import Callable

from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutResult
from rollout_service.openai import responses as out
from rollout_service.openai.templates import ChatRenderer
from rollout_service.openai.tool_calls import surely_content

PARTIAL_CHAR = "\ufffd"  # what a token ending inside a multi-byte character decodes to


class Diverged(Exception):
    pass


class ChoiceStream:
    """One choice's stream: its current attempt's tokens and their text, the text shown, and how many tokens'
    log-probs went out. The text grows by decoding a window of the last tokens only (each delta's tokens after
    those of the one before, diffed against the decode of those alone), so a long answer costs linear time,
    not a decode of all its tokens at every delta."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str],
                 shown_of: Callable[[str], int] = len):
        self._decode = decode
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._shown_of = shown_of  # how much of the text so far may be shown (tool calls: its sure content)
        self.attempt = 0
        self.tokens: list[int] = []
        self.text = ""       # the text of self.tokens[:self._read]
        self._prefix = 0     # the window's first token: context for those from _read on
        self._read = 0
        self.shown = ""
        self.logged = 0  # tokens whose log-probs a chunk carried

    def delta(self, d: TokenDelta) -> tuple[str, range]:
        """The text this delta lets out (maybe "") and the token positions whose log-probs go with it."""
        if d.attempt != self.attempt:  # generated again: its tokens start over
            self.attempt, self.tokens, self.text, self._prefix, self._read = d.attempt, [], "", 0, 0
        if d.start != len(self.tokens):
            return "", range(0)  # (deltas of one attempt come in order: never seen)
        self.tokens += d.token_ids
        self.text += self._new_text()
        ready = self.text[:max(0, min(len(self.text) - self._hold, self._shown_of(self.text)))]
        piece = ready[len(self.shown):] if ready.startswith(self.shown) else ""
        self.shown += piece
        return piece, self._logs(len(self.tokens))

    def _new_text(self) -> str:
        """The text the tokens from _read on add, once it cannot change (not ending inside a character). Decoded
        with the window's earlier tokens before them, as a tokenizer may write a token differently at the
        start of a text (a SentencePiece word's leading space)."""
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if len(after) <= len(before) or after.endswith(PARTIAL_CHAR) or not after.startswith(before):
            return ""  # wait for the next tokens
        self._prefix, self._read = self._read, len(self.tokens)
        return after[len(before):]

    def finish(self, r: RolloutResult, text: str) -> tuple[str, range]:
        """The rest of the choice's `text` (its result's, or its content when it called tools) and of its
        log-probs."""
        if not text.startswith(self.shown):
            raise Diverged(f"choice {r.sample_index} was generated again (its worker failed, or its tokens went "
                           f"stale), and the new sample differs from the text already streamed: call again (a call "
                           f"with stream false is answered whole)")
        piece, self.shown = text[len(self.shown):], text
        return piece, self._logs(len(r.token_ids))

    def _logs(self, end: int) -> range:
        start, self.logged = self.logged, max(end, self.logged)
        return range(start, self.logged)


class CallStream:
    """The chunks of one token-streamed call (a completion or a chat call; `tools`: what a chat call that may call
    tools offered), by sample index."""

    def __init__(self, renderer: ChatRenderer, stops: list[str], chat: bool, logprobs: bool, rid: str, model: str,
                 tools: out.Tools | None = None):
        self._renderer, self._stops, self._chat, self._logprobs = renderer, stops, chat, logprobs
        self._rid, self._model, self._tools = rid, model, tools
        self._choices: dict[int, ChoiceStream] = {}
        self._offsets: dict[int, int] = {}  # completions: where the next chunk's logprobs start in the text

    def on_delta(self, d: TokenDelta) -> dict | None:
        """The chunk this delta makes, or None when it lets out nothing yet."""
        piece, span = self._choice(d.sample_index).delta(d)
        if not piece and not (self._logprobs and span):
            return None
        return self._chunk(d.sample_index, piece, span_of(d, span) if self._logprobs else None)

    def on_result(self, r: RolloutResult) -> dict:
        """The choice's last chunk (Diverged if a sample generated again no longer extends what was shown)."""
        message, reason = {"content": r.text}, None
        if self._tools is not None:  # its content and calls, read from the finished text
            message, reason = out.turn_of(r, self._renderer, self._tools)
        piece, span = self._choice(r.sample_index).finish(r, message["content"] or "")
        return self._chunk(r.sample_index, piece, result_span(r, span) if self._logprobs else None, r,
                           message.get("tool_calls"), reason)

    def _choice(self, index: int) -> ChoiceStream:
        if index not in self._choices:
            shown_of = len if self._tools is None else surely_content
            self._choices[index] = ChoiceStream(self._renderer.decode, self._stops, shown_of)
        return self._choices[index]

    def _chunk(self, index: int, piece: str, span: out.Span | None, r: RolloutResult | None = None,
               tool_calls: list[dict] | None = None, reason: str | None = None) -> dict:
        if self._chat:
            logprobs = None if span is None else out.chat_logprobs_of(span, self._renderer)
            return out.chat_piece_chunk(index, piece, logprobs, self._rid, self._model, r, tool_calls, reason)
        logprobs = None
        if span is not None:
            logprobs = out.completion_logprobs_of(span, self._renderer, self._offsets.get(index, 0))
            self._offsets[index] = sum(map(len, logprobs["tokens"]), self._offsets.get(index, 0))
        return out.completion_piece_chunk(index, piece, logprobs, self._rid, self._model, r)


def span_of(d: TokenDelta, span: range) -> out.Span:
    """The token ids, log-probs and top alternatives of positions `span` within delta `d`."""
    lo, hi = span.start - d.start, span.stop - d.start
    top = None if d.top_logprobs is None else d.top_logprobs[lo:hi]
    return d.token_ids[lo:hi], d.logprobs[lo:hi], top


def result_span(r: RolloutResult, span: range) -> out.Span:
    top = None if r.top_logprobs is None else r.top_logprobs[span.start:span.stop]
    return r.token_ids[span.start:span.stop], r.logprobs[span.start:span.stop].tolist(), top
