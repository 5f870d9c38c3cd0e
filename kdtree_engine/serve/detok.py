"""Incremental detokenization: text deltas from a growing list of token ids, never a partial UTF-8 character.

Decoding the whole list at every token costs time quadratic in its length; this decodes a short window instead
(the tokens of the last delta and the new ones), as vLLM does. A window whose text ends in U+FFFD (the
replacement character a byte-level decoder gives for an incomplete UTF-8 sequence) is held until more tokens
complete it. :meth:`Detokenizer.finish` emits whatever the full decode has beyond the deltas, so the joined
deltas always equal ``decode(all ids)``.
"""

from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class Detokenizer:
    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0      # first id of the window
        self.read = 0        # ids up to here are shown
        self.shown = ""      # all text emitted so far

    def push(self, token: int) -> str:
        """Add one token; returns the new text it completes ("" while a character is incomplete)."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""
        delta = text[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.shown += delta
        return delta

    def finish(self) -> str:
        """The text of all ids not yet emitted (a held character, a decoder's final cleanup)."""
        full = self.decode(self.ids)
        if full.startswith(self.shown):
            rest = full[len(self.shown):]
            self.shown = full
            return rest
        return ""
