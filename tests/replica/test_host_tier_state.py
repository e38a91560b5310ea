"""The prefix cache with a host tier, under random interleavings of match + promote,
allocate (device eviction demotes, host eviction drops), commit, grow, pin (forks),
release, TTL sweep and clear.

The model of test_prefix_cache_state is reused: per block id (host slots after the
device blocks) the (salt, prefix) its KV encodes. The mover here copies that model's
entries between ids the way the real one copies tensors, so every hit checks that the
KV that moved is the KV the key names. After every step: the cache's invariants (one
tier per key, the host slots partitioned), pins equal to the model's, and no held block
ever moved (the mover refuses to demote one).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from replica.host_tier import BlockMover
from replica.prefix_cache import CacheListener, PrefixMatch
from router.index import PrefixIndex
from router.protocol import Medium, short_key
from tests.replica.test_prefix_cache_state import (
    NUM_BLOCKS,
    PrefixCacheMachine,
    weak_key,
)


class ModelMover:
    """Copies the model's KV entries between a device block and a host slot."""

    block_bytes = 64

    def __init__(self, machine: TwoTierMachine) -> None:
        self.machine = machine
        self.demoted = 0
        self.promoted = 0

    def demote(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        machine = self.machine
        assert len(device_blocks) == len(host_slots) == len(set(host_slots))
        for device_block, host_slot in zip(device_blocks, host_slots, strict=True):
            assert 0 <= device_block < NUM_BLOCKS and 0 <= host_slot < machine.host_blocks
            assert device_block not in machine.held(), f"pinned block {device_block} demoted"
            machine.truth[NUM_BLOCKS + host_slot] = machine.truth.get(device_block)
            self.demoted += 1

    def promote(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        machine = self.machine
        assert len(device_blocks) == len(host_slots) == len(set(device_blocks))
        for host_slot, device_block in zip(host_slots, device_blocks, strict=True):
            assert 0 <= device_block < NUM_BLOCKS and 0 <= host_slot < machine.host_blocks
            assert device_block not in machine.held(), f"promoted into pinned {device_block}"
            machine.truth[device_block] = machine.truth.get(NUM_BLOCKS + host_slot)
            self.promoted += 1


class IndexFeed:
    """The cache's events, as a router's index folds them in (router.index)."""

    def __init__(self) -> None:
        self.index = PrefixIndex()

    def on_stored(self, parent: bytes | None, keys: list[bytes], medium: Medium = "device") -> None:
        self.index.insert("r", [short_key(k) for k in keys], medium=medium)

    def on_removed(self, keys: list[bytes]) -> None:
        self.index.remove("r", [short_key(k) for k in keys])

    def on_cleared(self) -> None:
        self.index.clear("r")


class TwoTierMachine(PrefixCacheMachine):
    host_blocks = 6

    def make_listener(self) -> CacheListener | None:
        self.feed = IndexFeed()
        return self.feed

    def make_mover(self) -> BlockMover | None:
        self.finished: list[tuple[list[int], str]] = []
        self.mover = ModelMover(self)
        return self.mover

    def lookup(self, tokens: list[int], salt: str) -> PrefixMatch:
        hit = self.cache.match(tokens, salt)
        self.check_hit(hit, tokens, salt)  # host blocks hold the right KV too
        on_host = [b for b in hit.block_ids if b >= NUM_BLOCKS]
        assert bool(on_host) == (hit.host_tokens > 0)
        promoted, blocks_in = self.cache.promote(hit)
        assert blocks_in <= len(on_host)
        assert promoted.host_tokens == 0 and all(b < NUM_BLOCKS for b in promoted.block_ids)
        assert promoted.cached_tokens <= hit.cached_tokens
        if promoted.cached_tokens < hit.cached_tokens:  # cut only for lack of device room
            assert NUM_BLOCKS - len(self.held()) - len(promoted.block_ids) < len(on_host)
        self.check_hit(promoted, tokens, salt)  # the copied KV is the matched KV
        return promoted

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def finish_and_remember(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.requests))
        self.requests.remove(request)
        self.release(request.blocks)
        if request.committed_len:
            self.finished.append((request.tokens[: request.committed_len], request.salt))

    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), salt=st.sampled_from(["", "t"])
    )
    def serve(self, tokens: list[int], salt: str) -> None:
        """A whole request: match (+ promote), compute, commit, finish."""
        count = len(self.requests)
        self.start(tokens, salt)
        if len(self.requests) == count:
            return  # no room now
        request = self.requests.pop()
        self.write(request)
        self.cache.commit(request.tokens, request.blocks, request.salt)
        self.release(request.blocks)
        self.finished.append((request.tokens, request.salt))

    @precondition(lambda self: bool(self.finished))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=5))
    def again(self, data: st.DataObject, extra: list[int]) -> None:
        """A later turn of a finished conversation: its prompt again, and more."""
        tokens, salt = data.draw(st.sampled_from(self.finished))
        self.start([*tokens, *extra], salt)

    @rule(roll=st.integers(0, 7))
    def clear(self, roll: int) -> None:
        """Rarer than in the one-tier machine (an argument-free rule is drawn far more
        often than the others), so that demoted chains live long enough to be hit."""
        if roll == 0:
            super().clear()

    @rule(dt=st.floats(0.0, 2.0))
    def sweep(self, dt: float) -> None:
        """Shorter idle gaps than the TTL (5 s) mostly: expiry empties the device tier."""
        super().sweep(dt)

    @rule(keep=st.integers(0, 2))
    def pressure(self, keep: int) -> None:
        """Another request takes every unheld block but ``keep``: idle device blocks are
        evicted, demoted while the host has room (or an idle block to drop)."""
        blocks = self.allocate(max(NUM_BLOCKS - len(self.held()) - keep, 0))
        if blocks:
            self.release(blocks)

    @invariant()
    def router_sees_the_tiers(self) -> None:
        """A router fed the events holds exactly the cached keys, with their tiers."""
        device, host = self.cache.keys_by_tier()
        shorts = [short_key(k) for k in device | host]
        host_shorts = [short_key(k) for k in host]
        index = self.feed.index
        assert index.blocks("r") == len(shorts)
        assert all(index.holds("r", k) for k in shorts)
        assert index.host_blocks("r", shorts) == index.host_blocks("r", host_shorts)
        assert index.host_blocks("r", host_shorts) == len(host_shorts)

    @invariant()
    def tiers(self) -> None:
        stats = self.cache.stats()
        assert stats.host_total_blocks == self.host_blocks
        assert stats.host_cached_blocks <= self.host_blocks
        assert stats.demotions == self.mover.demoted and stats.promotions == self.mover.promoted
        assert stats.bytes_to_host == 64 * stats.demotions
        assert stats.host_hit_tokens <= stats.hit_tokens


class TwoTierWeakKeyMachine(TwoTierMachine):
    policy = "sink_lru"
    key_fn = staticmethod(weak_key)


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestTwoTiers = TwoTierMachine.TestCase
TestTwoTiers.settings = _settings
TestTwoTiersSinkLRUWeakKeys = TwoTierWeakKeyMachine.TestCase
TestTwoTiersSinkLRUWeakKeys.settings = _settings
