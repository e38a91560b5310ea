"""A simulated-engine replica process (``--model sim``): real server, scheduler, cache and
publisher, no torch anywhere in the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import redis

from prefixgate.procs import free_port, stop_process, wait_http_ok
from tests.conftest import RedisServer
from tests.replica.conftest import REPO, start_replica

SYSTEM = (
    "You are a careful assistant for a test suite. Answer in one short sentence, never "
    "use lists, and keep every answer polite, plain and free of jargon."
)

# Runs the real replica CLI; at exit, writes which heavy modules the process imported.
WRAPPER = """
import atexit, json, sys

def report():
    with open(sys.argv[1], "w") as out:
        json.dump({m: m in sys.modules for m in ("torch", "transformers")}, out)

atexit.register(report)
from replica.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_sim_replica_serves_caches_publishes_and_never_imports_torch(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    port = free_port()
    report = tmp_path / "modules.json"
    args = ["--model", "sim", "--port", str(port), "--kv-cache-mb", "256"]
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
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        answers = [
            client.chat.completions.create(
                model="sim",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=12,
                stop=["\n\n\n"],
            )
            for _ in range(2)
        ]
        first, second = (a.usage for a in answers)
        assert first is not None and second is not None
        assert first.completion_tokens == 12 and answers[0].choices[0].finish_reason == "length"
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        assert second.prompt_tokens_details is not None
        assert (second.prompt_tokens_details.cached_tokens or 0) >= 16  # whole prompt blocks
        # It has no logits: log probabilities are a 400 saying so, not made up.
        with pytest.raises(openai.BadRequestError, match="computes no logits"):
            client.completions.create(model="sim", prompt="Hi", max_tokens=2, logprobs=1)
        with pytest.raises(openai.BadRequestError, match="computes no logits"):
            client.completions.create(
                model="sim",
                prompt="Hi",
                max_tokens=2,
                extra_body={"structured_outputs": {"choice": ["a", "b"]}},
            )
        stats = httpx.get(url + "/cache/stats", timeout=10).json()
        assert stats["total_blocks"] == 128  # 256 MiB in the profile's 2 MiB blocks
        assert redis.Redis.from_url(redis_server.url).keys("*"), "nothing published to Redis"
    finally:
        code = stop_process(proc)
    assert code == 0, log_path.read_text()[-3000:]
    assert json.loads(report.read_text()) == {"torch": False, "transformers": False}


def test_stored_responses_are_held_within_the_replicas_memory_bound(tmp_path: Path) -> None:
    """``--response-store-mb``: the Responses API stores by default, and each stored turn
    holds its whole conversation; past the bound the least recently used go (404), the
    newest chain stays usable."""
    replica = start_replica(
        tmp_path, "--model", "sim", "--num-blocks", "4096", "--response-store-mb", "0.2"
    )
    try:
        client = openai.OpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0)
        document = "word " * 18_000  # 90 KB: two fit in 0.2 MiB, three do not
        ids = [
            client.responses.create(model="sim", input=f"{i} {document}", max_output_tokens=4).id
            for i in range(3)
        ]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert client.responses.retrieve(ids[2]).id == ids[2]
        follow = client.responses.create(
            model="sim", input="and then?", previous_response_id=ids[2], max_output_tokens=4
        )
        assert follow.usage is not None and follow.usage.input_tokens > 18_000
    finally:
        code = stop_process(replica.proc)
    assert code == 0, replica.log_tail()
