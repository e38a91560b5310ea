"""BlockLRU: generations of logs with membership in the node words; the index adds
nothing the GC walks; the order equals a plain model's, one dict per generation."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from hypothesis import given, note, settings
from hypothesis import strategies as st

from router.index import PrefixIndex
from router.lru import FIELD_BITS, LABELS, MAX_GENERATIONS, MAX_WORDS, BlockLRU
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
    # Everything that grows with the blocks held (the per-label counters and the
    # generation list have a fixed size: 128 labels, 16 generations).
    containers: list[object] = [index._nodes, index._words]
    for blocks in index._replicas.values():
        containers += [blocks.tentative, blocks.host]
        containers += [gen.order for gen in blocks.lru.gens]
    assert len(containers) >= 8 and not any(gc.is_tracked(c) for c in containers)
    # Nothing the collector walks refers to an indexed key: a full collection's work
    # does not grow with the index.
    probes = [chain[0], chain[40], prompt[-3]]
    for k in probes:
        assert [r for r in gc.get_referrers(k) if r not in (chain, prompt, probes)] == []


@dataclass
class ModelLRU:
    """The order BlockLRU documents, written plainly: one dict per generation."""

    gen_size: int
    gens: list[tuple[dict[bytes, None], list[bytes]]] = field(default_factory=lambda: [({}, [])])

    def find(self, k: bytes) -> int | None:
        return next((i for i, (keys, _) in enumerate(self.gens) if k in keys), None)

    def add(self, k: bytes) -> None:
        if len(self.gens[-1][1]) >= self.gen_size:
            if len(self.gens) >= MAX_GENERATIONS:
                g = self.gens
                i = min(range(len(g) - 1), key=lambda j: len(g[j][0]) + len(g[j + 1][0]))
                g[i : i + 2] = [({**g[i][0], **g[i + 1][0]}, g[i][1] + g[i + 1][1])]
            self.gens.append(({}, []))
        self.gens[-1][0][k] = None
        self.gens[-1][1].append(k)

    def touch(self, k: bytes) -> None:
        i = self.find(k)
        if i is not None and i != len(self.gens) - 1:
            del self.gens[i][0][k]
            self.add(k)

    def discard(self, k: bytes) -> bool:
        i = self.find(k)
        if i is not None:
            del self.gens[i][0][k]
        return i is not None

    def evict(self) -> bytes:
        while True:
            keys, order = self.gens[0]
            if not keys:
                del self.gens[0]
                continue
            k = order.pop(0)
            if k in keys:
                del keys[k]
                return k


lru_ops = st.lists(
    st.tuples(st.sampled_from(["hold", "hold", "discard", "evict"]), st.integers(0, 40)),
    max_size=400,
)


@settings(max_examples=150, deadline=None)
@given(
    fill=st.integers(0, 60),
    ops=lru_ops,
    gen_size=st.integers(1, 4),
    labels=st.sampled_from([16, 17, 128]),
)
def test_the_order_equals_one_dict_per_generation(
    fill: int, ops: list[tuple[str, int]], gen_size: int, labels: int
) -> None:
    # Few labels (16, 17) force relabelling (more so after ``fill`` blocks left behind
    # in their generations), which must not change the order. Two LRUs share the node
    # words, as the index's replicas do; the second mirrors the first.
    nodes: dict[bytes, int] = {}
    words: dict[int, int] = {}
    lru = BlockLRU(gen_size, 1, nodes, words, labels)
    other = BlockLRU(gen_size, 0, nodes, words)
    model = ModelLRU(gen_size)
    held: set[bytes] = set()
    ever: set[bytes] = set()  # what ``other`` holds
    for op, i in [("hold", 100 + i) for i in range(fill)] + ops:
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
    note(f"relabels: {lru.relabels}")
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
        assert len(lru._label_gen) > MAX_GENERATIONS or relabelled
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
