"""Which blocks one replica holds, in approximate least-recently-used order, stored in
the index's node words and in logs the garbage collector does not track.

The index holds up to 10⁶ blocks per replica. An ``OrderedDict`` (or any container of
objects the GC tracks) of that size makes every full collection walk it: 60–100 ms
pauses of the gateway's event loop. A dict per replica of ``key -> None`` is untracked
but costs ~40 bytes per holding. Here a holding costs its 16-byte log entry and a few
bits of the block's node word, which the index keeps anyway (``key -> word``, one int
per block, interned so that equal words are one object):

    word = Σ over the replica slots holding the block of
           (held bit | generation label << 1) << (slot · FIELD_BITS)

Order is kept in generations, oldest first, each ``gen_size`` additions long:

    generation = labels: set[int]     the labels whose holdings belong to it
                 order: bytearray     keys as added, 16 bytes each (may be stale)

A holding belongs to the generation owning its label; a log entry is *live* when its
key is held with a label of the log's generation, otherwise it is skipped.

* add a block: into the newest generation (a new one starts when it is full);
* use a held block again: it moves from its generation to the newest (a block
  already in the newest stays where it is: it is recent at this granularity);
* evict: read the oldest generation's ``order`` from its start, skipping entries that
  are not live (used again since, or removed): FIFO within the oldest generation, so a
  chain added deepest block first loses its leaves before its head.

At most ``MAX_GENERATIONS`` generations live: when one more would start, the adjacent
pair holding the fewest blocks merges (labels united, logs concatenated). Eviction and
use are O(1) amortized; with ``gen_size`` 1 (a cap of 8 blocks or fewer) the order is
exact LRU.

Labels: each generation starts with one free label; a label is free again once no
block holds it (and its generation is not the newest). Merges leave a generation with
several labels, so labels in use can outnumber generations, but never the blocks held
(+1): with 2²³ labels a free one is always there below ~8·10⁶ blocks per replica. Past
that, a new generation that finds none free relabels the generation with the most
labels to one of them: one walk over its log, the only step here that is not O(1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

KEY_BYTES = 16
MAX_GENERATIONS = 16
FIELD_BITS = 24  # per replica slot in a node word: held bit + 23-bit generation label
LABELS = 1 << (FIELD_BITS - 1)
FIELD = (1 << FIELD_BITS) - 1
MAX_WORDS = 4096  # interned words kept; past it the table starts over (``_write``)


@dataclass(slots=True)
class _Generation:
    label: int  # the label its additions get while it is the newest
    labels: set[int]  # the labels whose holdings belong here
    held: int = 0
    order: bytearray = field(default_factory=bytearray)
    start: int = 0  # read position in ``order`` (bytes)

    @property
    def added(self) -> int:
        return (len(self.order) - self.start) // KEY_BYTES


@dataclass(slots=True)
class BlockLRU:
    """One replica's holdings. ``nodes`` and ``words`` are the index's node map and its
    interned words, shared by every replica's LRU (standalone: private ones)."""

    gen_size: int
    slot: int = 0
    nodes: dict[bytes, int] = field(default_factory=dict)
    words: dict[int, int] = field(default_factory=dict)
    labels: int = LABELS  # labels it may use (fewer in tests, to force relabelling)
    gens: list[_Generation] = field(init=False)
    held: int = 0
    relabels: int = 0  # how many times ``_relabel`` ran (a statistic)
    shift: int = field(init=False)
    _next_label: int = 0  # where the search for a free label starts
    # Labels in use (owned by a generation): holdings per label, and the owner.
    _label_held: dict[int, int] = field(init=False)
    _label_gen: dict[int, _Generation] = field(init=False)

    def __post_init__(self) -> None:
        if not MAX_GENERATIONS <= self.labels <= LABELS:
            raise ValueError(f"labels must be in [{MAX_GENERATIONS}, {LABELS}]")
        self.shift = self.slot * FIELD_BITS
        self._reset()

    def _reset(self) -> None:
        first = _Generation(0, {0})
        self.gens = [first]
        self.held = 0
        self._next_label = 1
        self._label_held = {0: 0}
        self._label_gen = {0: first}

    def __contains__(self, key: bytes) -> bool:
        return bool(self.nodes.get(key, 0) >> self.shift & 1)

    def __len__(self) -> int:
        return self.held

    def __iter__(self) -> Iterator[bytes]:
        """Held keys, oldest generation first."""
        seen: set[bytes] = set()
        for gen in self.gens:
            for key in self._live(gen):
                if key not in seen:
                    seen.add(key)
                    yield key

    def hold(self, key: bytes) -> bool:
        """The replica holds ``key`` now: a new block is added, a held one touched.
        Whether it was new."""
        word = self.nodes.get(key, 0)
        field_ = word >> self.shift & FIELD
        if not field_:
            self._add(key, word)
            return True
        if field_ >> 1 != self.gens[-1].label:  # (the newest has that one label only)
            self._add(key, self._unhold(key, word, field_))
        return False

    def add(self, key: bytes) -> None:
        """A block the replica did not hold (the caller checks)."""
        self._add(key, self.nodes.get(key, 0))

    def touch(self, key: bytes) -> None:
        """A held block used again: it becomes one of the newest."""
        if key in self:
            self.hold(key)

    def discard(self, key: bytes) -> bool:
        """Forget the block; whether it was held."""
        word = self.nodes.get(key, 0)
        field_ = word >> self.shift & FIELD
        if not field_:
            return False
        self._unhold(key, word, field_)
        return True

    def evict(self) -> bytes:
        """Forget and return the least recently used block (the LRU must not be empty)."""
        nodes, shift = self.nodes, self.shift
        while True:
            gen = self.gens[0]
            if not gen.held:
                if len(self.gens) == 1:
                    raise KeyError("evict from an empty BlockLRU")
                del self.gens[0]  # its labels were freed with its last holding
                continue
            start = gen.start
            key = bytes(gen.order[start : start + KEY_BYTES])
            gen.start = start + KEY_BYTES
            if gen.start >= 4096 and 2 * gen.start >= len(gen.order):
                del gen.order[: gen.start]  # a bytearray drops its head in O(1)
                gen.start = 0
            word = nodes.get(key, 0)
            field_ = word >> shift & FIELD
            if field_ and field_ >> 1 in gen.labels:
                self._unhold(key, word, field_)
                return key

    def clear(self) -> None:
        """Forget every block (their node words lose this replica's field)."""
        for gen in self.gens:
            for key in self._live(gen):
                self.discard(key)
        self._reset()

    # ----------------------------------------------------------------------- internals

    def _add(self, key: bytes, word: int) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"index keys are {KEY_BYTES}-byte short keys, got {len(key)} bytes")
        newest = self.gens[-1]
        if newest.added >= self.gen_size:
            newest = self._new_generation()
        label = newest.label
        self._write(key, word | (label << 1 | 1) << self.shift)
        newest.order += key
        newest.held += 1
        self._label_held[label] += 1
        self.held += 1

    def _unhold(self, key: bytes, word: int, field_: int) -> int:
        """Drop the holding from its generation and the node word; the new word."""
        label = field_ >> 1
        gen = self._label_gen[label]
        gen.held -= 1
        self.held -= 1
        self._label_held[label] -= 1
        if not self._label_held[label] and gen is not self.gens[-1]:
            self._free_label(label)
        word ^= field_ << self.shift
        self._write(key, word)
        return word

    def _write(self, key: bytes, word: int) -> None:
        if not word:
            del self.nodes[key]
            return
        # Interned: a million nodes share the few words that chains have in common.
        # The table is bounded; starting it over only costs duplicates of the words
        # still in use (each re-interned once on its next write).
        words = self.words
        interned = words.get(word)
        if interned is None:
            if len(words) >= MAX_WORDS:
                words.clear()
            words[word] = interned = word
        self.nodes[key] = interned

    def _free_label(self, label: int) -> None:
        assert not self._label_held[label]
        self._label_gen.pop(label).labels.remove(label)
        del self._label_held[label]

    def _live(self, gen: _Generation) -> Iterator[bytes]:
        """The keys of the generation's live log entries, in log order (a key may
        repeat: discarded and added again in the same generation)."""
        nodes, shift, order = self.nodes, self.shift, gen.order
        for i in range(gen.start, len(order), KEY_BYTES):
            key = bytes(order[i : i + KEY_BYTES])
            field_ = nodes.get(key, 0) >> shift & FIELD
            if field_ and field_ >> 1 in gen.labels:
                yield key

    def _new_generation(self) -> _Generation:
        gens = self.gens
        newest = gens[-1]
        if not self._label_held[newest.label]:  # it stops being the newest
            self._free_label(newest.label)
        if len(gens) >= MAX_GENERATIONS:
            # Merge the adjacent pair with the fewest blocks (the older one's log first).
            i = min(range(len(gens) - 1), key=lambda j: gens[j].held + gens[j + 1].held)
            older, newer = gens[i], gens[i + 1]
            merged = _Generation(
                newer.label,
                older.labels | newer.labels,
                older.held + newer.held,
                older.order[older.start :] + newer.order[newer.start :],
            )
            gens[i : i + 2] = [merged]
            for label in merged.labels:
                self._label_gen[label] = merged
        if len(self._label_gen) >= self.labels:
            self._relabel(max(gens, key=lambda g: len(g.labels)))
        label = self._next_label
        while label in self._label_gen:  # a few steps: labels in use are few (module doc)
            label = (label + 1) % self.labels
        self._next_label = (label + 1) % self.labels
        gen = _Generation(label, {label})
        self._label_gen[label] = gen
        self._label_held[label] = 0
        gens.append(gen)
        return gen

    def _relabel(self, gen: _Generation) -> None:
        """Give every holding of ``gen`` one of its labels and free the others. Stale
        entries keep theirs: liveness, hence the order, is unchanged."""
        self.relabels += 1
        label = min(gen.labels)
        shift = self.shift
        for key in list(self._live(gen)):
            word = self.nodes[key]
            field_ = word >> shift & FIELD
            if field_ >> 1 != label:
                self._write(key, word ^ (field_ ^ (label << 1 | 1)) << shift)
        for other in sorted(gen.labels - {label}):
            self._label_held[other] = 0
            self._free_label(other)
        self._label_held[label] = gen.held

    def check_invariants(self) -> None:
        gens = self.gens
        assert gens and self.held == sum(g.held for g in gens)
        owned: set[int] = set()
        for gen in gens:
            assert not owned & gen.labels, "a label in two generations"
            owned |= gen.labels
            assert gen.held == sum(self._label_held[label] for label in gen.labels)
            assert all(self._label_gen[label] is gen for label in gen.labels)
            assert gen.held == len(set(self._live(gen))), "a holding missing from its log"
            assert gen is gens[-1] or all(map(self._label_held.get, gen.labels)), "unused label"
        newest = gens[-1]
        assert newest.labels == {newest.label}, "the newest generation has one label"
        assert owned == self._label_gen.keys() == self._label_held.keys()
        assert len(owned) <= min(self.labels, self.held + 1)
        per_label = dict.fromkeys(owned, 0)
        for word in self.nodes.values():
            field_ = word >> self.shift & FIELD
            if field_:
                assert field_ & 1, "a field with a label but no held bit"
                per_label[field_ >> 1] += 1
        assert per_label == self._label_held, "label counts disagree with the words"
