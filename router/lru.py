"""Which blocks one replica holds, in approximate least-recently-used order, stored in
the index's node words and in logs the garbage collector does not track.

The index holds up to 10⁶ blocks per replica. An ``OrderedDict`` (or any container of
objects the GC tracks) of that size makes every full collection walk it: 60–100 ms
pauses of the gateway's event loop. A dict per replica of ``key -> None`` is untracked
but costs ~40 bytes per holding. Here a holding costs its 16-byte log entry and a few
bits of the block's node word, which the index keeps anyway (``key -> word``, one int
per block, interned so that equal words are one object):

    word = Σ over the replica slots holding the block of
           (held bit | label << 1) << (slot · FIELD_BITS)

Order is kept in generations, oldest first. A generation is a list of logs, one per
label; a new generation has one log and its label, and takes every addition while it
is the newest (``gen_size`` of them):

    log = label: int
          order: bytearray     keys as added, 16 bytes each, unread ones from ``start``

A log entry is *live* while its key is held with the log's label. A holding's place
is its key's first live entry in its label's log that eviction has not read:

* add a block: appended to the newest log (a new generation starts when it is full);
* use a held block again: it leaves its log and is appended to the newest (a block
  whose label is the newest's stays where it is: it is recent at this granularity);
* discard: the block leaves its log;
* evict: read the oldest generation's first log from ``start``, skipping entries that
  are not live: FIFO within a log, so a chain added deepest block first loses its
  leaves before its head.

At most ``MAX_GENERATIONS`` generations live: when one more would start, the adjacent
pair holding the fewest blocks merges, the older one's logs first. Labels stay apart
in a merge, so a block used again since keeps its newer place behind its old
generation's blocks. A block discarded and added again while its log is the newest
has two live entries there and takes its first place back, as a block used again
there keeps it. Eviction and use are O(1) amortized; with ``gen_size`` 1 (a cap of 8
blocks or fewer) the order is exact LRU.

Compaction bounds the logs: entries only become stale (a block used again, or
discarded), and a closed log (not the newest) gets no new ones. Once a closed log's
stale entries outnumber its holdings it is queued and rewritten with its live entries
only, each key's first, in order; no key gets a closed log's label again, so the
order is unchanged. The work is paid as it is caused: ``COMPACT_RATE`` entries per
holding that leaves a log (at most 2 are needed per stale entry removed), done in
steps of ``compact_slice`` entries (~0.5 ms at the default). So every log holds at
most 2 entries per block it holds, except the newest (≤ ``gen_size`` entries), the
log eviction is reading (the oldest generation's first, never rewritten: eviction
consumes it) and the queued ones.

Labels: a label is free again once no block holds it (and it is not the newest's),
so labels in use never exceed the blocks held (+1): with 2²³ labels a free one is
always there below ~8·10⁶ blocks per replica. Past that, a new generation that finds
none free relabels the generation with the most logs to one label and one compacted
log: one walk over its logs, the only step here that is not O(1) amortized.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

KEY_BYTES = 16
MAX_GENERATIONS = 16
FIELD_BITS = 24  # per replica slot in a node word: held bit + 23-bit label
LABELS = 1 << (FIELD_BITS - 1)
FIELD = (1 << FIELD_BITS) - 1
MAX_WORDS = 4096  # interned words kept; past it the table starts over (``_write``)
COMPACT_RATE = 4  # compaction work (log entries read) earned per holding leaving a log
COMPACT_SLICE = 1024  # log entries one compaction step reads (~0.5 ms at 10⁶ nodes)


@dataclass(slots=True, eq=False)
class _Log:
    """One label's additions, in order."""

    label: int
    gen: _Generation
    order: bytearray = field(default_factory=bytearray)
    start: int = 0  # read position in ``order`` (bytes)
    held: int = 0  # blocks held with this label
    repeats: bool = False  # a block left it while it was the newest: a key may be in it twice
    queued: bool = False  # in the compaction queue

    @property
    def entries(self) -> int:
        return (len(self.order) - self.start) // KEY_BYTES


@dataclass(slots=True, eq=False)
class _Generation:
    logs: list[_Log] = field(default_factory=list)  # in order; dead ones (held 0) empty
    held: int = 0


@dataclass(slots=True)
class _Compaction:
    """The queue head's rewrite: ``order[start:read]`` is done, its live entries kept."""

    log: _Log
    read: int
    kept: bytearray = field(default_factory=bytearray)
    seen: dict[bytes, None] | None = None  # keys kept, when the log may repeat one


@dataclass(slots=True)
class BlockLRU:
    """One replica's holdings. ``nodes`` and ``words`` are the index's node map and its
    interned words, shared by every replica's LRU (standalone: private ones)."""

    gen_size: int
    slot: int = 0
    nodes: dict[bytes, int] = field(default_factory=dict)
    words: dict[int, int] = field(default_factory=dict)
    labels: int = LABELS  # labels it may use (fewer in tests, to force relabelling)
    compact_slice: int = COMPACT_SLICE
    gens: list[_Generation] = field(init=False)
    held: int = 0
    relabels: int = 0  # how many times ``_relabel`` ran (a statistic)
    compactions: int = 0  # logs rewritten by compaction (a statistic)
    shift: int = field(init=False)
    _newest: _Log = field(init=False)  # the log additions go to
    _logs: dict[int, _Log] = field(init=False)  # labels in use
    _next_label: int = 0  # where the search for a free label starts
    _queue: deque[_Log] = field(init=False)  # logs to compact; the head is being rewritten
    _compaction: _Compaction | None = None
    _credit: int = 0  # compaction work earned and not done yet

    def __post_init__(self) -> None:
        if not MAX_GENERATIONS <= self.labels <= LABELS:
            raise ValueError(f"labels must be in [{MAX_GENERATIONS}, {LABELS}]")
        if self.compact_slice < 1:
            raise ValueError("compact_slice must be positive")
        self.shift = self.slot * FIELD_BITS
        self._reset()

    def _reset(self) -> None:
        first = _Generation()
        self.gens = [first]
        self.held = 0
        self._logs = {}
        self._newest = self._open_log(first, 0)
        self._next_label = 1
        self._queue = deque()
        self._compaction = None
        self._credit = 0

    def __contains__(self, key: bytes) -> bool:
        return bool(self.nodes.get(key, 0) >> self.shift & 1)

    def __len__(self) -> int:
        return self.held

    def __iter__(self) -> Iterator[bytes]:
        """Held keys, oldest first (as evicted)."""
        seen: set[bytes] = set()
        for gen in self.gens:
            for log in gen.logs:
                for key in self._live(log):
                    if key not in seen:
                        seen.add(key)
                        yield key

    @property
    def log_bytes(self) -> int:
        """Bytes allocated to the logs (a statistic)."""
        return sum(log.order.__sizeof__() for gen in self.gens for log in gen.logs)

    def hold(self, key: bytes) -> bool:
        """The replica holds ``key`` now: a new block is added, a held one touched.
        Whether it was new."""
        word = self.nodes.get(key, 0)
        field_ = word >> self.shift & FIELD
        if not field_:
            self._add(key, word)
            return True
        if field_ >> 1 != self._newest.label:
            log = self._room()  # first: a relabel there may change the word
            word = self.nodes[key]
            self._append(key, self._unhold(word, word >> self.shift & FIELD), log)
            self._pay()  # (one write above: the node stays put, see ``_unhold``)
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
        self._write(key, self._unhold(word, field_))
        self._pay()
        return True

    def evict(self) -> bytes:
        """Forget and return the least recently used block (the LRU must not be empty)."""
        nodes, shift = self.nodes, self.shift
        while True:
            gen = self.gens[0]
            if not gen.held:
                if len(self.gens) == 1:
                    raise KeyError("evict from an empty BlockLRU")
                del self.gens[0]  # its logs are dead
                continue
            log = gen.logs[0]
            if not log.held:  # dead (not the newest log: its generation would hold none)
                del gen.logs[0]
                continue
            if log.queued:  # eviction reads it now: a rewrite would only race it
                self._unqueue(log)
            start = log.start
            key = bytes(log.order[start : start + KEY_BYTES])
            log.start = start + KEY_BYTES
            if log.start >= 4096 and 2 * log.start >= len(log.order):
                del log.order[: log.start]  # a bytearray drops its head in O(1)
                log.start = 0
            word = nodes.get(key, 0)
            field_ = word >> shift & FIELD
            if field_ == log.label << 1 | 1:
                self._write(key, self._unhold(word, field_))
                self._pay()
                return key

    def clear(self) -> None:
        """Forget every block (their node words lose this replica's field)."""
        for _ in self.clearing(step=1 << 62):
            pass

    def clearing(self, step: int) -> Iterator[None]:
        """``clear`` in steps, yielding after every ``step`` blocks. Nothing else may
        change this LRU meanwhile (the index retires it first: router/index.py); other
        replicas' fields of the same words may change, as each write keeps them."""
        keep = ~(FIELD << self.shift)
        nodes, write = self.nodes, self._write
        done = 0
        for gen in self.gens:
            for log in gen.logs:
                for key in self._live(log):  # (a repeated key is not live the 2nd time)
                    write(key, nodes[key] & keep)
                    done += 1
                    if done == step:
                        done = 0
                        yield
        self._reset()

    # ----------------------------------------------------------------------- internals

    def _open_log(self, gen: _Generation, label: int) -> _Log:
        log = _Log(label, gen)
        gen.logs.append(log)
        self._logs[label] = log
        return log

    def _add(self, key: bytes, word: int) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"index keys are {KEY_BYTES}-byte short keys, got {len(key)} bytes")
        self._append(key, word, self._room())

    def _room(self) -> _Log:
        """The log the next addition goes to (a new generation's when the newest is full)."""
        log = self._newest
        if len(log.order) - log.start >= self.gen_size * KEY_BYTES:
            log = self._new_generation()
        return log

    def _append(self, key: bytes, word: int, log: _Log) -> None:
        self._write(key, word | (log.label << 1 | 1) << self.shift)
        log.order += key
        log.held += 1
        log.gen.held += 1
        self.held += 1

    def _unhold(self, word: int, field_: int) -> int:
        """Drop the holding from its log; the node word without it (the caller writes
        it: a node dropped and inserted again would leave the node map a deleted slot,
        and a million-entry dict full of them rebuilds itself, a pause of many ms)."""
        log = self._logs[field_ >> 1]
        log.held -= 1
        log.gen.held -= 1
        self.held -= 1
        if log is self._newest:
            log.repeats = True  # (evicted: its entry is read; discarded: it is not)
        elif not log.held:
            self._free(log)
        elif log.entries > 2 * log.held and not log.queued and log is not self.gens[0].logs[0]:
            self._enqueue(log)  # (not the log eviction reads)
        if self._queue:
            self._credit += COMPACT_RATE
        return word ^ field_ << self.shift

    def _pay(self) -> None:
        """Compaction work, once a step's worth is earned (``_unhold`` earns it)."""
        if self._credit >= self.compact_slice:
            self._compact()

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

    def _free(self, log: _Log) -> None:
        """The label has no holding left and is not the newest's: it is free, and its log
        (all stale) is emptied, since a later owner of the label would make it live."""
        del self._logs[log.label]
        log.order = bytearray()
        log.start = 0
        if log.queued:
            self._unqueue(log)

    def _enqueue(self, log: _Log) -> None:
        log.queued = True
        self._queue.append(log)

    def _unqueue(self, log: _Log) -> None:
        log.queued = False
        self._queue.remove(log)  # (it is nearly always the head)
        if self._compaction is not None and self._compaction.log is log:
            self._compaction = None
        if not self._queue:
            self._credit = 0

    def _live(self, log: _Log) -> Iterator[bytes]:
        """The keys of the log's live unread entries, in order (a key may repeat: see
        ``_Log.repeats``)."""
        nodes, shift, order = self.nodes, self.shift, log.order
        want = log.label << 1 | 1
        for i in range(log.start, len(order), KEY_BYTES):
            key = bytes(order[i : i + KEY_BYTES])
            if nodes.get(key, 0) >> shift & FIELD == want:
                yield key

    def _compact(self) -> None:
        """One step: read up to the earned entries (at least ``compact_slice``) of the
        queued logs, keeping the live ones; a log read to its end gets the kept ones."""
        budget, self._credit = self._credit, 0
        nodes, shift, queue = self.nodes, self.shift, self._queue
        while budget > 0 and queue:
            log = queue[0]
            run = self._compaction
            if run is None:
                run = self._compaction = _Compaction(log, log.start)
                if log.repeats:
                    run.seen = {}
            order = log.order
            end = min(len(order), run.read + budget * KEY_BYTES)
            chunk = bytes(order[run.read : end])
            budget -= (end - run.read) // KEY_BYTES + 1
            run.read = end
            want = log.label << 1 | 1
            live = [
                key
                for key in [chunk[i : i + KEY_BYTES] for i in range(0, len(chunk), KEY_BYTES)]
                if nodes.get(key, 0) >> shift & FIELD == want
            ]
            if run.seen is not None:  # keep each key's first entry only
                seen = run.seen
                live = [key for key in dict.fromkeys(live) if key not in seen]
                seen.update(dict.fromkeys(live))
            run.kept += b"".join(live)
            if end == len(order):
                log.order, log.start = run.kept, 0
                log.repeats = False
                self.compactions += 1
                self._unqueue(log)
                if log.entries > 2 * log.held:  # blocks left it during the rewrite
                    self._enqueue(log)

    def _new_generation(self) -> _Log:
        gens = self.gens
        closed = self._newest
        if not closed.held:
            self._free(closed)
        elif closed.entries > 2 * closed.held and closed is not gens[0].logs[0]:
            self._enqueue(closed)
        if len(gens) >= MAX_GENERATIONS:
            # Merge the adjacent pair with the fewest blocks (the older one's logs first).
            i = min(range(len(gens) - 1), key=lambda j: gens[j].held + gens[j + 1].held)
            older, newer = gens[i], gens[i + 1]
            merged = _Generation([log for log in older.logs + newer.logs if log.held])
            merged.held = older.held + newer.held
            for log in merged.logs:
                log.gen = merged
            gens[i : i + 2] = [merged]
        if len(self._logs) >= self.labels:
            self._relabel(max(gens, key=lambda g: len(g.logs)))
        label = self._next_label
        while label in self._logs:  # a few steps: labels in use are few (module doc)
            label = (label + 1) % self.labels
        self._next_label = (label + 1) % self.labels
        gen = _Generation()
        gens.append(gen)
        self._newest = self._open_log(gen, label)
        return self._newest

    def _relabel(self, gen: _Generation) -> None:
        """Give every holding of ``gen`` one label, in one log of its live entries (each
        key's first, in order), and free the other labels: the order is unchanged."""
        self.relabels += 1
        owned = [log for log in gen.logs if log.held]
        keys = dict.fromkeys(key for log in owned for key in self._live(log))
        assert len(keys) == gen.held
        for log in owned:
            if log.queued:
                self._unqueue(log)
            del self._logs[log.label]
            log.order, log.start, log.held = bytearray(), 0, 0
        label = min(log.label for log in owned)
        want, shift = label << 1 | 1, self.shift
        for key in keys:
            word = self.nodes[key]
            field_ = word >> shift & FIELD
            if field_ != want:
                self._write(key, word ^ (field_ ^ want) << shift)
        log = _Log(label, gen, bytearray(b"".join(keys)), held=gen.held)
        gen.logs = [log]
        self._logs[label] = log

    def check_invariants(self) -> None:
        gens, newest = self.gens, self._newest
        assert gens and self.held == sum(g.held for g in gens)
        assert len(gens[-1].logs) == 1 and gens[-1].logs[0] is newest
        assert len(self._logs) <= min(self.labels, self.held + 1)
        queued = {id(log) for log in self._queue}
        assert len(queued) == len(self._queue), "a log queued twice"
        if self._compaction is not None:
            assert self._queue[0] is self._compaction.log
        front = True  # the first log holding blocks: eviction reads it, nothing rewrites it
        owned = 0
        for gen in gens:
            assert gen.held == sum(log.held for log in gen.logs)
            for log in gen.logs:
                if self._logs.get(log.label) is not log:  # dead: label freed, log emptied
                    assert not log.held and not log.order and not log.queued
                    continue
                owned += 1
                assert log.gen is gen and log.queued == (id(log) in queued)
                live = list(self._live(log))
                assert log.held == len(set(live)), "a holding missing from its log"
                assert log.repeats or len(live) == log.held, "a key twice in a log"
                if log is newest:
                    assert not log.queued
                    continue
                assert log.held, "a label in use with no holding"
                if not front:
                    assert log.queued or log.entries <= 2 * log.held, "stale log not queued"
                front = False
        assert owned == len(self._logs), "a label in use whose log is in no generation"
        per_label = dict.fromkeys(self._logs, 0)
        for word in self.nodes.values():
            field_ = word >> self.shift & FIELD
            if field_:
                assert field_ & 1, "a field with a label but no held bit"
                per_label[field_ >> 1] += 1
        assert per_label == {label: log.held for label, log in self._logs.items()}
