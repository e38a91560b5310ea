"""A simulated-engine replica process with ``--host-cache-mb``: a prefix pushed out of a
small device pool comes back from the host tier with its cached tokens reported, the
cache's stats and /metrics count it per tier in the profile's block bytes, the replica's
events say which tier each block moved to, and no torch is imported."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import redis

from prefixgate.procs import free_port, stop_process, wait_http_ok
from replica.sim.profiles import builtin_profiles
from router.protocol import BlockEvent, KeySpace, events_stream_key
from tests.conftest import RedisServer, wait_until
from tests.replica.conftest import REPO
from tests.replica.test_sim_replica import WRAPPER

BLOCK_BYTES = builtin_profiles()["llama3.1-8b-a100"].block_bytes(16)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_a_sim_replica_serves_a_prefix_from_its_host_tier(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    port = free_port()
    report = tmp_path / "modules.json"
    args = ["--model", "sim", "--sim-profile", "llama3.1-8b-a100", "--port", str(port)]
    args += ["--num-blocks", "8", "--host-cache-mb", "32"]  # 16 host blocks of 2 MiB
    args += ["--redis-url", redis_server.url, "--heartbeat-s", "0.2"]
    log_path = tmp_path / "replica.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, str(report), *args],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/health", timeout=60, procs=[proc])
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def complete(ids: list[int]) -> int:
            out = client.completions.create(model="sim", prompt=ids, max_tokens=2)
            assert out.usage is not None and out.usage.prompt_tokens == len(ids)
            details = out.usage.prompt_tokens_details
            return details.cached_tokens or 0 if details is not None else 0

        prompt = _ids(1, 70)
        assert complete(prompt) == 0
        for seed in (2, 3):  # each fills the 8-block device pool: the first is demoted
            complete(_ids(seed, 90))
        before = httpx.get(url + "/cache/stats", timeout=10).json()
        assert before["host_total_blocks"] == 16 and before["host_cached_blocks"] > 0
        assert before["bytes_to_host"] == before["demotions"] * BLOCK_BYTES > 0
        assert complete(prompt) == 64  # its four full blocks, back from the host
        stats = httpx.get(url + "/cache/stats", timeout=10).json()
        assert stats["host_hit_tokens"] - before["host_hit_tokens"] == 64
        assert stats["promotions"] - before["promotions"] == 4
        assert stats["bytes_to_device"] == stats["promotions"] * BLOCK_BYTES
        assert stats["pinned_blocks"] == 0
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'prefixgate:prefix_cache_tier_hits_total{tier="host"} 64.0' in metrics

        # The events: the prompt's blocks were stored on the device, moved to the host,
        # and came back to the device, in that order.
        keys = KeySpace("sim", 16).short_keys(prompt)
        assert len(keys) == 4
        r = redis.Redis.from_url(redis_server.url)
        replica_id = f"127.0.0.1:{port}"

        def media() -> list[str]:
            seen: list[str] = []
            for _, fields in r.xrange(events_stream_key(replica_id)) or []:
                event = BlockEvent.decode(fields)  # type: ignore[arg-type]
                if event.type == "stored" and keys[-1] in event.keys:
                    seen.append(event.medium)
            return seen

        wait_until(lambda: media()[-1:] == ["device"] and "host" in media(), 10, "events")
        assert media()[0] == "device" and media().index("host") > 0
    finally:
        code = stop_process(proc)
    assert code == 0, log_path.read_text()[-3000:]
    assert json.loads(report.read_text()) == {"torch": False, "transformers": False}
    assert "simulated host tier: 16 blocks (32 MiB)" in log_path.read_text()
