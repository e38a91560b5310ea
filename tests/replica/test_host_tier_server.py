"""A real replica process with ``--host-cache-mb``: a prefix pushed out of a small device
pool is served from the host tier, and /cache/stats and /metrics say so per tier."""

from __future__ import annotations

import random
from pathlib import Path

from prefixgate.procs import stop_process
from tests.replica.conftest import start_replica


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _sample(text: str, name: str, *labels: str) -> float:
    """The one Prometheus sample of ``name`` whose labels include all of ``labels``."""
    found = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(label in line for label in labels)
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_host_tier_hit_in_stats_and_metrics(tmp_path: Path) -> None:
    rep = start_replica(tmp_path, "--num-blocks", "8", "--host-cache-mb", "2")
    try:
        client = rep.client()
        prompt = _ids(1, 70)

        def complete(ids: list[int]) -> int:
            out = client.completions.create(
                model="tiny-random", prompt=ids, max_tokens=2, temperature=0
            )
            assert out.usage is not None and out.usage.prompt_tokens == len(ids)
            details = out.usage.prompt_tokens_details
            return details.cached_tokens or 0 if details is not None else 0

        assert complete(prompt) == 0
        for seed in (2, 3):  # each fills the device pool: the first prompt is demoted
            complete(_ids(seed, 90))
        before = rep.cache_stats()
        assert before["host_total_blocks"] > 0 and before["host_cached_blocks"] > 0
        assert before["demotions"] > 0 and before["bytes_to_host"] > 0
        assert complete(prompt) == 64  # its four full blocks, copied back from the host
        stats = rep.cache_stats()
        assert stats["host_hit_tokens"] - before["host_hit_tokens"] == 64
        assert stats["promotions"] - before["promotions"] == 4
        assert stats["bytes_to_device"] == stats["promotions"] * (
            stats["bytes_to_host"] // stats["demotions"]
        )
        assert stats["pinned_blocks"] == 0
        metrics = rep.get("/metrics").text
        assert _sample(metrics, "prefixgate:prefix_cache_tier_hits_total", 'tier="host"') == 64
        moved = _sample(metrics, "prefixgate:kv_tier_moved_bytes_total", 'direction="to_device"')
        assert moved == stats["bytes_to_device"]
        host_total = _sample(metrics, "prefixgate:kv_tier_blocks", 'tier="host"', 'state="total"')
        assert host_total == stats["host_total_blocks"]
    finally:
        stop_process(rep.proc)
