"""The prefix index against a brute-force model: per replica, a set of keys."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.index import PrefixIndex
from router.lru import FIELD_BITS

REPLICAS = ["a", "b", "c"]
# A small key universe so that chains overlap: key = bytes of its position and variant.
KEYS = [bytes([depth, variant]) * 8 for depth in range(6) for variant in range(2)]


def chain(variants: list[int]) -> list[bytes]:
    return [bytes([depth, v]) * 8 for depth, v in enumerate(variants)]


def brute_match(model: dict[str, set[bytes]], keys: list[bytes]) -> dict[str, int]:
    out = {}
    for replica, held in model.items():
        depth = 0
        while depth < len(keys) and keys[depth] in held:
            depth += 1
        if depth:
            out[replica] = depth
    return out


chains = st.lists(st.integers(0, 1), min_size=1, max_size=6).map(chain)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from(REPLICAS), chains),
        st.tuples(st.just("insert_later"), st.sampled_from(REPLICAS), chains),
        st.tuples(st.just("remove"), st.sampled_from(REPLICAS), st.lists(st.sampled_from(KEYS))),
        st.tuples(st.just("clear"), st.sampled_from(REPLICAS), st.just([])),
        st.tuples(st.just("drop"), st.sampled_from(REPLICAS), st.just([])),
        st.tuples(st.just("scrub"), st.sampled_from(REPLICAS), st.just([])),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, query=chains)
def test_match_equals_brute_force(
    ops: list[tuple[str, str, list[bytes]]], query: list[bytes]
) -> None:
    index = PrefixIndex(scrub_step=1)  # a cleared replica's old slot: scrubbed a block a step
    model: dict[str, set[bytes]] = {}
    for op, replica, keys in ops:
        if op == "scrub":
            index.scrub()
        elif op == "insert":
            index.insert(replica, keys)
            model.setdefault(replica, set()).update(keys)
        elif op == "insert_later":  # deferred: matches must see it before any fold
            index.insert_later(replica, keys, tentative_until=1e9)
            model.setdefault(replica, set()).update(keys)
            assert index.match(query) == brute_match(model, query)
        elif op == "remove":
            index.remove(replica, keys)
            model.get(replica, set()).difference_update(keys)
        elif op == "clear":
            index.clear(replica)
            model.get(replica, set()).clear()
        else:
            index.drop_replica(replica)
            model.pop(replica, None)
        index.check_invariants()
        assert index.match(query) == brute_match(model, query)
    while index.scrub(steps=100):
        pass
    index.check_invariants()
    assert len(index) == len(set().union(*model.values())) if model else len(index) == 0


@settings(max_examples=100, deadline=None)
@given(inserts=st.lists(st.tuples(st.sampled_from(REPLICAS), chains), max_size=40))
def test_cap_holds_and_evicts_oldest_leaves_first(inserts: list[tuple[str, list[bytes]]]) -> None:
    index = PrefixIndex(max_blocks_per_replica=4)
    for replica, keys in inserts:
        index.insert(replica, keys)
        index.check_invariants()
        assert index.blocks(replica) <= 4
        # The newest chain's head always survives: heads are touched last.
        assert index.holds(replica, keys[0])


def test_lru_evicts_the_least_recently_touched_chain() -> None:
    index = PrefixIndex(max_blocks_per_replica=6)
    old, new = chain([0, 0, 0]), chain([1, 1, 1])
    index.insert("a", old)
    index.insert("a", new)
    index.insert("a", old[:1])  # touching the head of `old` keeps it alive
    index.insert("a", chain([0, 2, 2]))  # 2 new blocks under old's head -> evict 2
    assert index.match(old) == {"a": 1}  # old's leaves were the oldest; its head was touched
    assert index.match(new) == {"a": 3}
    index.check_invariants()


def test_remove_really_removes() -> None:
    index = PrefixIndex()
    keys = chain([0, 0, 0, 0])
    index.insert("a", keys)
    index.insert("b", keys[:2])
    index.remove("a", keys[2:3])
    assert index.match(keys) == {"a": 2, "b": 2}
    index.drop_replica("a")
    assert index.match(keys) == {"b": 2}
    assert len(index) == 2  # nodes nobody holds are gone
    index.drop_replica("b")
    assert len(index) == 0 and index.match(keys) == {}
    index.check_invariants()


def test_optimistic_inserts_expire_unless_confirmed() -> None:
    index = PrefixIndex()
    keys = chain([0, 0, 0])
    index.insert("a", keys, tentative_until=10.0)
    index.insert("a", keys[:2])  # an event confirms the first two blocks
    assert index.expire("a", now=9.0) == 0
    assert index.expire("a", now=10.0) == 1
    assert index.match(keys) == {"a": 2}
    index.check_invariants()


def test_confirmed_blocks_stay_confirmed_after_a_new_optimistic_insert() -> None:
    index = PrefixIndex()
    keys = chain([0, 0])
    index.insert("a", keys)
    index.insert("a", keys + chain([0, 0, 1])[2:], tentative_until=1.0)
    assert index.expire("a", now=5.0) == 1
    assert index.match(keys) == {"a": 2}


def test_slots_are_reused_after_a_replica_leaves() -> None:
    index = PrefixIndex()
    for i in range(3):
        index.insert(f"r{i}", chain([i % 2]))
    index.drop_replica("r1")
    index.insert("r3", chain([1]))
    assert index.match(chain([1])) == {"r3": 1}
    assert index.match(chain([0])) == {"r0": 1, "r2": 1}
    index.check_invariants()


def test_deferred_inserts_fold_into_the_same_index_as_eager_ones() -> None:
    eager, lazy = PrefixIndex(max_blocks_per_replica=5), PrefixIndex(max_blocks_per_replica=5)
    for index in (eager, lazy):
        index.insert("a", chain([0, 0]))  # confirmed head
    eager.insert("a", chain([0, 0, 1, 1]), tentative_until=10.0)
    eager.insert("b", chain([0, 1, 0]), tentative_until=12.0)
    lazy.insert_later("a", chain([0, 0, 1, 1]), tentative_until=10.0)
    lazy.insert_later("b", chain([0, 1, 0]), tentative_until=12.0)
    assert lazy.pending == 2
    assert lazy.match(chain([0, 0, 1, 1])) == eager.match(chain([0, 0, 1, 1])) == {"a": 4, "b": 1}
    assert lazy.fold() == 2 and lazy.pending == 0
    for index in (eager, lazy):
        index.check_invariants()
        assert (index.blocks("a"), index.tentative_blocks("a"), len(index)) == (4, 2, 6)
        assert index.expire("a", now=11.0) == 2  # unconfirmed optimistic blocks leave
        assert index.match(chain([0, 0, 1, 1])) == {"a": 2, "b": 1}


def test_unconfirmed_is_an_optimistic_insert_no_event_confirmed_yet() -> None:
    index = PrefixIndex()
    head, tail = chain([0, 1]), chain([0, 1, 1, 0])
    index.insert("a", head)  # an event: confirmed
    index.insert_later("a", tail, tentative_until=5.0, held=2)  # deferred, in the overlay
    index.insert_later("b", tail, tentative_until=5.0)
    assert not index.unconfirmed("a", head[1])
    assert index.unconfirmed("a", tail[3]) and index.unconfirmed("b", head[0])
    assert not index.unconfirmed("c", head[0])  # unknown replica
    index.fold()  # now tentative in the replicas' own records: still unconfirmed
    assert index.unconfirmed("a", tail[3]) and index.unconfirmed("b", tail[3])
    assert not index.unconfirmed("a", head[0])
    index.insert("a", tail)  # the event for the rest of the chain
    assert not index.unconfirmed("a", tail[3]) and index.unconfirmed("b", tail[3])


def test_an_update_folds_deferred_inserts_first() -> None:
    index = PrefixIndex()
    index.insert_later("a", chain([0, 1, 1]), tentative_until=5.0)
    index.insert("a", chain([0, 1]))  # an event confirms the head
    assert index.pending == 0
    assert index.tentative_blocks("a") == 1
    index.drop_replica("a")
    index.insert_later("b", chain([1]), tentative_until=5.0)
    index.drop_replica("b")
    assert index.match(chain([1])) == {} and len(index) == 0
    index.check_invariants()


def holders(word: int) -> set[int]:
    """The slots whose held bit the node word has."""
    return {s for s in range(word.bit_length() // FIELD_BITS + 1) if word >> s * FIELD_BITS & 1}


def brute_depths(owners: list[str], sets: list[set[int]]) -> dict[str, int]:
    out = {}
    for slot, owner in enumerate(owners):
        depth = 0
        while depth < len(sets) and slot in sets[depth]:
            depth += 1
        if depth:
            out[owner] = depth
    return out


@settings(max_examples=300, deadline=None)
@given(
    masks=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1)), max_size=12),
    interned=st.booleans(),
)
def test_depths_of_any_words_equal_brute_force(
    masks: list[tuple[int, int]], interned: bool
) -> None:
    # Any words, not only ``lookup``'s: runs, holders that leave and come back, zeros
    # anywhere, generation labels that differ between equal holder sets (depths reads
    # only the held bits). Slots 9-11 make the words ints CPython does not cache, so
    # equal words come both as one object (interned, as the index keeps them) and as
    # distinct ones.
    owners = [f"r{slot}" for slot in range(12)]
    index = PrefixIndex()
    for replica in owners:
        index.insert(replica, chain([0]))
    sets = [{9 + b for b in range(3) if m >> b & 1} for m, _label in masks]
    words = [
        int(str(sum((label << 1 | 1) << slot * FIELD_BITS for slot in slots)))
        for slots, (_m, label) in zip(sets, masks, strict=True)
    ]
    if interned:
        pool: dict[int, int] = {}
        words = [pool.setdefault(w, w) for w in words]
    assert index.depths(words) == brute_depths(owners, sets)


def test_lookup_stops_at_the_first_key_nobody_holds() -> None:
    index = PrefixIndex()
    keys = [bytes([i]) * 16 for i in range(40)]
    index.insert("a", keys)
    index.insert("b", keys[:20])
    index.remove("a", keys[17:18])
    a, b = {0}, {1}
    # Key 17: b holds it, a does not, so no stop there.
    assert list(map(holders, index.lookup(keys))) == [a | b] * 17 + [b] + [a | b] * 2 + [a] * 20
    assert index.match(keys) == {"a": 17, "b": 20}
    index.remove("b", keys[17:18])
    assert list(map(holders, index.lookup(keys))) == [a | b] * 17
    assert index.match(keys) == {"a": 17, "b": 17}
    assert index.lookup(keys[17:]) == [] and index.match(keys[17:]) == {}
    assert index.lookup([]) == [] and index.match([]) == {}


def test_a_deferred_insert_bridges_a_gap_in_the_confirmed_blocks() -> None:
    index = PrefixIndex()
    keys = [bytes([i]) * 16 for i in range(40)]
    index.insert("a", keys)
    index.remove("a", keys[16:17])
    index.insert("b", keys[:3])
    assert index.match(keys) == {"a": 16, "b": 3}
    # Only the overlay knows key 16 now (and the keys after it, for b): no stop there.
    index.insert_later("a", keys[:17], tentative_until=1e9, held=16)
    index.insert_later("b", keys, tentative_until=1e9, held=3)
    assert len(index.lookup(keys)) == 40
    assert index.match(keys) == {"a": 40, "b": 40}
    index.remove("a", keys[30:31])  # folds the overlay first, then a loses key 30
    assert index.match(keys) == {"a": 30, "b": 40}
    index.check_invariants()


def test_clearing_a_view_is_immediate_and_its_blocks_are_scrubbed_as_others_are_added() -> None:
    """Cleared at once, a million-block view held the gateway's event loop for a second
    (a prefix cache reset, a rebuild from a snapshot). The view is empty at once; its old
    slot is retired (never reused while its fields are set) and cleared by later inserts,
    at least as many blocks as they add, and by ``scrub``."""
    index = PrefixIndex(scrub_step=100)
    old = [i.to_bytes(16, "little") for i in range(5_000)]
    index.insert("a", old)
    index.insert("b", old[:10])
    index.clear("a")
    assert index.match(old) == {"b": 10} and index.blocks("a") == 0
    assert len(index) > 4_000  # nodes only the retired slot holds: still in the map
    index.insert("c", [b"\xff" * 16])  # a new replica: not the retired slot
    index.check_invariants()
    new = [(i + 10_000).to_bytes(16, "little") for i in range(5_000)]
    index.insert("a", new)  # adds 5,000: clears at least as many retired ones
    assert not index.scrub()  # nothing left to clear
    assert len(index) == 10 + 5_000 + 1
    assert index.match(new) == {"a": 5_000} and index.match(old) == {"b": 10}
    index.check_invariants()
    index.drop_replica("a")  # large: retired too, then freed by scrubbing
    while index.scrub():
        pass
    assert len(index) == 11 and index.replica_ids == ["b", "c"]
    index.check_invariants()
