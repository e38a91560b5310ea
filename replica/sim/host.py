"""The simulated engine's host KV tier: slots without bytes, copies that cost time.

``SimHostPool`` is the prefix cache's ``BlockMover`` (``replica.host_tier``) for a sim
replica, as ``replica.host_pool.HostPool`` is for the built-in engine: the cache keeps the
same two-tier bookkeeping (demote on device eviction, promote on a host hit, events and
stats per tier), and each copy adds its device time to what the next step sleeps:

* promote k blocks: ``profile.swap_in_s(k)``, whole (the prefill reads those blocks, so
  the copy is on the step's critical path);
* demote k blocks: ``profile.demote_s(k)`` (a fraction, 0 by default: on a GPU it runs
  on a side stream beside compute).

The cache promotes and demotes while the scheduler builds a step, before the backend runs
it; ``SimBackend.run`` then takes what accrued (``take_pending_s``) into that step's sleep.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from replica.sim.profile import MIB, SimProfile


@dataclass(slots=True)
class SimHostStats:
    promoted_blocks: int = 0
    demoted_blocks: int = 0
    swap_in_s: float = 0.0  # device time charged for copies to the device
    demote_s: float = 0.0  # device time charged for copies to the host


@dataclass(slots=True)
class SimHostPool:
    """``num_blocks`` host slots of ``profile``'s blocks; copies accrue device time."""

    profile: SimProfile
    block_size: int
    num_blocks: int
    pending_s: float = 0.0  # copy time not yet slept by a step
    stats: SimHostStats = field(default_factory=SimHostStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"a host pool needs at least one block, got {self.num_blocks}")

    @classmethod
    def from_budget(cls, profile: SimProfile, block_size: int, budget_mb: float) -> SimHostPool:
        block_bytes = profile.block_bytes(block_size)
        blocks = int(budget_mb * MIB) // block_bytes
        if blocks < 1:
            raise ValueError(
                f"a host cache of {budget_mb} MB holds no block ({block_bytes} bytes each "
                f"for {profile.name}); give --host-cache-mb more"
            )
        return cls(profile, block_size, blocks)

    @property
    def block_bytes(self) -> int:
        return self.profile.block_bytes(self.block_size)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def demote(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        self._check(device_blocks, host_slots)
        seconds = self.profile.demote_s(len(device_blocks), self.block_size)
        self.stats.demoted_blocks += len(device_blocks)
        self.stats.demote_s += seconds
        self.pending_s += seconds

    def promote(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        self._check(host_slots, device_blocks)
        seconds = self.profile.swap_in_s(len(host_slots), self.block_size)
        self.stats.promoted_blocks += len(host_slots)
        self.stats.swap_in_s += seconds
        self.pending_s += seconds

    def take_pending_s(self) -> float:
        """The copy time accrued since the last call (the step about to run sleeps it)."""
        seconds, self.pending_s = self.pending_s, 0.0
        return seconds

    def _check(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if len(src) != len(dst) or len(set(dst)) != len(dst):
            raise ValueError("copies need one distinct target per source block")
