"""``prefixgate bridge``: make a vLLM or SGLang engine a prefixgate replica in Redis."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

from bridge.engine_auth import add_engine_access_flags, engine_api_key
from bridge.media import known_media_text, parse_medium_flag
from bridge.service import Bridge, BridgeConfig
from bridge.zmq_source import rank_endpoint
from prefixgate.envflags import add_env_flag, add_env_list_flag
from router.protocol import DEFAULT_BLOCK_SIZE, MAX_DATA_PARALLEL_RANK

DESCRIPTION = """\
Subscribe to an engine's KV-cache events (vLLM or SGLang with --kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558"}') and publish the engine as a prefixgate replica:
registry record with the engine's URL, heartbeats with its load (from /metrics), and
its cached blocks as prefixgate keys, in the layout gateways already read.

--kv-events follows the engine's own rule: a wildcard address (tcp://*:5557) binds, a
concrete one connects. An engine that binds tcp://*:5557 is reached with
tcp://ENGINE_HOST:5557; an engine whose endpoint is tcp://BRIDGE_HOST:5557 connects to
a bridge started with --kv-events tcp://*:5557.

An engine with several data-parallel ranks behind one server (vLLM's
--data-parallel-size N) takes a bridge per rank, --data-parallel-rank 0 to N-1, each given
the engine's own --kv-events and --replay: each rank publishes on those ports plus its
rank, and the bridge adds its rank the same way. Each rank is then a replica of its own
(id HOST:PORT-dpR), and gateways send its requests to the engine with the
X-data-parallel-rank header, so they reach the rank whose cache the router chose.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate bridge",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_env_flag(p, "engine-url", help="the engine's OpenAI server, e.g. http://10.0.0.5:8000")
    add_env_flag(p, "kv-events", help="the engine's event PUB endpoint, e.g. tcp://10.0.0.5:5557")
    add_env_flag(p, "replay", help="the engine's replay endpoint, e.g. tcp://10.0.0.5:5558")
    add_engine_access_flags(p)
    add_env_flag(p, "topic", default="", help="the engine's event topic")
    add_env_flag(p, "redis-url", default="redis://127.0.0.1:6379/0", help="Redis to publish to")
    add_env_flag(p, "replica-id", help="id in Redis (default: host:port of the advertised URL)")
    add_env_flag(p, "advertise-url", help="URL gateways call (default: --engine-url)")
    add_env_flag(
        p,
        "data-parallel-rank",
        type=int,
        help="follow one data-parallel rank of the engine (0 to its --data-parallel-size - 1) "
        "as a replica of its own; default: the engine as a whole",
    )
    add_env_flag(
        p, "model", help="the engine's served model name (default: its first /v1/models entry)"
    )
    add_env_flag(
        p, "block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="prefixgate key block size"
    )
    add_env_flag(
        p,
        "tokenizer",
        help="the gateway's tokenizer (builtin name, model folder or Hub id) for the start-up "
        "parity check (default: --model, else the engine's root, as the gateway tries them)",
    )
    add_env_flag(
        p,
        "chat-template",
        metavar="FILE",
        help="the jinja chat template the engine and the gateways were started with, if "
        "not the model's own, for the start-up parity check",
    )
    add_env_flag(
        p,
        "default-chat-template-kwargs",
        metavar="JSON",
        help="the template variables the engine and the gateways were started with "
        "(vLLM's --default-chat-template-kwargs), for the start-up parity check",
    )
    add_env_flag(
        p,
        "tokenizer-mode",
        default="auto",
        help="the engine's --tokenizer-mode (vLLM's: auto, hf, mistral), for the start-up "
        "parity check",
    )
    add_env_flag(
        p,
        "chat-template-content-format",
        default="auto",
        choices=("auto", "string", "openai"),  # prefixgate.content_format's options
        help="the engine's --chat-template-content-format (vLLM's), for the start-up parity check",
    )
    p.add_argument(
        "--no-tokenizer-check", action="store_true", help="skip the start-up parity check"
    )
    add_env_list_flag(
        p,
        "medium",
        metavar="NAME=TIER",
        help="route blocks the engine reports in medium NAME as on the device, on the host, "
        "or not at all (TIER: device, host, ignore); overrides the built-in table "
        f"({known_media_text()}; any other name ignored)",
    )
    add_env_flag(p, "heartbeat-s", type=float, default=1.0, help="heartbeat period")
    add_env_flag(p, "log-level", default="info", help="debug, info, warning")
    return p


def parse_args(argv: list[str] | None) -> BridgeConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.engine_url or not args.kv_events:
        parser.error("--engine-url and --kv-events are required (or PREFIXGATE_ENGINE_URL, ...)")
    if args.block_size <= 0:
        parser.error("--block-size must be positive")
    if args.data_parallel_rank is not None and not (
        0 <= args.data_parallel_rank <= MAX_DATA_PARALLEL_RANK
    ):
        parser.error(f"--data-parallel-rank must be 0 to {MAX_DATA_PARALLEL_RANK}")
    try:
        key = engine_api_key(args.engine_api_key)
        media = dict(parse_medium_flag(value) for value in args.medium)
        template = None
        if args.chat_template:  # imported here: the tokenizer stack costs ~0.2 s to load
            from prefixgate.tokenizer import read_chat_template_file

            template = read_chat_template_file(args.chat_template)
        defaults = None
        if args.default_chat_template_kwargs is not None:
            from prefixgate.chat_input import template_defaults

            defaults = template_defaults(args.default_chat_template_kwargs)
        if args.tokenizer_mode != "auto":
            from prefixgate.mistral_tokenizer import check_mode

            check_mode(args.tokenizer_mode)
        if args.data_parallel_rank:  # the rank's own endpoints, offset as the engine does
            for endpoint in (args.kv_events, args.replay):
                if endpoint is not None:
                    rank_endpoint(endpoint, args.data_parallel_rank)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = BridgeConfig(
        engine_url=args.engine_url,
        engine_api_key=key,
        engine_ca_certs=args.engine_ca_certs,
        engine_certfile=args.engine_certfile,
        engine_keyfile=args.engine_keyfile,
        kv_events=args.kv_events,
        redis_url=args.redis_url,
        replay=args.replay,
        topic=args.topic,
        model=args.model,
        replica_id=args.replica_id,
        advertise_url=args.advertise_url,
        data_parallel_rank=args.data_parallel_rank,
        block_size=args.block_size,
        media=media,
        tokenizer=args.tokenizer,
        chat_template=template,
        template_defaults=defaults,
        tokenizer_mode=args.tokenizer_mode,
        content_format=args.chat_template_content_format,
        check_tokenizer=not args.no_tokenizer_check,
        heartbeat_s=args.heartbeat_s,
    )
    try:
        config.engine_tls()  # a TLS file that does not load stops the bridge here
    except ValueError as exc:
        parser.error(str(exc))
    return config


async def run(config: BridgeConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bridge = Bridge(config)
    try:
        starting = asyncio.create_task(bridge.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        else:
            starting.result()
            await stopping
    finally:
        await bridge.stop()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    asyncio.run(run(config))
    return 0
