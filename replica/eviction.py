"""Eviction policies for the prefix cache: which unpinned cached block goes first.

The cache owns ref counts and contents; a policy only orders the *evictable* blocks
(cached, ref count 0). The cache tells it when a block becomes evictable (``push``) and
when it stops being evictable (``discard``: pinned again, dropped, expired, cleared).
``pop`` picks and removes the victim. Every operation is O(1); nothing scans the cache.

* ``lru``      — least recently released first. The cache pushes a request's blocks
                 tail-first, so a request's last block is the oldest and shared heads
                 outlive their tails.
* ``sink_lru`` — LRU, but a prompt's first block (depth 0, the "attention sink" and the
                 head every request with that system prompt shares) is never evicted
                 while any other block can go.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

POLICY_NAMES = ("lru", "sink_lru")


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
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
