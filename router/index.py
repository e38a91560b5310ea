"""The prefix index: which replica holds which block, as a radix tree over key chains.

A block key is a chained hash (router/protocol.py): it names its block *and* the whole
path of blocks before it. So the radix tree needs no explicit edges: the map
``key -> holders`` is the tree flattened, and walking a request's keys in order walks
the tree from the root. ``match`` stops at the first key no candidate holds, and
``lookup`` at the first key nobody holds.

Memory and pauses are the design constraints (docs/BENCHMARKS.md, "Decision latency,
index memory, GC pauses"): no container the garbage collector tracks grows with the
index, and a block costs its key, one node-map entry and 16 bytes per holding.

* node = one dict entry ``short key (16 B) -> word``, an int packing per replica slot a
  ``FIELD_BITS``-wide field: a held bit and the label of the LRU log the holding is in
  (router/lru.py). Words are interned, so a million nodes share a few hundred
  int objects. The held bit of slot ``s`` is ``1 << s * FIELD_BITS``; a "holder word"
  below is any int read that way;
* LRU  = per replica a ``BlockLRU`` (router/lru.py): bytearray logs of raw keys, one
  per label, in generations; membership and label are the node word's field, not a
  dict.

A chain is touched deepest block first, so the first block of a prefix is always newer
than its continuation and cap eviction takes a replica's oldest *leaves* first, keeping
shared heads alive — the same order the replicas' caches evict in. Eviction happens a
few blocks per insert, never as a walk over the tree.

Optimistic (tentative) inserts sit in a per-replica dict ``key -> deadline`` in
deadline order until an event confirms them or ``expire`` drops them.

Clearing a replica (a prefix cache reset, a rebuild from its snapshot, its removal) is
O(1): it gets a fresh slot, and its old slot is *retired*: left out of the held bits, so
nothing reads its fields, and cleared from the node words ``SCRUB_STEP`` blocks at a time
(``scrub``: by each insert, as many as it adds, and by ``Router.sweep``), then freed.
Cleared at once, a million blocks held the gateway's event loop for a second. Until
then a node held only by retired slots stays in the map (``len`` counts it).

Tiers: a replica with a host-memory KV tier reports where each block lives (the event's
``medium``). The index keeps, per replica, the set of its keys held on the host (an
untracked ``key -> None`` dict, empty for replicas without the tier); every other held
key is on the device. ``host_blocks`` counts a match's host blocks, which the cost model
prices as a copy instead of as free.

The router's own optimistic insert (one per routing decision) can be deferred:
``insert_later`` ORs the replica's held bit into a small overlay ``key -> bits`` that
``lookup`` consults, and ``fold`` (called by any update, by the router after a request,
or by its sweep) does the real bookkeeping later. At 10⁶ blocks each of the ~6 dict
operations per block of an eager insert is a cache miss; the overlay is small and hot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat, takewhile
from operator import or_, truth
from typing import NamedTuple

from router.lru import FIELD, FIELD_BITS, BlockLRU
from router.protocol import Medium


@dataclass(slots=True)
class _ReplicaBlocks:
    slot: int
    lru: BlockLRU
    tentative: dict[bytes, float] = field(default_factory=dict)  # untracked: bytes -> float
    host: dict[bytes, None] = field(default_factory=dict)  # held on the host tier (untracked)


_DONE = object()
_RETIRED = "\x00retired"  # the owner of a retired slot (no replica id is this)
SCRUB_STEP = 2048  # retired holdings cleared per ``scrub`` step (~1-2 ms)


class _Pending(NamedTuple):
    replica_id: str
    keys: Sequence[bytes]
    tentative_until: float


class PrefixIndex:
    """Block keys held per replica, with matching, a per-replica cap and LRU eviction."""

    __slots__ = (
        "_held_bits",
        "_nodes",
        "_pending",
        "_recent",
        "_replicas",
        "_retired",
        "_scrub_step",
        "_slot_owner",
        "_words",
        "max_blocks_per_replica",
    )

    def __init__(
        self, max_blocks_per_replica: int = 1_000_000, scrub_step: int = SCRUB_STEP
    ) -> None:
        if max_blocks_per_replica < 1 or scrub_step < 1:
            raise ValueError("max_blocks_per_replica and scrub_step must be positive")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._scrub_step = scrub_step
        self._nodes: dict[bytes, int] = {}  # key -> word (module doc)
        self._words: dict[int, int] = {}  # interned words (router/lru.py writes both)
        self._held_bits = 0  # the held bit of every slot ever allocated
        self._replicas: dict[str, _ReplicaBlocks] = {}
        self._slot_owner: list[str | None] = []  # slot -> replica id, None when free
        self._retired: deque[tuple[int, Iterator[None]]] = deque()  # (slot, its clearing)
        # Deferred optimistic inserts (``insert_later``), oldest first, and the overlay
        # ``key -> bits`` that makes them visible to ``lookup`` until ``fold`` applies them.
        self._pending: list[_Pending] = []
        self._recent: dict[bytes, int] = {}

    # ----------------------------------------------------------------------- replicas

    def _blocks_of(self, replica_id: str) -> _ReplicaBlocks:
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            try:
                slot = self._slot_owner.index(None)
                self._slot_owner[slot] = replica_id
            except ValueError:
                slot = len(self._slot_owner)
                self._slot_owner.append(replica_id)
                self._held_bits |= 1 << slot * FIELD_BITS
            gen_size = max(1, self.max_blocks_per_replica // 8)
            lru = BlockLRU(gen_size, slot, self._nodes, self._words)
            blocks = self._replicas[replica_id] = _ReplicaBlocks(slot, lru)
        return blocks

    def drop_replica(self, replica_id: str) -> None:
        """Remove every block of the replica; its slot is free once scrubbed."""
        self.fold()
        blocks = self._replicas.pop(replica_id, None)
        if blocks is not None:
            self._retire(blocks)

    def _retire(self, blocks: _ReplicaBlocks) -> None:
        if not blocks.lru.held:  # nothing to scrub
            blocks.lru.clear()
            self._slot_owner[blocks.slot] = None
            return
        self._slot_owner[blocks.slot] = _RETIRED
        self._held_bits &= ~(1 << blocks.slot * FIELD_BITS)
        self._retired.append((blocks.slot, blocks.lru.clearing(self._scrub_step)))
        self.scrub()  # a step now: a small view is gone at once

    def scrub(self, steps: int = 1) -> bool:
        """Clear retired slots' holdings from the node words, up to ``steps`` steps of
        ``scrub_step`` blocks (a slot done is free again); whether any work is left."""
        retired = self._retired
        while steps > 0 and retired:
            steps -= 1
            slot, clearing = retired[0]
            if next(clearing, _DONE) is _DONE:
                retired.popleft()
                self._slot_owner[slot] = None
                self._held_bits |= 1 << slot * FIELD_BITS  # (a free slot's bit is set)
        return bool(retired)

    @property
    def replica_ids(self) -> list[str]:
        return list(self._replicas)

    # ----------------------------------------------------------------------- updates

    def insert(
        self,
        replica_id: str,
        keys: Sequence[bytes],
        *,
        tentative_until: float | None = None,
        medium: Medium = "device",
    ) -> None:
        """Record that the replica holds the chain ``keys`` (first key = shallowest).

        ``tentative_until``: an optimistic insert, dropped by ``expire`` after that time
        unless a confirming insert (``tentative_until=None``) comes first. Blocks already
        confirmed stay confirmed; blocks already tentative keep their first deadline.
        ``medium``: the tier they are in now (a key stored in the other tier moved).
        """
        self.fold()
        if self._retired:  # paid as caused: retired blocks cleared at least as fast as added
            self.scrub(steps=1 + len(keys) // self._scrub_step)
        self._insert_now(replica_id, keys, tentative_until)
        blocks = self._replicas[replica_id]
        host = blocks.host
        if medium == "host":
            for key in keys:
                if key in blocks.lru:  # (a tiny cap may have evicted it already)
                    host[key] = None
        elif host:
            for key in keys:
                host.pop(key, None)

    def insert_later(
        self, replica_id: str, keys: Sequence[bytes], tentative_until: float, *, held: int = 0
    ) -> None:
        """An optimistic insert that ``lookup``/``match`` see at once but whose LRU and
        node bookkeeping waits for ``fold`` (the next update, or the router's call after
        the request): the routing decision then costs one small-dict update instead of
        ~6 dict operations per block on million-entry tables. ``held``: the replica's
        matched depth, whose blocks need no overlay entry."""
        bit = 1 << self._blocks_of(replica_id).slot * FIELD_BITS  # its held bit
        recent = self._recent
        new = keys[held:]
        if recent:
            for key in new:
                recent[key] = recent.get(key, 0) | bit
        else:
            recent.update(dict.fromkeys(new, bit))
        self._pending.append(_Pending(replica_id, keys, tentative_until))

    def fold(self) -> int:
        """Apply the deferred optimistic inserts, oldest first; returns how many."""
        pending = self._pending
        if not pending:
            return 0
        self._pending, self._recent = [], {}
        for replica_id, keys, until in pending:
            if replica_id in self._replicas:
                self._insert_now(replica_id, keys, until)
        return len(pending)

    @property
    def pending(self) -> int:
        """Deferred optimistic inserts not folded in yet."""
        return len(self._pending)

    def _insert_now(
        self, replica_id: str, keys: Sequence[bytes], tentative_until: float | None
    ) -> None:
        blocks = self._blocks_of(replica_id)
        hold, tentative = blocks.lru.hold, blocks.tentative
        for key in reversed(keys):  # deepest first: heads end up newest (module doc)
            if hold(key):  # new to the replica
                if tentative_until is not None:
                    tentative[key] = tentative_until
            elif tentative_until is None:  # held already, and an event confirms it
                tentative.pop(key, None)
            # (held already, optimistic again: it keeps its first deadline)
        lru = blocks.lru
        while len(lru) > self.max_blocks_per_replica:
            key = lru.evict()
            tentative.pop(key, None)
            blocks.host.pop(key, None)

    def remove(self, replica_id: str, keys: Iterable[bytes]) -> None:
        """The replica no longer holds ``keys`` in any tier (unknown keys are ignored)."""
        self.fold()
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            return
        for key in keys:
            if blocks.lru.discard(key):
                blocks.tentative.pop(key, None)
                blocks.host.pop(key, None)

    def clear(self, replica_id: str) -> None:
        """The replica holds nothing: at once, in a fresh slot (the old one is retired)."""
        self.fold()
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            return
        if not blocks.lru.held:
            blocks.lru.clear()  # (cheap: only its logs' bookkeeping)
            blocks.tentative.clear()
            blocks.host.clear()
            return
        del self._replicas[replica_id]
        self._retire(blocks)
        self._blocks_of(replica_id)

    def expire(self, replica_id: str, now: float) -> int:
        """Drop the replica's optimistic inserts whose deadline passed; returns how many."""
        self.fold()
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            return 0
        expired = []
        for key, deadline in blocks.tentative.items():  # deadline order
            if deadline > now:
                break
            expired.append(key)
        self.remove(replica_id, expired)
        return len(expired)

    # ----------------------------------------------------------------------- queries

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The holder words of the leading keys somebody holds (deferred inserts
        included), for ``depths``: it stops at the first key nobody holds, whose word
        (0) it leaves out, as it does every later key's.

        No match can reach past that key, and each key looked up in the million-entry
        node map is a few cache misses: a new prompt's tail costs nothing. ``takewhile``
        keeps the stop at C speed (chunks cost more per chunk than they save).
        """
        found = map(self._nodes.get, keys, repeat(0))
        if self._recent:  # a key the overlay holds is no stop, wherever it comes
            found = map(or_, found, map(self._recent.get, keys, repeat(0)))
        return list(takewhile(truth, found))

    def match(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Matched depth (leading blocks held) per replica; replicas with 0 are left out."""
        return self.depths(self.lookup(keys))

    def depths(self, masks: Sequence[int]) -> dict[str, int]:
        """``match`` from the holder words ``lookup`` returned (or any key's words: it
        reads up to the first 0)."""
        if not masks or not masks[0]:
            return {}
        # A chain's words come in runs of one interned int (the same holders and
        # generations block after block), so walk the runs, not the blocks: ``groupby``
        # finds and ``list`` counts them at C speed. ``held`` = replicas holding every
        # key so far; a run that lacks some of them ends their match at its start.
        depth_by_slot: dict[int, int] = {}
        held = masks[0] & self._held_bits  # held bits only: labels differ run to run
        depth = 0
        for mask, run in groupby(masks):
            dropped = held & ~mask
            if dropped:
                _record(depth_by_slot, dropped, depth)
                held &= mask
                if not held:
                    break
            depth += len(list(run))
        else:  # the replicas still holding hold every key
            _record(depth_by_slot, held, depth)
        owner = self._slot_owner
        return {owner[slot]: d for slot, d in depth_by_slot.items()}  # type: ignore[misc]

    def host_blocks(self, replica_id: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a match's leading keys) the replica holds on its host
        tier. O(1) for a replica with nothing there."""
        blocks = self._replicas.get(replica_id)
        if blocks is None or not blocks.host:
            return 0
        host = blocks.host
        return sum(1 for key in keys if key in host)

    def unconfirmed(self, replica_id: str, key: bytes) -> bool:
        """Whether the replica holds ``key`` only by an optimistic insert (deferred or
        tentative) that no event has confirmed yet: for a replica that publishes
        events, a prefix still being computed there. O(1), no fold."""
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            return False
        if self._recent.get(key, 0) & (1 << blocks.slot * FIELD_BITS):
            return True
        return key in blocks.tentative

    def holds(self, replica_id: str, key: bytes) -> bool:
        self.fold()
        blocks = self._replicas.get(replica_id)
        return blocks is not None and key in blocks.lru

    def blocks(self, replica_id: str) -> int:
        self.fold()
        blocks = self._replicas.get(replica_id)
        return 0 if blocks is None else len(blocks.lru)

    def tentative_blocks(self, replica_id: str) -> int:
        self.fold()
        blocks = self._replicas.get(replica_id)
        return 0 if blocks is None else len(blocks.tentative)

    def __len__(self) -> int:
        """Distinct blocks (nodes) in the index, those only retired slots hold included
        until they are scrubbed."""
        self.fold()
        return len(self._nodes)

    def check_invariants(self) -> None:
        self.fold()
        holdings = 0
        for replica_id, blocks in self._replicas.items():
            assert self._slot_owner[blocks.slot] == replica_id
            assert len(blocks.lru) <= self.max_blocks_per_replica
            blocks.lru.check_invariants()  # its fields of the node words included
            for key in blocks.tentative:
                assert key in blocks.lru, "tentative block not held"
            for key in blocks.host:
                assert key in blocks.lru, "host-tier block not held"
            holdings += len(blocks.lru)
        live = sum(1 << b.slot * FIELD_BITS for b in self._replicas.values())
        assert not live & ~self._held_bits
        retired = 0  # every field of the retired slots
        for slot, _ in self._retired:
            assert self._slot_owner[slot] == _RETIRED
            retired |= FIELD << slot * FIELD_BITS
        assert not retired & self._held_bits, "a retired slot's fields are read"
        fields = retired | sum(FIELD << b.slot * FIELD_BITS for b in self._replicas.values())
        held = [word & self._held_bits for word in self._nodes.values()]
        assert sum(h.bit_count() for h in held) == holdings
        for word, h in zip(self._nodes.values(), held, strict=True):
            assert not word & ~fields, "a free slot's field in a node"
            assert (h and not h & ~live) or word & retired, "a node nobody holds"


def _record(depth_by_slot: dict[int, int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        depth_by_slot[(low.bit_length() - 1) // FIELD_BITS] = depth
        mask ^= low
