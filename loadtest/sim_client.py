"""The simulated clients' side: the token space and each session's conversation.

No real model: words become stable ids (``WordTokenizer``), replies are seeded stand-in
ids (``reply_tokens``), and every replica serves ``MODEL_ID`` with ``BLOCK_SIZE``-token
blocks. A session's next turn resends everything so far (system, earlier user turns and
replies) plus the new user text, unless its prompts are given whole.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.workloads import Session

MODEL_ID = "sim"
BLOCK_SIZE = 16


class WordTokenizer:
    """Stand-in tokenizer: one id per word, stable across runs (crc32), memoized."""

    def __init__(self, vocab: int = 60_000) -> None:
        self.vocab = vocab
        self._ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        out = []
        for word in text.split():
            token = ids.get(word)
            if token is None:
                token = ids[word] = 1000 + zlib.crc32(word.encode()) % self.vocab
            out.append(token)
        return out


def reply_tokens(session_id: str, turn: int, n: int) -> list[int]:
    """A reply of ``n`` stand-in ids, the same for the same session and turn."""
    rng = random.Random(f"{session_id}/{turn}")
    return [rng.randrange(1000, 61_000) for _ in range(n)]


@dataclass(slots=True)
class Conversation:
    """One session's state between turns."""

    session: Session
    tokens: list[int]  # everything sent and received so far
    keys: list[bytes] = field(default_factory=list)  # full-block keys of ``tokens``
    turn: int = 0
    # Each turn's whole prompt as token ids, when given (e.g. a real chat template's):
    # then the prompts are sent as they are instead of being built from the word ids.
    prompts: Sequence[list[int]] | None = None

    def given_reply(self, max_tokens: int) -> list[int]:
        """With given prompts the reply is what the next prompt resends after this one
        (the client appends the reply it got), else stand-in ids."""
        assert self.prompts is not None
        prompt = self.prompts[self.turn]
        if self.turn + 1 < len(self.prompts):
            following = self.prompts[self.turn + 1]
            if following[: len(prompt)] == prompt:
                return list(following[len(prompt) : len(prompt) + max_tokens])
        return reply_tokens(self.session.session_id, self.turn, max_tokens)
