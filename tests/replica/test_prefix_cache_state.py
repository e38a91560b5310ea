"""Random interleavings of match/allocate/commit/grow/release/pin/sweep/clear against a
simple model of what each block's KV really encodes.

The model keeps, per block id, the (salt, token prefix) its KV was computed for, and the
number of holders each block has. After every step the cache's invariants hold, its pin
counts equal the model's, every hit serves KV computed for exactly that salt and prefix,
no held block is ever handed out again, and ``CacheFull`` happens iff the model says the
unheld blocks cannot cover the request.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replica.host_tier import BlockMover
from replica.prefix_cache import CacheFull, CacheListener, KeyFn, PrefixCache, PrefixMatch

B = 4
NUM_BLOCKS = 12
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)
salts = st.sampled_from(["", "tenant-a"])


def weak_key(prev: bytes, block: bytes) -> bytes:
    """Blind to history (the same block after any prefix collides) and to most of the
    block (3 values): every kind of collision a real hash could ever produce."""
    return bytes([hashlib.sha256(block).digest()[0] % 3]) * 32


@dataclass(slots=True)
class Request:
    salt: str
    tokens: list[int]
    blocks: list[int]
    can_write: bool = True  # forks share blocks read-only
    committed_len: int = 0


class PrefixCacheMachine(RuleBasedStateMachine):
    policy = "lru"
    key_fn: KeyFn | None = None
    host_blocks = 0  # > 0: a host tier (tests/replica/test_host_tier_state.py)

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.truth: dict[int, tuple[str, tuple[int, ...]] | None] = {}
        self.holds: Counter[int] = Counter()
        self.requests: list[Request] = []
        self.cache = PrefixCache(
            NUM_BLOCKS,
            B,
            "m",
            eviction_policy=self.policy,
            ttl_s=5.0,
            clock=lambda: self.now,
            key_fn=type(self).key_fn,
            host_blocks=self.host_blocks,
            mover=self.make_mover(),
            listener=self.make_listener(),
        )

    def make_mover(self) -> BlockMover | None:
        return None

    def make_listener(self) -> CacheListener | None:
        return None

    def lookup(self, tokens: list[int], salt: str) -> PrefixMatch:
        """The cache's match for a new request, as the scheduler takes it."""
        hit = self.cache.match(tokens, salt)
        self.check_hit(hit, tokens, salt)
        return hit

    def check_hit(self, hit: PrefixMatch, tokens: list[int], salt: str) -> None:
        """Every matched block holds KV computed for exactly that salt and prefix."""
        n = len(tokens)
        assert hit.cached_tokens <= max(n - 1, 0)
        assert len(hit.block_ids) == -(-hit.cached_tokens // B)
        for i, b in enumerate(hit.block_ids):
            end = min((i + 1) * B, hit.cached_tokens)
            truth = self.truth.get(b)
            assert truth is not None, f"hit on block {b} that holds no KV"
            assert truth[0] == salt and truth[1][:end] == tuple(tokens[:end]), "wrong KV"

    # -------------------------------------------------------------- helpers

    def held(self) -> set[int]:
        return {b for b, n in self.holds.items() if n > 0}

    def allocate(self, n: int) -> list[int] | None:
        unheld = NUM_BLOCKS - len(self.held())
        try:
            blocks = self.cache.allocate(n)
        except CacheFull:
            assert n > unheld, f"CacheFull with {unheld} unheld blocks for {n}"
            return None
        assert n <= unheld
        assert not set(blocks) & self.held(), "a held block was handed out again"
        for b in blocks:
            self.truth[b] = None  # garbage until the holder writes it
            self.holds[b] += 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        self.cache.release(blocks)
        self.holds.subtract(blocks)

    def write(self, request: Request) -> None:
        """The engine computed KV for all the request's tokens into its blocks."""
        for i, b in enumerate(request.blocks):
            end = min((i + 1) * B, len(request.tokens))
            if i * B < end:
                self.truth[b] = (request.salt, tuple(request.tokens[:end]))

    # -------------------------------------------------------------- rules

    @rule(tokens=prompts, salt=salts)
    def start(self, tokens: list[int], salt: str) -> None:
        hit = self.lookup(tokens, salt)
        n = len(tokens)
        self.holds.update(hit.block_ids)
        blocks = list(hit.block_ids)
        if hit.cached_tokens % B:  # copy-on-write of the shared partial block
            fresh = self.allocate(1)
            if fresh is None:
                self.release(blocks)
                return
            self.truth[fresh[0]] = self.truth[blocks[-1]]
            self.release([blocks[-1]])
            blocks[-1] = fresh[0]
        more = self.allocate(-(-n // B) - len(blocks))
        if more is None:
            self.release(blocks)
            return
        self.requests.append(Request(salt, list(tokens), blocks + more))

    @precondition(lambda self: any(r.can_write for r in self.requests))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.requests if r.can_write]))
        self.write(request)
        self.cache.commit(request.tokens, request.blocks, request.salt)
        request.committed_len = len(request.tokens)
        if self.key_fn is None and len(request.tokens) > 1:
            # Right after a commit the whole prompt is found again (strong keys).
            hit = self.cache.match(request.tokens, request.salt)
            assert hit.cached_tokens == len(request.tokens) - 1
            self.cache.release(hit.block_ids)  # that probe's pins are not the model's

    @precondition(lambda self: any(r.can_write for r in self.requests))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data: st.DataObject, extra: list[int]) -> None:
        """Decode: more tokens, more blocks when a block boundary is crossed."""
        request = data.draw(st.sampled_from([r for r in self.requests if r.can_write]))
        tokens = request.tokens + extra
        more = self.allocate(-(-len(tokens) // B) - len(request.blocks))
        if more is None:
            return
        request.tokens = tokens
        request.blocks += more

    @precondition(lambda self: any(r.committed_len for r in self.requests))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """n > 1 choices: another holder of a committed request's blocks."""
        request = data.draw(st.sampled_from([r for r in self.requests if r.committed_len]))
        self.cache.pin(request.blocks)
        self.holds.update(request.blocks)
        fork = Request(request.salt, list(request.tokens), list(request.blocks), can_write=False)
        self.requests.append(fork)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.requests))
        self.requests.remove(request)
        self.release(request.blocks)

    @rule(dt=st.floats(0.0, 8.0))
    def sweep(self, dt: float) -> None:
        self.now += dt
        self.cache.sweep()

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        assert self.cache.stats().free_blocks == NUM_BLOCKS - len(self.held())

    # -------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        stats = self.cache.stats()
        assert stats.pinned_blocks == len(self.held())
        assert stats.free_blocks + stats.evictable_blocks + stats.pinned_blocks == NUM_BLOCKS


class SinkLRUWeakKeyMachine(PrefixCacheMachine):
    policy = "sink_lru"
    key_fn = staticmethod(weak_key)


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPrefixCacheLRU = PrefixCacheMachine.TestCase
TestPrefixCacheLRU.settings = _settings
TestPrefixCacheSinkLRUWeakKeys = SinkLRUWeakKeyMachine.TestCase
TestPrefixCacheSinkLRUWeakKeys.settings = _settings
