"""Unit tests for the prefix block cache, one rule each (block size 4 unless said)."""

from __future__ import annotations

import hashlib
import random

import pytest

from replica.prefix_cache import CacheFull, CacheStats, PrefixCache, PrefixMatch
from router.protocol import KeySpace, Medium, SnapshotBlock, short_key

B = 4


class Recorder:
    """A CacheListener that keeps every call."""

    def __init__(self) -> None:
        self.stored: list[tuple[bytes | None, list[bytes]]] = []
        self.removed: list[bytes] = []
        self.cleared = 0

    def on_stored(self, parent: bytes | None, keys: list[bytes], medium: Medium = "device") -> None:
        self.stored.append((parent, list(keys)))

    def on_removed(self, keys: list[bytes]) -> None:
        self.removed.extend(keys)

    def on_cleared(self) -> None:
        self.cleared += 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 16, **kwargs: object) -> PrefixCache:
    return PrefixCache(num_blocks, B, "m", **kwargs)  # type: ignore[arg-type]


def serve(cache: PrefixCache, tokens: list[int], salt: str = "") -> PrefixMatch:
    """What a replica does for one request: match, allocate the rest, commit, release."""
    size = cache.block_size
    hit = cache.match(tokens, salt)
    blocks = list(hit.block_ids)
    if hit.cached_tokens % size:  # copy-on-write of the shared partial block
        (fresh,) = cache.allocate(1)
        cache.release([blocks[-1]])
        blocks[-1] = fresh
    blocks += cache.allocate(-(-len(tokens) // size) - len(blocks))
    cache.commit(tokens, blocks, salt)
    cache.release(blocks)
    cache.check_invariants()
    return hit


# --------------------------------------------------------------------------- match


def test_cold_miss_then_hit_leaves_one_token_to_compute() -> None:
    cache = make()
    prompt = list(range(10))
    assert serve(cache, prompt) == PrefixMatch([], 0)
    hit = cache.match(prompt)
    # 10 tokens: two full blocks and a tail of 2; the tail is reused for 1 of its tokens.
    assert hit.cached_tokens == 9
    assert len(hit.block_ids) == 3
    cache.check_invariants()


def test_block_aligned_prompt_returns_its_last_block_partially_used() -> None:
    cache = make()
    prompt = list(range(8))
    serve(cache, prompt)
    hit = cache.match(prompt)
    assert hit.cached_tokens == 7  # never the whole prompt
    assert len(hit.block_ids) == 2  # ceil(7 / 4): the last block is shared, copy-on-write
    assert cache.match([*prompt[:4], 99, 98, 97, 96]).cached_tokens == 4


def test_tiny_prompts_never_hit() -> None:
    cache = make()
    serve(cache, [5])
    assert cache.match([5]) == PrefixMatch([], 0)
    assert cache.match([]) == PrefixMatch([], 0)


def test_longest_prefix_and_divergence() -> None:
    cache = make()
    serve(cache, list(range(12)))
    hit = cache.match([0, 1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 53, 54])
    assert hit.cached_tokens == 8 and len(hit.block_ids) == 2


def test_exact_match_layer_serves_partial_tail_to_longer_prompts() -> None:
    cache = make()
    first_turn = list(range(10))  # tail = [8, 9]
    serve(cache, first_turn)
    second_turn = [*first_turn, 40, 41, 42]
    assert cache.match(second_turn).cached_tokens == 10


def test_tail_is_not_served_when_the_tokens_differ() -> None:
    cache = make()
    serve(cache, list(range(10)))
    assert cache.match([*range(8), 9, 8, 7]).cached_tokens == 8


def test_salts_isolate_tenants() -> None:
    cache = make()
    prompt = list(range(12))
    serve(cache, prompt, salt="tenant-a")
    assert cache.match(prompt, salt="tenant-b").cached_tokens == 0
    assert cache.match(prompt).cached_tokens == 0
    assert cache.match(prompt, salt="tenant-a").cached_tokens == 11


def test_hit_refreshes_and_pins() -> None:
    cache = make()
    serve(cache, list(range(8)))
    hit = cache.match(list(range(9)))
    assert cache.stats().pinned_blocks == 2
    cache.release(hit.block_ids)
    assert cache.stats().pinned_blocks == 0


# --------------------------------------------------------------------------- allocate


def test_allocate_evicts_idle_blocks_but_never_pinned_ones() -> None:
    cache = make(num_blocks=6)
    serve(cache, list(range(12)))  # 3 cached idle blocks
    hit = cache.match(list(range(12)))  # pins all 3
    assert len(cache.allocate(3)) == 3
    with pytest.raises(CacheFull) as err:
        cache.allocate(1)
    assert "need 1" in str(err.value) and "6 are pinned" in str(err.value)
    assert cache.stats().pinned_blocks == 6
    assert set(hit.block_ids) <= {b for b in range(6)}
    cache.check_invariants()


def test_allocate_is_never_partial() -> None:
    cache = make(num_blocks=4)
    held = cache.allocate(2)
    with pytest.raises(CacheFull, match="need 3 blocks but only 2 are free and 0 evictable"):
        cache.allocate(3)
    assert cache.stats().free_blocks == 2
    cache.release(held)
    assert cache.stats().free_blocks == 4
    cache.check_invariants()


def test_release_is_tail_first_so_shared_heads_outlive_tails() -> None:
    recorder = Recorder()
    cache = make(num_blocks=4, listener=recorder)
    prompt = list(range(16))
    serve(cache, prompt)
    keys = KeySpace("m", B).keys(prompt)
    cache.allocate(1)  # must evict the prompt's LAST block
    assert recorder.removed == [keys[3]]
    cache.allocate(1)
    assert recorder.removed == [keys[3], keys[2]]
    assert cache.match(prompt).cached_tokens == 8


def test_allocate_rejects_negative() -> None:
    with pytest.raises(ValueError):
        make().allocate(-1)


# --------------------------------------------------------------------------- commit


def test_same_prompt_committed_twice_keeps_one_copy_and_leaks_nothing() -> None:
    cache = make(num_blocks=8)
    prompt = list(range(10))
    a = cache.allocate(3)
    b = cache.allocate(3)  # two requests computed the same prompt concurrently
    cache.commit(prompt, a)
    cache.commit(prompt, b)
    cache.release(a)
    cache.release(b)
    cache.check_invariants()
    stats = cache.stats()
    assert stats.cached_blocks == 3 and stats.free_blocks == 5
    hit = cache.match(prompt)
    assert hit.block_ids == a


def test_commit_is_idempotent_and_grows_with_the_request() -> None:
    recorder = Recorder()
    cache = make(listener=recorder)
    prompt = list(range(10))
    blocks = cache.allocate(4)
    cache.commit(prompt, blocks[:3])  # after prefill
    cache.commit(prompt, blocks[:3])  # again: nothing new
    keys = KeySpace("m", B).keys([*prompt, 70, 71, 72, 73, 74])
    assert recorder.stored == [(None, keys[:2])]
    grown = [*prompt, 70, 71, 72, 73, 74]  # finished: 15 tokens, block 2 now full
    cache.commit(grown, blocks)
    assert recorder.stored[1] == (keys[1], [keys[2]])
    cache.release(blocks)
    cache.check_invariants()
    # The partial tail registered after prefill still serves the original prompt.
    assert cache.match(prompt).cached_tokens == 9
    assert cache.match([*grown, 1]).cached_tokens == 15


def test_commit_validates_its_inputs() -> None:
    cache = make()
    blocks = cache.allocate(2)
    with pytest.raises(ValueError, match="need 3 blocks"):
        cache.commit(list(range(9)), blocks)
    cache.release(blocks)
    with pytest.raises(ValueError, match="not held"):
        cache.commit(list(range(8)), blocks)
    held = cache.allocate(1)
    cache.commit([1, 2, 3, 4], held)
    with pytest.raises(ValueError, match="different tokens"):
        cache.commit([1, 2, 3, 5], held)
    with pytest.raises(ValueError, match="different prefix"):
        cache.commit([9, 9, 9, 9, 1, 2, 3, 4], [*cache.allocate(1), *held])


def test_keys_and_events_are_the_router_contract() -> None:
    recorder = Recorder()
    cache = PrefixCache(8, 16, "smollm2-135m", listener=recorder)
    prompt = list(range(40))
    serve(cache, prompt, salt="tenant-a")
    keys = KeySpace("smollm2-135m", 16, "tenant-a").keys(prompt)
    assert recorder.stored == [(None, keys)]  # the partial tail is not published
    assert cache.snapshot() == [
        SnapshotBlock(None, short_key(keys[0])),
        SnapshotBlock(short_key(keys[0]), short_key(keys[1])),
    ]
    cache.allocate(8)
    assert sorted(recorder.removed) == sorted(keys)
    assert cache.snapshot() == []


# --------------------------------------------------------------------------- collisions


def weak_key(prev: bytes, block: bytes) -> bytes:
    """Only 4 distinct keys: collisions everywhere."""
    return bytes([hashlib.sha256(prev + block).digest()[0] % 4]) * 32


def history_blind_key(prev: bytes, block: bytes) -> bytes:
    """The same block after any prefix (or at any depth) gets the same key."""
    return hashlib.sha256(block).digest()


@pytest.mark.parametrize("key_fn", [weak_key, history_blind_key, lambda prev, block: b"k" * 32])
def test_colliding_keys_never_return_another_prompts_blocks(key_fn: object) -> None:
    rng = random.Random(7)
    cache = make(num_blocks=24, key_fn=key_fn)
    truth: dict[int, list[int]] = {}  # block id -> the full token prefix its KV encodes
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(2, 14))] for _ in range(12)]
    for _ in range(300):
        prompt = rng.choice(prompts)
        hit = cache.match(prompt)
        for i, block_id in enumerate(hit.block_ids):
            end = min((i + 1) * B, hit.cached_tokens)
            assert truth[block_id][:end] == prompt[:end], "served another prompt's KV"
        blocks = list(hit.block_ids)
        if hit.cached_tokens % B:
            (fresh,) = cache.allocate(1)
            truth[fresh] = truth[blocks[-1]]
            cache.release([blocks[-1]])
            blocks[-1] = fresh
        blocks += cache.allocate(-(-len(prompt) // B) - len(blocks))
        for i, block_id in enumerate(blocks):
            truth[block_id] = prompt[: (i + 1) * B]
        cache.commit(prompt, blocks)
        cache.release(blocks)
        cache.check_invariants()
    assert cache.stats().hit_tokens > 0


def test_a_colliding_parent_key_is_caught_by_the_parent_chain() -> None:
    """Token and parent-key checks alone are not enough: here the orphaned second block of
    prompt X has the right tokens and a parent key equal to Y's first key, yet its KV
    was computed after X's first block, not Y's."""

    def first_token_key(prev: bytes, block: bytes) -> bytes:
        return hashlib.sha256(prev + block[:4]).digest()  # only a block's first token counts

    cache = make(num_blocks=3, key_fn=first_token_key)
    x_head, y_head, body = [1, 2, 3, 4], [1, 9, 9, 9], [5, 6, 7, 8]  # the heads collide
    blocks = cache.allocate(2)
    cache.commit(x_head + body, blocks)
    cache.release(blocks[::-1])  # head-first, so X's head is evicted before its body
    cache.release(cache.allocate(2))
    serve(cache, [*y_head, 0])  # Y's head takes the key X's head had
    hit = cache.match([*y_head, *body, 0])
    assert hit.cached_tokens == 4  # Y's own head only; X's body is never served
    cache.release(hit.block_ids)
    cache.check_invariants()


# --------------------------------------------------------------------------- ttl, clear


def test_ttl_sweep_drops_idle_blocks_and_a_hit_refreshes_the_timer() -> None:
    clock = FakeClock()
    recorder = Recorder()
    cache = make(ttl_s=10.0, clock=clock, listener=recorder)
    serve(cache, list(range(8)))  # idle since t=0
    clock.now = 5.0
    serve(cache, [50, 51, 52, 53, 54])  # idle since t=5
    clock.now = 9.0
    cache.release(cache.match(list(range(9))).block_ids)  # hit: idle again since t=9
    assert cache.sweep(now=14.0) == 0
    assert cache.sweep(now=15.5) == 2  # [50..53] and its tail, idle since 5
    assert cache.match([50, 51, 52, 53, 54, 55]).cached_tokens == 0
    held = cache.match(list(range(9)))
    assert cache.sweep(now=100.0) == 0  # pinned blocks never expire
    clock.now = 100.0
    cache.release(held.block_ids)
    assert cache.sweep() == 0
    assert cache.sweep(now=111.0) == 2
    assert cache.stats().expirations == 4
    assert len(recorder.removed) == 3  # full blocks only: [50..53], [0..3], [4..7]
    cache.check_invariants()


def test_sweep_without_ttl_does_nothing() -> None:
    cache = make()
    serve(cache, list(range(8)))
    assert cache.sweep(now=1e9) == 0


def test_clear_drops_idle_blocks_and_unindexes_pinned_ones() -> None:
    recorder = Recorder()
    cache = make(listener=recorder)
    serve(cache, list(range(8)))
    held = cache.allocate(2)
    cache.commit([9] * 8, held)
    assert cache.clear() == 2
    assert recorder.cleared == 1
    assert cache.match(list(range(8))).cached_tokens == 0
    assert cache.match([9] * 9).cached_tokens == 0
    cache.release(held)
    assert cache.stats().free_blocks == 16  # the pinned ones went straight to the free list
    cache.check_invariants()


# --------------------------------------------------------------------------- pins, stats


def test_pin_adds_holders_for_n_choices() -> None:
    cache = make()
    blocks = cache.allocate(2)
    cache.pin(blocks)
    cache.release(blocks)
    assert cache.stats().pinned_blocks == 2
    cache.release(blocks)
    assert cache.stats().free_blocks == 16
    with pytest.raises(ValueError, match="not held"):
        cache.pin(blocks)


def test_release_rejects_double_release_and_bad_ids() -> None:
    cache = make()
    (block,) = cache.allocate(1)
    with pytest.raises(ValueError, match="more times"):
        cache.release([block, block])
    cache.release([block])
    with pytest.raises(ValueError, match="more times"):
        cache.release([block])
    with pytest.raises(ValueError, match="out of range"):
        cache.release([16])
    cache.check_invariants()


def test_stats() -> None:
    cache = make(num_blocks=10)
    serve(cache, list(range(8)))
    hit = cache.match(list(range(10)))
    stats = cache.stats()
    assert isinstance(stats, CacheStats)
    assert (stats.queries, stats.hits, stats.misses) == (2, 1, 1)
    assert (stats.query_tokens, stats.hit_tokens) == (18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    assert (stats.pinned_blocks, stats.cached_blocks, stats.free_blocks) == (2, 2, 8)
    assert stats.utilization == pytest.approx(0.2)
    d = stats.as_dict()
    assert d["hit_rate"] == stats.hit_rate and d["total_blocks"] == 10
    cache.release(hit.block_ids)


def test_orphans_left_by_head_first_release_are_replaced_on_recompute() -> None:
    recorder = Recorder()
    cache = make(num_blocks=5, listener=recorder)
    prompt = list(range(16))
    keys = KeySpace("m", B).keys(prompt)
    blocks = cache.allocate(4)
    cache.commit(prompt, blocks)
    cache.release(blocks[::-1])  # head-first: the first block becomes the oldest
    cache.release(cache.allocate(2))  # the free block, then the head is evicted
    assert recorder.removed == [keys[0]]
    # The three tail blocks are still cached but no lookup can reach them.
    assert cache.match(prompt).cached_tokens == 0
    assert cache.stats().cached_blocks == 3 and cache.snapshot() == []
    serve(cache, prompt)  # recompute: evicts two orphans, replaces the third in place
    assert recorder.removed == [keys[0], keys[1], keys[2], keys[3]]
    assert cache.match(prompt).cached_tokens == 15
    assert len(cache.snapshot()) == 4
    cache.check_invariants()


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        PrefixCache(0)
    with pytest.raises(ValueError):
        PrefixCache(4, ttl_s=0)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        PrefixCache(4, eviction_policy="fifo")
