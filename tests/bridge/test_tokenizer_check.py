"""check-tokenizer against a real HTTP /tokenize, fed by the same or a different tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge import tokenizer_check
from bridge.engine_load import parse_load
from prefixgate.tokenizer import ChatTokenizer
from router.protocol import ReplicaLoad
from tests.bridge.fake_engine import VLLM_METRICS, FakeEngineHTTP


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.for_model("tiny-random")


@pytest.fixture
def engine(tokenizer: ChatTokenizer) -> Iterator[FakeEngineHTTP]:
    server = FakeEngineHTTP(model="served-name", tokenize=tokenizer.encode_chat)
    server.start()
    yield server
    server.stop()


async def parity_checked(config: Any) -> bool | None:
    """What a bridge started with ``config`` found in its start-up parity check."""
    from bridge.service import Bridge
    from tests.conftest import wait_until_async

    bridge = Bridge(config)
    await bridge.start()
    try:
        await wait_until_async(lambda: bridge.stats.tokenizer_ok is not None, 30, "the check")
        return bridge.stats.tokenizer_ok
    finally:
        await bridge.stop()


def test_same_tokenizer_passes_every_case(
    engine: FakeEngineHTTP, capsys: pytest.CaptureFixture[str]
) -> None:
    code = tokenizer_check.main(["--engine-url", engine.url, "--model", "tiny-random"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("PASS") == len(tokenizer_check.CASES) and "FAIL" not in out
    assert "/v1/models" in engine.requests  # the served name was asked for


def test_a_different_template_fails_the_cases_it_changes(
    engine: FakeEngineHTTP, tokenizer: ChatTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    def engine_with_extra_bos(messages: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.encode_chat(messages)
        return ids if len(messages) == 1 else [0, *ids]  # multi-message chats differ

    engine.tokenize = engine_with_extra_bos
    code = tokenizer_check.main(["--engine-url", engine.url, "--model", "tiny-random"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL  system prompt" in out and "PASS  single user turn" in out
    assert "first difference at token 0" in out


def test_an_engine_without_tokenize_fails_clearly(
    engine: FakeEngineHTTP, capsys: pytest.CaptureFixture[str]
) -> None:
    engine.tokenize = None  # 404
    assert tokenizer_check.main(["--engine-url", engine.url, "--model", "tiny-random"]) == 1
    assert "engine:" in capsys.readouterr().out


def test_load_from_vllm_and_sglang_metrics() -> None:
    vllm = parse_load(VLLM_METRICS, 16)
    assert (vllm.running, vllm.waiting) == (3, 2)
    assert vllm.total_blocks == 40 * 128 // 16 and vllm.used_blocks == vllm.total_blocks // 2
    sglang = parse_load(
        "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 4\n"
        "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 1\n"
        "# TYPE sglang:token_usage gauge\nsglang:token_usage 0.25\n"
        "# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens 1600\n",
        16,
    )
    assert (sglang.running, sglang.waiting, sglang.total_blocks, sglang.used_blocks) == (
        4,
        1,
        100,
        25,
    )
    assert parse_load("", 16).total_blocks == 0
    # An engine's odd values cost the load figures, never the heartbeat loop.
    odd = parse_load(
        "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs +Inf\n"
        "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs -3\n"
        "# TYPE sglang:token_usage gauge\nsglang:token_usage NaN\n"
        "# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens +Inf\n",
        16,
    )
    assert odd == ReplicaLoad()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_bridge_checks_parity_at_start_and_logs_a_mismatch_loudly(
    anyio_backend: str,
    engine: FakeEngineHTTP,
    tokenizer: ChatTokenizer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from bridge.service import BridgeConfig
    from prefixgate.procs import free_port

    engine.tokenize = lambda messages: [1, *tokenizer.encode_chat(messages)]
    config = BridgeConfig(
        engine.url,
        f"tcp://127.0.0.1:{free_port()}",
        "redis://127.0.0.1:1/0",  # unreachable: the check does not depend on Redis
        model="served-name",
        tokenizer="tiny-random",
        heartbeat_s=0.1,
    )
    assert await parity_checked(config) is False
    assert "TOKENIZER MISMATCH" in caplog.text and "FAIL  system prompt" in caplog.text


TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


def test_a_chat_template_file_is_applied_to_the_gateways_side(
    engine: FakeEngineHTTP, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine started with --chat-template FILE: the check passes only when given the
    same file, as the gateway would be."""
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    templated = ChatTokenizer.for_model("tiny-random")
    templated.set_chat_template(TEMPLATE)
    engine.tokenize = templated.encode_chat
    args = ["--engine-url", engine.url, "--model", "tiny-random"]
    assert tokenizer_check.main(args) == 1  # the model's own template differs
    assert "FAIL  single user turn" in capsys.readouterr().out
    assert tokenizer_check.main([*args, "--chat-template", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == len(tokenizer_check.CASES), out


def test_a_missing_or_broken_template_file_is_a_clear_error(
    engine: FakeEngineHTTP, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--engine-url", engine.url, "--model", "tiny-random", "--chat-template"]
    assert tokenizer_check.main([*args, str(tmp_path / "nope.jinja")]) == 2
    assert "nope.jinja" in capsys.readouterr().err
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    assert tokenizer_check.main([*args, str(broken)]) == 2
    assert "chat template" in capsys.readouterr().err and not engine.requests


def test_the_bridge_takes_the_template_and_media_flags(tmp_path: Path) -> None:
    from bridge.cli import parse_args

    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    base = ["--engine-url", "http://e:8000", "--kv-events", "tcp://e:5557"]
    config = parse_args([*base, "--chat-template", str(path), "--medium", "hbm=device"])
    assert config.chat_template == TEMPLATE and config.media == {"HBM": "device"}
    for bad in (["--medium", "HBM"], ["--chat-template", str(tmp_path / "nope")]):
        with pytest.raises(SystemExit) as stop:
            parse_args([*base, *bad])
        assert stop.value.code == 2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_bridges_start_up_check_uses_its_chat_template(
    anyio_backend: str, engine: FakeEngineHTTP
) -> None:
    from bridge.service import BridgeConfig
    from prefixgate.procs import free_port

    templated = ChatTokenizer.for_model("tiny-random")
    templated.set_chat_template(TEMPLATE)
    engine.tokenize = templated.encode_chat
    config = BridgeConfig(
        engine.url,
        f"tcp://127.0.0.1:{free_port()}",
        "redis://127.0.0.1:1/0",
        model="served-name",
        tokenizer="tiny-random",
        chat_template=TEMPLATE,
        heartbeat_s=0.1,
    )
    assert await parity_checked(config) is True


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_bridges_check_finds_the_tokenizer_by_the_engines_root(
    anyio_backend: str, tokenizer: ChatTokenizer
) -> None:
    """An engine serving ``--served-model-name chat`` lists what it was started from as
    its card's root: the check tries it after the served name, as the gateway does (it
    was not checked at all: no tokenizer named ``chat``)."""
    from bridge.service import BridgeConfig
    from prefixgate.procs import free_port

    engine = FakeEngineHTTP(model="chat", tokenize=tokenizer.encode_chat, root="tiny-random")
    engine.start()
    config = BridgeConfig(
        engine.url, f"tcp://127.0.0.1:{free_port()}", "redis://127.0.0.1:1/0", heartbeat_s=0.1
    )
    try:
        assert await parity_checked(config) is True
    finally:
        engine.stop()


def test_check_tokenizer_without_model_tries_the_engines_name_then_its_root(
    tokenizer: ChatTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = FakeEngineHTTP(model="chat", tokenize=tokenizer.encode_chat, root="tiny-random")
    engine.start()
    try:
        code = tokenizer_check.main(["--engine-url", engine.url])
    finally:
        engine.stop()
    out = capsys.readouterr().out
    assert code == 0, out
    assert "the gateway's tokenizer: tiny-random" in out and "FAIL" not in out
    junk = FakeEngineHTTP(model="chat")
    junk.models_body = b'{"data": ["chat"]}'
    junk.start()
    try:
        assert tokenizer_check.main(["--engine-url", junk.url]) == 2
    finally:
        junk.stop()
    assert "lists no model card" in capsys.readouterr().err


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_model_list_of_no_cards_is_waited_on_not_a_crash(anyio_backend: str) -> None:
    """``/v1/models`` answering a list of strings, or a card that is a list, raised out of
    the bridge's wait for its engine's model (a TypeError): the bridge never started."""
    import asyncio

    from bridge.service import Bridge, BridgeConfig
    from prefixgate.procs import free_port

    engine = FakeEngineHTTP(model="chat")
    engine.start()
    try:
        config = BridgeConfig(engine.url, f"tcp://127.0.0.1:{free_port()}", "redis://r:1/0")
        bridge = Bridge(config)
        for junk in (b'{"data": ["chat"]}', b'{"data": [["chat"]]}', b'{"data": 7}'):
            engine.models_body = junk
            with pytest.raises(TimeoutError):  # still waiting, as for an engine not up
                await asyncio.wait_for(bridge._wait_for_model(), 1.0)
        engine.models_body = None
        assert await asyncio.wait_for(bridge._wait_for_model(), 10) == "chat"
        await bridge.stop()
    finally:
        engine.stop()


def test_load_first_takes_the_first_source_that_loads() -> None:
    tokenizer, source = tokenizer_check.load_first(["chat", "tiny-random", "smollm2-135m"])
    assert source == "tiny-random" and tokenizer.encode("hi")
    with pytest.raises(Exception, match="nowhere"):
        tokenizer_check.load_first(["chat", "/nowhere"])


def test_up_gives_its_bridges_the_engines_chat_template(tmp_path: Path) -> None:
    from bridge.cli import parse_args
    from prefixgate import up
    from prefixgate.engines import EnginePorts, bridge_command

    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    args = up.parse_args(
        ["--engine", "vllm", "--model", "tiny-random", "--chat-template", str(path)]
    )
    cmd = bridge_command(args, EnginePorts(8101, 5557, 5558), "127.0.0.1", "redis://r:6379/0")
    assert parse_args(cmd[4:]).chat_template == TEMPLATE
