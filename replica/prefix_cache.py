"""The prefix block cache: which KV block holds which prompt prefix (torch-free).

The replica's block pool owns the tensors; this cache owns block *ids*: a free list, ref
counts that pin blocks in use, the eviction order of idle cached blocks (a policy from
``replica.eviction``, plus TTL), and, through ``replica.content_index``, what each cached
block holds and the two indexes over it (full blocks by chained key, rooted in model,
block size and salt so tenants never share; partial last blocks in the exact-match layer).

Block states (``check_invariants`` asserts the partition):

    free        ref 0, no content                on ``_free``
    evictable   ref 0, cached content            in the eviction policy
    pinned      ref > 0, cached or private        counted by ``_pinned``

With a host tier (``replica.host_tier``, ids after the device blocks) evicting a device
block demotes its content to a host slot instead of dropping it, and a match that reaches
host blocks is promoted back (``promote``) before the request's prefill. Pinned blocks
never move; a key is in one tier at a time. The TTL (``sweep``) drops idle device blocks
(it does not demote them); host blocks leave by promotion, host eviction or ``clear``.

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
from itertools import pairwise

from replica.cache_types import (
    CacheFull,
    CacheListener,
    CacheStats,
    KeyFn,
    PrefixMatch,
    Promotion,
)
from replica.content_index import ContentIndex
from replica.eviction import EvictionPolicy, make_policy
from replica.host_tier import BlockMover, HostTier
from router.protocol import (
    DEFAULT_BLOCK_SIZE,
    Medium,
    SnapshotBlock,
    chain_key,
    encode_tokens,
    root_key,
)

__all__ = [
    "CacheFull",
    "CacheListener",
    "CacheStats",
    "KeyFn",
    "PrefixCache",
    "PrefixMatch",
    "Promotion",
]


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
        host_blocks: int = 0,
        mover: BlockMover | None = None,
    ) -> None:
        """``host_blocks`` > 0 adds a host tier of that many blocks; ``mover`` copies KV
        between the tiers (required with it)."""
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
        if host_blocks < 0 or (host_blocks and mover is None):
            raise ValueError(f"host_blocks must be >= 0 and come with a mover, got {host_blocks}")
        self._host = HostTier(num_blocks, host_blocks) if host_blocks else None
        self._mover = mover

        # Ref counts and contents by block id over both tiers (host ids start at
        # num_blocks); a host block is held (ref > 0) only inside ``promote``.
        self._refs = [0] * (num_blocks + host_blocks)
        self._index = ContentIndex(num_blocks + host_blocks, block_size, self._key_fn)
        self._contents = self._index.contents  # the same list: read by block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._pinned = 0
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

    def match(
        self, token_ids: Sequence[int], salt: str = "", *, record: bool = True
    ) -> PrefixMatch:
        """The longest verified cached prefix of ``token_ids``, pinned for the caller.
        Blocks found on the host tier come back as host ids, counted in ``host_tokens``:
        the caller passes the match to ``promote`` (or ``release``) right away.
        ``record``: count it in the query and hit statistics now (False: the caller may
        give the match back and look again later, and calls ``record`` once the lookup
        is the one that counts; as vLLM counts a request once, when it is scheduled)."""
        n = len(token_ids)
        hit = self._index.lookup(encode_tokens(token_ids), self.root(salt))
        cached = min(hit.tokens, n - 1) if n else 0
        B = self._block_size
        found = hit.block_ids[: math.ceil(cached / B)]
        host = self._host
        host_tokens = 0
        for i, block_id in enumerate(found):
            self._pin_one(block_id)
            if host is not None and host.holds(block_id):
                host_tokens += min(B, cached - i * B)
        match = PrefixMatch(found, cached, host_tokens)
        if record:
            self.record(n, match)
        return match

    def record(self, query_tokens: int, match: PrefixMatch) -> None:
        """Count one lookup of ``query_tokens`` tokens that found ``match`` (as ``match``
        returned it, before any ``promote``) in the query and hit statistics."""
        stats = self._stats
        stats.queries += 1
        stats.query_tokens += query_tokens
        if match.cached_tokens:
            stats.hits += 1
            stats.hit_tokens += match.cached_tokens
            if match.host_tokens:
                stats.host_hits += 1
                stats.host_hit_tokens += match.host_tokens
        else:
            stats.misses += 1

    def cached_tokens(self, token_ids: Sequence[int], salt: str = "") -> int:
        """How many leading tokens of ``token_ids`` a ``match`` would find now (either
        tier), without pinning them or counting a query: for load reports."""
        hit = self._index.lookup(encode_tokens(token_ids), self.root(salt))
        return min(hit.tokens, len(token_ids) - 1) if token_ids else 0

    def room(self) -> int:
        """Device blocks ``allocate`` can hand out now: free, or cached but idle."""
        return len(self._free) + len(self._policy)

    def promote(self, match: PrefixMatch) -> Promotion:
        """Copy the host blocks of ``match`` (from ``match``) into fresh device blocks, the
        caller's pins moving with them; the same match on device blocks only. When the
        device pool cannot take them all, the match is cut before the first block left
        on the host (released back to the host tier). Pinned device blocks never move:
        the fresh blocks come from the free list or demote idle ones. Also says how
        many blocks were copied."""
        host, mover = self._host, self._mover
        if host is None or mover is None or not match.host_tokens:
            return Promotion(match, 0)
        ids = list(match.block_ids)
        on_host = [i for i, block_id in enumerate(ids) if host.holds(block_id)]
        k = min(len(on_host), self.room())
        fresh = self.allocate(k)  # the match's own blocks are pinned: never victims
        refs = self._refs
        mover.promote([host.slot(ids[i]) for i in on_host[:k]], fresh)
        for i, dst in zip(on_host, fresh, strict=False):
            src = ids[i]
            assert refs[src] == 1, f"host block {src} held {refs[src]} times"
            self._index.move(src, dst)
            refs[src] = 0
            host.give_back(src)
            ids[i] = dst
            self._emit_moved(dst, "device")
        self._stats.promotions += k
        cached = match.cached_tokens
        if k < len(on_host):
            cut = on_host[k]
            self.release(ids[cut:])
            ids = ids[:cut]
            cached = cut * self._block_size
        return Promotion(PrefixMatch(ids, cached, 0), k)

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
        demoted: dict[int, int] = {}  # host id -> the device block whose KV it receives
        evict = n - len(out)
        for _ in range(evict):
            victim = self._policy.pop()
            self._idle_since.pop(victim, None)
            if not self._demote(victim, removed, demoted):
                key = self._drop_content(victim)
                if key is not None:
                    removed.append(key)
            out.append(victim)
        self._stats.evictions += evict
        refs = self._refs
        for block_id in out:
            refs[block_id] = 1
        self._pinned += n
        if demoted:  # one batch of copies, before the caller can write the victims
            assert self._host is not None and self._mover is not None
            slots = [self._host.slot(host_id) for host_id in demoted]
            self._mover.demote(list(demoted.values()), slots)
            self._stats.demotions += len(demoted)  # copies made (bytes_to_host)
        if removed and self._listener is not None:
            self._listener.on_removed(removed)
        for host_id in demoted:
            self._emit_moved(host_id, "host")
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
        last block becomes the oldest and shared heads outlive their tails. Host blocks
        of a match not promoted go back to the host tier."""
        self._check_ids(block_ids, len(self._refs))
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
            content = self._contents[block_id]
            if self._host is not None and self._host.holds(block_id):
                if content is None:  # cleared while held
                    self._host.give_back(block_id)
                else:
                    self._host.push(block_id)
                continue
            self._pinned -= 1
            if content is None:
                self._free[block_id] = None
                continue
            self._policy.push(block_id, sink=content.depth == 0)
            if self._ttl_s is not None:
                self._idle_since[block_id] = now

    def _pin_one(self, block_id: int) -> None:
        if self._refs[block_id] == 0:
            if self._host is not None and self._host.holds(block_id):
                self._host.hold(block_id)
            else:
                self._pinned += 1
                self._policy.discard(block_id)
                self._idle_since.pop(block_id, None)
        self._refs[block_id] += 1

    def _check_ids(self, block_ids: Sequence[int], limit: int | None = None) -> None:
        """Device ids only, unless ``limit`` admits host ids too."""
        end = self._num_blocks if limit is None else limit
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= end):
            raise ValueError(f"block ids {list(block_ids)} out of range [0, {end})")

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
        index = self._index
        own = index.update(block_id, depth, prev, parent_uid, chunk)  # committed before?
        if own is not None and own.key is not None:
            return own.key, own.uid, False
        key = self._key_fn(prev, chunk)
        holder = index.holder_of_key(key)
        if holder is not None:
            other = self._contents[holder]
            assert other is not None
            if other.follows(prev, parent_uid) and other.data == chunk:
                if own is None and self._on_idle_host(holder):
                    # We just computed what the host holds: ours becomes the cached copy
                    # (same uid: children still verify), the host slot is freed.
                    assert self._host is not None
                    self._index.move(holder, block_id)
                    self._host.give_back(holder)
                    self._emit_moved(block_id, "device")
                return key, other.uid, False  # same KV already cached: ours stays unindexed
            if self._refs[holder] > 0:
                return None  # a pinned colliding/orphaned block: leave it, stop here
            self._evict_now(holder)  # an unverifiable idle block: replace it
        if own is None:
            own = index.new(block_id, depth, prev, parent_uid, chunk)
        index.index_key(block_id, key)
        return key, own.uid, True

    def _commit_tail(
        self, block_id: int, depth: int, prev: bytes, parent_uid: int | None, tail: bytes
    ) -> None:
        index = self._index
        own = index.update(block_id, depth, prev, parent_uid, tail)
        if own is not None and len(tail) // 4 in own.tail_lengths:
            return
        holder = index.holder_of_tail(prev, tail)
        if holder is not None:
            other = self._contents[holder]
            assert other is not None
            if other.parent_uid == parent_uid or self._refs[holder] > 0:
                return  # already cached (or pinned and unverifiable): keep that one
            self._evict_now(holder)
        if own is None:
            index.new(block_id, depth, prev, parent_uid, tail)
        index.index_tail(block_id, prev, tail)

    # ------------------------------------------------------------------------- dropping

    def _drop_content(self, block_id: int) -> bytes | None:
        """Forget a block's content (out of policy and index); its full key if it had one."""
        self._policy.discard(block_id)
        return self._index.drop(block_id)

    def _on_idle_host(self, block_id: int) -> bool:
        return self._host is not None and self._host.holds(block_id) and not self._refs[block_id]

    def _demote(self, victim: int, removed: list[bytes], demoted: dict[int, int]) -> bool:
        """Move an evicted device block's content to the host tier (dropping the host's
        oldest idle block when it is full, its key into ``removed``) and record the copy
        to make in ``demoted`` (a host id taken again later in the same batch gets only
        the last copy); False when there is no host tier or every host block is held."""
        host, mover = self._host, self._mover
        if host is None or mover is None or not host.can_take:
            return False
        assert not self._refs[victim], f"pinned block {victim} cannot move to the host"
        slot = host.take_free()
        if slot is None:
            slot = host.pop_victim()
            key = self._index.drop(slot)
            if key is not None:
                removed.append(key)
            self._stats.host_evictions += 1
        self._index.move(victim, slot)
        host.push(slot)
        demoted[slot] = victim
        return True

    def _emit_moved(self, block_id: int, medium: Medium) -> None:
        """Tell the listener a full block's key now lives in ``medium``."""
        content = self._contents[block_id]
        if self._listener is None or content is None or content.key is None:
            return
        parent = content.prev if content.depth else None
        self._listener.on_stored(parent, [content.key], medium=medium)

    def _evict_now(self, block_id: int) -> None:
        """Drop an idle cached block out of order (commit replaces it) to the free list."""
        if self._host is not None and self._host.holds(block_id):
            key = self._index.drop(block_id)
            self._host.give_back(block_id)
            self._stats.host_evictions += 1
            if key is not None and self._listener is not None:
                self._listener.on_removed([key])
            return
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
        host = self._host
        for block_id, content in enumerate(self._contents):
            if content is None:
                continue
            self._drop_content(block_id)
            if host is not None and host.holds(block_id):
                if self._refs[block_id] == 0:  # a held one is given back on release
                    host.give_back(block_id)
                    count += 1
                continue
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
        host = self._host
        host_cached = len(host.idle) if host is not None else 0
        block_bytes = self._mover.block_bytes if self._mover is not None else 0
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
            cached_blocks=self._index.cached - host_cached,
            evictable_blocks=len(self._policy),
            host_total_blocks=host.num_blocks if host is not None else 0,
            host_cached_blocks=host_cached,
            host_hits=s.host_hits,
            host_hit_tokens=s.host_hit_tokens,
            demotions=s.demotions,
            promotions=s.promotions,
            host_evictions=s.host_evictions,
            bytes_to_host=s.demotions * block_bytes,
            bytes_to_device=s.promotions * block_bytes,
        )

    def keys_by_tier(self) -> tuple[set[bytes], set[bytes]]:
        """Full keys of the cached full blocks: (on the device, on the host). O(cache)."""
        device: set[bytes] = set()
        host: set[bytes] = set()
        for block_id, content in enumerate(self._contents):
            if content is not None and content.key is not None:
                (host if block_id >= self._num_blocks else device).add(content.key)
        return device, host

    def snapshot(self) -> list[SnapshotBlock]:
        """Every reachable full block as (short parent key | None, short key), parents
        first. Orphans (parent evicted) are left out: no lookup can reach them."""
        return self._index.snapshot()

    def _emit_stored(self, parent: bytes | None, keys: list[bytes]) -> None:
        if self._listener is not None:
            self._listener.on_stored(parent, keys)

    def check_invariants(self) -> None:
        """Assert the block partition, its agreement with the contents, and the indexes
        are consistent. O(cache)."""
        self._policy.check_invariants()
        self._index.check_invariants()
        N, contents = self._num_blocks, self._contents
        refs = self._refs[:N]
        assert all(r >= 0 for r in self._refs), "negative ref count"
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
        keys = [c.key for c in contents if c is not None and c.key is not None]
        assert len(keys) == len(set(keys)), "a key is held by two blocks (or two tiers)"
        if self._host is not None:
            held = {b for b in range(N, len(self._refs)) if self._refs[b]}
            cached = {b for b in range(N, len(contents)) if contents[b] is not None}
            self._host.check_invariants(cached - held, held)
        for block_id, content in enumerate(contents[:N]):
            if content is None:
                continue
            in_policy = block_id in self._policy
            assert in_policy == (refs[block_id] == 0), f"block {block_id} evictable state wrong"
            if self._ttl_s is not None:
                assert (block_id in self._idle_since) == in_policy
        times = list(self._idle_since.values())
        assert all(a <= b for a, b in pairwise(times)), "idle order broken"
