"""How an engine is sized and behaves: pool size, batch limits, eviction, checks.

Its own module so that the engine and its backends (``replica.torch_backend`` sizes the
pool from it) depend on it and not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    num_blocks: int | None = None  # wins over kv_cache_mb
    kv_cache_mb: int | None = None  # the backend's default budget when both are None
    host_cache_mb: int = 0  # the host tier (replica.host_pool); 0 = none
    block_size: int = 16
    max_prefill_tokens_per_step: int = 512
    max_running: int = 64
    max_waiting: int = 256
    eviction_policy: str | None = None
    ttl_s: float | None = None
    heartbeat_timeout_s: float = 60.0  # ``alive`` turns False if a step takes longer
    check_invariants: bool = False  # assert scheduler + cache invariants after every step
