"""Response affinity (gateway/response_affinity.py) while Redis fails: against a real
redis-server that hangs (SIGSTOP, as in a failover or a partition), and through the
gateway app with the official openai client while Redis is down."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any

import openai
import pytest

from gateway.response_affinity import AffinityUnavailable, Owner, ResponseAffinity
from prefixgate.procs import free_port
from router.replica_redis import MIN_BACKOFF_S
from tests.conftest import RedisServer
from tests.gateway.loopback import Replica, Request, answer, running_gateway
from tests.gateway.test_responses_proxy import client, response

pytestmark = pytest.mark.timeout(60)

OWNER = Owner("r0", "chain", "default")


def test_a_hung_redis_is_waited_for_once_per_backoff_and_logged_once(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Every stored response waited out the 2 s socket timeout while Redis hung, and each
    logged a warning. Now the first failure starts a backoff in which Redis is left
    alone: records stay local, a lookup only Redis could answer is AffinityUnavailable
    (a 503, not a 404), one warning per outage; a success ends it."""
    now = [0.0]
    mine = ResponseAffinity(redis_server.url, clock=lambda: now[0])
    other = ResponseAffinity(redis_server.url, clock=lambda: now[0])  # another gateway
    proc = redis_server.proc
    assert proc is not None

    async def scenario() -> None:
        await mine.record("resp_before", OWNER)
        assert await other.lookup("resp_before") == OWNER  # shared through Redis
        proc.send_signal(signal.SIGSTOP)
        try:
            await mine.record("resp_1", OWNER)  # times out: the outage starts
            assert mine.outage.down and 0.0 <= mine.down_until <= MIN_BACKOFF_S
            for i in range(2, 20):  # within the backoff: Redis is not asked
                await mine.record(f"resp_{i}", OWNER)
            assert await mine.lookup("resp_7") == OWNER  # the local table answers
            with pytest.raises(AffinityUnavailable):
                await mine.lookup("resp_of_another_gateway")
            now[0] = 1.5  # past the backoff (up to 1 s): asked again, still hung
            with pytest.raises(AffinityUnavailable):
                await mine.lookup("resp_of_another_gateway")
            assert mine.backoff.attempts == 2  # the next delay is up to 2 s
        finally:
            proc.send_signal(signal.SIGCONT)
        now[0] = 4.0  # past the second backoff too
        await mine.record("resp_after", OWNER)
        assert not mine.outage.down and mine.backoff.attempts == 0
        assert await other.lookup("resp_after") == OWNER
        assert await other.lookup("resp_5") is None  # recorded during the outage: local only
        await mine.aclose()
        await other.aclose()

    with caplog.at_level(logging.INFO, logger="prefixgate.gateway"):
        asyncio.run(asyncio.wait_for(scenario(), 30))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1
    assert sum("response affinity is shared again" in m for m in messages) == 1


def test_a_turn_only_redis_could_place_is_a_503_while_redis_is_down() -> None:
    async def owner_replica(request: Request, _: Any, w: asyncio.StreamWriter) -> None:
        w.write(answer(200, json.dumps(response("resp_local")).encode()))

    async def main() -> None:
        replica = await Replica(owner_replica).start()
        down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
        async with running_gateway([replica], redis_url=down) as (url, state):
            c = client(url)
            made = await c.responses.create(model="m", input="hello")
            assert (await c.responses.retrieve(made.id)).id == "resp_local"  # local table
            with pytest.raises(openai.InternalServerError) as caught:
                await c.responses.create(
                    model="m", input="on", previous_response_id="resp_of_another_gateway"
                )
            assert caught.value.status_code == 503
            assert caught.value.response.headers["retry-after"] == "1"
            assert caught.value.body["code"] == "response_affinity_unavailable"  # type: ignore[index]
            assert state.affinity.outage.down
        replica.close()

    asyncio.run(asyncio.wait_for(main(), 30))
