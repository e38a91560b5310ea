"""Several names on one replica, as vLLM serves them (gateway/probes.py, ``Served``): more
than one ``--served-model-name`` (aliases of one model: one cache, one key space) and
LoRA adapters (cards with a ``parent``: a key space each, as the bridge publishes their
blocks). The gateway knew only the first name a replica listed, so a request for any
other one was a 404 although the replica served it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway import probes
from gateway.probes import Served, served_names
from tests.conftest import wait_until_async
from tests.gateway.conftest import Server, start_gateway, start_stub
from tests.gateway.loopback import Replica, running_gateway

pytestmark = pytest.mark.timeout(120)

PROMPT = "the same long shared prefix of words " * 8


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root: Path = tmp_path_factory.mktemp("names")
    stub = start_stub(root, "stub", "--model", "base", "--alias", "base-alias", "--lora", "sql")
    gw = start_gateway(root, "gateway", [stub.url])
    yield gw
    gw.stop()
    stub.stop()


def test_vllm_model_lists_are_read_as_names_and_key_spaces() -> None:
    cards: list[Any] = [
        {"id": "llama", "parent": None, "max_model_len": 8192, "permission": [{"x": 1}]},
        {"id": "gpt-4o", "parent": None},  # another --served-model-name
        {"id": "sql-lora", "parent": "llama"},  # --lora-modules sql-lora=...
        {"id": 7},
        "junk",
    ]
    served = served_names(cards)
    assert served is not None
    assert served[:2] == ("llama", {"gpt-4o": "llama", "sql-lora": "sql-lora"})
    # The cards are kept for the gateway's list, their plain fields only.
    assert served.cards["llama"] == {"id": "llama", "parent": None, "max_model_len": 8192}
    assert served_names([{"id": "only"}]) == Served("only", {}, {"only": {"id": "only"}})
    assert served_names([]) is None and served_names({"id": "x"}) is None


def test_every_served_name_is_routed_and_listed(gateway: Server) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {"base", "base-alias", "sql"}
    # Each card as the replica lists it: vLLM's max_model_len and parent included (before:
    # the gateway's own card, without either).
    assert listed["sql"].owned_by == "stub" and listed["sql"].model_extra == {
        "parent": "base",
        "max_model_len": 4096,
    }

    def route(model: str) -> str:
        r = client.completions.with_raw_response.create(model=model, prompt=PROMPT, max_tokens=2)
        return r.headers["x-prefixgate-route"]

    assert route("base").startswith("no_match")
    # An alias is the same model: the prompt is found where "base" put it (before: 404).
    assert route("base-alias").startswith("prefix_match")
    # An adapter's blocks are its own: nothing of the base model's matches.
    assert route("sql").startswith("no_match")
    assert route("sql").startswith("prefix_match")
    with pytest.raises(openai.NotFoundError):
        route("not-served")
    assert httpx.get(gateway.url + "/v1/models/sql", timeout=10).status_code == 200


def test_an_adapter_loaded_at_run_time_is_learned(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM loads LoRA adapters at run time (``/v1/load_lora_adapter``): every replica's
    list is read again every ``NAMES_REFRESH_S``."""
    monkeypatch.setattr(probes, "NAMES_REFRESH_S", 0.3)

    async def main() -> None:
        replica = await Replica().start()
        async with running_gateway([replica]) as (url, state), httpx.AsyncClient() as client:
            body = {"model": "late-lora", "prompt": PROMPT}
            assert (await client.post(url + "/v1/completions", json=body)).status_code == 404
            replica.more_models.append({"id": "late-lora", "parent": "m"})
            await wait_until_async(
                lambda: state.serving("late-lora") is not None, what="the adapter learned"
            )
            r = await client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
        replica.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_replica_registered_under_another_alias_keys_them_all_by_it() -> None:
    """A bridge registers the engine under the name it was given, which need not be the
    first that engine lists: its blocks are keyed by that name, so every alias is."""

    async def main() -> None:
        listed = [{"id": "b"}, {"id": "c"}, {"id": "lora", "parent": "a"}]
        first = await Replica(model="a", more_models=listed).start()
        other = await Replica(model="a", more_models=listed).start()
        async with running_gateway([first]) as (_url, state):
            assert state.router.replicas[first.replica_id].names == {
                "b": "a",
                "c": "a",
                "lora": "lora",
            }
            state.router.add_replica("registered", other.url, model="b")
            await probes.refresh_names(state, {})
            view = state.router.replicas["registered"]
            assert view.names == {"a": "b", "c": "b", "lora": "lora"}
            assert [view.key_model(name) for name in ("a", "b", "c", "lora")] == [
                "b",
                "b",
                "b",
                "lora",
            ]
        first.close()
        other.close()

    asyncio.run(asyncio.wait_for(main(), 30))
