"""``prefixgate up --model sim --replicas 16``: sixteen simulated-engine replicas, the real
gateway and an embedded Redis on this machine, answering the official ``openai`` client
and reporting cached prompt tokens on a repeated prompt."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
from openai import OpenAI

from prefixgate.procs import free_port
from tests.conftest import wait_until
from tests.deploy.test_up import SYSTEM, Listed, read_pids, stop_up, up_command, while_running
from tests.support.proc_tree import alive, children

REPLICAS = 16


def test_sixteen_sim_replicas_behind_the_gateway_serve_and_cache(tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    out_path = tmp_path / "up.out"
    cmd = up_command(port, run_dir, "--replicas", str(REPLICAS), "--model", "sim")
    cmd += ["--sim-profile", "llama3.1-8b-a100", "--kv-cache-mb", "512"]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    listed: list[Listed] = []
    try:
        wait_until(while_running((run_dir / "ready").exists, proc), 120, "run_dir/ready")
        listed = read_pids(run_dir)
        assert sum(p.name.startswith("replica-") for p in listed) == REPLICAS
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Say hello."},
        ]
        answers = []
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="sim",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=6,
                extra_headers={"X-Conversation-Id": "sim-16"},
            )
            completion = raw.parse()
            usage = completion.usage
            assert usage is not None and usage.completion_tokens == 6
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            answers.append((raw.headers["x-prefixgate-replica"], cached))
        (first, _), (second, cached) = answers
        assert second == first and cached is not None and cached > 0
        assert "llama3.1-8b-a100" in (run_dir / "replica-0.log").read_text()
    finally:
        stop_up(proc, out_path, listed)


def test_up_with_gateway_workers_serves_through_both_and_stops_them(tmp_path: Path) -> None:
    """``up --gateway-workers 2``: the gateway's workers answer on its one port, and
    stopping ``up`` stops them too (they run in sessions of their own, outside the
    gateway's process group that ``up`` signals)."""
    port = free_port()
    run_dir = tmp_path / "run"
    out_path = tmp_path / "up.out"
    cmd = up_command(port, run_dir, "--replicas", "2", "--model", "sim", "--gateway-workers", "2")
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    listed: list[Listed] = []
    workers: list[int] = []
    try:
        wait_until(while_running((run_dir / "ready").exists, proc), 120, "run_dir/ready")
        listed = read_pids(run_dir)
        gateway = next(p.pid for p in listed if p.name == "gateway")
        workers = children(gateway)
        assert len(workers) == 2
        url = f"http://127.0.0.1:{port}"
        seen: set[int] = set()
        for i in range(60):  # a connection each: the kernel deals them to the workers
            with httpx.Client() as http:
                seen.add(http.get(url + "/router/stats").json()["worker"]["index"])
                client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
                reply = client.chat.completions.create(
                    model="sim", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2
                )
                assert reply.usage is not None and reply.usage.completion_tokens == 2
            if seen == {0, 1} and i >= 3:
                break
        assert seen == {0, 1}
    finally:
        stop_up(proc, out_path, listed)
    assert not [pid for pid in workers if alive(pid)], "a gateway worker outlived up"
