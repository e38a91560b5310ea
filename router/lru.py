"""Which blocks one replica holds, in approximate least-recently-used order, built only
from containers the garbage collector does not track.

The index holds up to 10⁶ blocks per replica. An ``OrderedDict`` (or any container of
objects the GC tracks) of that size makes every full collection walk it: 60–100 ms
pauses of the gateway's event loop. Here every large container is untracked: dicts of
``bytes -> None`` (CPython never tracks a dict whose keys and values are all atomic)
and ``bytearray`` logs of raw 16-byte keys.

Order is kept in generations, oldest first, each ``gen_size`` additions long:

    generation = keys: dict[key, None]   held keys last used in this generation
                 order: bytearray        keys as added, 16 bytes each (may be stale)

* add a block: into the newest generation (a new one starts when it is full);
* use a held block again: it moves from its generation to the newest (a block
  already in the newest stays where it is: it is recent at this granularity);
* evict: read the oldest generation's ``order`` from its start, skipping keys no
  longer in its ``keys`` (used again since, or removed): FIFO within the oldest
  generation, so a chain added deepest block first loses its leaves before its head.

Eviction and use are O(1) amortized; at most ``MAX_GENERATIONS`` generations live (the
two smallest neighbours merge when one more would start), so finding a block's
generation costs a few dict probes. With ``gen_size`` 1 (a cap of 8 blocks or fewer)
the order is exact LRU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

KEY_BYTES = 16
MAX_GENERATIONS = 16


@dataclass(slots=True)
class _Generation:
    keys: dict[bytes, None] = field(default_factory=dict)
    order: bytearray = field(default_factory=bytearray)
    start: int = 0  # read position in ``order`` (bytes)

    @property
    def added(self) -> int:
        return (len(self.order) - self.start) // KEY_BYTES


@dataclass(slots=True)
class BlockLRU:
    gen_size: int
    gens: list[_Generation] = field(default_factory=lambda: [_Generation()])
    held: int = 0

    def __contains__(self, key: bytes) -> bool:
        return self._find(key) is not None

    def __len__(self) -> int:
        return self.held

    def __iter__(self) -> Iterator[bytes]:
        for gen in self.gens:
            yield from gen.keys

    def add(self, key: bytes) -> None:
        """A block the replica did not hold (the caller checks)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"index keys are {KEY_BYTES}-byte short keys, got {len(key)} bytes")
        newest = self.gens[-1]
        if newest.added >= self.gen_size:
            newest = self._new_generation()
        newest.keys[key] = None
        newest.order += key
        self.held += 1

    def touch(self, key: bytes) -> None:
        """A held block used again: it becomes one of the newest."""
        gen = self._find(key)
        if gen is None or gen is self.gens[-1]:
            return
        del gen.keys[key]
        self.held -= 1
        self.add(key)

    def discard(self, key: bytes) -> bool:
        """Forget the block; whether it was held."""
        gen = self._find(key)
        if gen is None:
            return False
        del gen.keys[key]
        self.held -= 1
        return True

    def evict(self) -> bytes:
        """Forget and return the least recently used block (the LRU must not be empty)."""
        while True:
            gen = self.gens[0]
            if not gen.keys:
                if len(self.gens) == 1:
                    raise KeyError("evict from an empty BlockLRU")
                del self.gens[0]
                continue
            start = gen.start
            key = bytes(gen.order[start : start + KEY_BYTES])
            gen.start = start + KEY_BYTES
            if gen.start >= 4096 and 2 * gen.start >= len(gen.order):
                del gen.order[: gen.start]  # a bytearray drops its head in O(1)
                gen.start = 0
            if key in gen.keys:
                del gen.keys[key]
                self.held -= 1
                return key

    def clear(self) -> None:
        self.gens = [_Generation()]
        self.held = 0

    def _find(self, key: bytes) -> _Generation | None:
        for gen in reversed(self.gens):
            if key in gen.keys:
                return gen
        return None

    def _new_generation(self) -> _Generation:
        gens = self.gens
        if len(gens) >= MAX_GENERATIONS:
            # Merge the adjacent pair with the fewest blocks (the older one's log first).
            i = min(range(len(gens) - 1), key=lambda j: len(gens[j].keys) + len(gens[j + 1].keys))
            older, newer = gens[i], gens[i + 1]
            small, large = sorted((older.keys, newer.keys), key=len)
            large.update(small)
            order = older.order[older.start :] + newer.order[newer.start :]
            gens[i : i + 2] = [_Generation(large, order)]
        gen = _Generation()
        gens.append(gen)
        return gen

    def check_invariants(self) -> None:
        assert self.gens and self.held == sum(len(g.keys) for g in self.gens)
        seen: set[bytes] = set()
        for gen in self.gens:
            assert not seen & gen.keys.keys(), "a block in two generations"
            seen.update(gen.keys)
            logged = {
                bytes(gen.order[i : i + KEY_BYTES])
                for i in range(gen.start, len(gen.order), KEY_BYTES)
            }
            assert gen.keys.keys() <= logged, "a held block missing from its generation's log"
