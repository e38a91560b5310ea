"""Incremental detokenization and stop strings for one choice.

``IncrementalDetokenizer`` decodes a small window of recent tokens rather than the whole
output each step: decoding ``ids[prefix:]`` and ``ids[prefix:read]`` and taking the
difference keeps tokenizer-specific joins (leading spaces, merged bytes) right. A window
whose text ends in U+FFFD is an unfinished multi-byte character: nothing is emitted until
a later token completes it.

``StopStringMatcher`` holds back text that might be the start of a stop string until it
is decided, and cuts the output before the stop string when one appears.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    decoder: TokenDecoder
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # window start: decoded for context, already emitted
    read_offset: int = 0  # tokens before this are emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.decoder.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of the output: whatever is still held back (even a broken char)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


class StopCheck(NamedTuple):
    text: str  # safe to emit now
    stopped: bool  # a stop string appeared; ``text`` ends right before it


@dataclass(slots=True)
class StopStringMatcher:
    stops: Sequence[str]
    include_stop: bool = False  # the stop string stays in the text (vLLM's option)
    held: str = ""  # text not yet emitted: it may be the start of a stop string
    matched: str | None = None  # the stop string that ended the output (vLLM's stop_reason)

    def feed(self, text: str, *, unchecked: bool = False) -> StopCheck:
        """``text`` as it may be emitted; ``unchecked``: before ``min_tokens``, when no
        stop string may end the output (what is held goes out too)."""
        pending = self.held + text
        if not self.stops or unchecked:
            self.held = ""
            return StopCheck(pending, False)
        # Anything that could start a stop string was held back, so a stop string lies
        # wholly inside ``pending``; the earliest one wins.
        hits = [(i, s) for s in self.stops if (i := pending.find(s)) >= 0]
        if hits:
            self.held = ""
            at, self.matched = min(hits)
            end = at + len(self.matched) if self.include_stop else at
            return StopCheck(pending[:end], True)
        keep = self._longest_stop_prefix_suffix(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        return StopCheck(pending[: len(pending) - keep], False)

    def flush(self) -> str:
        """The output ended without a stop string: release what was held."""
        out, self.held = self.held, ""
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
