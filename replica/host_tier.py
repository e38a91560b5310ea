"""The second KV tier: block slots in host memory, below the device pool (torch-free).

The prefix cache numbers every block it can index in one id space::

    ids   0 .. N-1          device blocks (the pool the model reads)
          N .. N+H-1        host slots (this tier; slot = id - N in the mover's tensors)

so one content index holds both tiers under the same chained keys, the tier being a
property of the id. A key is in at most one tier: demotion and promotion *move* a
block's content from one id to the other.

* demote: the device pool evicts an idle cached block; its KV is copied into a host slot
  (a free one, else the host's least recently demoted idle block is dropped for it).
* promote: a lookup matched blocks on the host; they are copied into fresh device blocks
  before the request's prefill, and their host slots are freed.
* host eviction drops: nothing lies below this tier.

This class keeps the host slots' free list and eviction order; the cache decides when to
demote, promote or drop, and a ``BlockMover`` copies the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class BlockMover(Protocol):
    """Copies blocks' KV between the device pool and the host slots, a batch per call
    (pairs by position; no target repeats within a call)."""

    @property
    def block_bytes(self) -> int:
        """Bytes one block's KV takes (all layers, K and V): what each copy moves."""
        ...

    def demote(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        """Copy device blocks -> host slots. The device blocks may be rewritten by the
        next step, so the copies must be ordered before it (see ``replica.host_pool``)."""
        ...

    def promote(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Copy host slots -> device blocks, ordered before the next step reads them."""
        ...


class HostTier:
    """Free list and LRU order of the host slots, ids ``[first_id, first_id + num_blocks)``."""

    def __init__(self, first_id: int, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a host tier needs a positive number of blocks, got {num_blocks}")
        self.first_id = first_id
        self.num_blocks = num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(first_id, first_id + num_blocks)
        )
        # Idle cached host blocks, least recently demoted first (the host's victims).
        self.idle: OrderedDict[int, None] = OrderedDict()

    def holds(self, block_id: int) -> bool:
        """Whether ``block_id`` names a host slot (the tier of an id)."""
        return block_id >= self.first_id

    def slot(self, block_id: int) -> int:
        """The slot index in the host tensors."""
        return block_id - self.first_id

    @property
    def can_take(self) -> bool:
        """A demotion has somewhere to go: a free slot or an idle block to drop."""
        return bool(self.free or self.idle)

    def take_free(self) -> int | None:
        return self.free.popitem(last=False)[0] if self.free else None

    def pop_victim(self) -> int:
        """The idle host block to drop for a new demotion (the caller drops its content)."""
        return self.idle.popitem(last=False)[0]

    def push(self, block_id: int) -> None:
        """A host block now holds content nobody is promoting: most recently used."""
        self.idle[block_id] = None

    def hold(self, block_id: int) -> None:
        """Being promoted: out of the eviction order until it is freed."""
        del self.idle[block_id]

    def give_back(self, block_id: int) -> None:
        """Its content moved away or was dropped: the slot is free again."""
        self.idle.pop(block_id, None)
        self.free[block_id] = None

    def check_invariants(self, idle: set[int], held: set[int]) -> None:
        """``idle``: host ids holding content nobody holds; ``held``: host ids pinned by a
        match not yet promoted or released. Free, idle and held partition the slots."""
        ids = set(range(self.first_id, self.first_id + self.num_blocks))
        free = set(self.free)
        assert set(self.idle) == idle, "host eviction order != idle host blocks with content"
        assert not free & idle and not free & held and not idle & held, "host states overlap"
        assert free | idle | held == ids, "a host block is neither free, idle nor held"
