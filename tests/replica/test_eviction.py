"""Eviction policies alone, then through the cache."""

from __future__ import annotations

import pytest

from replica.eviction import (
    EvictionPolicy,
    LRUPolicy,
    SinkLRUPolicy,
    make_policy,
)
from replica.prefix_cache import PrefixCache

ALL = [LRUPolicy, SinkLRUPolicy]


def drain(policy: EvictionPolicy) -> list[int]:
    out = []
    while len(policy):
        out.append(policy.pop())
        policy.check_invariants()
    return out


@pytest.mark.parametrize("cls", ALL)
def test_common_contract(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    with pytest.raises(IndexError):
        policy.pop()
    for block in (1, 2, 3):
        policy.push(block, sink=False)
    assert len(policy) == 3 and 2 in policy
    policy.discard(2)
    policy.discard(42)  # absent: ignored
    assert 2 not in policy
    policy.push(1, sink=False)  # pushed again: now the most recent
    assert drain(policy) == [3, 1]


def test_lru_ignores_sinks() -> None:
    policy = LRUPolicy()
    policy.push(1, sink=True)
    policy.push(2, sink=False)
    assert drain(policy) == [1, 2]


def test_sink_lru_evicts_sinks_last() -> None:
    policy = SinkLRUPolicy()
    policy.push(1, sink=True)
    policy.push(2, sink=False)
    policy.push(3, sink=True)
    policy.push(4, sink=False)
    assert drain(policy) == [2, 4, 1, 3]


def test_make_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("SINK_LRU"), SinkLRUPolicy)
    given = SinkLRUPolicy()
    assert make_policy(given) is given
    monkeypatch.setenv("EVICTION_POLICY", "sink_lru")  # unprefixed: not a setting
    assert isinstance(make_policy(None), LRUPolicy)
    assert PrefixCache(4).policy.name == "lru"
    with pytest.raises(ValueError, match="lru, sink_lru"):
        make_policy("fifo")


# --------------------------------------------------------------------------- via the cache


def run_prompt(cache: PrefixCache, tokens: list[int]) -> None:
    blocks = cache.allocate(-(-len(tokens) // cache.block_size))
    cache.commit(tokens, blocks)
    cache.release(blocks)


def test_sink_lru_keeps_a_prompts_first_block_while_anything_else_can_go() -> None:
    cache = PrefixCache(4, 4, "m", eviction_policy="sink_lru")
    system = [1, 2, 3, 4]
    run_prompt(cache, [*system, 5, 6, 7, 8])  # first block: a sink
    run_prompt(cache, [9, 9, 9, 9, 8, 8, 8, 8])  # newer, its first block is a sink too
    cache.allocate(2)  # both non-sink blocks go, though the first prompt's are older
    assert cache.match([*system, 0]).cached_tokens == 4
    assert cache.match([9, 9, 9, 9, 0]).cached_tokens == 4
    cache.check_invariants()


def test_lru_would_have_evicted_the_old_system_prompt() -> None:
    cache = PrefixCache(4, 4, "m", eviction_policy="lru")
    system = [1, 2, 3, 4]
    run_prompt(cache, [*system, 5, 6, 7, 8])
    run_prompt(cache, [9, 9, 9, 9, 8, 8, 8, 8])
    cache.allocate(2)
    assert cache.match([*system, 0]).cached_tokens == 0
