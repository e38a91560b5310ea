"""Long prompts on the replica: a text far beyond the context is refused from its head
alone, and large requests are made into jobs off the event loop, so other streams go on
(replica/jobs.py). Encoding 16 MiB of text took a minute of the loop and 2.5 GB."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest

from prefixgate.procs import stop_process
from prefixgate.tokenizer import ChatTokenizer
from prefixgate.wire import OpenAIError
from replica.jobs import PROBE_CHARS_PER_TOKEN, encode_within
from tests.replica.conftest import start_replica

pytestmark = pytest.mark.timeout(180)


def test_a_text_far_beyond_the_context_is_refused_from_its_head() -> None:
    tokenizer = ChatTokenizer.for_model("tiny-random")
    seen: list[int] = []

    def encode(text: str) -> list[int]:
        seen.append(len(text))
        return tokenizer.encode(text)

    context = 1_000
    text = "several words of a document " * 5_000  # 140,000 characters, ~25k tokens
    with pytest.raises(OpenAIError) as refused:
        encode_within(encode, text, context, "prompt")
    assert refused.value.code == "context_length_exceeded" and refused.value.status == 400
    assert "more than" in refused.value.message
    assert seen == [PROBE_CHARS_PER_TOKEN * context]  # the head only
    # Dense text whose head fits is encoded whole (and judged by the caller).
    dense = "=" * (PROBE_CHARS_PER_TOKEN * context + 10)  # 63 characters a token
    assert encode_within(encode, dense, context, "prompt") == tokenizer.encode(dense)
    short = "a few words"
    assert encode_within(encode, short, context, "prompt") == tokenizer.encode(short)


def test_other_streams_go_on_while_a_huge_prompt_is_read(tmp_path: Path) -> None:
    """2 MiB of never-seen text held every stream of the replica for ~2 s: its JSON,
    template and BPE ran on the event loop (and BPE in a worker thread held the GIL)."""
    replica = start_replica(tmp_path, "--model", "sim", "--num-blocks", "4096")
    try:
        text = "lorem ipsum dolor sit amet " * 80_000  # 2.1 MB

        async def scenario() -> tuple[int, int]:
            client = openai.AsyncOpenAI(
                base_url=replica.url + "/v1", api_key="unused", max_retries=0
            )
            chunks = 0
            stream = await client.chat.completions.create(
                model="sim",
                messages=[{"role": "user", "content": "count"}],
                max_tokens=2_000,
                stream=True,
            )

            async def read() -> None:
                nonlocal chunks
                async for _ in stream:
                    chunks += 1

            reader = asyncio.create_task(read())
            while chunks < 5:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(timeout=120) as http:
                before = chunks
                started = time.perf_counter()
                answer = await http.post(
                    replica.url + "/v1/chat/completions",
                    json={"model": "sim", "messages": [{"role": "user", "content": text}]},
                )
                during = chunks - before
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "context_length_exceeded"
            took_ms = int((time.perf_counter() - started) * 1000)
            reader.cancel()
            return during, took_ms

        during, took_ms = asyncio.run(scenario())
        assert during >= 3, (during, took_ms)  # before: 0 while the loop was held
    finally:
        code = stop_process(replica.proc)
    assert code == 0, replica.log_tail()
