"""Eviction policies for the prefix cache: which unpinned cached block goes first.

The cache owns ref counts and contents; a policy only orders the *evictable* blocks
(cached, ref count 0). The cache tells it when a block becomes evictable (``push``), when
it stops being evictable (``discard``: pinned again, expired, cleared), and when its
content is gone for good (``forget``). ``pop`` picks and removes the victim. Every
operation is O(1) or O(log n); nothing scans the whole cache.

* ``lru``      — least recently released first. The cache pushes a request's blocks
                 tail-first, so a request's last block is the oldest and shared heads
                 outlive their tails.
* ``sink_lru`` — LRU, but a prompt's first block (depth 0, the "attention sink" and the
                 head every request with that system prompt shares) is never evicted
                 while any other block can go.
* ``h2o``      — least accumulated attention mass first (heavy hitters stay), ties by
                 LRU order, first blocks protected as in ``sink_lru``.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict

POLICY_NAMES = ("lru", "sink_lru", "h2o")


class EvictionPolicy(ABC):
    """Orders evictable blocks. ``sink`` marks a prompt's first block."""

    name: str

    @abstractmethod
    def push(self, block_id: int, *, sink: bool) -> None:
        """The block just became evictable; it is now the most recently used."""

    @abstractmethod
    def discard(self, block_id: int) -> None:
        """The block is no longer evictable (pinned or dropped); absent ids are ignored."""

    @abstractmethod
    def pop(self) -> int:
        """Remove and return the victim. Raises IndexError when nothing is evictable."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...

    def forget(self, block_id: int) -> None:
        """The block's content is gone (its id will hold other tokens): drop its history."""
        self.discard(block_id)

    def record_attention(self, block_id: int, mass: float) -> None:  # noqa: B027
        """Attention mass the block received; only ``h2o`` uses it."""

    def check_invariants(self) -> None:  # noqa: B027
        """Assert the policy's internal bookkeeping is consistent."""


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        # Oldest first; values unused (an ordered set).
        self._order: OrderedDict[int, None] = OrderedDict()

    def push(self, block_id: int, *, sink: bool) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def discard(self, block_id: int) -> None:
        self._order.pop(block_id, None)

    def pop(self) -> int:
        if not self._order:
            raise IndexError("no evictable block")
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order


class SinkLRUPolicy(EvictionPolicy):
    name = "sink_lru"

    def __init__(self) -> None:
        self._sinks: OrderedDict[int, None] = OrderedDict()
        self._others: OrderedDict[int, None] = OrderedDict()

    def push(self, block_id: int, *, sink: bool) -> None:
        self.discard(block_id)
        (self._sinks if sink else self._others)[block_id] = None

    def discard(self, block_id: int) -> None:
        if block_id in self._others:
            del self._others[block_id]
        else:
            self._sinks.pop(block_id, None)

    def pop(self) -> int:
        if self._others:
            return self._others.popitem(last=False)[0]
        if self._sinks:
            return self._sinks.popitem(last=False)[0]
        raise IndexError("no evictable block")

    def __len__(self) -> int:
        return len(self._sinks) + len(self._others)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._others or block_id in self._sinks

    def check_invariants(self) -> None:
        assert not (self._sinks.keys() & self._others.keys()), "block both sink and non-sink"


class H2OPolicy(EvictionPolicy):
    """Heavy-hitter oracle: evict the non-sink block with the least attention mass.

    Fed by ``PrefixCache.record_attention``. NOTE: the engine does not report attention
    mass yet (a later issue wires it in); until it does every mass is 0 and this policy
    behaves exactly like ``sink_lru`` (ties go to the least recently released block).

    The heap uses lazy deletion: an entry is live only while it matches ``_live``. The
    heap is rebuilt when stale entries outnumber live ones, so pops stay amortised
    O(log n).
    """

    name = "h2o"

    def __init__(self) -> None:
        self._mass: dict[int, float] = {}  # every block with recorded mass, evictable or not
        self._heap: list[tuple[float, int, int]] = []  # (mass, push order, block id)
        self._live: dict[int, tuple[float, int]] = {}  # evictable non-sink -> its heap entry
        self._sinks: OrderedDict[int, None] = OrderedDict()
        self._counter = 0

    def push(self, block_id: int, *, sink: bool) -> None:
        self.discard(block_id)
        if sink:
            self._sinks[block_id] = None
            return
        self._counter += 1
        self._enter(block_id, self._mass.get(block_id, 0.0), self._counter)

    def _enter(self, block_id: int, mass: float, order: int) -> None:
        self._live[block_id] = (mass, order)
        heapq.heappush(self._heap, (mass, order, block_id))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(m, o, b) for b, (m, o) in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, block_id: int) -> None:
        if self._live.pop(block_id, None) is None:
            self._sinks.pop(block_id, None)

    def forget(self, block_id: int) -> None:
        self.discard(block_id)
        self._mass.pop(block_id, None)

    def record_attention(self, block_id: int, mass: float) -> None:
        total = self._mass.get(block_id, 0.0) + mass
        self._mass[block_id] = total
        entry = self._live.get(block_id)
        if entry is not None:  # evictable right now: re-rank it, keeping its age
            self._enter(block_id, total, entry[1])

    def pop(self) -> int:
        while self._heap:
            mass, order, block_id = heapq.heappop(self._heap)
            if self._live.get(block_id) == (mass, order):
                del self._live[block_id]
                return block_id
        if self._sinks:
            return self._sinks.popitem(last=False)[0]
        raise IndexError("no evictable block")

    def __len__(self) -> int:
        return len(self._live) + len(self._sinks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live or block_id in self._sinks

    def check_invariants(self) -> None:
        assert not (self._live.keys() & self._sinks.keys()), "block both sink and non-sink"
        in_heap = {(m, o, b) for m, o, b in self._heap}
        for block_id, (mass, order) in self._live.items():
            assert (mass, order, block_id) in in_heap, f"live block {block_id} not in heap"
            assert mass == self._mass.get(block_id, 0.0), f"stale mass for block {block_id}"


def make_policy(policy: str | EvictionPolicy | None = None) -> EvictionPolicy:
    """A policy instance from a name, an instance, or None (``lru``). Operators choose by
    name with ``--eviction-policy`` / ``PREFIXGATE_EVICTION_POLICY``."""
    if isinstance(policy, EvictionPolicy):
        return policy
    name = (policy if policy is not None else "lru").strip()
    match name.lower():
        case "lru":
            return LRUPolicy()
        case "sink_lru":
            return SinkLRUPolicy()
        case "h2o":
            return H2OPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
