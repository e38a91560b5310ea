"""Where the gateway finds a model's tokenizer (gateway/routing.py ``KeyBuilder``).

vLLM and SGLang users name models by their Hugging Face Hub id (``--model
Qwen/Qwen2.5-7B-Instruct``, served under that name by default) or serve them under
another name (``--served-model-name chat``). The gateway looked a model's tokenizer up by
its served name, as a builtin name or a local folder only: for either kind of engine it
found none, keyed every prompt by its bytes, and so never matched the blocks the engines
published (routing fell back to its own guesses, forgotten after 30 s). Now it fetches a
Hub model's tokenizer files, and tries the ``root`` the replicas list on their model cards
(what they were started from) after the served name.

The Hub cannot be reached from the tests: they fill a Hugging Face cache in the Hub's own
layout, and the real ``huggingface_hub`` reads it offline.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.routing import KeyBuilder
from prefixgate.models import (
    ModelNotFoundError,
    ensure_tokenizer_dir,
    hub_tokenizer_dir,
    is_hub_id,
)
from prefixgate.procs import free_port
from prefixgate.wire import CompletionRequest
from tests.conftest import RedisServer, wait_until
from tests.gateway.conftest import Server, start, start_gateway

pytestmark = pytest.mark.timeout(240)

REVISION = "0123456789abcdef0123456789abcdef01234567"


def fill_hub_cache(cache: Path, repo_id: str, source: Path, files: list[str]) -> None:
    """``repo_id`` in a Hugging Face cache (``HF_HUB_CACHE``), its snapshot holding
    ``files`` of the folder ``source``, as ``huggingface_hub`` lays a download out."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for name in files:
        shutil.copy(source / name, snapshot / name)


def tiny_random_dir() -> Path:
    from replica.models import ensure_model_dir  # torch: only for the cluster's cache

    return ensure_model_dir("tiny-random")


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's Hugging Face cache, offline, holding ``acme/tiny``'s tokenizer."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    source = ensure_tokenizer_dir("tiny-random")
    fill_hub_cache(cache, "acme/tiny", source, ["tokenizer.json", "tokenizer_config.json"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_ids_are_org_slash_name() -> None:
    for name in ("Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B", "a/b.c_d-e"):
        assert is_hub_id(name)
    # Served aliases, builtin names, paths: never looked up on the Hub.
    for name in ("chat", "gpt-4o-mini", "tiny-random", "/srv/models/x", "./x/y", "a/b/c"):
        assert not is_hub_id(name)
    assert not is_hub_id("../etc") and not is_hub_id("a/..")


def test_a_hub_models_tokenizer_comes_from_the_hugging_face_cache(offline_hub: Path) -> None:
    from prefixgate.tokenizer import ChatTokenizer

    path = ensure_tokenizer_dir("acme/tiny")
    assert path.is_relative_to(offline_hub) and (path / "tokenizer.json").is_file()
    ours = ChatTokenizer.for_model("acme/tiny")
    assert ours.encode("Hello there") == ChatTokenizer.for_model("tiny-random").encode(
        "Hello there"
    )
    with pytest.raises(ModelNotFoundError, match="acme/absent"):
        ensure_tokenizer_dir("acme/absent")  # offline and not cached: said, not a crash


def test_a_tokenizer_without_a_chat_template_keys_chats_by_bytes(
    offline_hub: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A base model's tokenizer, or a vision model's whose template is its processor's,
    has no chat template; its engines render chats with their own (vLLM's
    --chat-template). The gateway answered every chat for such a model 400 "has no chat
    template", a chat the engine would have served."""
    from prefixgate.wire import ChatCompletionRequest

    builder = KeyBuilder()  # the gateway's own loader, over the Hub cache: no template
    chat = ChatCompletionRequest.model_validate(
        {"model": "acme/tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    keyed = asyncio.run(builder.keys(chat, "acme/tiny", 16, ""))
    assert not keyed.tokenized and keyed.prompt_tokens > 0
    assert "has no chat template" in caplog.text and "--chat-template acme/tiny=FILE" in caplog.text
    completion = CompletionRequest(model="acme/tiny", prompt="plain text " * 20)
    assert asyncio.run(builder.keys(completion, "acme/tiny", 16, "")).tokenized


@pytest.fixture
def silent_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A Hub endpoint that takes connections and never answers (a proxy or firewall that
    holds them), and an empty Hugging Face cache."""
    from huggingface_hub import constants

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield url
    listener.close()  # the fetch given up on then ends, its connection refused or reset


def test_a_hub_that_never_answers_is_given_up_on(silent_hub: str) -> None:
    """huggingface_hub sets no timeout: the fetch waited for ever, and a gateway started
    for such a model never became ready."""
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="no answer from the Hub within 1 s"):
        hub_tokenizer_dir("acme/held", 1.0)
    assert time.monotonic() - started < 5


def test_a_request_waits_for_a_slow_first_load_only_so_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway import routing

    monkeypatch.setattr(routing, "REQUEST_LOAD_WAIT_S", 0.2)
    release = threading.Event()
    loads = Loads("slow")

    def slow(source: str, chat_template: str | None, mode: str) -> Any:
        release.wait(30)
        return loads(source, chat_template, mode)

    builder = KeyBuilder(loader=slow)
    request = CompletionRequest(model="slow", prompt="a prompt of some words " * 8)

    async def run() -> None:
        started = time.monotonic()
        first = await builder.keys(request, "slow", 16, "")
        assert not first.tokenized and time.monotonic() - started < 5  # not held
        release.set()
        task = builder.load_soon("slow")
        assert task is not None  # the load it started, still under way
        await task
        assert (await builder.keys(request, "slow", 16, "")).tokenized
        assert loads.calls == ["slow"]  # one load for both requests

    asyncio.run(run())


class Loads:
    """A loader that loads the sources in ``good`` and records every attempt."""

    def __init__(self, *good: str) -> None:
        self.good = set(good)
        self.calls: list[str] = []

    def __call__(self, source: str, chat_template: str | None, mode: str = "auto") -> Any:
        self.calls.append(source)
        if source not in self.good:
            raise FileNotFoundError(source)
        from prefixgate.segments import SegmentCache
        from prefixgate.tokenizer import ChatTokenizer

        return SegmentCache(ChatTokenizer.for_model("tiny-random"))


def test_the_served_name_then_the_replicas_roots_are_tried() -> None:
    loads = Loads("/srv/llama")
    builder = KeyBuilder(loader=loads)
    roots: dict[str, list[str]] = {"chat": ["/srv/llama"]}
    builder.roots = lambda model: roots.get(model, [])
    assert builder.tokenizer_for("chat") is not None
    assert loads.calls == ["chat", "/srv/llama"]
    assert builder.tokenizer_for("chat") is not None and len(loads.calls) == 2  # kept


def test_a_root_named_later_is_tried_in_the_background() -> None:
    """A replica's card may be read after the model was first keyed: the next request
    starts a load of the new source and is keyed by bytes meanwhile, never waiting."""
    loads = Loads("acme/tiny")
    builder = KeyBuilder(loader=loads)
    roots: list[str] = []
    builder.roots = lambda model: roots
    request = CompletionRequest(model="chat", prompt="a prompt of some words " * 8)

    async def run() -> None:
        first = await builder.keys(request, "chat", 16, "")
        assert not first.tokenized and loads.calls == ["chat"]
        again = await builder.keys(request, "chat", 16, "")
        assert not again.tokenized and loads.calls == ["chat"]  # nothing new: not retried
        roots.append("acme/tiny")  # the replica's card, read since
        meanwhile = await builder.keys(request, "chat", 16, "")
        assert not meanwhile.tokenized
        task = builder.load_soon("chat")
        assert task is not None  # the load the request started
        await task
        assert loads.calls == ["chat", "acme/tiny"]
        assert (await builder.keys(request, "chat", 16, "")).tokenized

    asyncio.run(run())


def test_a_tokenizer_flag_wins_per_model_or_for_every_model() -> None:
    loads = Loads("/srv/qwen", "/srv/all")
    builder = KeyBuilder(loader=loads, tokenizers={"qwen": "/srv/qwen"})
    builder.roots = lambda model: ["/elsewhere"]
    assert builder.tokenizer_for("qwen") is not None and loads.calls == ["/srv/qwen"]
    every = KeyBuilder("/srv/all", loader=loads, tokenizers={"qwen": "/srv/qwen"})
    every.roots = lambda model: ["/elsewhere"]
    assert every.tokenizer_for("llama") is not None and loads.calls[-1] == "/srv/all"
    assert every.sources("qwen") == ["/srv/qwen"]


def test_the_tokenizer_flag_parses_per_model_values() -> None:
    from gateway.cli import tokenizer_flags

    assert tokenizer_flags([]) == (None, {})
    parsed = tokenizer_flags(["acme/tiny", "chat=/srv/llama"])
    assert parsed == ("acme/tiny", {"chat": "/srv/llama"})
    for bad in (["a", "b"], ["=x"], ["m="]):
        with pytest.raises(ValueError):
            tokenizer_flags(bad)


# --------------------------------------------------------------------------- a cluster


@pytest.fixture
def hub_cluster(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[Server, list[Server]]]:
    """Two built-in replicas started as a vLLM user starts engines: ``--model acme/tiny``
    (a Hub id, fetched from the Hugging Face cache) served as ``chat``; a gateway without
    ``--tokenizer``; the Hub offline, its cache holding the model."""
    cache = tmp_path / "hub"
    model = tiny_random_dir()
    files = sorted(p.name for p in model.iterdir() if p.is_file())
    fill_hub_cache(cache, "acme/tiny", model, files)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    replicas = []
    gateway = None
    try:
        for i in range(2):
            port = free_port()
            args = ["-m", "prefixgate", "replica", "--model", "acme/tiny", "--port", str(port)]
            args += ["--served-model-name", "chat", "--redis-url", redis_server.url]
            replicas.append(start(args, port, tmp_path, f"replica-{i}", env=env))
        flags = ["--redis-url", redis_server.url]
        gateway = start_gateway(tmp_path, "gateway", [], *flags, ready=False, env=env)
        wait_until(
            lambda: httpx.get(gateway.url + "/ready?min_replicas=2").status_code == 200,
            timeout_s=60,
            what="both replicas ready",
        )
        yield gateway, replicas
    finally:
        for server in [gateway, *replicas]:
            if server is not None:
                server.stop()


def test_a_served_name_is_keyed_by_the_tokenizer_its_root_names(
    hub_cluster: tuple[Server, list[Server]],
) -> None:
    """A prompt a replica cached (sent to it directly, so the gateway routed nothing) is
    routed to that replica by the blocks it published: the gateway's keys are the
    replica's. Before, ``chat`` had no tokenizer the gateway could find: the prompt was
    keyed by bytes and matched nothing."""
    gateway, replicas = hub_cluster
    cards = httpx.get(replicas[0].url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"]) for c in cards] == [("chat", "acme/tiny")]
    prompt = "A long shared document about prefix caches and routing. " * 48
    holder = replicas[1]
    direct = openai.OpenAI(base_url=holder.url + "/v1", api_key="unused", max_retries=0)
    direct.completions.create(model="chat", prompt=prompt, max_tokens=1)

    def published() -> bool:
        stats = httpx.get(gateway.url + "/router/stats").json()["replicas"]
        return any(v["blocks"] > 0 for v in stats.values())

    wait_until(published, timeout_s=20, what="the holder's blocks in the gateway's index")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    started = time.monotonic()
    raw = client.completions.with_raw_response.create(
        model="chat", prompt=prompt + "Question?", max_tokens=1
    )
    assert time.monotonic() - started < 30
    route = raw.headers["x-prefixgate-route"]
    matched = int(route.rsplit("matched=", 1)[1].split("/")[0])
    assert matched >= 30, route  # of 33 blocks
    stats = httpx.get(gateway.url + "/router/stats").json()["replicas"]
    holders = [rid for rid, v in stats.items() if v["blocks"] > 0]
    assert raw.headers["x-prefixgate-replica"] in holders, (route, holders)
    usage = raw.parse().usage
    details = usage.prompt_tokens_details if usage is not None else None
    assert details is not None and (details.cached_tokens or 0) >= 320
    assert "routing on prompt bytes" not in gateway.log_text()


def test_a_gateway_starts_and_serves_while_the_hub_never_answers(tmp_path: Path) -> None:
    """A replica serving a model named by its Hub id, a gateway whose Hub takes connections
    and never answers: the gateway is ready once the fetch is given up on, and serves,
    keying by bytes. It never became ready before (the fetch had no timeout)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    cache = tmp_path / "replica-hub"
    model = tiny_random_dir()
    fill_hub_cache(cache, "acme/tiny", model, sorted(p.name for p in model.iterdir()))
    replica_env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{listener.getsockname()[1]}", "HF_HUB_OFFLINE": "0"}
    env |= {"HF_HUB_CACHE": str(tmp_path / "gateway-hub"), "PREFIXGATE_HUB_TIMEOUT_S": "2"}
    port = free_port()
    args = ["-m", "prefixgate", "replica", "--model", "acme/tiny", "--port", str(port)]
    replica = start(args, port, tmp_path, "replica", env=replica_env)
    gateway = None
    try:
        started = time.monotonic()
        gateway = start_gateway(tmp_path, "gateway", [replica.url], env=env)
        assert time.monotonic() - started < 30
        body = {"model": "acme/tiny", "prompt": "hello", "max_tokens": 2}
        answer = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert "no answer from the Hub within 2 s" in gateway.log_text()
    finally:
        if gateway is not None:
            gateway.stop()
        replica.stop()
        listener.close()


def test_a_pinned_revision_is_the_tokenizer_of_that_revision(offline_hub: Path) -> None:
    """An engine started with vLLM's ``--revision REV`` renders with that revision's
    template; ``ID@REV`` names it wherever a tokenizer source goes (the gateway's and the
    bridge's ``--tokenizer``, ``up --model``), and the default branch is not it."""
    from prefixgate.models import hub_revision, served_names
    from prefixgate.tokenizer import ChatTokenizer

    pinned = "fedcba9876543210fedcba9876543210fedcba98"
    old = offline_hub / "models--acme--tiny" / "snapshots" / pinned
    old.mkdir()
    source = ensure_tokenizer_dir("tiny-random")
    shutil.copy(source / "tokenizer.json", old / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}OLD {{ m.content }}\n{% endfor %}"
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    assert is_hub_id(f"acme/tiny@{pinned}") and is_hub_id("acme/tiny@v1.0")
    assert not is_hub_id("acme/tiny@") and not is_hub_id("acme/tiny@a/b")
    assert hub_revision(f"acme/tiny@{pinned}") == ("acme/tiny", pinned)
    assert ensure_tokenizer_dir(f"acme/tiny@{pinned}") == old
    chat = [{"role": "user", "content": "hi"}]
    assert ChatTokenizer.for_model(f"acme/tiny@{pinned}").apply_chat_template(chat) == "OLD hi\n"
    assert "OLD" not in (ChatTokenizer.for_model("acme/tiny").chat_template or "")
    assert served_names(f"acme/tiny@{pinned}", None) == ["acme/tiny"]
    assert served_names(f"acme/tiny@{pinned}", ["chat"]) == ["chat"]


def test_up_pins_the_engines_revision_and_keys_by_it() -> None:
    from bridge.cli import build_parser as bridge_parser
    from gateway.cli import build_parser as gateway_parser
    from prefixgate import up
    from prefixgate.engines import EnginePorts, bridge_command, vllm_command

    args = up.parse_args(["--engine", "vllm", "--model", "acme/tiny@v1.0"])
    engine = vllm_command(args, EnginePorts(1, 2, 3))
    assert engine[engine.index("--model") + 1] == "acme/tiny"
    assert engine[engine.index("--revision") + 1] == "v1.0"
    assert engine[engine.index("--served-model-name") + 1] == "acme/tiny"
    gateway = gateway_parser().parse_args(up.gateway_command(args, [], "redis://x")[4:])
    assert (gateway.model, gateway.tokenizer) == (["acme/tiny"], ["acme/tiny@v1.0"])
    bridge = bridge_parser().parse_args(bridge_command(args, EnginePorts(1, 2, 3), "h", "r")[4:])
    assert (bridge.model, bridge.tokenizer) == ("acme/tiny", "acme/tiny@v1.0")
    plain = vllm_command(
        up.parse_args(["--engine", "vllm", "--model", "acme/tiny"]), EnginePorts(1, 2, 3)
    )
    assert "--revision" not in plain
