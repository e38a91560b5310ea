"""``prefixgate gateway``: run the OpenAI-compatible front door.

Every flag can also come from the environment: ``--foo-bar`` ↔ ``PREFIXGATE_FOO_BAR``
(lists comma-separated: ``PREFIXGATE_REPLICA=http://a:8001,http://b:8001``). Flags win.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from gateway.config import POLICIES, GatewayConfig
from gateway.upstream import TRANSPORTS
from router.config import RouterConfig, with_options


def fast_server_options() -> dict[str, Any]:
    """uvloop and httptools when installed: the event loop and HTTP parser in C."""
    options: dict[str, Any] = {}
    if importlib.util.find_spec("uvloop") is not None:
        options["loop"] = "uvloop"
    if importlib.util.find_spec("httptools") is not None:
        options["http"] = "httptools"
    return options


def _env(name: str) -> str | None:
    return os.environ.get("PREFIXGATE_" + name.upper().replace("-", "_")) or None


def _env_list(name: str) -> list[str]:
    value = _env(name)
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate gateway",
        description="OpenAI-compatible gateway that routes each request to the replica "
        "holding its prompt's KV cache. Flags also read PREFIXGATE_<FLAG> env vars.",
    )
    p.add_argument("--host", default=_env("host") or "127.0.0.1")
    p.add_argument("--port", type=int, default=int(_env("port") or 8000))
    p.add_argument(
        "--replica",
        action="append",
        default=None,
        metavar="URL",
        help="a replica's base URL (repeatable); more come from the Redis registry",
    )
    p.add_argument("--redis-url", default=_env("redis-url"), help="discovery and block events")
    p.add_argument("--policy", choices=POLICIES, default=_env("policy") or "cache_aware")
    p.add_argument(
        "--router-option",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="a router threshold, e.g. load_slack=0.5 (repeatable; names and defaults: "
        "router/config.py)",
    )
    p.add_argument(
        "--api-keys",
        type=Path,
        default=_env("api-keys"),
        metavar="FILE",
        help="JSON/YAML: key -> {tenant, cache_salt, shared_namespace}; without it the "
        "gateway is open with one shared cache namespace",
    )
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help="model assumed for static replicas that do not say (repeatable)",
    )
    p.add_argument("--tokenizer", default=_env("tokenizer"), help="tokenizer for every model")
    p.add_argument("--block-size", type=int, default=int(_env("block-size") or 16))
    p.add_argument("--max-body-mb", type=float, default=float(_env("max-body-mb") or 16))
    p.add_argument(
        "--upstream-timeout-s", type=float, default=float(_env("upstream-timeout-s") or 600)
    )
    p.add_argument("--connect-timeout-s", type=float, default=float(_env("connect-timeout-s") or 2))
    p.add_argument("--probe-interval-s", type=float, default=float(_env("probe-interval-s") or 2))
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=_env("transport") or "http1",
        help="HTTP client for forwarded requests: http1 (the gateway's own, fastest), "
        "aiohttp, or httpx's API over its own transport or aiohttp's",
    )
    p.add_argument("--gateway-id", default=_env("gateway-id"))
    p.add_argument("--log-level", default=_env("log-level") or "info")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        replicas=args.replica or _env_list("replica"),
        redis_url=args.redis_url,
        policy=args.policy,
        router=with_options(RouterConfig(), args.router_option or _env_list("router-option")),
        api_keys_path=Path(args.api_keys) if args.api_keys else None,
        models=args.model or _env_list("model"),
        tokenizer=args.tokenizer,
        block_size=args.block_size,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        upstream_timeout_s=args.upstream_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        probe_interval_s=args.probe_interval_s,
        transport=args.transport,
        gateway_id=args.gateway_id,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"prefixgate gateway: {exc}")
        return 2
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call: noise
    import uvicorn

    from gateway.app import create_app

    options: dict[str, Any] = fast_server_options()
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        access_log=False,  # the gateway writes its own structured access log
        proxy_headers=False,  # the front door: no proxy in front to trust, and a cost per request
        **options,
    )
    return 0
