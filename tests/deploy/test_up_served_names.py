"""``prefixgate up --served-model-name NAME ALIAS``: a client whose code names a model the
stack does not run by that name (``gpt-4o-mini``) is served, as vLLM serves its
``--served-model-name`` aliases: one model, one cache, routed as one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from openai import OpenAI

from prefixgate import up
from prefixgate.procs import free_port
from tests.conftest import wait_until
from tests.deploy.test_up import SYSTEM, Listed, read_pids, stop_up, up_command, while_running


def test_an_alias_is_served_from_the_models_cache(tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    out_path = tmp_path / "up.out"
    cmd = up_command(port, run_dir, "--replicas", "2", "--model", "sim", "--kv-cache-mb", "64")
    cmd += ["--served-model-name", "team-model", "gpt-4o-mini"]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    listed: list[Listed] = []
    try:
        wait_until(while_running((run_dir / "ready").exists, proc), 120, "run_dir/ready")
        listed = read_pids(run_dir)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == ["gpt-4o-mini", "team-model"]
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Say hello."},
        ]
        seen = []
        for model in ("gpt-4o-mini", "team-model", "gpt-4o-mini"):
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
            )
            usage = raw.parse().usage
            assert usage is not None and usage.completion_tokens == 4
            details = usage.prompt_tokens_details
            route = raw.headers["x-prefixgate-route"]
            seen.append(
                (raw.headers["x-prefixgate-replica"], details.cached_tokens if details else 0)
            )
            assert route.startswith("prefix_match") or len(seen) == 1, route
        # One cache under both names: the later turns go where the prompt is, and hit it.
        assert len({replica for replica, _ in seen}) == 1
        assert all(cached and cached > 0 for _, cached in seen[1:]), seen
    finally:
        stop_up(proc, out_path, listed)


def test_the_names_reach_the_replicas_and_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli import build_parser as gateway_parser
    from replica.cli import build_parser as replica_parser

    args = up.parse_args(["--model", "tiny-random", "--served-model-name", "mine", "gpt-4o"])
    parsed = replica_parser().parse_args(up.replica_command(args, 0, 9000, "redis://r")[4:])
    assert parsed.served_model_name == ["mine", "gpt-4o"]
    gateway = gateway_parser().parse_args(up.gateway_command(args, ["http://r:1"], "redis://r")[4:])
    # The names are not ones the gateway can look up: it tokenizes them as the model.
    assert (gateway.model, gateway.tokenizer) == (["mine"], ["tiny-random"])
    plain = up.parse_args(["--model", "tiny-random"])
    gateway = gateway_parser().parse_args(
        up.gateway_command(plain, ["http://r:1"], "redis://r")[4:]
    )
    assert (gateway.model, gateway.tokenizer) == (["tiny-random"], [])
    # As vLLM's flag: several after it; from the environment, comma-separated.
    monkeypatch.setenv("PREFIXGATE_SERVED_MODEL_NAME", "a, b")
    assert replica_parser().parse_args([]).served_model_name == ["a", "b"]
    assert replica_parser().parse_args(["--served-model-name", "c"]).served_model_name == ["c"]
