"""Turn a request's full decoded text after each step into the new piece to stream.

Two things are held back until they settle: a trailing U+FFFD (a multi-byte character cut between
tokens) and a tail that could still grow into a stop string (the engine trims stop strings from the
final text). So the streamed pieces always add up to the final text.
"""

from __future__ import annotations


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TextDelta:
    def __init__(self, stops: list[str] | None = None) -> None:
        self.stops = stops or []
        self.sent = ""

    def push(self, text: str, finished: bool) -> str:
        """The text not yet sent that is safe to send now (everything, once finished)."""
        ready = text
        if not finished:
            ready = ready.rstrip("\ufffd")
            hold = _stop_prefix_len(ready, self.stops)
            ready = ready[: len(ready) - hold]
        if len(ready) <= len(self.sent):
            return ""
        # if the decoded prefix ever changed under us (a rare tokenizer merge), only the new tail is sent
        piece = ready[len(self.sent) :]
        self.sent = ready
        return piece
