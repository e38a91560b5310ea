"""Health probes: an address the HTTP client cannot even parse is a failed probe."""

from __future__ import annotations

import asyncio

import httpx

from gateway.probes import probe_once


def test_an_unparsable_address_fails_its_probe_and_nothing_else() -> None:
    """httpx raises InvalidURL (no HTTPError) for ``http://[::1``: it escaped the probe,
    failed the whole round's gather, and no replica's probe result was recorded again."""

    async def scenario() -> list[bool | None]:
        async with httpx.AsyncClient() as client:
            return list(
                await asyncio.gather(
                    probe_once(client, "http://[::1", 1.0),
                    probe_once(client, "http://127.0.0.1:1", 1.0),  # nothing listens: refused
                )
            )

    assert asyncio.run(scenario()) == [False, False]
