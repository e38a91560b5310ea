"""check-tokenizer against a real HTTP /tokenize, fed by the same or a different tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bridge import tokenizer_check
from bridge.engine_load import parse_load
from prefixgate.tokenizer import ChatTokenizer
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


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_bridge_checks_parity_at_start_and_logs_a_mismatch_loudly(
    anyio_backend: str,
    engine: FakeEngineHTTP,
    tokenizer: ChatTokenizer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from bridge.service import Bridge, BridgeConfig
    from prefixgate.procs import free_port
    from tests.conftest import wait_until_async

    engine.tokenize = lambda messages: [1, *tokenizer.encode_chat(messages)]
    config = BridgeConfig(
        engine.url,
        f"tcp://127.0.0.1:{free_port()}",
        "redis://127.0.0.1:1/0",  # unreachable: the check does not depend on Redis
        model="served-name",
        tokenizer="tiny-random",
        heartbeat_s=0.1,
    )
    bridge = Bridge(config)
    await bridge.start()
    try:
        await wait_until_async(lambda: bridge.stats.tokenizer_ok is not None, 30, "the check")
        assert bridge.stats.tokenizer_ok is False
        assert "TOKENIZER MISMATCH" in caplog.text and "FAIL  system prompt" in caplog.text
    finally:
        await bridge.stop()
