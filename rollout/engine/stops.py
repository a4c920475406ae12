"""Stop strings: which committed token's text completes one of a sample's stop strings.

The engine checks the tokens a step committed, after verification accepted them (never drafts
that may still be rejected), one token at a time, and keeps the sample's tokens up to and
including the token whose text completes a stop string; its text may run past the string, and
nothing after that token is kept (masks, log-probs and acceptance lengths follow the kept
tokens: rollout.engine.commit). Text is the tokenizer's decoding without special tokens, the
same as the `text` column.

Decoding is incremental and costs a few tokens per token, whatever the output's length: an
`IncrementalDecoder` keeps the last few token ids as left context (decoding a token alone can
lose a leading space or split a character) and the ids of a character still incomplete (a
multi-byte character spread over byte tokens); a `StopMatcher` adds the last `longest stop - 1`
characters of text, which is all an occurrence that ends in the next token's text can reach back
into. (`rollout show` uses the same decoder to give each token its own piece of text.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

CONTEXT_TOKENS = 4  # token ids kept as left context of the next decode
MAX_PENDING_TOKENS = 4  # a character of up to 4 bytes; past that the replacement character is text
_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """The text a token stream adds, one token at a time, decoding a few tokens per token."""

    __slots__ = ("decode", "context", "context_text", "pending")

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.context: list[int] = []  # ids whose text has been read, the last few
        self.context_text = ""  # decode(context)
        self.pending: list[int] = []  # ids after context whose character is not complete yet

    def push(self, token: int) -> str:
        """The text `token` adds: "" while it leaves a character incomplete, which the token that
        completes it then brings whole."""
        ids = self.context + self.pending + [token]
        text = self.decode(ids)
        if text.endswith(_REPLACEMENT) and len(self.pending) < MAX_PENDING_TOKENS:
            self.pending.append(token)
            return ""
        new = text[len(os.path.commonprefix((text, self.context_text))):]
        self.pending = []
        self.context, self.context_text = ids, text
        if len(ids) > 2 * CONTEXT_TOKENS:
            self.context = ids[-CONTEXT_TOKENS:]
            self.context_text = self.decode(self.context)
        return new


class StopMatcher:
    """One sample's stop strings and the end of its decoded text so far."""

    __slots__ = ("stops", "keep", "decoder", "tail")

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = tuple(stops)
        self.keep = max(map(len, self.stops)) - 1  # characters an occurrence may span before new text
        self.decoder = IncrementalDecoder(decode)
        self.tail = ""  # the last `keep` characters of the text read

    def scan(self, tokens: Sequence[int], position: int, min_tokens: int) -> tuple[int, str] | None:
        """Reads committed `tokens` (the first at output position `position`) in order; returns
        (index in tokens, stop string) of the first whose text completes a stop string at an output
        position >= `min_tokens` (stop strings wait for min_tokens, like stop tokens), else None."""
        for i, token in enumerate(tokens):
            hit = self.push(token)
            if hit is not None and position + i >= min_tokens:
                return i, hit
        return None

    def push(self, token: int) -> str | None:
        """Reads one token; returns the stop string its text completes (the earliest-ending one)."""
        new = self.decoder.push(token)
        if not new:
            return None
        window = self.tail + new
        hit = _earliest(window, self.stops, len(self.tail))
        self.tail = window[-self.keep:] if self.keep else ""
        return hit


def _earliest(window: str, stops: tuple[str, ...], new_from: int) -> str | None:
    """The stop string whose first occurrence ending past `new_from` ends first (ties: list order)."""
    best, best_end = None, len(window) + 1
    for stop in stops:
        start = window.find(stop, max(0, new_from - len(stop) + 1))
        if start >= 0 and start + len(stop) < best_end:
            best, best_end = stop, start + len(stop)
    return best
