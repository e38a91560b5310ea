"""HTTPS on both sides of a gateway in front of a vLLM that wants client certificates.

    VLLM_SERVER_DEV_MODE=1 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
        --model ~/.cache/prefixgate/models/smollm2-135m-v1 --served-model-name smollm2-135m \
        --port 8100 --enable-prefix-caching --enable-prompt-tokens-details \
        --max-model-len 4096 --ssl-certfile server.pem --ssl-keyfile server.key \
        --ssl-ca-certs ca.pem --ssl-cert-reqs 2 --kv-events-config \
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
          "replay_endpoint":"tcp://*:5558","topic":"kv"}'
    .venv/bin/python benchmarks/tls_vllm.py --engine-url https://127.0.0.1:8100 \
        --certs DIR   # ca.pem, server.pem/.key (the gateway's own), client.pem/.key

Starts Redis, a bridge and two gateways, all given the CA and the client certificate: one
serves HTTPS with the server certificate, the other plain HTTP. Then:

* parity: greedy chats, whole and streamed, directly and through the HTTPS gateway;
* the cache: questions after one long system prompt, through the HTTPS gateway, each
  one's cached prompt tokens (vLLM's usage);
* the cost of TLS at the front: one-token completions through each gateway, on one kept
  connection and on a new connection each, interleaved; median and p90 milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from prefixgate.procs import free_port, start_redis, stop_process
from prefixgate.tls import client_context

SYSTEM = "You are a careful assistant for a hardware store. " * 60


def wait_ready(url: str, verify: Any, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} exited with {p.returncode}")
        try:
            if httpx.get(url + "/ready?min_replicas=1", verify=verify, timeout=2).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling interval
    raise TimeoutError(f"{url} not ready")


def chat(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]]) -> Any:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = client.post(url + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def streamed(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]]) -> str:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    body["stream"] = True
    text = []
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def one_token(client: httpx.Client, url: str, model: str) -> float:
    body = {"model": model, "prompt": "Hi", "max_tokens": 1}
    started = time.perf_counter()
    client.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--certs", required=True, type=Path)
    p.add_argument("--kv-events", default="tcp://127.0.0.1:5557")
    p.add_argument("--replay", default="tcp://127.0.0.1:5558")
    p.add_argument("--topic", default="kv")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=30, help="per arm and round")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    d = args.certs
    ca, cert, key = str(d / "ca.pem"), str(d / "client.pem"), str(d / "client.key")
    shown = client_context(ca, cert, key)  # what the engine wants
    trusted = client_context(ca)  # what a client of the gateway needs
    work = Path(tempfile.mkdtemp(prefix="tls-vllm-"))
    procs: list[subprocess.Popen[bytes]] = []

    def start(cmd: list[str], name: str) -> None:
        out = open(work / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        procs.append(subprocess.Popen([sys.executable, "-m", "prefixgate", *cmd], stdout=out,
                                      stderr=subprocess.STDOUT))  # fmt: skip

    try:
        redis_port = free_port()
        procs.append(start_redis(redis_port, work / "redis"))
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        engine_tls = ["--engine-ca-certs", ca, "--engine-certfile", cert, "--engine-keyfile", key]
        start(["bridge", "--engine-url", args.engine_url, "--kv-events", args.kv_events,
               "--replay", args.replay, "--topic", args.topic, "--redis-url", redis_url,
               "--no-tokenizer-check", *engine_tls], "bridge")  # fmt: skip
        upstream = ["--upstream-ca-certs", ca, "--upstream-certfile", cert]
        upstream += ["--upstream-keyfile", key, "--redis-url", redis_url]
        https_port, http_port = free_port(), free_port()
        start(["gateway", "--port", str(https_port), *upstream,
               "--ssl-certfile", str(d / "server.pem"), "--ssl-keyfile", str(d / "server.key")],
              "gateway-https")  # fmt: skip
        start(["gateway", "--port", str(http_port), *upstream], "gateway-http")
        https_url = f"https://127.0.0.1:{https_port}"
        http_url = f"http://127.0.0.1:{http_port}"
        wait_ready(https_url, trusted, procs)
        wait_ready(http_url, True, procs)
        print(f"engine {args.engine_url}; gateways {https_url} and {http_url}; logs in {work}")

        direct = httpx.Client(verify=shown)
        front = httpx.Client(verify=trusted)
        same = 0
        questions = ["What is a torque wrench?", "Name three kinds of saw.", "What is grout?"]
        for q in questions:
            messages = [{"role": "user", "content": q}]
            a = chat(direct, args.engine_url, args.model, messages)["choices"][0]["message"]
            b = chat(front, https_url, args.model, messages)["choices"][0]["message"]
            s = streamed(front, https_url, args.model, messages)
            same += a["content"] == b["content"] == s
        print(f"parity: {same} of {len(questions)} greedy chats the same direct, through the "
              "HTTPS gateway, and streamed through it")  # fmt: skip

        cached = []
        for q in ["Where are the hammers?", "Do you cut keys?", "Is there parking?", "Hours?"]:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            usage = chat(front, https_url, args.model, messages)["usage"]
            details = usage.get("prompt_tokens_details") or {}
            cached.append(f"{details.get('cached_tokens')}/{usage['prompt_tokens']}")
        print("cache through the HTTPS gateway (cached/prompt tokens): " + ", ".join(cached))

        arms: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, url, verify in (("https", https_url, trusted), ("http", http_url, True)):
                with httpx.Client(verify=verify) as kept:
                    one_token(kept, url, args.model)  # the connection made
                    arms.setdefault(f"{name}, kept connection", []).extend(
                        one_token(kept, url, args.model) for _ in range(args.requests)
                    )
                new = arms.setdefault(f"{name}, new connection each", [])
                for _ in range(args.requests):
                    with httpx.Client(verify=verify) as fresh:
                        new.append(one_token(fresh, url, args.model))
        for name, values in arms.items():
            values.sort()
            p90 = values[int(0.9 * (len(values) - 1))]
            print(f"{name:32s} median {statistics.median(values):7.1f} ms  p90 {p90:7.1f} ms"
                  f"  ({len(values)} requests)")  # fmt: skip
    finally:
        for proc in reversed(procs):
            stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
