"""A keyed gateway's tenants sending vLLM's ``kv_transfer_params`` through a gateway from
each tree: what does the engine report, and what does a malformed one cost?

    # the engine: any vLLM 0.32 (no KV connector needed), e.g. on 127.0.0.1:8100
    .venv/bin/python benchmarks/transfer_params_vllm.py --engine http://127.0.0.1:8100 \
        --tree before=DIR --tree after=.

Per tree, a gateway in keyed mode (a tenant, a shared-namespace tenant for the Messages
API, an admin) in front of the engine. Each API is asked a short prompt (below one
128-token block: nothing of it can be cached) twice, as sent and with
``{"do_remote_prefill": true, "remote_prefill_cached_tokens": P}`` (P: its prompt
tokens), once with the tenant's key and once with the admin's. Prints the cached tokens
the answer reports, and the gateway's ``prefixgate_gateway_reported_cached_tokens``.
Then a chat with ``vllm_xargs: {"kv_transfer_params": "x"}``: the gateway's status and
the 5xx answers the engine counted (its ``http_requests_total``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from prefixgate.procs import free_port, stop_process, wait_http_ok

KEYS = {
    "sk-tenant": {"tenant": "alpha"},
    "sk-shared": {"tenant": "docs", "shared_namespace": True},
    "sk-admin": {"tenant": "ops", "admin": True},
}
PROMPT = "Write one line about the bakery on Elm Street."


def request(api: str, model: str) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": PROMPT}]
    if api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 2}
    if api == "completions":
        return "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2}
    if api == "responses":
        return "/v1/responses", {"model": model, "input": PROMPT, "max_output_tokens": 2}
    return "/v1/messages", {"model": model, "messages": messages, "max_tokens": 2}


def usage_of(api: str, answer: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) as each API reports them."""
    u = answer["usage"]
    if api == "messages":
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    if api == "responses":
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def post(url: str, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def run(tree: str, label: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as work:
        keys = Path(work) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        port = free_port()
        cmd = [sys.executable, "-m", "prefixgate", "gateway", "--port", str(port)]
        cmd += ["--replica", args.engine, "--api-keys", str(keys)]
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        with open(Path(work) / "gateway.log", "ab") as log:
            proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http_ok(url + "/ready", 120, [proc])
            for api in ("chat", "completions", "responses", "messages"):
                path, body = request(api, args.model)
                for who in ("tenant", "admin"):
                    key = "sk-shared" if api == "messages" and who == "tenant" else f"sk-{who}"
                    if api == "messages" and who == "admin":
                        continue  # the Messages API is a shared-namespace tenant's
                    plain = post(url, key, path, body)
                    plain.raise_for_status()
                    prompt, cached = usage_of(api, plain.json())
                    params = {"do_remote_prefill": True, "remote_prefill_cached_tokens": prompt}
                    forged = post(url, key, path, {**body, "kv_transfer_params": params})
                    forged.raise_for_status()
                    _, said = usage_of(api, forged.json())
                    print(
                        f"{label}: {api}, {who} key: cached {cached}/{prompt} as sent; "
                        f"{said}/{prompt} with remote_prefill_cached_tokens={prompt}"
                    )
            text = httpx.get(url + "/metrics").text
            reported = metric(text, "prefixgate_gateway_reported_cached_tokens_total")
            print(f"{label}: gateway's reported cached tokens, all requests: {reported:.0f}")
            engine_5xx = metric(httpx.get(args.engine + "/metrics").text, _FIVE_XX)
            path, body = request("chat", args.model)
            bad = post(url, "sk-tenant", path, {**body, "vllm_xargs": {"kv_transfer_params": "x"}})
            after_5xx = metric(httpx.get(args.engine + "/metrics").text, _FIVE_XX)
            error = bad.json().get("error", {})
            print(
                f"{label}: vllm_xargs kv_transfer_params 'x': gateway {bad.status_code} "
                f"({error.get('param') or error.get('type')}), engine 5xx answers "
                f"+{after_5xx - engine_5xx:.0f}"
            )
        finally:
            stop_process(proc, grace_s=5)


_FIVE_XX = 'http_requests_total{handler="/v1/chat/completions",method="POST",status="5xx"}'


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", required=True, metavar="URL")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()
    for name, tree in [t.split("=", 1) for t in args.tree] or [["this", "."]]:
        run(tree, name, args)


if __name__ == "__main__":
    main()
