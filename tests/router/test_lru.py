"""BlockLRU: generations of untracked containers; the index adds nothing the GC walks."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from router.index import PrefixIndex
from router.lru import MAX_GENERATIONS, BlockLRU
from router.router import Router


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_eviction_is_lru_by_generation_and_fifo_inside_one() -> None:
    lru = BlockLRU(gen_size=4)
    for i in range(12):  # generations [0-3] [4-7] [8-11]
        lru.add(key(i))
    lru.touch(key(1))  # used again: into the newest generation
    assert [lru.evict() for _ in range(3)] == [key(0), key(2), key(3)]
    assert lru.discard(key(4)) and not lru.discard(key(4))
    assert lru.evict() == key(5)
    assert key(1) in lru and len(lru) == 12 - 5
    lru.check_invariants()


def test_generations_stay_few_and_merge_their_order() -> None:
    lru = BlockLRU(gen_size=2)
    for i in range(200):
        lru.add(key(i))
        if i % 3 == 0:
            lru.discard(key(i))
    assert len(lru.gens) <= MAX_GENERATIONS
    lru.check_invariants()
    left = [lru.evict() for _ in range(len(lru))]
    assert left == sorted(left, key=lambda k: int.from_bytes(k, "little"))  # oldest first
    lru.check_invariants()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["add", "touch", "discard", "evict"]), st.integers(0, 30))),
    st.integers(1, 5),
)
def test_held_blocks_equal_a_set_model(ops: list[tuple[str, int]], gen_size: int) -> None:
    lru = BlockLRU(gen_size)
    model: set[bytes] = set()
    for op, i in ops:
        k = key(i)
        if op == "add" and k not in model:
            lru.add(k)
            model.add(k)
        elif op == "touch" and k in model:
            lru.touch(k)
        elif op == "discard":
            assert lru.discard(k) == (k in model)
            model.discard(k)
        elif op == "evict" and model:
            model.remove(lru.evict())
        assert set(lru) == model and len(lru) == len(model)
        lru.check_invariants()


def test_the_index_holds_its_blocks_in_containers_the_gc_does_not_track() -> None:
    router = Router(seed=0)
    for rid in ("r0", "r1"):
        router.add_replica(rid, f"http://{rid}", static=True)
    chain = [key(i) for i in range(64)]
    router.index.insert("r0", chain)
    router.index.insert("r1", chain[:16], tentative_until=1e9)  # optimistic: tentative too
    prompt = chain[:32] + [key(1000 + i) for i in range(8)]
    router.route(prompt)  # optimistic insert via the deferred overlay
    index: PrefixIndex = router.index
    index.fold()
    gc.collect()
    containers = [index._nodes, index._masks]
    for blocks in index._replicas.values():
        containers.append(blocks.tentative)
        for gen in blocks.lru.gens:
            containers += [gen.keys, gen.order]
    assert not any(gc.is_tracked(c) for c in containers)
    # Nothing the collector walks refers to an indexed key: a full collection's work
    # does not grow with the index.
    probes = [chain[0], chain[40], prompt[-3]]
    for k in probes:
        assert [r for r in gc.get_referrers(k) if r not in (chain, prompt, probes)] == []
