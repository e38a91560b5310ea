"""BlockLRU: generations of logs with membership in the node words; the index adds
nothing the GC walks; the order equals a plain model's, one dict per log; compaction
keeps the logs within a constant factor of the blocks held."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from hypothesis import given, note, settings
from hypothesis import strategies as st

from router.index import PrefixIndex
from router.lru import (
    COMPACT_SLICE,
    FIELD_BITS,
    KEY_BYTES,
    LABELS,
    MAX_GENERATIONS,
    MAX_WORDS,
    BlockLRU,
)
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
    # Everything that grows with the blocks held (the logs' objects and the label map
    # grow with the labels in use, a few hundred, not with the blocks).
    containers: list[object] = [index._nodes, index._words]
    for blocks in index._replicas.values():
        containers += [blocks.tentative, blocks.host]
        containers += [log.order for gen in blocks.lru.gens for log in gen.logs]
    assert len(containers) >= 8 and not any(gc.is_tracked(c) for c in containers)
    # Nothing the collector walks refers to an indexed key: a full collection's work
    # does not grow with the index.
    probes = [chain[0], chain[40], prompt[-3]]
    for k in probes:
        assert [r for r in gc.get_referrers(k) if r not in (chain, prompt, probes)] == []


@dataclass
class Log:
    held: dict[bytes, None] = field(default_factory=dict)  # the blocks whose place is here
    order: list[bytes] = field(default_factory=list)  # additions not read by eviction


@dataclass
class ModelLRU:
    """The order BlockLRU documents, written plainly: a generation is a list of logs,
    the newest takes the additions, merges concatenate, a block is in one log's dict."""

    gen_size: int
    gens: list[list[Log]] = field(default_factory=lambda: [[Log()]])

    def find(self, k: bytes) -> tuple[int, Log] | None:
        for i, gen in enumerate(self.gens):
            for log in gen:
                if k in log.held:
                    return i, log
        return None

    def add(self, k: bytes) -> None:
        if len(self.gens[-1][-1].order) >= self.gen_size:
            if len(self.gens) >= MAX_GENERATIONS:
                g = self.gens
                i = min(range(len(g) - 1), key=lambda j: self.held(g[j]) + self.held(g[j + 1]))
                g[i : i + 2] = [g[i] + g[i + 1]]
            self.gens.append([Log()])
        self.gens[-1][-1].held[k] = None
        self.gens[-1][-1].order.append(k)

    @staticmethod
    def held(gen: list[Log]) -> int:
        return sum(len(log.held) for log in gen)

    def touch(self, k: bytes) -> None:
        found = self.find(k)
        if found is not None and found[0] != len(self.gens) - 1:
            del found[1].held[k]
            self.add(k)

    def discard(self, k: bytes) -> bool:
        found = self.find(k)
        if found is not None:
            del found[1].held[k]
        return found is not None

    def evict(self) -> bytes:
        while True:
            gen = self.gens[0]
            if not self.held(gen):
                del self.gens[0]
                continue
            if not gen[0].held:
                del gen[0]
                continue
            k = gen[0].order.pop(0)
            if k in gen[0].held:
                del gen[0].held[k]
                return k


lru_ops = st.lists(
    st.tuples(st.sampled_from(["hold", "hold", "discard", "evict"]), st.integers(0, 40)),
    max_size=400,
)


@settings(max_examples=200, deadline=None)
@given(
    fill=st.integers(0, 60),
    stride=st.integers(2, 5),
    ops=lru_ops,
    gen_size=st.integers(1, 8),
    labels=st.sampled_from([16, 17, 128]),
    compact_slice=st.sampled_from([1, 2, 5, COMPACT_SLICE]),
)
def test_the_order_equals_one_dict_per_log(
    fill: int,
    stride: int,
    ops: list[tuple[str, int]],
    gen_size: int,
    labels: int,
    compact_slice: int,
) -> None:
    # ``fill`` blocks, then all used again but every ``stride``-th: logs mostly stale,
    # so compaction runs, in small slices interleaved with what follows. Few labels
    # (16, 17) force relabelling (more so with blocks left behind in their
    # generations). Neither may change the order. Two LRUs share the node words, as the
    # index's replicas do; the second mirrors the first.
    nodes: dict[bytes, int] = {}
    words: dict[int, int] = {}
    lru = BlockLRU(gen_size, 1, nodes, words, labels, compact_slice)
    other = BlockLRU(gen_size, 0, nodes, words)
    model = ModelLRU(gen_size)
    held: set[bytes] = set()
    ever: set[bytes] = set()  # what ``other`` holds
    again = [("hold", 100 + i) for i in range(fill) if i % stride]
    for op, i in [("hold", 100 + i) for i in range(fill)] + again + ops:
        k = key(i)
        if op == "hold":
            assert lru.hold(k) == (k not in held)
            other.hold(k)
            ever.add(k)
            if k in held:
                model.touch(k)
            else:
                model.add(k)
                held.add(k)
        elif op == "discard":
            assert lru.discard(k) == model.discard(k) == (k in held)
            held.discard(k)
        elif op == "evict" and held:
            evicted = lru.evict()
            assert evicted == model.evict()
            held.remove(evicted)
        assert (k in other) == (k in ever) and (k in lru) == (k in held) and len(lru) == len(held)
        lru.check_invariants()
    other.check_invariants()
    assert set(lru) == held
    note(f"relabels: {lru.relabels}, compactions: {lru.compactions}")
    assert [lru.evict() for _ in range(len(held))] == [model.evict() for _ in range(len(held))]
    lru.clear()
    assert not lru and set(other) == set(nodes)
    assert all(w >> FIELD_BITS == 0 for w in nodes.values())  # slot 1's fields are gone
    lru.check_invariants()
    other.check_invariants()


def test_relabelling_keeps_the_order_and_frees_labels() -> None:
    # gen_size 1 and the fewest labels: every add starts a generation, merges pile
    # labels into the generations of blocks left behind, and relabelling takes them back.
    lru, model = BlockLRU(1, labels=MAX_GENERATIONS), ModelLRU(1)
    for i in range(60):
        lru.add(key(i))
        model.add(key(i))
        if i % 4:
            lru.touch(key(i // 2))
            model.touch(key(i // 2))
        lru.check_invariants()
    assert lru.relabels > 10
    assert [lru.evict() for _ in range(len(lru))] == [model.evict() for _ in range(60)]
    lru.check_invariants()


def test_node_words_pack_held_bit_and_label_per_slot_and_are_interned() -> None:
    nodes: dict[bytes, int] = {}
    words: dict[int, int] = {}
    a, b = BlockLRU(4, 0, nodes, words), BlockLRU(4, 3, nodes, words)
    chain = [key(1000 + i) for i in range(100)]
    for k in chain:
        a.add(k)
        b.add(k)
    distinct = {id(w) for w in nodes.values()}
    assert len(distinct) <= len({w for w in nodes.values()})  # equal words: one object
    first = nodes[chain[0]]
    assert first & 1 and first >> 3 * FIELD_BITS & 1 and not first >> FIELD_BITS & 1
    for k in chain:
        assert a.discard(k) and b.discard(k)
    assert nodes == {} and len(words) <= MAX_WORDS
    a.check_invariants()
    b.check_invariants()


def test_labels_in_use_stay_within_the_blocks_held() -> None:
    # Every generation leaves one block behind (the others are used again): merges pile
    # labels up, but each label in use has a holding, so the default label space never
    # runs out and nothing is relabelled; with 16 labels the same pattern relabels.
    for labels, relabelled in ((LABELS, False), (MAX_GENERATIONS, True)):
        lru = BlockLRU(4, labels=labels)
        previous: list[bytes] = []
        for g in range(120):
            batch = [key(10_000 * g + i) for i in range(4)]
            for k in batch + previous[1:]:
                lru.hold(k)
            previous = batch
        lru.check_invariants()  # includes: labels in use <= blocks held + 1
        assert len(lru._logs) > MAX_GENERATIONS or relabelled
        assert (lru.relabels > 0) == relabelled


def test_the_interned_words_table_is_bounded_and_starts_over() -> None:
    # gen_size 1: every block gets its own generation, hence its own label and word.
    lru = BlockLRU(1)
    blocks = [key(i) for i in range(MAX_WORDS + 500)]
    for k in blocks:
        lru.add(k)
    assert len({lru.nodes[k] for k in blocks}) == len(blocks)  # distinct words
    assert len(lru.words) <= MAX_WORDS  # the table started over once
    lru.check_invariants()
    for k in blocks[::2]:
        lru.touch(k)
    assert set(lru) == set(blocks) and len(lru.words) <= MAX_WORDS
    lru.check_invariants()


def test_a_block_used_again_keeps_its_newer_place_when_its_generations_merge() -> None:
    lru = BlockLRU(gen_size=2)
    for i in range(3):  # generations [0 1] [2 ...
        lru.add(key(i))
    lru.touch(key(0))  # ... 2 0]: 0 leaves the oldest
    for i in range(100, 100 + 2 * (MAX_GENERATIONS - 2) + 1):  # 16 generations, then 17
        lru.add(key(i))
    assert len(lru.gens) == MAX_GENERATIONS  # the first two (3 blocks) merged
    assert [lru.evict() for _ in range(3)] == [key(1), key(2), key(0)]
    lru.check_invariants()


def log_entries(lru: BlockLRU) -> int:
    return sum(log.entries for gen in lru.gens for log in gen.logs)


def test_logs_stay_within_twice_the_blocks_held_when_each_generation_leaves_one_behind() -> None:
    # The working set of one generation is used again every round, all but one block,
    # which a new one replaces: the block left behind keeps its generation's log alive,
    # and no eviction reads it (held stays far below any cap). Without compaction the
    # logs hold every entry ever added: 60 x 501 here.
    gen_size, rounds = 500, 60
    lru, model = BlockLRU(gen_size, compact_slice=64), ModelLRU(gen_size)
    working = [key(i) for i in range(gen_size + 1)]
    for r in range(rounds):
        if r:
            working[r % len(working)] = key(10_000 + r)
        for k in working:
            if lru.hold(k):
                model.add(k)
            else:
                model.touch(k)
        # all but the newest log: twice the holdings, plus what a step has not read yet
        bound = 2 * len(lru) + 2 * gen_size + lru.compact_slice
        assert log_entries(lru) <= bound, (r, log_entries(lru), len(lru))
    lru.check_invariants()
    assert len(lru) == len(working) + rounds - 1 and lru.compactions >= rounds - 2
    assert lru.log_bytes <= 4 * KEY_BYTES * (len(lru) + gen_size)
    n = len(lru)
    assert [lru.evict() for _ in range(n)] == [model.evict() for _ in range(n)]


def test_compaction_keeps_the_order_of_a_key_added_twice_to_a_log() -> None:
    # A block discarded and added again while its log is the newest takes its first
    # place back; compaction keeps that entry, not the later one.
    lru = BlockLRU(gen_size=6, compact_slice=1)
    filler, (a, b, c, d, e, f) = [key(100 + i) for i in range(6)], [key(i) for i in range(6)]
    for k in [*filler, a, b]:
        lru.add(k)
    lru.discard(a)
    for k in [a, c, d, e, f]:  # log: a b a c d e, then f starts the next generation
        lru.add(k)
    for k in [c, d, e, filler[0]]:  # used again: 2 of 6 entries live, so a rewrite
        lru.touch(k)  # (4 entries' work per holding moved: done by the 4th)
    lru.check_invariants()
    assert lru.compactions == 1 and lru.gens[1].logs[0].entries == 2
    assert [lru.evict() for _ in range(len(lru))] == [*filler[1:], a, b, f, c, d, e, filler[0]]
    lru.check_invariants()
