"""``prefixgate up --engine vllm``: the engine and bridge commands, and a whole stack with a
stand-in engine (tests/deploy/fake_vllm.py) in place of vLLM, which is not installed here."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from bridge.cli import parse_args as bridge_args
from prefixgate import up
from prefixgate.engines import EnginePorts, bridge_command, engine_env, vllm_command
from prefixgate.procs import free_port
from router.protocol import REPLICAS_SET, ReplicaInfo, replica_info_key
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_engine_and_bridge_commands_fit_each_other() -> None:
    args = up.parse_args(
        ["--engine", "vllm", "--model", "tiny-random", "--device", "cuda",
         "--engine-arg", "--max-model-len 4096", "--engine-python", "/opt/vllm/bin/python"]
    )  # fmt: skip
    ports = EnginePorts(8101, 5557, 5558)
    cmd = vllm_command(args, ports)
    assert cmd[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny-random"
    assert cmd[-2:] == ["--max-model-len", "4096"] and "--enable-prefix-caching" in cmd
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5558"
    config = bridge_args(bridge_command(args, ports, "127.0.0.1", "redis://r:6379/0")[4:])
    assert config.kv_events == "tcp://127.0.0.1:5557" and config.replay == "tcp://127.0.0.1:5558"
    assert config.engine_url == "http://127.0.0.1:8101" and config.model == "tiny-random"
    assert engine_env(args, 1, {})["CUDA_VISIBLE_DEVICES"] == "1"
    # Aliases: every name to vLLM; the bridge registers the engine under the first.
    args = up.parse_args(
        ["--engine", "vllm", "--model", "tiny-random", "--served-model-name", "mine", "gpt-4o"]
    )
    cmd = vllm_command(args, ports)
    at = cmd.index("--served-model-name")
    assert cmd[at + 1 : at + 3] == ["mine", "gpt-4o"] and cmd[at + 3].startswith("--")
    config = bridge_args(bridge_command(args, ports, "127.0.0.1", "redis://r:6379/0")[4:])
    assert (config.model, config.tokenizer) == ("mine", "tiny-random")


def test_a_hub_id_goes_to_vllm_as_given_and_keys_as_that_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM fetches a model named by its Hub id itself; ``up`` refused any model that was
    not a builtin name or a local folder."""
    args = up.parse_args(["--engine", "vllm", "--model", "Qwen/Qwen2.5-0.5B-Instruct"])
    ports = EnginePorts(8101, 5557, 5558)
    cmd = vllm_command(args, ports)
    assert cmd[cmd.index("--model") + 1] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cmd[cmd.index("--served-model-name") + 1] == "Qwen/Qwen2.5-0.5B-Instruct"
    config = bridge_args(bridge_command(args, ports, "127.0.0.1", "redis://r:6379/0")[4:])
    assert config.tokenizer == "Qwen/Qwen2.5-0.5B-Instruct"
    monkeypatch.setenv("PREFIXGATE_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(FileNotFoundError):  # a builtin model not converted yet: still said
        vllm_command(up.parse_args(["--engine", "vllm", "--model", "smollm2-135m"]), ports)


@pytest.mark.parametrize("ranks", [1, 2])
def test_up_starts_engines_bridges_and_gateway_and_stops_them(tmp_path: Path, ranks: int) -> None:
    """Two engines with a bridge each; or one engine with two data-parallel ranks, a
    bridge per rank, each rank a replica (``--data-parallel-size 2``)."""
    engine_python = tmp_path / "engine-python"
    engine_python.write_text(
        f'#!/bin/sh\nexport PYTHONPATH="{ROOT}"\nexec "{sys.executable}" '
        f'"{ROOT / "tests" / "deploy" / "fake_vllm.py"}" "$@"\n'
    )
    engine_python.chmod(0o755)
    port, run_dir = free_port(), tmp_path / "run"
    cmd = [
        sys.executable, "-m", "prefixgate", "up", "--engine", "vllm", "--model", "tiny-random",
        "--engine-python", str(engine_python), "--port", str(port), "--run-dir", str(run_dir),
        "--stop-grace-s", "10", "--replicas", str(2 // ranks),
        "--data-parallel-size", str(ranks),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read() if proc.stdout else "up exited")
            return (run_dir / "ready").is_file()

        wait_until(ready, 120, "prefixgate up --engine vllm ready")
        pids = (run_dir / "pids").read_text()
        bridges = ["bridge-0", "bridge-1"] if ranks == 1 else ["bridge-0-dp0", "bridge-0-dp1"]
        assert all(name in pids for name in bridges)
        redis_port = int(next(r.split()[2] for r in pids.splitlines() if r.startswith("redis")))
        client = redis.Redis(port=redis_port)
        try:

            def registered() -> list[ReplicaInfo]:
                ids = sorted(i.decode() for i in client.smembers(REPLICAS_SET))  # type: ignore[union-attr]
                raws = [client.get(replica_info_key(i)) for i in ids]
                return [ReplicaInfo.decode(r) for r in raws if r]  # type: ignore[arg-type]

            wait_until(lambda: len(registered()) == 2, 30, "both bridges registered")
            infos = registered()
            assert {i.model for i in infos} == {"tiny-random"}
            if ranks == 1:
                assert all(i.load.running == 3 for i in infos)  # read from the engine's /metrics
                assert {i.data_parallel_rank for i in infos} == {None}
            else:  # one engine: each rank with its own load, from its own gauges
                assert len({i.url for i in infos}) == 1
                by_rank = {i.data_parallel_rank: i.load.running for i in infos}
                assert by_rank == {0: 3, 1: 4}
                # The gateway: the two ranks, in place of the engine's URL it was given.
                stats = httpx.get(f"http://127.0.0.1:{port}/router/stats").json()
                assert sorted(stats["replicas"]) == sorted(i.replica_id for i in infos)
        finally:
            client.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "all processes stopped" in out
        assert ("2 data-parallel ranks each" in out) == (ranks == 2), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_data_parallel_engine_takes_its_ranks_gpus_and_ports() -> None:
    args = up.parse_args(
        ["--engine", "vllm", "--model", "tiny-random", "--device", "cuda",
         "--data-parallel-size", "4"]
    )  # fmt: skip
    assert engine_env(args, 1, {})["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    ports = EnginePorts(8101, 5557, 5561)
    cmd = vllm_command(args, ports)
    assert cmd[cmd.index("--data-parallel-size") + 1] == "4"
    config = bridge_args(bridge_command(args, ports, "127.0.0.1", "redis://r:6379/0", 3)[4:])
    assert config.data_parallel_rank == 3
    assert config.events_endpoint == "tcp://127.0.0.1:5560"
    assert config.replay_endpoint == "tcp://127.0.0.1:5564"
    with pytest.raises(SystemExit):  # the built-in engine has no ranks
        up.parse_args(["--data-parallel-size", "2"])
