"""A request's output text, decoded a few tokens at a time and streamed as deltas.

IncrementalText decodes only the tokens since the text last settled, not the whole output (which
made a long generation cost O(n^2) in decode calls). The text of tokens [start, read) is settled:
it is kept, in the pieces it settled in, and a step decodes only the window [prefix, n), where
prefix is where the last settled piece began, so that the tokenizer sees the same left context as a
full decode would (SentencePiece drops the leading space of the first token it decodes; the window's
head absorbs that). The new text is what the window adds beyond the decode of [prefix, read). A
piece that ends in U+FFFD (a UTF-8 character cut between tokens) is kept as the tail, not settled,
so a later token can complete it, exactly as a full decode would show it. If the window ever
disagrees with its own head (a tokenizer whose text for earlier tokens depends on later ones), the
whole output is decoded once and the window starts again from there.

Detokenizer turns that into deltas that are safe to show: a trailing U+FFFD and a tail that could
still grow into a stop string are held back until they settle, and everything left is flushed when
the request finishes, the stop string cut off. So the deltas add up to the final text (unless the
tokenizer rewrote text already shown: a delta is never taken back). Each step costs O(new tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # left context kept after a full re-decode

Decode = Callable[[list[int]], str]


def decoder_for(tokenizer: Any) -> Decode:
    """ids -> text as `tokenizer.decode(ids, skip_special_tokens=True)` gives it, through the Rust tokenizer's own
    decode where that is all transformers would do: transformers' wrapper turns its argument into Python objects
    and checks for a batch on every call, 3-4x the decode itself, and the engine decodes once or twice per token
    of every running request each step (a 256-row step: ~500 calls). Where transformers would clean up the
    text's spaces afterwards (a WordPiece tokenizer with clean_up_tokenization_spaces), its decode is kept."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or _cleans_up(tokenizer, backend):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    decode = backend.decode
    return lambda ids: decode(ids, skip_special_tokens=True)


def _cleans_up(tokenizer: Any, backend: Any) -> bool:
    """Whether transformers' decode edits the backend's text (its clean_up_tokenization, which it skips for a BPE
    model unless forced)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or bool(forced)


class IncrementalText:
    __slots__ = ("head", "pieces", "prefix", "read", "size", "start", "tail")

    def __init__(self, start: int = 0) -> None:
        self.start = start  # ids before it (the prompt) are not part of the text
        self.pieces: list[str] = []  # the decode of ids [start, read), as it settled
        self.size = 0  # their length
        self.tail = ""  # the decode of ids [read, n) while it ends in U+FFFD
        self.prefix = start
        self.read = start
        self.head: str | None = ""  # the decode of ids [prefix, read), once asked for

    @property
    def text(self) -> str:
        """The decoded text so far (joined on every call: read it once, at the end)."""
        return "".join(self.pieces) + self.tail

    def update(self, decode: Decode, ids: list[int]) -> str:
        """Decode the ids added since the last call (ids only ever grows); the newly settled text."""
        if self.head is None:  # the same until the text settles again
            self.head = decode(ids[self.prefix : self.read])
        window = decode(ids[self.prefix :])
        if not window.startswith(self.head):
            return self._redecode(decode, ids)
        new = window[len(self.head) :]
        if new.endswith(REPLACEMENT):
            self.tail = new
            return ""
        self.tail = ""
        self.prefix, self.read, self.head = self.read, len(ids), None
        self.pieces.append(new)
        self.size += len(new)
        return new

    def _redecode(self, decode: Decode, ids: list[int]) -> str:
        text = decode(ids[self.start :])
        # measured against the old settled text's length: what came before it is not sent again
        if text.endswith(REPLACEMENT):
            self.tail = text[self.size :]
            return ""
        new = text[self.size :]
        self.pieces, self.size, self.tail = [text], len(text), ""
        self.prefix, self.read, self.head = max(self.start, len(ids) - CONTEXT_TOKENS), len(ids), None
        return new


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class Detokenizer:
    """One request's text: update() after each token, then delta() for what to show."""

    __slots__ = ("decoded", "num_sent", "pending", "stop_at", "stops", "unsent")

    def __init__(self, start: int = 0, stops: list[str] | None = None) -> None:
        self.decoded = IncrementalText(start)
        self.stops = stops or []
        self.num_sent = 0  # characters shown so far
        self.unsent = ""  # settled text not shown yet (it may begin a stop string)
        self.pending = ""  # all the text not shown yet: unsent, then the rest of the tail
        self.stop_at: int | None = None  # where the stop string begins in the text, once found

    def update(self, decode: Decode, ids: list[int]) -> None:
        """Decode the new tokens of ids (the prompt, then every output token so far)."""
        text = self.decoded
        size = text.size
        new = text.update(decode, ids)
        shown = self.num_sent - size  # > 0: that much of the old tail (all but its U+FFFD) was shown
        rest = new + text.tail
        self.pending = self.unsent + (rest[shown:] if shown > 0 else rest)

    def find_stop(self) -> bool:
        """True if a stop string is complete; the text then ends where it begins. Only the text not
        shown yet is searched: a stop string that began earlier would have kept its start unshown."""
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if not hits:
            return False
        self.pending = self.pending[: min(hits)]
        self.stop_at = self.num_sent + len(self.pending)
        return True

    def delta(self, finished: bool) -> str:
        """The text that is safe to show now and was not shown yet: all of it once finished."""
        piece = self.pending
        if not finished:
            piece = piece.rstrip(REPLACEMENT)
            piece = piece[: len(piece) - stop_prefix_len(piece, self.stops)]
        self.num_sent += len(piece)
        self.pending = self.pending[len(piece) :]
        self.unsent = self.pending[: max(0, self.decoded.size - self.num_sent)]
        return piece

    @property
    def text(self) -> str:
        """The final text, the stop string cut off (joined on every call: read it once, at the end)."""
        text = self.decoded.text
        return text if self.stop_at is None else text[: self.stop_at]
