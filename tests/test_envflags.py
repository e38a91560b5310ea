"""PREFIXGATE_<FLAG> environment defaults, on both server CLIs' real parsers."""

from __future__ import annotations

import argparse

import pytest

from prefixgate.envflags import add_env_flag, add_env_list_flag, env_var


def test_env_var_names() -> None:
    assert env_var("kv-cache-mb") == "PREFIXGATE_KV_CACHE_MB"
    assert env_var("port") == "PREFIXGATE_PORT"


def test_replica_flags_come_from_env_and_the_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from replica.cli import build_parser

    monkeypatch.setenv("PREFIXGATE_KV_CACHE_MB", "512")
    monkeypatch.setenv("PREFIXGATE_EVICTION_POLICY", "sink_lru")
    monkeypatch.setenv("PREFIXGATE_TTL_S", "2.5")
    monkeypatch.setenv("PREFIXGATE_PORT", "9000")
    monkeypatch.setenv("PREFIXGATE_REDIS_URL", "")  # empty: unset
    args = build_parser().parse_args([])
    assert (args.kv_cache_mb, args.eviction_policy, args.ttl_s, args.port) == (
        512,
        "sink_lru",
        2.5,
        9000,
    )
    assert args.redis_url is None and args.block_size == 16  # untouched defaults
    args = build_parser().parse_args(["--port", "9100", "--eviction-policy", "lru"])
    assert (args.port, args.eviction_policy, args.kv_cache_mb) == (9100, "lru", 512)


def test_gateway_flags_come_from_env_and_the_command_line_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.cli import build_parser, config_from_args

    monkeypatch.setenv("PREFIXGATE_PORT", "8123")
    monkeypatch.setenv("PREFIXGATE_POLICY", "round_robin")
    monkeypatch.setenv("PREFIXGATE_MAX_BODY_MB", "2")
    monkeypatch.setenv("PREFIXGATE_REPLICA", "http://a:8001, http://b:8001,")
    monkeypatch.setenv("PREFIXGATE_ROUTER_OPTION", "load_slack=0.25")
    config = config_from_args(build_parser().parse_args([]))
    assert (config.port, config.policy, config.max_body_bytes) == (8123, "round_robin", 2 << 20)
    assert config.replicas == ["http://a:8001", "http://b:8001"]
    assert config.router.load_slack == 0.25
    assert config.host == "127.0.0.1" and config.models == []  # untouched defaults

    flags = "--port 9 --policy least_loaded --replica http://c:1 --replica http://d:2"
    args = build_parser().parse_args(flags.split())
    config = config_from_args(args)
    # A list flag on the command line replaces the environment's list, never adds to it.
    assert (config.port, config.policy) == (9, "least_loaded")
    assert config.replicas == ["http://c:1", "http://d:2"]
    assert config.router.load_slack == 0.25  # not given on the command line: from env


@pytest.mark.parametrize(
    ("cli", "var", "value", "says"),
    [
        ("replica", "PREFIXGATE_PORT", "eighty", "PREFIXGATE_PORT='eighty' is not a valid int"),
        ("replica", "PREFIXGATE_EVICTION_POLICY", "fifo", "POLICY='fifo' is not one of lru"),
        ("gateway", "PREFIXGATE_UPSTREAM_TIMEOUT_S", "1m", "is not a valid float"),
        ("gateway", "PREFIXGATE_POLICY", "fastest", "PREFIXGATE_POLICY='fastest' is not one of"),
    ],
)
def test_a_bad_value_in_the_environment_is_a_usage_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cli: str,
    var: str,
    value: str,
    says: str,
) -> None:
    if cli == "replica":
        from replica.cli import build_parser
    else:
        from gateway.cli import build_parser
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exc:
        build_parser()
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_help_names_the_variable_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIXGATE_BATCH", raising=False)
    monkeypatch.delenv("PREFIXGATE_PEER", raising=False)
    parser = argparse.ArgumentParser(prog="x")
    add_env_flag(parser, "batch", type=int, default=4, help="requests per batch")
    add_env_list_flag(parser, "peer", metavar="URL", help="a peer")
    text = parser.format_help()
    assert "requests per batch (env PREFIXGATE_BATCH; default 4)" in text
    assert "a peer (repeatable; env PREFIXGATE_PEER, comma-separated)" in text
    args = parser.parse_args([])
    assert (args.batch, args.peer) == (4, [])
