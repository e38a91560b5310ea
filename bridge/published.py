"""The keys the bridge has published for its engine, and the tier each one is in.

Several engine blocks can produce one prefixgate key (the same tokens under engine
hashes that differ in what prefixgate's keys do not cover, e.g. multimodal ids), and
each engine block sits in one tier at a time as far as routing cares (the device when
it has a copy there, else the host). So per key:

    producers[key]  engine blocks held in any tier that produced it   (> 0: published)
    on_host[key]    of those, the blocks whose tier is the host       (0 < n <= producers)

and a key's tier is ``host`` when all its producers are on the host, ``device``
otherwise. Counting the host side keeps an engine without a host tier at no cost.
``parents`` mirrors the chain (short key → short parent) for snapshots. An engine block's
tier comes from its ``Copies``: how many times it was announced in each tier, less its
removals there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from router.protocol import Medium, SnapshotBlock


class Copies(NamedTuple):
    """How many times the engine announced a block in each tier, less its removals there
    (vLLM may hold duplicate device blocks of one hash, and re-announces offloaded ones
    once per chunk that covers them; each leaves with its own removal)."""

    device: int = 0
    host: int = 0

    @property
    def tier(self) -> Medium | None:
        """Where routing finds the block: the device when it has a copy there."""
        return "device" if self.device else "host" if self.host else None

    def plus(self, tier: Medium, n: int) -> Copies:
        counts = (self.device + n, self.host) if tier == "device" else (self.device, self.host + n)
        return _FEW_COPIES.get(counts) or Copies(*counts)


# Shared instances for the usual counts, so a million blocks hold no tuple of their own.
_FEW_COPIES = MappingProxyType({(d, h): Copies(d, h) for d in range(4) for h in range(4)})
NO_COPIES = _FEW_COPIES[0, 0]


@dataclass(slots=True)
class PublishedKeys:
    parents: dict[bytes, bytes | None] = field(default_factory=dict)
    producers: dict[bytes, int] = field(default_factory=dict)
    on_host: dict[bytes, int] = field(default_factory=dict)

    def tier(self, key: bytes) -> Medium | None:
        """Where routing finds ``key`` on this replica; None: not published."""
        count = self.producers.get(key, 0)
        if count == 0:
            return None
        return "host" if self.on_host.get(key, 0) == count else "device"

    def add(self, keys: Iterable[bytes], parent: bytes | None, tier: Medium) -> None:
        """One more producer of the chain ``keys`` (the first a child of ``parent``)."""
        for key in keys:
            count = self.producers.get(key, 0)
            if count == 0:
                self.parents[key] = parent
            self.producers[key] = count + 1
            if tier == "host":
                self.on_host[key] = self.on_host.get(key, 0) + 1
            parent = key

    def drop(self, keys: Iterable[bytes], tier: Medium) -> None:
        """One producer of ``keys``, in ``tier``, is gone."""
        for key in keys:
            if tier == "host":
                _decrement(self.on_host, key)
            if not _decrement(self.producers, key):
                del self.parents[key]

    def move(self, keys: Iterable[bytes], tier: Medium) -> None:
        """One producer of ``keys`` is now in ``tier`` (it was in the other one)."""
        for key in keys:
            if tier == "host":
                self.on_host[key] = self.on_host.get(key, 0) + 1
            else:
                _decrement(self.on_host, key)

    def clear(self) -> None:
        self.parents.clear()
        self.producers.clear()
        self.on_host.clear()

    def snapshot(self) -> list[SnapshotBlock]:
        """The published keys with their tiers, parents before children."""
        out: list[SnapshotBlock] = []
        emitted: set[bytes] = set()
        for key in self.parents:
            path: list[bytes] = []
            k: bytes | None = key
            while k is not None and k in self.parents and k not in emitted and k not in path:
                path.append(k)
                k = self.parents[k]
            for node in reversed(path):
                tier = self.tier(node)
                assert tier is not None
                out.append(SnapshotBlock(self.parents[node], node, tier))
                emitted.add(node)
        return out

    def check_invariants(self) -> None:
        assert self.parents.keys() == self.producers.keys(), "mirror and counts disagree"
        for key, n in self.on_host.items():
            assert 0 < n <= self.producers.get(key, 0), "more host producers than producers"
        assert all(n > 0 for n in self.producers.values()), "a published key without producer"


def _decrement(counts: dict[bytes, int], key: bytes) -> int:
    """``counts[key] - 1``, the entry deleted at 0; returns what is left."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
    return left
