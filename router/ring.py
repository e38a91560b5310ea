"""Consistent-hash ring (uhashring) over replica ids, with bounded-load lookup.

The ring holds every known replica; health, model and exclusions are applied while
walking it, so a replica that comes back finds its old conversations again and adding a
replica moves only about 1/n of the keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from uhashring import HashRing


class Ring:
    def __init__(self, vnodes: int = 160) -> None:
        self._ring = HashRing(nodes=[], vnodes=vnodes)
        self._members: set[str] = set()

    def add(self, replica_id: str) -> None:
        if replica_id not in self._members:
            self._ring.add_node(replica_id)
            self._members.add(replica_id)

    def remove(self, replica_id: str) -> None:
        if replica_id in self._members:
            self._ring.remove_node(replica_id)
            self._members.discard(replica_id)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def walk(self, key: str) -> Iterator[str]:
        """Replica ids in ring order starting at ``key``'s position, each once."""
        if not self._members:
            return
        for node in self._ring.range(key):
            yield node["nodename"]

    def pick(self, key: str, allowed: Callable[[str], bool]) -> str | None:
        """The first replica on ``key``'s walk that ``allowed`` accepts."""
        for replica_id in self.walk(key):
            if allowed(replica_id):
                return replica_id
        return None

    def rank(self, key: str, among: set[str]) -> str | None:
        """The member of ``among`` that comes first on ``key``'s walk."""
        return self.pick(key, among.__contains__)
