"""The prefix cache's vocabulary: what a lookup returns, its stats, who it tells, and
what a cached block holds. Torch-free, no behaviour beyond derived values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol

from router.protocol import Medium

# (parent key, block bytes) -> key; router.protocol.chain_key unless a test weakens it.
KeyFn = Callable[[bytes, bytes], bytes]


class CacheFull(RuntimeError):
    """``allocate(n)`` cannot be satisfied: every other block is pinned."""


class PrefixMatch(NamedTuple):
    # Pinned (ref + 1) blocks covering token positions [0, cached_tokens);
    # len(block_ids) == ceil(cached_tokens / B).
    block_ids: list[int]
    # Always <= len(token_ids) - 1: at least one prompt token is computed.
    cached_tokens: int
    # How many of cached_tokens are in host-tier blocks (ids >= the device pool's size):
    # PrefixCache.promote copies them to the device before the match is used.
    host_tokens: int = 0
    # RULE for callers: when cached_tokens % B != 0, block_ids[-1] is shared and read-only;
    # copy it to a fresh block (allocate(1), copy tensors, release([old])) before writing.


class Promotion(NamedTuple):
    """``PrefixCache.promote``'s result: the match on device blocks only, and how many
    blocks were copied in from the host tier to get there."""

    match: PrefixMatch
    blocks: int


@dataclass(slots=True)
class CacheStats:
    queries: int = 0
    hits: int = 0  # queries with cached_tokens > 0
    misses: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    evictions: int = 0
    expirations: int = 0
    total_blocks: int = 0
    free_blocks: int = 0
    used_blocks: int = 0  # total - free
    pinned_blocks: int = 0
    cached_blocks: int = 0  # blocks holding registered content, pinned or not
    evictable_blocks: int = 0
    # The host tier (all 0 without one). hit_tokens counts both tiers; host_hit_tokens
    # the part that was found on the host and promoted.
    host_total_blocks: int = 0
    host_cached_blocks: int = 0
    host_hits: int = 0  # queries whose match reached host blocks
    host_hit_tokens: int = 0
    demotions: int = 0  # device -> host block copies
    promotions: int = 0  # host -> device block copies
    host_evictions: int = 0  # host blocks dropped
    bytes_to_host: int = 0
    bytes_to_device: int = 0

    @property
    def hit_rate(self) -> float:
        """Token hit rate: cached prompt tokens / prompt tokens looked up."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def device_hit_tokens(self) -> int:
        return self.hit_tokens - self.host_hit_tokens

    @property
    def utilization(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        out["device_hit_tokens"] = self.device_hit_tokens
        out["utilization"] = self.utilization
        return out


class CacheListener(Protocol):
    """Told about full blocks entering and leaving the index (the Redis publisher)."""

    def on_stored(self, parent: bytes | None, keys: list[bytes], medium: Medium = "device") -> None:
        """Keys stored in ``medium``; with a host tier also a key that moved there
        ("host": demoted, "device": promoted back)."""

    def on_removed(self, keys: list[bytes]) -> None: ...
    def on_cleared(self) -> None: ...


@dataclass(slots=True)
class BlockContent:
    """What a cached block holds. ``data`` is ``encode_tokens`` of its tokens (4 bytes each)."""

    uid: int  # unique per registration: children verify their parent by it
    prev: bytes  # key of the block before, or the root key when depth == 0
    parent_uid: int | None  # None exactly when depth == 0
    depth: int  # block index within the prompt
    data: bytes
    key: bytes | None = None  # set while registered in the full-block index
    tail_lengths: tuple[int, ...] = ()  # exact-match entries (tokens); rarely more than one

    def follows(self, prev: bytes, parent_uid: int | None) -> bool:
        """Whether this block continues the chain ending in ``prev`` / ``parent_uid``."""
        return self.parent_uid == parent_uid and self.prev == prev


class TailHit(NamedTuple):
    block_id: int
    tokens: int
