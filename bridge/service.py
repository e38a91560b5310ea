"""The bridge: one engine's KV-cache events → a prefixgate replica in Redis.

Three tasks on one event loop:

* **events**: live batches from the engine's PUB socket, through the sequence follower
  (bridge/follower.py: gaps, replays, restarts, resets) and the key translator into the
  Redis writer's queue;
* **writes**: the Redis writer's queue (snapshot first when one is due), with jittered
  backoff while Redis is down;
* **heartbeat**: the engine's ``/metrics`` → load → registry record. No heartbeat while
  the engine does not answer, so its record expires and gateways stop routing to it.

At start the bridge compares the gateway's tokenizer with the engine's ``/tokenize``
(bridge/tokenizer_check.py) and logs loudly on a mismatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from bridge.engine_auth import engine_headers
from bridge.engine_load import engine_ranks, parse_load, prefix_caching_off, reports_load
from bridge.event_sources import fetch_sources, meet
from bridge.follower import EventFollower
from bridge.media import MediumMap
from bridge.redis_out import REDIS_ERRORS, RedisWriter, WriterConfig
from bridge.translate import KeyTranslator
from bridge.zmq_source import EngineEvents, rank_endpoint
from prefixgate.tls import TLSFiles, client_context, tls_failure
from router.backoff import Backoff
from router.protocol import DEFAULT_BLOCK_SIZE, Medium

log = logging.getLogger("prefixgate.bridge")


@dataclass(slots=True)
class BridgeConfig:
    engine_url: str
    kv_events: str
    redis_url: str
    engine_api_key: str | None = field(default=None, repr=False)  # the engine's --api-key
    # An HTTPS engine (bridge/engine_auth.py): the CA file its certificate is verified
    # against (None: the system's store and SSL_CERT_FILE), and a client certificate.
    engine_ca_certs: str | None = None
    engine_certfile: str | None = None
    engine_keyfile: str | None = None
    replay: str | None = None
    topic: str = ""
    model: str | None = None  # the served model name; None: the engine's first /v1/models
    replica_id: str | None = None  # None: host:port of the advertised URL
    advertise_url: str | None = None  # None: the engine URL
    block_size: int = DEFAULT_BLOCK_SIZE
    # One data-parallel rank of an engine that runs several behind one URL (vLLM's
    # --data-parallel-size): its events (on the engine's endpoints offset by the rank, as
    # the engine offsets them), its load, and a record that names the rank. None: the
    # engine as a whole.
    data_parallel_rank: int | None = None
    # Engine medium → tier overrides (--medium NAME=TIER; bridge/media.py), upper-cased.
    media: dict[str, Medium | None] = field(default_factory=dict)
    tokenizer: str | None = None  # for the parity check; None: the model name, its root
    chat_template: str | None = None  # jinja source (--chat-template), for the parity check
    # the engine's --default-chat-template-kwargs, for the parity check
    template_defaults: dict[str, Any] | None = None
    tokenizer_mode: str = "auto"  # the engine's --tokenizer-mode, for the parity check
    content_format: str = "auto"  # the engine's --chat-template-content-format, likewise
    check_tokenizer: bool = True
    heartbeat_s: float = 1.0
    info_ttl_s: float = 5.0
    snapshot_interval_s: float = 5.0
    replay_timeout_s: float = 2.0
    http_timeout_s: float = 2.0

    @property
    def url(self) -> str:
        return (self.advertise_url or self.engine_url).rstrip("/")

    def engine_tls(self) -> ssl.SSLContext:
        """The context of HTTPS calls to the engine; ValueError names a file that fails."""
        return client_context(
            self.engine_ca_certs, self.engine_certfile, self.engine_keyfile, "engine"
        )

    @property
    def resolved_replica_id(self) -> str:
        if self.replica_id:
            return self.replica_id
        engine = urlsplit(self.url).netloc or self.url
        rank = self.data_parallel_rank
        return engine if rank is None else f"{engine}-dp{rank}"

    @property
    def events_endpoint(self) -> str:
        """The endpoint this bridge's rank publishes on (``--kv-events`` as the engine was
        given it)."""
        rank = self.data_parallel_rank or 0
        return rank_endpoint(self.kv_events, rank)

    @property
    def replay_endpoint(self) -> str | None:
        rank = self.data_parallel_rank or 0
        return None if self.replay is None else rank_endpoint(self.replay, rank)


def _warn_about_metrics(engine_url: str, metrics: str) -> None:
    """What the engine's ``/metrics`` says of a configuration that defeats routing: no
    request counts (every gateway then sees there only the requests it sent itself, none
    of the others'), or no prefix cache (nothing to route to: the engine computes every
    prompt whole, and its events never come)."""
    if prefix_caching_off(metrics):
        log.warning(
            "engine %s caches no prefixes (its vllm:cache_config_info says "
            "enable_prefix_caching=False, as under --no-enable-prefix-caching): it computes "
            "every prompt whole, whatever a gateway sends it, and publishes no blocks. Start "
            "it with --enable-prefix-caching",
            engine_url,
        )
    if not reports_load(metrics):
        log.warning(
            "engine %s exports no request counts on /metrics (vllm:num_requests_running, "
            "sglang:num_running_reqs), as a vLLM started with --disable-log-stats does: its "
            "heartbeats say 0 requests and no cache size, so each gateway sees only its own "
            "requests there and none of the other gateways'. Start it without that flag",
            engine_url,
        )


def _warn_if_data_parallel(engine_url: str, metrics: str, rank: int | None) -> None:
    """Several data-parallel ranks behind one URL (vLLM's internal load balancing): each
    rank publishes its events on a port of its own (the event port + its rank), so a
    bridge for the whole engine follows one rank's cache while the engine spreads requests
    over all of them, whatever the gateway chose. A bridge per rank
    (``--data-parallel-rank``) is what such an engine needs."""
    try:
        ranks = engine_ranks(metrics)
    except ValueError:
        return
    if rank is None and len(ranks) > 1:
        log.warning(
            "engine %s runs %d data-parallel ranks behind one URL: this bridge follows one "
            "rank's cache events, and the engine picks the rank for each request. Run a "
            "bridge per rank: --data-parallel-rank R for R in 0..%d, each with the same "
            "--kv-events and --replay (the bridge offsets them by R, as the engine does)",
            engine_url,
            len(ranks),
            len(ranks) - 1,
        )
    elif rank is not None and ranks and str(rank) not in ranks:
        log.warning(
            "engine %s has no data-parallel rank %d (its ranks: %s): this bridge's replica "
            "gets no events, and requests sent to it name a rank the engine does not have",
            engine_url,
            rank,
            ", ".join(sorted(ranks, key=lambda r: (len(r), r))),
        )


def _engine_label(rank: int | None) -> str | None:
    """vLLM's ``engine`` metric label of a data-parallel rank (its index, in decimal)."""
    return None if rank is None else str(rank)


def _refused(exc: Exception) -> bool:
    """Whether the engine turned the request away for want of its API key."""
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (401, 403)


@dataclass(slots=True)
class BridgeStats:
    tokenizer_ok: bool | None = None  # None: not checked (yet)
    engine_up: bool = False


class Bridge:
    def __init__(self, config: BridgeConfig) -> None:
        self.config = config
        # Subscribed at once, so batches sent while the model name is resolved queue up.
        self.source = EngineEvents(config.events_endpoint, config.replay_endpoint, config.topic)
        self.follower: EventFollower | None = None  # set by start(), with the model name
        self.writer: RedisWriter | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        # The engine is infrastructure beside the bridge, as replicas are to the gateway:
        # reached directly, never through the environment's HTTP_PROXY.
        tls = config.engine_tls()
        files = (config.engine_certfile, config.engine_keyfile, config.engine_ca_certs)
        self._tls_files = TLSFiles(tls, *files, "engine") if any(files) else None
        self._http = httpx.AsyncClient(
            timeout=config.http_timeout_s,
            headers=engine_headers(config.engine_api_key),
            trust_env=False,
            verify=tls,
        )
        self.stats = BridgeStats()
        self.engine_root: str | None = None  # its cards' root: a source of its tokenizer
        self.event_source_notes: list[str] | None = None  # None: not checked (yet)

    # ----------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        model = self.config.model or await self._wait_for_model()
        self.config.model = model
        c = self.config
        translator = KeyTranslator(model, c.block_size, MediumMap(dict(c.media)))
        self.writer = RedisWriter(
            WriterConfig(
                c.redis_url,
                c.resolved_replica_id,
                c.url,
                model,
                c.block_size,
                c.info_ttl_s,
                data_parallel_rank=c.data_parallel_rank,
            ),
            translator.snapshot,
        )
        self.follower = EventFollower(self.source, translator, self.writer, c.replay_timeout_s)
        log.info(
            "bridging engine %s%s (model %s, events %s) as replica %s into %s",
            c.engine_url,
            "" if c.data_parallel_rank is None else f" rank {c.data_parallel_rank}",
            model,
            c.events_endpoint,
            c.resolved_replica_id,
            c.redis_url,
        )
        self._tasks = [
            asyncio.create_task(self._events_loop(), name="bridge-events"),
            asyncio.create_task(self._write_loop(), name="bridge-writes"),
            asyncio.create_task(self._heartbeat_loop(), name="bridge-heartbeat"),
        ]
        if c.check_tokenizer:
            self._tasks.append(asyncio.create_task(self._check_tokenizer(), name="bridge-tok"))
        self._tasks.append(asyncio.create_task(self._check_event_sources(), name="bridge-src"))
        if self._tls_files is not None:  # certificates rotated on disk are used at once
            self._tasks.append(asyncio.create_task(self._tls_files.watch(), name="bridge-tls"))

    async def stop(self) -> None:
        self._closing = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        self._tasks = []
        if self.writer is not None:
            await self.writer.deregister()
            await self.writer.aclose()
        await self._http.aclose()
        self.source.close()

    async def _wait_for_model(self) -> str:
        """The engine's served model name, waiting for the engine to come up (minutes)."""
        backoff = Backoff(0.5, 5.0)
        started = time.monotonic()
        next_note = started
        while True:
            try:
                reply = await self._http.get(f"{self.config.engine_url.rstrip('/')}/v1/models")
                reply.raise_for_status()
                card = reply.json()["data"][0]
                root = card.get("root")  # what vLLM and SGLang were started from
                self.engine_root = root if isinstance(root, str) and root else None
                return str(card["id"])
            # (a list that is no list of cards: waited on as an engine not up yet)
            except (
                httpx.HTTPError,
                ValueError,
                KeyError,
                IndexError,
                TypeError,
                AttributeError,
            ) as exc:
                if time.monotonic() >= next_note:
                    waited = time.monotonic() - started
                    if _refused(exc):  # waiting will not help: say which flag will
                        log.warning(
                            "engine %s refused GET /v1/models (%s): %s",
                            self.config.engine_url,
                            exc,
                            "it does not take --engine-api-key"
                            if self.config.engine_api_key is not None
                            else "start the bridge with --engine-api-key (or VLLM_API_KEY)",
                        )
                    elif why := tls_failure(exc, "engine", self.config.engine_certfile is not None):
                        log.warning("engine %s cannot be reached: %s", self.config.engine_url, why)
                    else:
                        log.info(
                            "waiting for engine %s (%.0f s): %s",
                            self.config.engine_url,
                            waited,
                            exc,
                        )
                    next_note += 30.0
                await backoff.wait()

    @property
    def translator(self) -> KeyTranslator | None:
        return self.follower.translator if self.follower is not None else None

    # ----------------------------------------------------------------------- events

    async def _events_loop(self) -> None:
        assert self.follower is not None
        while not self._closing:
            message = await self.source.recv(timeout_s=0.5)
            if message is None:
                continue
            await self.follower.follow(message)
            self._wake.set()

    # ----------------------------------------------------------------------- Redis

    async def _write_loop(self) -> None:
        assert self.writer is not None
        backoff = Backoff(0.1, 2.0)
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            while self.writer.has_work and not self._closing:
                try:
                    await self.writer.flush()
                    backoff.reset()
                except REDIS_ERRORS:
                    await backoff.wait()
                except Exception:  # a bug must not end the loop: the cache would go unpublished
                    log.exception("writing to Redis failed; a snapshot follows after a backoff")
                    await backoff.wait()

    async def _heartbeat_loop(self) -> None:
        assert self.writer is not None
        last_snapshot = time.monotonic()
        metrics_url = f"{self.config.engine_url.rstrip('/')}/metrics"
        while not self._closing:
            try:
                reply = await self._http.get(metrics_url)
                reply.raise_for_status()
                rank = self.config.data_parallel_rank
                load = parse_load(reply.text, self.config.block_size, _engine_label(rank))
            except (httpx.HTTPError, ValueError) as exc:
                if self.stats.engine_up:
                    log.warning("engine %s not answering (%s); not heartbeating", metrics_url, exc)
                self.stats.engine_up = False
                assert self.follower is not None
                self.follower.engine_was_down = True
            else:
                if not self.stats.engine_up:
                    log.info("engine %s answers; heartbeating", self.config.engine_url)
                    _warn_if_data_parallel(self.config.engine_url, reply.text, rank)
                    _warn_about_metrics(self.config.engine_url, reply.text)
                self.stats.engine_up = True
                with contextlib.suppress(*REDIS_ERRORS):
                    await self.writer.heartbeat(load)
            now = time.monotonic()
            # Refresh the snapshot while the events since it are still in the capped stream
            # (a burst can fill half of it between two periods).
            behind = self.writer.behind
            if behind and (
                now - last_snapshot >= self.config.snapshot_interval_s
                or behind >= self.writer.config.stream_maxlen // 2
            ):
                self.writer.need_snapshot = True
                last_snapshot = now
            if self.writer.has_work:
                self._wake.set()
            await asyncio.sleep(self.config.heartbeat_s)  # the heartbeat period

    # ----------------------------------------------------------------------- tokenizer

    async def _check_event_sources(self) -> None:
        """The engine's publisher against this bridge's socket (bridge/event_sources.py),
        once the engine answers."""
        try:
            await self._wait_for_model()  # the engine may still be starting (minutes)
            sources = await fetch_sources(self._http, self.config.engine_url)
            if sources is not None:
                self.event_source_notes = meet(
                    sources,
                    self.config.data_parallel_rank or 0,
                    self.source,
                    self.config.engine_url,
                )
        except Exception as exc:  # a failed check must not stop the bridge
            log.warning("the engine's event publisher not checked (%s)", exc)

    async def _check_tokenizer(self) -> None:
        from bridge.tokenizer_check import check, load_first, report

        try:
            if self.config.tokenizer is not None:
                sources = [self.config.tokenizer]
            else:  # as the gateway tries them: the served name, then the engine's root
                await self._wait_for_model()  # the engine may still be starting (minutes)
                assert self.config.model is not None
                sources = list(dict.fromkeys([self.config.model, self.engine_root or ""]))
            template = self.config.chat_template
            tokenizer, source = await asyncio.to_thread(
                load_first,
                [s for s in sources if s],
                template,
                self.config.template_defaults,
                self.config.tokenizer_mode,
                self.config.content_format,
            )
            await self._wait_for_model()
            c = self.config
            results = await check(
                c.engine_url, tokenizer, c.model, api_key=c.engine_api_key, tls=c.engine_tls()
            )
        except Exception as exc:  # a failed check must not stop the bridge
            log.warning("tokenizer parity with the engine not checked (%s)", exc)
            return
        self.stats.tokenizer_ok = all(r.ok for r in results)
        if self.stats.tokenizer_ok:
            log.info(
                "tokenizer parity with the engine: %d/%d chats identical",
                len(results),
                len(results),
            )
        else:
            log.error(
                "TOKENIZER MISMATCH between the gateway (%s) and engine %s: the gateway's keys "
                "will not match this engine's cache, and routing falls back to optimistic "
                "guesses.\n%s",
                source,
                self.config.engine_url,
                report(results),
            )
