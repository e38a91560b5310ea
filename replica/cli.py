"""``prefixgate replica``: serve one model on one device with an OpenAI API (like ``vllm serve``).

Every flag can also come from the environment: ``--kv-cache-mb`` from
``PREFIXGATE_KV_CACHE_MB`` and so on (a flag on the command line wins). Binds to
127.0.0.1 unless ``--host`` says otherwise. SIGTERM stops accepting connections, lets
in-flight requests finish for ``--grace-s`` seconds, cancels the rest and exits 0. If the
engine thread dies, the server stops at once and the process exits 1, for its supervisor
(``prefixgate up``, compose ``restart``, Kubernetes) to restart it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from prefixgate.envflags import add_env_flag, env_list
from prefixgate.guard import Guard, GuardConfig
from prefixgate.http_limits import add_http_limit_flags, http_limits_from_args, server_options
from prefixgate.models import served_names
from prefixgate.open_files import prepare_open_files
from prefixgate.root_path import add_root_path_flag, root_prefix, with_root_path
from prefixgate.tls import add_server_tls_flags, served_scheme, server_tls_options
from replica.chat_flags import add_chat_flags, apply_chat_template_flag
from replica.eviction import POLICY_NAMES
from replica.sim.setup import SIM_MODEL, add_sim_flags, build_sim

log = logging.getLogger("prefixgate.replica")

_WILDCARDS = ("", "0.0.0.0", "::")


def model_root(model: str) -> str:
    """The ``root`` of the model cards: what the model was started from, as vLLM lists
    its ``--model`` (a gateway loads the tokenizer from it when a served name is none);
    a folder by its absolute path."""
    from prefixgate.models import is_builtin, model_dir, on_the_hub

    if is_builtin(model) or model == SIM_MODEL or on_the_hub(model):
        return model
    return str(model_dir(model))


def default_advertise_url(host: str, port: int, redis_url: str | None, scheme: str = "http") -> str:
    """The URL gateways are told to call when ``--advertise-url`` is not given: the bound
    address (bracketed when IPv6). A wildcard bind (0.0.0.0, ::) is no address another
    host can call (a gateway elsewhere would call itself), so it advertises this host's
    address on its route to Redis, which the gateways reach too: 127.0.0.1 when Redis is
    local. Routes are looked up with an unconnected-to UDP socket: no packet is sent."""
    if host in _WILDCARDS:
        host = _address_towards(urlsplit(redis_url).hostname if redis_url else None)
        log.info(
            "--host is a wildcard: advertising %s to gateways (set --advertise-url if they"
            " reach this replica at another address)",
            host,
        )
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _address_towards(peer: str | None) -> str:
    """This host's source address for packets to ``peer`` (127.0.0.1 if none)."""
    if not peer:
        return "127.0.0.1"
    try:
        family, _, _, _, address = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:  # unresolvable, or no route: the best guess left
        return "127.0.0.1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate replica", description="Serve one model replica with an OpenAI API."
    )
    add_env_flag(
        p,
        "model",
        default="smollm2-135m",
        help="builtin model name, local HF folder, Hugging Face Hub id (org/name: fetched "
        "into the Hugging Face cache), or sim (the simulated engine: "
        "a GPU cost model instead of the forward pass, torch-free; --sim-profile)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        default=env_list("served-model-name"),
        help="the model names clients send, as vLLM's: several are aliases of one model (one "
        "cache); answers and the cache's keys use the first (env "
        "PREFIXGATE_SERVED_MODEL_NAME, comma-separated; default: --model)",
    )
    add_env_flag(p, "host", default="127.0.0.1", help="interface to bind")
    add_env_flag(p, "port", type=int, default=8101, help="port to bind")
    add_env_flag(p, "device", default="cpu", help="cpu or cuda:N")
    add_env_flag(p, "dtype", help="float32, bfloat16 or float16 (default: the model's)")
    add_env_flag(p, "kv-cache-mb", type=int, help="KV block pool size in MiB")
    add_env_flag(
        p, "num-blocks", type=int, help="KV block pool size in blocks (instead of --kv-cache-mb)"
    )
    add_env_flag(
        p,
        "host-cache-mb",
        type=int,
        default=0,
        help="host-memory KV tier in MiB: evicted prefix blocks are copied there and "
        "copied back on a hit (pinned memory on CUDA); 0 = off",
    )
    add_env_flag(p, "block-size", type=int, default=16, help="tokens per KV block")
    add_env_flag(p, "max-running", type=int, default=64, help="most requests in the running batch")
    add_env_flag(
        p,
        "max-waiting",
        type=int,
        default=256,
        help="most requests waiting; more get 503 + Retry-After",
    )
    add_env_flag(
        p, "max-prefill-tokens", type=int, default=512, help="prefill token budget per engine step"
    )
    add_env_flag(p, "eviction-policy", help="prefix cache eviction", choices=list(POLICY_NAMES))
    add_env_flag(p, "ttl-s", type=float, help="drop unpinned cached blocks idle this long")
    add_env_flag(p, "redis-url", help="publish registry, load and block events to this Redis")
    add_env_flag(p, "replica-id", help="id in Redis (default: host:port of --advertise-url)")
    add_env_flag(
        p,
        "advertise-url",
        help="URL gateways should call (default http://host:port, https:// with "
        "--ssl-certfile; for a wildcard host, this host's address on its route to Redis)",
    )
    add_env_flag(p, "heartbeat-s", type=float, default=1.0, help="registry heartbeat interval")
    add_env_flag(
        p,
        "grace-s",
        type=float,
        default=10.0,
        help="on SIGTERM, how long in-flight requests may finish",
    )
    add_env_flag(p, "max-body-mb", type=float, default=16.0, help="largest request body (413)")
    add_env_flag(
        p,
        "response-store-mb",
        type=float,
        default=1024.0,
        help="memory for stored Responses API conversations (least recently used dropped)",
    )
    add_http_limit_flags(p, send_timeout_s=None)  # its client is a gateway (http_limits.py)
    add_server_tls_flags(p)
    add_root_path_flag(p)
    add_chat_flags(p)
    add_sim_flags(p)
    add_env_flag(
        p,
        "log-level",
        default="info",
        help="logging level",
        choices=["debug", "info", "warning", "error"],
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.kv_cache_mb is not None and args.num_blocks is not None:
        print("prefixgate replica: give --kv-cache-mb or --num-blocks, not both", file=sys.stderr)
        return 2
    if args.host_cache_mb < 0:
        print("prefixgate replica: --host-cache-mb must be >= 0", file=sys.stderr)
        return 2
    if not 0 < args.response_store_mb < 1 << 40:  # (nan and inf fail too)
        print("prefixgate replica: --response-store-mb must be a positive size", file=sys.stderr)
        return 2
    try:
        open_files = prepare_open_files(fds_per_connection=1)
        limits = http_limits_from_args(args, open_files.max_connections)
        guard = GuardConfig(max_body_bytes=int(args.max_body_mb * 1024 * 1024))
        tls = server_tls_options(args)
        root_prefix(args.root_path)  # checked before the model loads
    except ValueError as exc:
        print(f"prefixgate replica: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log.info(open_files.describe())
    # Imported here: they take time `prefixgate --help` should not pay for.
    import uvicorn

    from prefixgate.segments import SegmentCache
    from prefixgate.serve import Server
    from replica.engine import Engine, EngineConfig
    from replica.metrics import ReplicaMetrics
    from replica.publisher import Publisher, PublisherConfig
    from replica.response_store import ResponseStore
    from replica.server import create_app
    from replica.state import Replica
    from router.protocol import redacted_url

    advertise_url = args.advertise_url or default_advertise_url(
        args.host, args.port, args.redis_url, served_scheme(args)
    )
    replica_id = args.replica_id or urlsplit(advertise_url).netloc or f"{args.host}:{args.port}"

    served_name, *aliases = served_names(args.model, args.served_model_name)
    loaded: Any  # replica.models.LoadedModel, or the simulated engine's SimModel
    backend = None
    if args.model == SIM_MODEL:  # torch-free: the forward pass is a cost model
        try:
            loaded, backend = build_sim(args, served_name)
        except ValueError as exc:
            print(f"prefixgate replica: {exc}", file=sys.stderr)
            return 2
    else:
        from replica.models import load_model  # pulls in torch

        started = time.perf_counter()
        log.info("loading model %s on %s (dtype %s)", args.model, args.device, args.dtype or "auto")
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
        log.info("model %s loaded in %.1f s", loaded.name, time.perf_counter() - started)
        # The cache's keys are rooted in the model's name and gateways compute keys from
        # the name clients send: they must be the same string.
        loaded = dataclasses.replace(loaded, name=served_name)
    try:
        apply_chat_template_flag(args, loaded.tokenizer)
    except ValueError as exc:
        print(f"prefixgate replica: {exc}", file=sys.stderr)
        return 2
    publisher = None
    if args.redis_url:
        publisher = Publisher(
            PublisherConfig(
                redis_url=args.redis_url,
                replica_id=replica_id,
                url=advertise_url,
                model=served_name,
                block_size=args.block_size,
                heartbeat_s=args.heartbeat_s,
            )
        )
    engine = Engine(
        loaded,
        EngineConfig(
            num_blocks=args.num_blocks,
            kv_cache_mb=args.kv_cache_mb,
            host_cache_mb=args.host_cache_mb,
            block_size=args.block_size,
            max_prefill_tokens_per_step=args.max_prefill_tokens,
            max_running=args.max_running,
            max_waiting=args.max_waiting,
            eviction_policy=args.eviction_policy,
            ttl_s=args.ttl_s,
        ),
        listener=publisher,
        backend=backend,
    )
    stats = engine.cache.stats()
    log.info(
        "KV pool: %d blocks of %d tokens; replica id %s, advertised at %s, redis %s",
        stats.total_blocks,
        args.block_size,
        replica_id,
        advertise_url,
        redacted_url(args.redis_url) if args.redis_url else "off",
    )
    metrics = ReplicaMetrics(load=engine.load, cache=engine.cache_stats)
    replica = Replica(
        loaded,
        engine,
        served_name,
        metrics,
        publisher,
        chats=SegmentCache(loaded.tokenizer),
        tool_call_parser=args.tool_call_parser,
        responses=ResponseStore(max_bytes=int(args.response_store_mb * 1024 * 1024)),
        aliases=tuple(dict.fromkeys(a for a in aliases if a != served_name)),
        root=model_root(args.model),
    )
    app = with_root_path(Guard(create_app(replica), guard), args.root_path)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(max(1, args.grace_s)),
        access_log=False,
        **server_options(limits),
        **tls,
    )
    server = Server(config, handshake_timeout_s=limits.header_timeout_s, settle_heap=True)
    replica.on_engine_death = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with
    # this handler in place that re-raise is a no-op and the process exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    if not server.started:
        log.error("server did not start (is port %d free?)", args.port)
        return 1
    if engine.error is not None:
        log.error("replica %s exits 1: its engine thread died (%r)", replica_id, engine.error)
        return 1
    log.info("replica %s exited cleanly", replica_id)
    return 0
