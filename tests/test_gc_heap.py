"""The servers' garbage collector once they serve (prefixgate/gc_heap.py): the start-up
heap frozen, and request bodies no longer a collection each.

Real processes (a gateway in front of a stub engine; a simulated-engine replica), the
official ``openai`` client, and each server's own ``/metrics``
(``python_gc_collections_total``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.procs import stop_process
from tests.gateway.conftest import start_gateway, start_stub
from tests.replica.conftest import start_replica

MODEL = "tiny-random"


def tools(n: int) -> list[dict[str, Any]]:
    """``n`` tool definitions as an agent sends them (about 100 containers each)."""
    properties = {
        f"field_{j}": {"type": "string", "description": f"field {j}", "enum": ["a", "b", "c"]}
        for j in range(8)
    }
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool number {i}.",
                "parameters": {"type": "object", "properties": properties, "required": ["field_0"]},
            },
        }
        for i in range(n)
    ]


def collections(url: str) -> dict[str, float]:
    """Garbage collections so far, by generation, from the gateway's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "python_gc_collections":
            return {s.labels["generation"]: s.value for s in family.samples}
    raise AssertionError("no python_gc_collections_total in /metrics")


def agent_turns(client: openai.OpenAI, model: str, n: int, **extra: Any) -> None:
    definitions = tools(30)
    for i in range(n):
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"request {i}: list my tickets"}],
            tools=definitions,  # type: ignore[arg-type]
            max_tokens=4,
            **extra,
        )
        assert answer.choices


def test_agent_turns_cost_the_serving_gateway_no_collections(tmp_path: Path) -> None:
    """200 agent turns of 30 tool definitions each (a body of about 630 dicts and lists,
    and more for its validation and render: with the collector's defaults about one
    young collection per turn): not a collection once the heap is settled."""
    stub = start_stub(tmp_path, "stub", "--model", MODEL)
    gateway = None
    try:
        gateway = start_gateway(tmp_path, "gateway", [stub.url], "--model", MODEL)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)
        agent_turns(client, MODEL, 5)  # the first turns load what the gateway loads on first use
        before = collections(gateway.url)
        agent_turns(client, MODEL, 200)
        after = collections(gateway.url)
        made = {g: after[g] - before[g] for g in after}
        assert made["0"] <= 2 and made["2"] == 0, made
        assert "start-up objects frozen" in gateway.log_text()
    finally:
        if gateway is not None:
            gateway.stop()
        stub.stop()


def test_agent_turns_cost_a_serving_sim_replica_no_collections(tmp_path: Path) -> None:
    """The same turns answered by a simulated-engine replica: its server, scheduler and
    cache bookkeeping make no collection either (a finished request used to leave a
    reference cycle: tests/replica/test_reference_cycles.py)."""
    replica = start_replica(tmp_path, "--model", "sim")
    try:
        client = replica.client()
        agent_turns(client, "sim", 5, tool_choice="none")
        before = collections(replica.url)
        agent_turns(client, "sim", 200, tool_choice="none")
        after = collections(replica.url)
        made = {g: after[g] - before[g] for g in after}
        assert made["0"] <= 2 and made["2"] == 0, made
        assert "start-up objects frozen" in replica.log_tail(100_000)
    finally:
        stop_process(replica.proc)


def test_settle_freezes_the_heap_and_raises_only_the_youngest_threshold() -> None:
    script = (
        "import gc; from prefixgate import gc_heap; gc.set_threshold(700, 11, 12); "
        "frozen = gc_heap.settle(); "
        "print(frozen == gc.get_freeze_count() > 1000, gc.get_threshold())"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split(maxsplit=1)
    assert out == ["True", "(50000, 11, 12)\n"]
