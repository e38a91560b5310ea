"""``KeyMemo``: block keys of recent prompts, so that a prompt sharing a prefix with one
seen lately hashes only the blocks after that prefix.

Agents resend the same tool definitions and system prompt with every step, chats resend
their history: thousands of prompt tokens whose keys were computed a moment ago. Keys are
chained (router/protocol.py): a block's key depends on its tokens and its parent's key
only, so when the first ``m`` full blocks of two prompts hold the same tokens, their first
``m`` keys are the same, and the rest of the chain resumes from key ``m - 1``. The memo
compares the tokens themselves (the bytes that are hashed, ``encode_tokens``), never a
digest of them, so the keys it gives are exactly ``block_keys``' keys.

One entry per first block (the most recent prompt that began with it), per key space
(model, block size, salt: another root, another chain), least recently used first out,
bounded by entries and by bytes (the tokens held plus about ``KEY_COST`` per block for its
two keys). Thread-safe: the gateway computes long prompts' keys in worker threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from router.protocol import SHORT_KEY_BYTES, KeySpace, chain_key, encode_tokens

KEY_COST = 160  # bytes a block's full and short key take in memory, list slots included
ENTRY_COST = 400  # bytes of an entry's own objects (tuple, lists, dict slot)


class Entry(NamedTuple):
    data: bytes  # the prompt's full blocks as encode_tokens bytes
    full: list[bytes]  # key of each full block (the chain resumes from these)
    short: list[bytes]  # their short forms, what the router takes


class KeyMemo:
    __slots__ = ("_bytes", "_entries", "_lock", "max_bytes", "max_entries", "reused")

    def __init__(self, max_bytes: int = 64 << 20, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes  # 0: remember nothing
        # (root, first block's bytes) -> the last prompt that began so
        self._entries: OrderedDict[tuple[bytes, bytes], Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # blocks whose keys came from the memo (for tests and stats)

    def short_keys(self, space: KeySpace, token_ids: Sequence[int]) -> list[bytes]:
        """``space.short_keys(token_ids)``, from memory where the prefix was seen."""
        width = 4 * space.block_size
        n_full = len(token_ids) // space.block_size
        if n_full == 0 or self.max_bytes <= 0 or self.max_entries <= 0:
            return space.short_keys(token_ids)
        root = space.root
        data = encode_tokens(token_ids)  # cut to the full blocks: cheaper than the list
        if len(data) > n_full * width:
            data = data[: n_full * width]
        slot = (root, data[:width])
        with self._lock:
            seen = self._entries.get(slot)
        same = 0 if seen is None else _common_blocks(data, seen.data, width)
        if seen is not None and same == n_full == len(seen.full):
            self._store(slot, seen)
            self.reused += same
            return list(seen.short)
        full = seen.full[:same] if seen is not None else []
        short = seen.short[:same] if seen is not None else []
        parent = full[-1] if full else root  # the chain resumes after the shared blocks
        for i in range(same, n_full):
            parent = chain_key(parent, data[i * width : (i + 1) * width])
            full.append(parent)
            short.append(parent[:SHORT_KEY_BYTES])
        self.reused += same
        self._store(slot, Entry(data, full, short))
        return list(short)

    def _store(self, slot: tuple[bytes, bytes], entry: Entry) -> None:
        with self._lock:
            old = self._entries.pop(slot, None)
            if old is not None:
                self._bytes -= _cost(old)
            self._entries[slot] = entry
            self._bytes += _cost(entry)
            while self._entries and (
                len(self._entries) > self.max_entries or self._bytes > self.max_bytes
            ):
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= _cost(dropped)

    def check_invariants(self) -> None:
        with self._lock:
            assert self._bytes == sum(_cost(e) for e in self._entries.values())
            assert self._bytes <= max(self.max_bytes, 0) or not self._entries
            assert len(self._entries) <= max(self.max_entries, 0)
            for (_, first), entry in self._entries.items():
                assert entry.data.startswith(first)
                assert len(entry.full) == len(entry.short) == len(entry.data) // len(first)


def _cost(entry: Entry) -> int:
    return ENTRY_COST + len(entry.data) + KEY_COST * len(entry.full)


def _common_blocks(data: bytes, other: bytes, width: int) -> int:
    """How many leading blocks of ``width`` bytes the two hold alike (bytes slices
    compare with memcmp; a binary search over the block count)."""
    hi = min(len(data), len(other)) // width
    if data[: hi * width] == other[: hi * width]:
        return hi
    lo = 0  # invariant: the first lo blocks are alike, the first hi are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if data[: mid * width] == other[: mid * width]:
            lo = mid
        else:
            hi = mid
    return lo
