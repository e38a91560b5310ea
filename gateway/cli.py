"""``prefixgate gateway``: run the OpenAI-compatible front door.

Every flag can also come from the environment (``prefixgate.envflags``): ``--foo-bar`` ↔
``PREFIXGATE_FOO_BAR``, lists comma-separated
(``PREFIXGATE_REPLICA=http://a:8001,http://b:8001``). Flags win.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from gateway.config import POLICIES, GatewayConfig
from gateway.sagemaker_sessions import session_seconds_from_env
from gateway.workers import (
    AUTO,
    Supervisor,
    bind_public,
    usable_cpus,
    worker_count,
    worker_spec,
)
from prefixgate.chat_input import template_defaults
from prefixgate.content_format import CONTENT_FORMAT_OPTIONS
from prefixgate.envflags import add_env_flag, add_env_list_flag, api_key_value, env_var
from prefixgate.guard import Guard, GuardConfig
from prefixgate.http_limits import add_http_limit_flags, http_limits_from_args, server_options
from prefixgate.mistral_tokenizer import check_mode
from prefixgate.open_files import prepare_open_files
from prefixgate.root_path import add_root_path_flag, root_prefix, with_root_path
from prefixgate.tls import add_client_tls_flags, add_server_tls_flags, server_tls_options
from router.config import RouterConfig, with_options


def fast_server_options() -> dict[str, Any]:
    """uvloop and httptools when installed: the event loop and HTTP parser in C."""
    options: dict[str, Any] = {}
    if importlib.util.find_spec("uvloop") is not None:
        options["loop"] = "uvloop"
    if importlib.util.find_spec("httptools") is not None:
        options["http"] = "httptools"
    return options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate gateway",
        description="OpenAI-compatible gateway that routes each request to the replica "
        "holding its prompt's KV cache. Flags also read PREFIXGATE_<FLAG> env vars.",
    )
    add_env_flag(p, "host", default="127.0.0.1", help="interface to bind")
    add_env_flag(p, "port", type=int, default=8000, help="port to bind")
    add_env_list_flag(
        p,
        "replica",
        metavar="URL",
        help="a replica's base URL; more come from the Redis registry",
    )
    add_env_flag(p, "redis-url", help="discovery and block events")
    add_env_flag(p, "policy", default="cache_aware", choices=POLICIES, help="routing policy")
    add_env_list_flag(
        p,
        "router-option",
        metavar="NAME=VALUE",
        help="a router threshold, e.g. load_slack=0.5 (names and defaults: router/config.py)",
    )
    add_env_flag(
        p,
        "api-keys",
        type=Path,
        metavar="FILE",
        help="JSON/YAML: key -> {tenant, cache_salt, shared_namespace}; without it the "
        "gateway is open with one shared cache namespace",
    )
    add_env_flag(
        p,
        "upstream-api-key",
        metavar="KEY",
        help="the API key of replicas started with --api-key (vLLM, SGLang): sent to every "
        "replica in place of the client's Authorization; without it an open gateway "
        "forwards the client's own",
    )
    add_env_flag(
        p,
        "allowed-origins",
        default='["*"]',
        help="browser origins allowed to call the gateway (CORS), as vLLM's flag: a JSON "
        'list, or comma-separated; default ["*"] as vLLM, SGLang and LiteLLM; [] for none',
    )
    add_client_tls_flags(p, "upstream", "replicas")
    add_server_tls_flags(p)
    add_root_path_flag(p)
    add_env_list_flag(p, "model", help="model assumed for static replicas that do not say")
    add_env_list_flag(
        p,
        "tokenizer",
        metavar="[MODEL=]SRC",
        help="the tokenizer (a folder or a Hugging Face Hub id) for every model or for MODEL "
        "(repeatable); default: the model's name, else the root its replicas list",
    )
    add_env_list_flag(
        p,
        "chat-template",
        metavar="[MODEL=]FILE",
        help="a jinja chat template instead of the model's own, for every model or for "
        "MODEL (repeatable); start the model's replicas with the same --chat-template",
    )
    add_env_list_flag(
        p,
        "default-chat-template-kwargs",
        metavar="[MODEL=]JSON",
        help="chat template variables where a request sets none, for every model or for "
        "MODEL, as the model's vLLM replicas were given them with this flag",
        separator=None,
    )
    add_env_list_flag(
        p,
        "tokenizer-mode",
        metavar="[MODEL=]MODE",
        help="vLLM's --tokenizer-mode the model's replicas were started with: auto (vLLM's "
        "default: Mistral's tokenizer for models with Mistral's weights and tokenizer "
        "files), hf or mistral; for every model or for MODEL (repeatable)",
    )
    exclude = env_var("exclude-tools-when-tool-choice-none")
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        default=os.environ.get(exclude, "").lower() in ("1", "true", "yes"),
        help="the replicas were started with vLLM's flag of this name: a chat whose "
        f"tool_choice is none is rendered without its tools (env {exclude}=1)",
    )
    add_env_flag(
        p,
        "chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMAT_OPTIONS,
        help="the replicas' --chat-template-content-format (vLLM's): how a message's "
        "content reaches the template, a string or OpenAI's list of parts; auto detects it",
    )
    add_env_flag(p, "block-size", type=int, default=16, help="tokens per KV block")
    add_env_flag(p, "max-body-mb", type=float, default=16.0, help="largest request body")
    add_env_flag(p, "upstream-timeout-s", type=float, default=600.0, help="per upstream request")
    add_env_flag(p, "connect-timeout-s", type=float, default=2.0, help="per upstream connect")
    add_env_flag(p, "probe-interval-s", type=float, default=2.0, help="active health checks")
    add_env_flag(
        p,
        "max-connections-per-replica",
        type=int,
        default=1024,
        help="connections to one replica in use at once (more requests wait for one)",
    )
    add_env_flag(
        p,
        "pool-timeout-s",
        type=float,
        default=5.0,
        help="longest wait for a free connection to a replica; then another one, or 503",
    )
    add_env_flag(
        p,
        "key-memo-mb",
        type=float,
        default=64.0,
        help="memory for the block keys of recent prompts, so that a prompt repeating a "
        "recent prefix (tools, system prompt, history) hashes only what follows it; 0: off",
    )
    add_env_flag(
        p,
        "keep-alive-s",
        type=float,
        default=75.0,
        help="how long an idle client connection stays open; above the idle timeout of any "
        "load balancer in front (AWS ALB and ingress-nginx: 60 s; Google Cloud's: 620 s)",
    )
    add_http_limit_flags(p)
    add_env_flag(p, "gateway-id", help="this gateway's id in routing hints shared through Redis")
    add_env_flag(
        p,
        "workers",
        type=worker_count,
        default=1,
        help="gateway processes serving the address, one core each at most; more than one "
        "needs --redis-url, which they share as separate gateways do (gateway/workers.py); "
        "auto: one per CPU this process may use (its affinity and its container's CPU "
        "limit), or 1 without --redis-url or with SageMaker sessions",
    )
    add_env_flag(p, "log-level", default="info", help="logging level")
    return p


def per_model_flag(flag: str, what: str, values: list[str]) -> tuple[str | None, dict[str, str]]:
    """A repeatable ``--FLAG WHAT`` (every model) and ``--FLAG MODEL=WHAT`` (that model)."""
    every: str | None = None
    per_model: dict[str, str] = {}
    for value in values:
        model, sep, given = value.partition("=")
        if sep and not (model and given):
            raise ValueError(f"--{flag} {value}: give MODEL={what} or {what}")
        if sep:
            per_model[model] = given
        elif every is not None:
            raise ValueError(f"--{flag} {what} given twice; use MODEL={what} per model")
        else:
            every = value
    return every, per_model


def chat_template_flags(values: list[str]) -> tuple[Path | None, dict[str, Path]]:
    """``--chat-template FILE`` (every model) and ``--chat-template MODEL=FILE``."""
    every, per_model = per_model_flag("chat-template", "FILE", values)
    for file in [every, *per_model.values()]:
        if file is not None and not Path(file).is_file():
            raise ValueError(f"--chat-template {file}: no such file")
    paths = {model: Path(file) for model, file in per_model.items()}
    return (Path(every) if every is not None else None), paths


def template_defaults_flags(values: list[str]) -> dict[str, dict[str, Any]]:
    """``--default-chat-template-kwargs JSON`` (every model: the key "") and
    ``MODEL=JSON``. A value that starts with ``{`` is for every model, whatever ``=`` its
    JSON holds."""
    out: dict[str, dict[str, Any]] = {}
    for value in values:
        model, sep, given = (
            ("", "", value) if value.lstrip().startswith("{") else value.partition("=")
        )
        if (sep and not model) or (not sep and model):
            raise ValueError(f"--default-chat-template-kwargs {value}: give MODEL=JSON or JSON")
        if model in out:
            where = f"for {model}" if model else "for every model"
            raise ValueError(f"--default-chat-template-kwargs given twice {where}")
        out[model] = template_defaults(given)
    return out


def tokenizer_mode_flags(values: list[str]) -> dict[str, str]:
    """``--tokenizer-mode MODE`` (every model: the key "") and ``--tokenizer-mode
    MODEL=MODE``."""
    every, per_model = per_model_flag("tokenizer-mode", "MODE", values)
    modes = dict(per_model) if every is None else {"": every, **per_model}
    for model, mode in modes.items():
        try:
            check_mode(mode)
        except ValueError as exc:
            raise ValueError(
                f"--tokenizer-mode {f'{model}=' if model else ''}{mode}: {exc}"
            ) from exc
    return modes


def tokenizer_flags(values: list[str]) -> tuple[str | None, dict[str, str]]:
    """``--tokenizer SRC`` (every model) and ``--tokenizer MODEL=SRC``."""
    return per_model_flag("tokenizer", "SRC", values)


def allowed_origins(value: str) -> list[str]:
    """``--allowed-origins``: a JSON list of origins, or comma-separated ones."""
    text = value.strip()
    if text.startswith("["):
        try:
            origins = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--allowed-origins {value!r}: not a JSON list ({exc})") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--allowed-origins {value!r}: a JSON list of strings, please")
        return [o.strip() for o in origins if o.strip()]
    return [o.strip() for o in text.split(",") if o.strip()]


def with_cors(app: Any, origins: list[str]) -> Any:
    """``app`` answering browsers' CORS preflights and marking its answers for
    ``origins`` (unchanged when there are none). Outermost, so that a preflight (no
    Authorization header) is answered before any check, and errors carry the headers
    too, or a browser hides them from the page. A request without an Origin header (any
    client but a browser) is served as it is; its answer gains only ``Vary: Origin``."""
    if not origins:
        return app
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(
        app,
        allow_origins=origins,
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=["x-prefixgate-replica", "x-prefixgate-route", "x-request-id"],
    )


def _memo_bytes(mb: float) -> int:
    if not math.isfinite(mb) or mb < 0:
        raise ValueError(f"--key-memo-mb must be a number of MiB >= 0, got {mb}")
    return int(mb * 1024 * 1024)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    chat_template, model_chat_templates = chat_template_flags(args.chat_template)
    tokenizer, model_tokenizers = tokenizer_flags(args.tokenizer)
    return GatewayConfig(
        host=args.host,
        port=args.port,
        replicas=args.replica,
        redis_url=args.redis_url,
        policy=args.policy,
        router=with_options(RouterConfig(), args.router_option),
        api_keys_path=Path(args.api_keys) if args.api_keys else None,
        upstream_api_key=api_key_value("upstream-api-key", args.upstream_api_key),
        upstream_ca_certs=args.upstream_ca_certs,
        upstream_certfile=args.upstream_certfile,
        upstream_keyfile=args.upstream_keyfile,
        models=args.model,
        tokenizer=tokenizer,
        model_tokenizers=model_tokenizers,
        chat_template=chat_template,
        model_chat_templates=model_chat_templates,
        template_defaults=template_defaults_flags(args.default_chat_template_kwargs),
        tokenizer_modes=tokenizer_mode_flags(args.tokenizer_mode),
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        content_format=args.chat_template_content_format,
        block_size=args.block_size,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        upstream_timeout_s=args.upstream_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        probe_interval_s=args.probe_interval_s,
        max_connections_per_replica=args.max_connections_per_replica,
        pool_timeout_s=args.pool_timeout_s,
        key_memo_bytes=_memo_bytes(args.key_memo_mb),
        gateway_id=args.gateway_id,
        sagemaker_session_s=session_seconds_from_env(),
    )


def resolve_workers(args: argparse.Namespace, config: GatewayConfig) -> str | None:
    """``--workers auto`` made a count (in ``args``); what was chosen and why, to log."""
    if args.workers != AUTO:
        return None
    if not config.redis_url:
        args.workers = 1
        return "--workers auto: 1 (several workers share state through --redis-url)"
    if config.sagemaker_session_s is not None:
        args.workers = 1
        return "--workers auto: 1 (SageMaker's sessions are kept by one process)"
    args.workers = usable_cpus()
    return f"--workers auto: {args.workers} (the CPUs this process may use)"


def check_workers(args: argparse.Namespace, config: GatewayConfig) -> None:
    """``--workers N``: what N processes cannot do without sharing state."""
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    if args.workers == 1:
        return
    if not config.redis_url:
        raise ValueError(
            "--workers above 1 needs --redis-url: the workers share the replicas' blocks, "
            "routing hints, response ids and tenant limits through it, as gateways do"
        )
    if config.sagemaker_session_s is not None:
        raise ValueError(
            "SageMaker's stateful sessions are kept by the process that opened them: "
            "run them with --workers 1"
        )


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(raw_argv)
    spec = worker_spec()  # set when this process is one of --workers
    try:
        config = config_from_args(args)
        chosen = resolve_workers(args, config)
        check_workers(args, config)
        if spec is not None:
            suffix = f"-w{spec.index}"
            config = replace(
                config,
                worker=spec.index,
                worker_ports=spec.ports,
                gateway_id=config.gateway_id + suffix if config.gateway_id else None,
                serves_tls=bool(args.ssl_certfile),
            )
        origins = allowed_origins(args.allowed_origins)
        root_prefix(args.root_path)  # checked here: a bad one stops the command
        if not (math.isfinite(args.keep_alive_s) and args.keep_alive_s > 0):
            raise ValueError(f"--keep-alive-s must be a positive number, got {args.keep_alive_s}")
        # Checked before this, which changes the process: two descriptors per client,
        # its connection and the pooled one to its replica.
        open_files = prepare_open_files(fds_per_connection=2)
        limits = http_limits_from_args(args, open_files.max_connections)
        tls = server_tls_options(args)
        # Keyed mode refuses POST bodies that are not JSON: a browser's cross-site
        # "simple" request (text/plain, form types) is never served. The audio API's
        # uploads are forms; a simple request cannot carry the Authorization header
        # keyed mode wants, so a cross-site one is a 401 there.
        from gateway.audio import AUDIO_PATHS

        guard = GuardConfig(
            config.max_body_bytes,
            require_json=config.api_keys_path is not None,
            form_paths=frozenset(AUDIO_PATHS),
        )
    except ValueError as exc:
        print(f"prefixgate gateway: {exc}")
        return 2
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    where = f" w{spec.index}" if spec is not None else ""
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s %(name)s{where} %(message)s"
    )
    if chosen is not None and spec is None:
        logging.getLogger("prefixgate.gateway").info(chosen)
    if spec is None and args.workers > 1:
        try:
            public = bind_public(config.host, config.port)
        except OSError as exc:
            print(f"prefixgate gateway: cannot listen on {config.host}:{config.port}: {exc}")
            return 1
        return Supervisor(raw_argv, args.workers, public, tls=bool(args.ssl_certfile)).run()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health probe: noise
    logging.getLogger("prefixgate.gateway").info(open_files.describe())
    import uvicorn

    from gateway.app import create_app
    from prefixgate.serve import Server

    server = Server(
        uvicorn.Config(
            with_root_path(with_cors(Guard(create_app(config), guard), origins), args.root_path),
            host=config.host,
            port=config.port,
            log_level=args.log_level,
            access_log=False,  # the gateway writes its own structured access log
            proxy_headers=False,  # the front door: no proxy in front to trust, and a cost each
            # uvicorn's 5 s is below every load balancer's idle timeout: one in front reuses
            # a connection the gateway is closing, and its request fails (a 502 from it).
            timeout_keep_alive=args.keep_alive_s,
            **server_options(limits),
            **tls,
        ),
        handshake_timeout_s=limits.header_timeout_s,
        settle_heap=True,
    )
    server.run(sockets=spec.sockets() if spec is not None else None)
    if not server.started:
        return 1
    return 0
