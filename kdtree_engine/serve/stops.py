"""Stop strings matched on the detokenized text, across token boundaries.

Text is released only once it cannot be the start of a stop string: the longest tail of the pending text that is
a prefix of some stop string is held back until the next delta decides it. The first stop string to complete
(the earliest end; at equal ends the longer) ends the text just before it (the stop string itself is not returned,
as OpenAI's API does). So the result does not depend on how the text was split into deltas.
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add text; returns the text that is safe to release. Sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        text = self.pending + delta
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            self.stopped = True
            self.pending = ""
            return text[:min(found)[1]]
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """The held-back text, at the end of the request (no stop string can complete any more)."""
        out, self.pending = self.pending, ""
        return out
