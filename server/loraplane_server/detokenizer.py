"""Incremental detokenization: a step decodes the few tokens since the text last settled, not the
whole output (which made a long generation cost O(n^2) in decode calls).

The text of tokens [0, read) is settled: it is kept, and a new step decodes only the window
[prefix, n), where prefix is where the last settled piece began, so that the tokenizer sees the
same left context as a full decode would (SentencePiece drops the leading space of the first token
it decodes; the window's head absorbs that). The new text is what the window adds beyond the
decode of [prefix, read). A piece that ends in U+FFFD (a UTF-8 character cut between tokens) is
returned but not settled, so a later token can complete it, exactly as a full decode would show it.
If the window ever disagrees with its own head (a tokenizer whose text for earlier tokens depends on
later ones), the whole output is decoded once and the window starts again from there.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # left context kept after a full re-decode


class IncrementalText:
    __slots__ = ("head", "prefix", "read", "text")

    def __init__(self) -> None:
        self.text = ""  # the decode of tokens [0, read)
        self.prefix = 0
        self.read = 0
        self.head: str | None = ""  # the decode of tokens [prefix, read), once asked for

    def update(self, decode: Callable[[list[int]], str], ids: list[int]) -> str:
        """The decoded text of ids, the whole output so far (ids only ever grows)."""
        if self.head is None:  # the same until the text settles again
            self.head = decode(ids[self.prefix : self.read])
        head = self.head
        window = decode(ids[self.prefix :])
        if not window.startswith(head):
            text = decode(ids)
            if not text.endswith(REPLACEMENT):
                self.text, self.prefix, self.read = text, max(0, len(ids) - CONTEXT_TOKENS), len(ids)
                self.head = None
            return text
        new = window[len(head) :]
        if new.endswith(REPLACEMENT):
            return self.text + new
        self.text += new
        self.prefix, self.read = self.read, len(ids)
        self.head = None
        return self.text
