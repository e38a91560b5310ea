"""A failure inside one of the gateway's own routes reaches the client as an OpenAI 500
that names nothing inside (a route made to fail: a bug cannot be reached otherwise)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from prefixgate.guard import Guard, GuardConfig


def test_a_failing_route_is_a_500_envelope(monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(GatewayConfig(tokenizer="tiny-random"))

    def broken_stats() -> dict[str, object]:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(app.state.router, "stats", broken_stats)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=Guard(app, GuardConfig()), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/router/stats")

    r = asyncio.run(call())
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "internal_error"
    assert "secret" not in r.text and "RuntimeError" not in r.text
