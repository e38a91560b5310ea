"""The prefix block cache: which KV block holds which prompt prefix (torch-free).

The replica's block pool owns the tensors; this cache owns block *ids*: a free list, ref
counts that pin blocks in use, and two indexes over cached content:

* full blocks by chained key (router.protocol: root from model, block size and salt, so
  tenants never share); a hit is verified against the stored token bytes AND the parent
  chain (each cached block records the ``uid`` of the block it follows), so even a
  colliding ``key_fn`` can never hand out another prompt's KV;
* the exact-match layer: a prompt's partial last block, keyed by (parent key, its token
  bytes), reused when those tokens are a prefix of a later prompt's remaining tokens.

Block states (``check_invariants`` asserts the partition):

    free        ref 0, no content                on ``_free``
    evictable   ref 0, cached content            in the eviction policy
    pinned      ref > 0, cached or private        counted by ``_pinned``

Cached-token arithmetic for a prompt of n tokens, B = 4 (``|`` = block edges):

    tokens   0 1 2 3 | 4 5 6 7 | 8 9
    blocks   key_0     key_1     tail (exact-match layer)
    cached   at most n - 1 = 9: the last prompt token is always computed, so a fully
             cached prompt returns its last block too, partially used (copy-on-write).
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any, NamedTuple, Protocol

from replica.eviction import EvictionPolicy, make_policy
from router.protocol import (
    DEFAULT_BLOCK_SIZE,
    SnapshotBlock,
    chain_key,
    encode_tokens,
    root_key,
    short_key,
)

KeyFn = Callable[[bytes, bytes], bytes]


class CacheFull(RuntimeError):
    """``allocate(n)`` cannot be satisfied: every other block is pinned."""


class PrefixMatch(NamedTuple):
    # Pinned (ref + 1) blocks covering token positions [0, cached_tokens);
    # len(block_ids) == ceil(cached_tokens / B).
    block_ids: list[int]
    # Always <= len(token_ids) - 1: at least one prompt token is computed.
    cached_tokens: int
    # RULE for callers: when cached_tokens % B != 0, block_ids[-1] is shared and read-only;
    # copy it to a fresh block (allocate(1), copy tensors, release([old])) before writing.


@dataclass(slots=True)
class CacheStats:
    queries: int = 0
    hits: int = 0  # queries with cached_tokens > 0
    misses: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    evictions: int = 0
    expirations: int = 0
    total_blocks: int = 0
    free_blocks: int = 0
    used_blocks: int = 0  # total - free
    pinned_blocks: int = 0
    cached_blocks: int = 0  # blocks holding registered content, pinned or not
    evictable_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Token hit rate: cached prompt tokens / prompt tokens looked up."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def utilization(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        out["utilization"] = self.utilization
        return out


class CacheListener(Protocol):
    """Told about full blocks entering and leaving the index (the Redis publisher)."""

    def on_stored(self, parent: bytes | None, keys: list[bytes]) -> None: ...
    def on_removed(self, keys: list[bytes]) -> None: ...
    def on_cleared(self) -> None: ...


class _TailHit(NamedTuple):
    block_id: int
    tokens: int


@dataclass(slots=True)
class _Content:
    """What a cached block holds. ``data`` is ``encode_tokens`` of its tokens (4 bytes each)."""

    uid: int  # unique per registration: children verify their parent by it
    prev: bytes  # key of the block before, or the root key when depth == 0
    parent_uid: int | None  # None exactly when depth == 0
    depth: int  # block index within the prompt
    data: bytes
    key: bytes | None = None  # set while registered in the full-block index
    tail_lengths: tuple[int, ...] = ()  # exact-match entries (tokens); rarely more than one


class PrefixCache:
    """Block ids, ref counts and the prefix index of one replica. Not thread-safe: the
    engine thread owns it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        model_id: str = "",
        *,
        eviction_policy: str | EvictionPolicy | None = None,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        key_fn: KeyFn | None = None,
        listener: CacheListener | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks, block_size must be positive: {num_blocks}, {block_size}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._model_id = model_id
        self._policy = make_policy(eviction_policy)
        self._ttl_s = ttl_s
        self._clock = clock
        self._key_fn: KeyFn = key_fn if key_fn is not None else chain_key
        self._listener = listener

        self._refs = [0] * num_blocks
        self._contents: list[_Content | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._pinned = 0
        self._cached = 0
        self._next_uid = 0
        self._by_key: dict[bytes, int] = {}  # full-block key -> block id
        self._tails: dict[tuple[bytes, bytes], int] = {}  # (prev key, tail bytes) -> block id
        self._tail_lengths: dict[bytes, dict[int, int]] = {}  # prev key -> {length: entries}
        # Evictable blocks in release order with the time they went idle (TTL sweep).
        self._idle_since: OrderedDict[int, float] = OrderedDict()
        self._stats = CacheStats(total_blocks=num_blocks)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    def root(self, salt: str = "") -> bytes:
        return root_key(self._model_id, self._block_size, salt)

    # ------------------------------------------------------------------------- lookup

    def match(self, token_ids: Sequence[int], salt: str = "") -> PrefixMatch:
        """The longest verified cached prefix of ``token_ids``, pinned for the caller."""
        n = len(token_ids)
        stats = self._stats
        stats.queries += 1
        stats.query_tokens += n
        width = 4 * self._block_size
        data = encode_tokens(token_ids)
        prev = self.root(salt)
        parent_uid: int | None = None
        found: list[int] = []
        contents = self._contents
        for start in range(0, (n // self._block_size) * width, width):
            chunk = data[start : start + width]
            key = self._key_fn(prev, chunk)
            block_id = self._by_key.get(key)
            if block_id is None:
                break
            content = contents[block_id]
            assert content is not None
            if content.parent_uid != parent_uid or content.prev != prev or content.data != chunk:
                break  # a key collision or an orphan: never serve it
            found.append(block_id)
            prev = key
            parent_uid = content.uid
        cached = len(found) * self._block_size
        if cached < n and prev in self._tail_lengths:
            tail = self._match_tail(prev, parent_uid, data[cached * 4 :])
            if tail is not None:
                found.append(tail.block_id)
                cached += tail.tokens
        cached = min(cached, n - 1) if n else 0
        found = found[: math.ceil(cached / self._block_size)]
        for block_id in found:
            self._pin_one(block_id)
        if cached:
            stats.hits += 1
            stats.hit_tokens += cached
        else:
            stats.misses += 1
        return PrefixMatch(found, cached)

    def _match_tail(self, prev: bytes, parent_uid: int | None, rest: bytes) -> _TailHit | None:
        """The longest exact-match entry under ``prev`` whose tokens start ``rest``."""
        for length in sorted(self._tail_lengths[prev], reverse=True):
            if 4 * length > len(rest):
                continue
            block_id = self._tails.get((prev, rest[: 4 * length]))
            if block_id is None:
                continue
            content = self._contents[block_id]
            assert content is not None
            if content.parent_uid == parent_uid:
                return _TailHit(block_id, length)
        return None

    # ------------------------------------------------------------------------- blocks

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks pinned for the caller (ref 1), evicting by policy if needed."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        free = len(self._free)
        if n > free + len(self._policy):
            raise CacheFull(
                f"need {n} blocks but only {free} are free and {len(self._policy)} evictable; "
                f"{self._pinned} of {self._num_blocks} are pinned by running requests"
            )
        pop_free = self._free.popitem
        out = [pop_free(last=False)[0] for _ in range(min(n, free))]
        removed: list[bytes] = []
        evict = n - len(out)
        for _ in range(evict):
            victim = self._policy.pop()
            self._idle_since.pop(victim, None)
            key = self._drop_content(victim)
            if key is not None:
                removed.append(key)
            out.append(victim)
        self._stats.evictions += evict
        refs = self._refs
        for block_id in out:
            refs[block_id] = 1
        self._pinned += n
        if removed and self._listener is not None:
            self._listener.on_removed(removed)
        return out

    def pin(self, block_ids: Sequence[int]) -> None:
        """+1 ref on blocks the caller already holds (n > 1 choices share a prompt)."""
        self._check_ids(block_ids)
        for block_id in block_ids:
            if self._refs[block_id] <= 0:
                raise ValueError(f"block {block_id} is not held; pin() only adds holders")
        for block_id in block_ids:
            self._refs[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """-1 ref each. Pass a request's blocks in order: they go idle tail-first, so its
        last block becomes the oldest and shared heads outlive their tails."""
        self._check_ids(block_ids)
        refs = self._refs
        if any(refs[block_id] <= 0 for block_id in block_ids):
            raise ValueError(f"a block in {list(block_ids)} was released more times than held")
        if len(set(block_ids)) != len(block_ids):
            for block_id, times in Counter(block_ids).items():
                if refs[block_id] < times:
                    raise ValueError(f"block {block_id} released more times than it was held")
        now = self._clock()
        for block_id in reversed(block_ids):
            left = refs[block_id] - 1
            refs[block_id] = left
            if left:
                continue
            self._pinned -= 1
            content = self._contents[block_id]
            if content is None:
                self._free[block_id] = None
                continue
            self._policy.push(block_id, sink=content.depth == 0)
            if self._ttl_s is not None:
                self._idle_since[block_id] = now

    def _pin_one(self, block_id: int) -> None:
        if self._refs[block_id] == 0:
            self._pinned += 1
            self._policy.discard(block_id)
            self._idle_since.pop(block_id, None)
        self._refs[block_id] += 1

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self._num_blocks):
            raise ValueError(f"block ids {list(block_ids)} out of range [0, {self._num_blocks})")

    # ------------------------------------------------------------------------- commit

    def commit(self, token_ids: Sequence[int], block_ids: Sequence[int], salt: str = "") -> None:
        """Register the blocks holding ``token_ids``: ``block_ids[i]`` holds the KV of
        ``token_ids[i*B:(i+1)*B]``; full blocks under their chained keys, a partial tail
        in the exact-match layer. A key someone else already holds keeps that block (ours
        stays private and is freed on release). Idempotent; may be called again as a
        request grows."""
        B = self._block_size
        n = len(token_ids)
        needed = math.ceil(n / B)
        if len(block_ids) < needed:
            raise ValueError(f"{n} tokens need {needed} blocks, got {len(block_ids)}")
        self._check_ids(block_ids[:needed])
        refs = self._refs
        if any(refs[block_id] <= 0 for block_id in block_ids[:needed]):
            raise ValueError(f"a block in {list(block_ids[:needed])} is not held; commit needs it")
        data = encode_tokens(token_ids)
        width = 4 * B
        prev = self.root(salt)
        parent_uid: int | None = None
        stored: list[bytes] = []
        stored_parent: bytes | None = None
        for depth in range(n // B):
            chunk = data[depth * width : (depth + 1) * width]
            link = self._commit_full(block_ids[depth], depth, prev, parent_uid, chunk)
            if link is None:
                break  # the chain cannot continue through a block we cannot verify
            key, parent_uid, is_new = link
            if is_new:
                if not stored:
                    stored_parent = prev if depth else None
                stored.append(key)
            elif stored:
                self._emit_stored(stored_parent, stored)
                stored = []
            prev = key
        else:
            if n % B:
                tail_block = block_ids[n // B]
                self._commit_tail(tail_block, n // B, prev, parent_uid, data[(n // B) * width :])
        if stored:
            self._emit_stored(stored_parent, stored)

    def _commit_full(
        self, block_id: int, depth: int, prev: bytes, parent_uid: int | None, chunk: bytes
    ) -> tuple[bytes, int, bool] | None:
        """Register one full block; returns (key, uid of the registered holder, newly
        registered) or None when the chain cannot be verified past this block."""
        own = None
        if self._contents[block_id] is not None:  # committed before: check and grow it
            own = self._update(block_id, depth, prev, parent_uid, chunk)
        if own is not None and own.key is not None:
            return own.key, own.uid, False
        key = self._key_fn(prev, chunk)
        holder = self._by_key.get(key)
        if holder is not None:
            other = self._contents[holder]
            assert other is not None
            if other.parent_uid == parent_uid and other.prev == prev and other.data == chunk:
                return key, other.uid, False  # same KV already cached: ours stays unindexed
            if self._refs[holder] > 0:
                return None  # a pinned colliding/orphaned block: leave it, stop here
            self._evict_now(holder)  # an unverifiable idle block: replace it
        if own is None:
            own = self._new_content(block_id, depth, prev, parent_uid, chunk)
        own.key = key
        self._by_key[key] = block_id
        return key, own.uid, True

    def _commit_tail(
        self, block_id: int, depth: int, prev: bytes, parent_uid: int | None, tail: bytes
    ) -> None:
        own = self._update(block_id, depth, prev, parent_uid, tail)
        length = len(tail) // 4
        if own is not None and length in own.tail_lengths:
            return
        entry = (prev, tail)
        holder = self._tails.get(entry)
        if holder is not None:
            other = self._contents[holder]
            assert other is not None
            if other.parent_uid == parent_uid or self._refs[holder] > 0:
                return  # already cached (or pinned and unverifiable): keep that one
            self._evict_now(holder)
        if own is None:
            own = self._new_content(block_id, depth, prev, parent_uid, tail)
        self._tails[entry] = block_id
        counts = self._tail_lengths.setdefault(prev, {})
        counts[length] = counts.get(length, 0) + 1
        own.tail_lengths += (length,)

    def _new_content(
        self, block_id: int, depth: int, prev: bytes, parent_uid: int | None, data: bytes
    ) -> _Content:
        self._next_uid += 1
        content = _Content(self._next_uid, prev, parent_uid, depth, data)
        self._contents[block_id] = content
        self._cached += 1
        return content

    def _update(
        self, block_id: int, depth: int, prev: bytes, parent_uid: int | None, data: bytes
    ) -> _Content | None:
        """The content record of a held block already cached, checked against this commit
        and grown if more tokens were written since; None for a block not cached."""
        content = self._contents[block_id]
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

    # ------------------------------------------------------------------------- dropping

    def _drop_content(self, block_id: int) -> bytes | None:
        """Unindex a block's content; returns its full key if it was registered."""
        content = self._contents[block_id]
        assert content is not None
        self._contents[block_id] = None
        self._cached -= 1
        self._policy.discard(block_id)
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

    def _evict_now(self, block_id: int) -> None:
        """Drop an idle cached block out of order (commit replaces it) to the free list."""
        self._idle_since.pop(block_id, None)
        key = self._drop_content(block_id)
        self._free[block_id] = None
        self._stats.evictions += 1
        if key is not None and self._listener is not None:
            self._listener.on_removed([key])

    def sweep(self, now: float | None = None) -> int:
        """TTL: drop idle cached blocks unused for longer than ``ttl_s``. O(expired)."""
        if self._ttl_s is None:
            return 0
        now = self._clock() if now is None else now
        removed: list[bytes] = []
        count = 0
        while self._idle_since:
            block_id, since = next(iter(self._idle_since.items()))
            if now - since <= self._ttl_s:
                break  # idle times only grow along the order: the rest are younger
            del self._idle_since[block_id]
            key = self._drop_content(block_id)
            self._free[block_id] = None
            if key is not None:
                removed.append(key)
            count += 1
        self._stats.expirations += count
        if removed and self._listener is not None:
            self._listener.on_removed(removed)
        return count

    def clear(self) -> int:
        """Drop every idle cached block; returns how many. Pinned blocks stay with their
        holders but leave the index (so a ``cleared`` event is true) and are freed on
        release."""
        count = 0
        for block_id, content in enumerate(self._contents):
            if content is None:
                continue
            self._drop_content(block_id)
            if self._refs[block_id] == 0:
                self._free[block_id] = None
                count += 1
        self._idle_since.clear()
        if self._listener is not None:
            self._listener.on_cleared()
        return count

    # ------------------------------------------------------------------------- reporting

    def stats(self) -> CacheStats:
        s = self._stats
        free = len(self._free)
        return CacheStats(
            queries=s.queries,
            hits=s.hits,
            misses=s.misses,
            hit_tokens=s.hit_tokens,
            query_tokens=s.query_tokens,
            evictions=s.evictions,
            expirations=s.expirations,
            total_blocks=self._num_blocks,
            free_blocks=free,
            used_blocks=self._num_blocks - free,
            pinned_blocks=self._pinned,
            cached_blocks=self._cached,
            evictable_blocks=len(self._policy),
        )

    def snapshot(self) -> list[SnapshotBlock]:
        """Every reachable full block as (short parent key | None, short key), parents
        first. Orphans (parent evicted) are left out: no lookup can reach them."""
        registered = [c for c in self._contents if c is not None and c.key is not None]
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

    def _emit_stored(self, parent: bytes | None, keys: list[bytes]) -> None:
        if self._listener is not None:
            self._listener.on_stored(parent, keys)

    def check_invariants(self) -> None:
        """Assert the block partition and both indexes are consistent. O(cache)."""
        self._policy.check_invariants()
        refs, contents = self._refs, self._contents
        assert all(r >= 0 for r in refs), "negative ref count"
        pinned = sum(1 for r in refs if r > 0)
        assert pinned == self._pinned, f"pinned counter {self._pinned} != {pinned}"
        assert len(self._free) + len(self._policy) + pinned == self._num_blocks, (
            f"free {len(self._free)} + evictable {len(self._policy)} + pinned {pinned} "
            f"!= total {self._num_blocks}"
        )
        for block_id in self._free:
            assert refs[block_id] == 0, f"free block {block_id} is pinned"
            assert contents[block_id] is None, f"free block {block_id} is cached"
            assert block_id not in self._policy, f"block {block_id} both free and evictable"
        assert sum(1 for c in contents if c is not None) == self._cached
        by_uid = {c.uid: c for c in contents if c is not None}
        for block_id, content in enumerate(contents):
            if content is None:
                continue
            in_policy = block_id in self._policy
            assert in_policy == (refs[block_id] == 0), f"block {block_id} evictable state wrong"
            if self._ttl_s is not None:
                assert (block_id in self._idle_since) == in_policy
            assert (content.parent_uid is None) == (content.depth == 0)
            assert 0 < len(content.data) <= 4 * self._block_size and len(content.data) % 4 == 0
            assert content.key is not None or content.tail_lengths, f"block {block_id} unindexed"
            if content.key is not None:
                assert len(content.data) == 4 * self._block_size, "partial block under a full key"
                assert self._by_key.get(content.key) == block_id, f"block {block_id} not indexed"
                assert self._key_fn(content.prev, content.data) == content.key, "tokens != key"
            parent = by_uid.get(content.parent_uid) if content.parent_uid is not None else None
            if parent is not None:  # a live parent: the chain must agree
                assert parent.key == content.prev and parent.depth == content.depth - 1
            for length in content.tail_lengths:
                assert 0 < length < self._block_size
                entry = (content.prev, content.data[: 4 * length])
                assert self._tails.get(entry) == block_id, f"tail of block {block_id} not indexed"
        for key, block_id in self._by_key.items():
            content = contents[block_id]
            assert content is not None and content.key == key
        assert sum(sum(c.values()) for c in self._tail_lengths.values()) == len(self._tails)
        times = list(self._idle_since.values())
        assert all(a <= b for a, b in pairwise(times)), "idle order broken"
