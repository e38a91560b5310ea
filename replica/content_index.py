"""What the prefix cache's blocks hold, and the two indexes that find them (torch-free).

* Full blocks by chained key (router.protocol). A hit is verified against the stored
  token bytes AND the parent chain (each block records the ``uid`` of the block it
  follows), so even a colliding ``key_fn`` never hands out another prompt's KV.
* The exact-match layer: a prompt's partial last block, keyed by (parent key, its token
  bytes), reused when those tokens are a prefix of a later prompt's remaining tokens.

This module knows contents only; ref counts, the free list and eviction order belong to
``PrefixCache``, which decides when content is registered or dropped.
"""

from __future__ import annotations

from typing import NamedTuple

from replica.cache_types import BlockContent, KeyFn, TailHit
from router.protocol import SnapshotBlock, short_key


class IndexHit(NamedTuple):
    block_ids: list[int]  # full blocks, then at most one partial (exact-match) block
    tokens: int  # tokens those blocks cover, before the caller's "last token" cut


class ContentIndex:
    """Contents of cached blocks by block id, and their full-key and exact-match indexes."""

    def __init__(self, num_blocks: int, block_size: int, key_fn: KeyFn) -> None:
        self.block_size = block_size
        self.key_fn = key_fn
        self.contents: list[BlockContent | None] = [None] * num_blocks
        self.cached = 0  # contents that are not None
        self._next_uid = 0
        self._by_key: dict[bytes, int] = {}  # full-block key -> block id
        self._tails: dict[tuple[bytes, bytes], int] = {}  # (prev key, tail bytes) -> block id
        self._tail_lengths: dict[bytes, dict[int, int]] = {}  # prev key -> {length: entries}

    def get(self, block_id: int) -> BlockContent | None:
        return self.contents[block_id]

    # ------------------------------------------------------------------------- lookup

    def lookup(self, data: bytes, root: bytes) -> IndexHit:
        """The longest verified chain of blocks holding a prefix of ``data`` (token bytes,
        ``encode_tokens``), starting from ``root``."""
        width = 4 * self.block_size
        prev = root
        parent_uid: int | None = None
        found: list[int] = []
        contents = self.contents
        for start in range(0, (len(data) // width) * width, width):
            chunk = data[start : start + width]
            key = self.key_fn(prev, chunk)
            block_id = self._by_key.get(key)
            if block_id is None:
                break
            content = contents[block_id]
            assert content is not None
            if not content.follows(prev, parent_uid) or content.data != chunk:
                break  # a key collision or an orphan: never serve it
            found.append(block_id)
            prev = key
            parent_uid = content.uid
        tokens = len(found) * self.block_size
        if 4 * tokens < len(data) and prev in self._tail_lengths:
            tail = self._match_tail(prev, parent_uid, data[4 * tokens :])
            if tail is not None:
                found.append(tail.block_id)
                tokens += tail.tokens
        return IndexHit(found, tokens)

    def _match_tail(self, prev: bytes, parent_uid: int | None, rest: bytes) -> TailHit | None:
        """The longest exact-match entry under ``prev`` whose tokens start ``rest``."""
        for length in sorted(self._tail_lengths[prev], reverse=True):
            if 4 * length > len(rest):
                continue
            block_id = self._tails.get((prev, rest[: 4 * length]))
            if block_id is None:
                continue
            content = self.contents[block_id]
            assert content is not None
            if content.parent_uid == parent_uid:
                return TailHit(block_id, length)
        return None

    def holder_of_key(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def holder_of_tail(self, prev: bytes, tail: bytes) -> int | None:
        return self._tails.get((prev, tail))

    # ------------------------------------------------------------------------- changes

    def new(
        self, block_id: int, depth: int, prev: bytes, parent_uid: int | None, data: bytes
    ) -> BlockContent:
        """Give ``block_id`` fresh content (not yet indexed)."""
        self._next_uid += 1
        content = BlockContent(self._next_uid, prev, parent_uid, depth, data)
        self.contents[block_id] = content
        self.cached += 1
        return content

    def update(
        self, block_id: int, depth: int, prev: bytes, parent_uid: int | None, data: bytes
    ) -> BlockContent | None:
        """The content of a block already cached, checked against this commit and grown
        if more tokens were written since; None for a block not cached."""
        content = self.contents[block_id]
        if content is None:
            return None
        if content.prev != prev or content.depth != depth:
            raise ValueError(f"block {block_id} already holds a different prefix")
        if data.startswith(content.data):
            content.data = data  # grew (or unchanged)
        elif not content.data.startswith(data):
            raise ValueError(f"block {block_id} already holds different tokens")
        # The caller vouches that this block follows the chain being committed now (its
        # parent may have been evicted and recomputed under a new uid since).
        content.parent_uid = parent_uid
        return content

    def index_key(self, block_id: int, key: bytes) -> None:
        content = self.contents[block_id]
        assert content is not None and content.key is None
        content.key = key
        self._by_key[key] = block_id

    def index_tail(self, block_id: int, prev: bytes, tail: bytes) -> None:
        content = self.contents[block_id]
        assert content is not None
        length = len(tail) // 4
        self._tails[(prev, tail)] = block_id
        counts = self._tail_lengths.setdefault(prev, {})
        counts[length] = counts.get(length, 0) + 1
        content.tail_lengths += (length,)

    def move(self, src: int, dst: int) -> None:
        """Give ``dst`` the content of ``src`` (a copy of its KV between tiers): same uid,
        key and exact-match entries, so children still verify their parent."""
        content = self.contents[src]
        assert content is not None and self.contents[dst] is None
        self.contents[dst] = content
        self.contents[src] = None
        if content.key is not None:
            self._by_key[content.key] = dst
        for length in content.tail_lengths:
            self._tails[(content.prev, content.data[: 4 * length])] = dst

    def drop(self, block_id: int) -> bytes | None:
        """Unindex and forget a block's content; returns its full key if it had one."""
        content = self.contents[block_id]
        assert content is not None
        self.contents[block_id] = None
        self.cached -= 1
        for length in content.tail_lengths:
            del self._tails[(content.prev, content.data[: 4 * length])]
            counts = self._tail_lengths[content.prev]
            counts[length] -= 1
            if not counts[length]:
                del counts[length]
                if not counts:
                    del self._tail_lengths[content.prev]
        if content.key is not None:
            del self._by_key[content.key]
        return content.key

    # ------------------------------------------------------------------------- reporting

    def snapshot(self) -> list[SnapshotBlock]:
        """Every reachable full block as (short parent key | None, short key), parents
        first. Orphans (parent dropped) are left out: no lookup can reach them."""
        registered = [c for c in self.contents if c is not None and c.key is not None]
        registered.sort(key=lambda c: c.depth)
        reachable: set[int] = set()
        out: list[SnapshotBlock] = []
        for content in registered:
            assert content.key is not None
            if content.parent_uid is None:
                out.append(SnapshotBlock(None, short_key(content.key)))
            elif content.parent_uid in reachable:
                out.append(SnapshotBlock(short_key(content.prev), short_key(content.key)))
            else:
                continue
            reachable.add(content.uid)
        return out

    def check_invariants(self) -> None:
        """Assert every content is indexed as it says and both indexes point back."""
        contents, width = self.contents, 4 * self.block_size
        assert sum(1 for c in contents if c is not None) == self.cached
        by_uid = {c.uid: c for c in contents if c is not None}
        for block_id, content in enumerate(contents):
            if content is None:
                continue
            assert (content.parent_uid is None) == (content.depth == 0)
            assert 0 < len(content.data) <= width and len(content.data) % 4 == 0
            assert content.key is not None or content.tail_lengths, f"block {block_id} unindexed"
            if content.key is not None:
                assert len(content.data) == width, "partial block under a full key"
                assert self._by_key.get(content.key) == block_id, f"block {block_id} not indexed"
                assert self.key_fn(content.prev, content.data) == content.key, "tokens != key"
            parent = by_uid.get(content.parent_uid) if content.parent_uid is not None else None
            if parent is not None:  # a live parent: the chain must agree
                assert parent.key == content.prev and parent.depth == content.depth - 1
            for length in content.tail_lengths:
                assert 0 < length < self.block_size
                entry = (content.prev, content.data[: 4 * length])
                assert self._tails.get(entry) == block_id, f"tail of block {block_id} not indexed"
        for key, block_id in self._by_key.items():
            content = contents[block_id]
            assert content is not None and content.key == key
        assert sum(sum(c.values()) for c in self._tail_lengths.values()) == len(self._tails)
