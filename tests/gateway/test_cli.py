"""``prefixgate gateway``'s flags reach the configuration (gateway/cli.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.cli import build_parser, config_from_args
from router.config import RouterConfig


def test_router_options_reach_the_router_config_with_clear_errors() -> None:
    args = build_parser().parse_args(
        ["--router-option", "load_slack=0.25", "--router-option", "queue-cap=6"]
    )
    config = config_from_args(args).router
    assert (config.load_slack, config.queue_cap) == (0.25, 6.0)
    assert config.load_abs_slack == RouterConfig().load_abs_slack  # the rest: defaults
    for bad, says in (
        ("no_such=1", "NAME one of"),
        ("load_slack", "NAME=VALUE"),
        ("load_abs_slack=1.5", "is not a valid int"),
        ("load_slack=-1", "non-negative"),
        ("load_slack=off", "is not a valid float"),
        ("recompute_weight=nan", "is not a valid float"),
        ("queue_cap=inf", "is not a valid float"),
    ):
        with pytest.raises(ValueError, match=says):
            config_from_args(build_parser().parse_args(["--router-option", bad]))


def test_connection_limits_reach_the_config_and_bad_ones_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = config_from_args(build_parser().parse_args([]))
    assert (config.max_connections_per_replica, config.pool_timeout_s) == (1024, 5.0)
    monkeypatch.setenv("PREFIXGATE_POOL_TIMEOUT_S", "0.5")
    args = build_parser().parse_args(["--max-connections-per-replica", "8"])
    config = config_from_args(args)
    assert (config.max_connections_per_replica, config.pool_timeout_s) == (8, 0.5)
    for flag, value in (("--max-connections-per-replica", "0"), ("--pool-timeout-s", "0")):
        with pytest.raises(ValueError, match=flag.removeprefix("--").replace("-", "_")):
            config_from_args(build_parser().parse_args([flag, value]))


def test_the_key_memo_size_reaches_the_config_and_bad_ones_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert config_from_args(build_parser().parse_args([])).key_memo_bytes == 64 << 20
    monkeypatch.setenv("PREFIXGATE_KEY_MEMO_MB", "0.5")
    assert config_from_args(build_parser().parse_args([])).key_memo_bytes == 1 << 19
    assert config_from_args(build_parser().parse_args(["--key-memo-mb", "0"])).key_memo_bytes == 0
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(ValueError, match="--key-memo-mb"):
            config_from_args(build_parser().parse_args(["--key-memo-mb", bad]))


def test_a_replica_url_the_http_client_cannot_use_is_refused_at_start() -> None:
    """Accepted, it failed every request and probe sent there with a ValueError."""
    ok = config_from_args(build_parser().parse_args(["--replica", "http://127.0.0.1:8001/"]))
    assert ok.replicas == ["http://127.0.0.1:8001"]
    for bad in ("http://[::1", "127.0.0.1:8001", "http://host:99999"):
        with pytest.raises(ValueError, match="replica URL"):
            config_from_args(build_parser().parse_args(["--replica", bad]))


def test_per_model_flags_take_one_for_every_model_and_one_per_model(tmp_path: Any) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    templates = ["--chat-template", str(template), "--chat-template", f"qwen={template}"]
    tokenizers = ["--tokenizer", "acme/base", "--tokenizer", "chat=/srv/llama"]
    args = build_parser().parse_args([*templates, *tokenizers])
    config = config_from_args(args)
    assert (config.chat_template, config.model_chat_templates) == (template, {"qwen": template})
    assert (config.tokenizer, config.model_tokenizers) == ("acme/base", {"chat": "/srv/llama"})
    for flags, says in (
        (["--chat-template", str(tmp_path / "absent")], "no such file"),
        (["--chat-template", f"m={tmp_path / 'absent'}"], "no such file"),
        (["--chat-template", str(template), "--chat-template", str(template)], "twice"),
        (["--tokenizer", "a", "--tokenizer", "b"], "twice"),
        (["--tokenizer", "=b"], "MODEL=SRC"),
        (["--tokenizer", "m="], "MODEL=SRC"),
    ):
        with pytest.raises(ValueError, match=says):
            config_from_args(build_parser().parse_args(flags))
