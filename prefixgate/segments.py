"""Chat tokenization with a cache of the pieces between special tokens.

The gateway tokenizes every chat to route it and the replica to serve it, and chats
repeat: the same system prompt, the same earlier turns, request after request. BPE over
a long system prompt costs milliseconds; a dictionary lookup does not.

Why pieces are safe to cache: the ``tokenizers`` library first cuts the text at its added
tokens (``<|im_start|>``, ``<|im_end|>``, ...), then normalizes, pre-tokenizes and
encodes each piece on its own. So the ids of a rendered chat are the ids of its pieces,
each encoded alone, with the added tokens' ids between them, provided that the cut is the
same (leftmost-longest match of the added tokens' literal text) and that nothing depends
on where a piece sits in the text. ``PieceSplitter.for_tokenizer`` only accepts
tokenizers where both hold (no stripping or normalized added tokens, no
position-dependent prefixing, no truncation or padding) and then checks sample chats id
for id against the whole-text encode; otherwise chats are encoded whole.
tests/test_segments.py checks equality on many chats.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizer

from prefixgate.chat_input import ChatInput
from prefixgate.content_format import ContentFormat
from prefixgate.tokenizer import encode_ids

# Pre-tokenizer or normalizer settings under which a piece's ids depend on its position.
POSITION_DEPENDENT = ('"Metaspace"', '"Prepend"', '"prepend_scheme"')


def probe_chats() -> list[list[dict[str, str]]]:
    """Chats that exercise the cut: added tokens inside content, edges, whitespace."""
    return [
        [{"role": "user", "content": "Hello there!"}],
        [
            {"role": "system", "content": "You are terse.\n\nRules: 1) be brief; 2) cite."},
            {"role": "user", "content": "  leading spaces, digits 12345, émoji 🙂 and\ttabs\n"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "text with <|im_start|> and <|im_end|> inside"},
        ],
    ]


class ChatSource(Protocol):
    """What the cache needs from prefixgate.tokenizer.ChatTokenizer."""

    tokenizer: HFTokenizer
    template_defaults: dict[str, Any]
    exclude_tools_when_tool_choice_none: bool
    content_format_option: ContentFormat | None

    def encode(self, text: str) -> list[int]: ...

    def render(self, chat: ChatInput) -> str: ...


class PieceSplitter:
    """Cuts text where the tokenizer cuts it: at its added tokens."""

    __slots__ = ("_ids", "_pattern")

    def __init__(self, added: dict[str, int]) -> None:
        self._ids = added
        # Longest first: at one position the regex takes the first alternative that fits,
        # which makes it leftmost-longest, as the tokenizer's Aho-Corasick match is.
        alternatives = sorted(added, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(a) for a in alternatives))

    @classmethod
    def for_tokenizer(cls, tokenizer: HFTokenizer) -> PieceSplitter | None:
        """A splitter when per-piece encoding is provably the same; None otherwise."""
        config: dict[str, Any] = json.loads(tokenizer.to_str())
        if config.get("truncation") or config.get("padding"):
            return None
        shape = json.dumps([config.get("normalizer"), config.get("pre_tokenizer")])
        if any(marker in shape for marker in POSITION_DEPENDENT):
            return None
        added: dict[str, int] = {}
        for token in config.get("added_tokens", []):
            flags = ("lstrip", "rstrip", "single_word", "normalized")
            if any(token.get(flag) for flag in flags) or not token.get("content"):
                return None
            added[token["content"]] = int(token["id"])
        return cls(added) if added else None

    def pieces(self, text: str) -> list[str | int]:
        """Text pieces and added-token ids, in order."""
        out: list[str | int] = []
        pos = 0
        for match in self._pattern.finditer(text):
            if match.start() > pos:
                out.append(text[pos : match.start()])
            out.append(self._ids[match.group()])
            pos = match.end()
        if pos < len(text):
            out.append(text[pos:])
        return out


class SegmentCache:
    """``encode_chat`` from cached piece ids (an LRU bounded by pieces and characters);
    plain ``encode`` passes through. Same ids as ``ChatTokenizer.encode_chat``."""

    __slots__ = (
        "_cache",
        "_chars",
        "_lock",
        "_max_chars",
        "_max_pieces",
        "_splitter",
        "hits",
        "inner",
    )

    def __init__(
        self, inner: ChatSource, *, max_pieces: int = 4096, max_chars: int = 8_000_000
    ) -> None:
        self.inner = inner
        self._max_pieces = max_pieces
        self._max_chars = max_chars
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        # The gateway encodes long prompts in worker threads: the LRU's check-then-move
        # and its size accounting must not interleave (encoding itself runs unlocked).
        self._lock = threading.Lock()
        self.hits = 0
        splitter = PieceSplitter.for_tokenizer(inner.tokenizer)
        if splitter is not None and not self._agrees(splitter):
            splitter = None
        self._splitter = splitter
        self._cache.clear()
        self._chars = 0

    @property
    def enabled(self) -> bool:
        return self._splitter is not None

    @property
    def template_defaults(self) -> dict[str, Any]:
        """The wrapped tokenizer's (prefixgate/tokenizer.py ``ChatTokenizer``)."""
        return self.inner.template_defaults

    @template_defaults.setter
    def template_defaults(self, value: dict[str, Any]) -> None:
        self.inner.template_defaults = value

    @property
    def exclude_tools_when_tool_choice_none(self) -> bool:
        """The wrapped tokenizer's (vLLM's flag: prefixgate/chat_input.py)."""
        return self.inner.exclude_tools_when_tool_choice_none

    @exclude_tools_when_tool_choice_none.setter
    def exclude_tools_when_tool_choice_none(self, value: bool) -> None:
        self.inner.exclude_tools_when_tool_choice_none = value

    @property
    def content_format_option(self) -> ContentFormat | None:
        """The wrapped tokenizer's (vLLM's --chat-template-content-format)."""
        return self.inner.content_format_option

    @content_format_option.setter
    def content_format_option(self, value: ContentFormat | None) -> None:
        self.inner.content_format_option = value

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode_input(ChatInput.plain(messages, add_generation_prompt))

    def encode_input(self, chat: ChatInput) -> list[int]:
        return self.encode_rendered(self.inner.render(chat))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.inner, "has_chat_template", True))

    def render(self, chat: ChatInput) -> str:
        """``encode_input``'s first half: the chat's prompt text."""
        return self.inner.render(chat)

    def encode_rendered(self, text: str) -> list[int]:
        """``encode_input``'s second half: the ids of a rendered chat."""
        if self._splitter is None:
            return self._whole(text)
        return self._by_pieces(self._splitter, text)

    def uncached_chars(self, text: str) -> int:
        """How much of a rendered chat ``encode_rendered`` would run the tokenizer's BPE
        over now (its pieces not in the cache): what encoding it costs, to decide where."""
        if self._splitter is None:
            return len(text)
        pieces = [p for p in self._splitter.pieces(text) if isinstance(p, str)]
        with self._lock:
            return sum(len(p) for p in pieces if p not in self._cache)

    def _whole(self, text: str) -> list[int]:
        return encode_ids(self.inner.tokenizer, text, add_special_tokens=False)

    def _by_pieces(self, splitter: PieceSplitter, text: str) -> list[int]:
        ids: list[int] = []
        for piece in splitter.pieces(text):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, text: str) -> list[int]:
        with self._lock:
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return cached
        ids = self._whole(text)
        if len(text) > self._max_chars // 16:
            return ids  # a document-sized piece would evict the prompts that do repeat
        with self._lock:
            if text not in self._cache:  # another thread may have encoded it meanwhile
                self._cache[text] = ids
                self._chars += len(text)
            while len(self._cache) > self._max_pieces or self._chars > self._max_chars:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)
        return ids

    def _agrees(self, splitter: PieceSplitter) -> bool:
        for chat in probe_chats():
            try:
                text = self.inner.render(ChatInput.plain(list(chat)))
            except Exception:  # a template that refuses the probe: no proof, no cache
                return False
            if self._by_pieces(splitter, text) != self._whole(text):
                return False
        return True
