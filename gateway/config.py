"""The gateway's settings: one dataclass, filled from flags and ``PREFIXGATE_*`` env vars."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixgate.tls import client_context
from router.config import RouterConfig
from router.policies import POLICIES
from router.protocol import DEFAULT_BLOCK_SIZE, http_url


@dataclass(slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Static replicas (base URLs without /v1); more may come from the Redis registry.
    replicas: list[str] = field(default_factory=list)
    redis_url: str | None = None
    policy: str = "cache_aware"
    # The router's thresholds (router/config.py), each with its documented default.
    router: RouterConfig = field(default_factory=RouterConfig)
    api_keys_path: Path | None = None
    # The key the gateway sends its replicas (a vLLM or SGLang started with --api-key) in
    # place of the client's Authorization; None: open mode forwards the client's own.
    upstream_api_key: str | None = field(default=None, repr=False)
    # HTTPS replicas (prefixgate/tls.py): the CA file their certificates are verified
    # against (None: the system's store and SSL_CERT_FILE), and a client certificate for
    # replicas that require one.
    upstream_ca_certs: str | None = None
    upstream_certfile: str | None = None
    upstream_keyfile: str | None = None
    # Model names assumed for static replicas that have not (yet) said what they serve.
    models: list[str] = field(default_factory=list)
    # --tokenizer: a folder or Hub id for every model, and per model (MODEL=SRC); each
    # overrides the lookup by the model's name and its replicas' roots (gateway/routing.py).
    tokenizer: str | None = None
    model_tokenizers: dict[str, str] = field(default_factory=dict)
    # --chat-template: a jinja file for every model, and per model (MODEL=FILE); the
    # replicas serving a model must be started with the same one.
    chat_template: Path | None = None
    model_chat_templates: dict[str, Path] = field(default_factory=dict)
    # --default-chat-template-kwargs: model ("" for every model) -> template variables
    template_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    # --tokenizer-mode: model ("" for every model) -> vLLM's mode (auto, hf, mistral)
    tokenizer_modes: dict[str, str] = field(default_factory=dict)
    # --exclude-tools-when-tool-choice-none: the replicas' (vLLM's flag)
    exclude_tools_when_tool_choice_none: bool = False
    # --chat-template-content-format: the replicas' (vLLM's flag); "auto" detects it
    content_format: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    max_body_bytes: int = 16 * 1024 * 1024
    # Longest wait for the upstream's next byte (first byte included); then it counts as
    # failed (before the first byte: retried elsewhere).
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 1.0
    gateway_id: str | None = None
    # Prompts longer than this (characters) are tokenized in a worker thread.
    inline_tokenize_chars: int = 8192
    # Memory for the block keys of recent prompts (gateway/key_memo.py); 0: none kept.
    key_memo_bytes: int = 64 << 20
    # Connections to one replica in use at once; a request finding none free waits up to
    # pool_timeout_s, then goes to another replica or gets 503 (gateway/upstream.py).
    max_connections_per_replica: int = 1024
    pool_timeout_s: float = 5.0
    # SageMaker's stateful sessions (gateway/sagemaker.py): how long one lasts, None: off.
    # Read from vLLM's SAGEMAKER_ENABLE_STATEFUL_SESSIONS and SAGEMAKER_SESSIONS_EXPIRATION.
    sagemaker_session_s: int | None = None
    # Under ``--workers`` (gateway/workers.py): this worker's index and every worker's
    # loopback port, by index; None for a gateway that is one process.
    worker: int | None = None
    worker_ports: tuple[int, ...] = ()
    serves_tls: bool = False  # the workers' loopback ports too, then

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        if self.max_connections_per_replica < 1:
            raise ValueError("max_connections_per_replica must be at least 1")
        if self.key_memo_bytes < 0:
            raise ValueError("key_memo_bytes must not be negative")
        if self.pool_timeout_s <= 0:
            raise ValueError("pool_timeout_s must be positive")
        if self.sagemaker_session_s is not None and self.sagemaker_session_s <= 0:
            raise ValueError("sagemaker_session_s must be positive")
        self.replicas = [http_url(url, "replica URL").rstrip("/") for url in self.replicas]
        if self.upstream_ca_certs or self.upstream_certfile or self.upstream_keyfile:
            self.upstream_tls()  # a file that does not load stops the gateway at start

    def upstream_tls(self) -> ssl.SSLContext:
        """The context of every HTTPS connection to a replica: requests, probes, listings."""
        return client_context(
            self.upstream_ca_certs, self.upstream_certfile, self.upstream_keyfile, "upstream"
        )
