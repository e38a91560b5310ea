"""How a bridge or a tokenizer check reaches its engine: its API key and its TLS.

A vLLM or SGLang started with ``--api-key`` answers 401 to ``/v1/models`` (and SGLang to
``/tokenize``) without the key, so a bridge or a tokenizer check that does not send it
never learns the engine's model.

``--engine-api-key`` (env ``PREFIXGATE_ENGINE_API_KEY``) names it; without the flag the
key is ``VLLM_API_KEY``, the variable vLLM itself reads, so that a bridge started beside
its engine with one environment needs nothing more.

An engine started with vLLM's ``--ssl-certfile`` is called over HTTPS: ``--engine-ca-certs``
names the CA its certificate is verified against (default: the system's store and
``SSL_CERT_FILE``), ``--engine-certfile`` and ``--engine-keyfile`` the client certificate
an engine started with ``--ssl-cert-reqs 2`` wants (prefixgate/tls.py).
"""

from __future__ import annotations

import argparse
import os

from prefixgate.envflags import add_env_flag, api_key_value
from prefixgate.tls import add_client_tls_flags

VLLM_KEY_VAR = "VLLM_API_KEY"


def add_engine_access_flags(parser: argparse.ArgumentParser) -> None:
    add_env_flag(
        parser,
        "engine-api-key",
        metavar="KEY",
        help=f"the engine's --api-key, sent with every request to it (default: ${VLLM_KEY_VAR})",
    )
    add_client_tls_flags(parser, "engine", "engines")


def engine_api_key(value: str | None) -> str | None:
    """The key to send: the flag's, else ``VLLM_API_KEY``'s, else None (checked as a
    header value, ``api_key_value``)."""
    return api_key_value("engine-api-key", value or os.environ.get(VLLM_KEY_VAR))


def engine_headers(key: str | None) -> dict[str, str] | None:
    return {"authorization": f"Bearer {key}"} if key is not None else None
