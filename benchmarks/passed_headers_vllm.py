"""Do the request headers vLLM reads reach it through a gateway? Trace context, priority
and session id, against a vLLM started to use all three:

    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf /work/vllm-venv/bin/python -m \
        vllm.entrypoints.openai.api_server --model ~/.cache/prefixgate/models/smollm2-135m-v1 \
        --served-model-name smollm2-135m --port 8100 --enable-prefix-caching \
        --scheduling-policy priority --max-num-seqs 1 \
        --otlp-traces-endpoint http://127.0.0.1:4318/v1/traces --kv-events-config \
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557",
          "topic":"kv"}'   # a host:port: vLLM connects to it
    .venv/bin/python benchmarks/passed_headers_vllm.py --engine-url http://127.0.0.1:8100 \
        --spans SPANS.jsonl --tree before=/tmp/wt-before --tree after=.

``--spans``: where an OTLP receiver writes each span vLLM exports, one JSON object a line
with its ``trace_id`` and ``parent`` (span id), hex. For each ``--tree NAME=DIR`` a gateway
from that source tree is started in front of the engine, and, through it:

* trace: a chat with a ``traceparent``; does vLLM export a span in the caller's trace,
  child of the caller's span (polled for 20 s: vLLM exports spans in batches)?
* session: a chat with ``X-Session-ID``; does a block event the engine publishes name it?
  (Events are read from a socket bound at ``--kv-events``, which the engine connects to.)
* priority: with one sequence at a time, a long request runs; then a request with
  ``X-Vllm-Priority: 5`` is sent, then one with ``-5``: which ends first? (vLLM runs the
  lower value first; without the header both are 0, and the first sent goes first.)

The same three are sent to the engine directly, as the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import zmq

from prefixgate.procs import free_port, stop_process, wait_http_ok

MODEL = "smollm2-135m"


def chat(url: str, text: str, headers: dict[str, str], max_tokens: int = 4) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    body |= {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)


def trace(url: str, spans: Path) -> str:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    chat(url, "Say hi.", {"traceparent": f"00-{trace_id}-{parent}-01"})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for line in spans.read_text().splitlines() if spans.exists() else []:
            span = json.loads(line)
            if span["trace_id"] == trace_id:
                child = "child of the caller's span" if span["parent"] == parent else "other parent"
                return f"in the caller's trace, {child}"
        time.sleep(0.5)  # polling the receiver's file
    return "not in the caller's trace (20 s)"


def session(url: str, sub: zmq.Socket[bytes]) -> str:
    while sub.poll(0):  # what earlier requests published
        sub.recv_multipart()
    name = "session-" + secrets.token_hex(4)
    text = f"{name}: " + "Describe a quiet harbour at dawn in great detail. " * 40
    chat(url, text, {"x-session-id": name})
    deadline = time.monotonic() + 10
    found = False
    while time.monotonic() < deadline and not found:
        if sub.poll(500):
            found = name.encode() in b"".join(sub.recv_multipart())
    return "a block event names it" if found else "no block event names it (10 s)"


def priority(url: str) -> str:
    done: list[str] = []
    long = threading.Thread(target=chat, args=(url, "Count to fifty.", {}, 150))
    long.start()
    time.sleep(1.0)  # the long request is running: the next two wait in the queue

    def ask(text: str, value: str) -> None:
        chat(url, text, {"x-vllm-priority": value})
        done.append(value)

    low = threading.Thread(target=ask, args=("Say one.", "5"))
    high = threading.Thread(target=ask, args=("Say two.", "-5"))
    low.start()
    time.sleep(0.3)  # sent in this order
    high.start()
    for t in (long, low, high):
        t.join()
    return f"ended first: priority {done[0]}" + (" (the higher)" if done[0] == "-5" else "")


def gateway_from_tree(
    tree: str,
    engine_url: str | list[str],
    log_path: str,
    env: dict[str, str] | None = None,
    flags: list[str] | None = None,
    port: int | None = None,
) -> tuple[str, subprocess.Popen[bytes]]:
    """A gateway run from the source tree ``tree`` in front of ``engine_url`` (one or a
    list), with ``env`` added to its environment and ``flags`` on its command line, on
    ``port`` (a free one by default), once ready: its URL and process (stopped by the
    caller)."""
    port = port or free_port()
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(Path(tree).resolve())}
    replicas = [engine_url] if isinstance(engine_url, str) else engine_url
    log = open(log_path, "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixgate", "gateway", "--port", str(port),
         *[arg for url in replicas for arg in ("--replica", url)], "--model", MODEL,
         *(flags or [])],
        cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready?min_replicas={len(replicas)}", 60, [proc])
    except Exception:
        stop_process(proc, grace_s=5)
        raise
    return f"http://127.0.0.1:{port}", proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument(
        "--kv-events",
        default="tcp://127.0.0.1:5557",
        help="the engine's event endpoint; bound here (the engine connects to a host:port)",
    )
    p.add_argument("--spans", required=True, type=Path)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    args = p.parse_args()
    targets: list[tuple[str, str, subprocess.Popen[bytes] | None]] = [
        ("direct", args.engine_url, None)
    ]
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        url, proc = gateway_from_tree(tree, args.engine_url, f"/tmp/passed-headers-{name}.log")
        targets.append((f"gateway ({name})", url, proc))
    results: dict[str, dict[str, Any]] = {}
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.bind(args.kv_events)  # vLLM connects its publisher to a tcp://host:port endpoint
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        for name, url, _ in targets:
            results[name] = {
                "trace": trace(url, args.spans),
                "session": session(url, sub),
                "priority": priority(url),
            }
            print(f"{name:18s} {json.dumps(results[name])}", flush=True)
    finally:
        for _, _, child in targets:
            if child is not None:
                stop_process(child, grace_s=5)


if __name__ == "__main__":
    main()
