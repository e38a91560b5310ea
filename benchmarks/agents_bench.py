"""Agents: requests that carry real tool definitions, through the gateway.

    .venv/bin/python benchmarks/agents_bench.py overhead [--requests 400 --repeats 3]
        [--no-baseline | --baseline-tree DIR]
    .venv/bin/python benchmarks/agents_bench.py routing [--agents 6 --sessions 3]

``overhead``: the gateway's added latency for a chat with 30 tool definitions (about 6k
tokens of schema), at concurrency 1 over the stub backend: p50/p99 of the full response
direct vs through the gateway, which renders the tool-aware template
(tests/support/tool_template.jinja) and tokenizes every request (``--tokenizer
tiny-random``); the user's question changes on every request. A second gateway started
with ``--key-memo-mb 0`` (no memory of recent prompts' block keys) is measured in the
same run (``--no-baseline``: not; ``--baseline-tree DIR``: the gateway of another source
tree instead, e.g. an older commit's); requests go to the targets in rotating order, so
that other load on the machine falls on each alike.

``routing``: an agents workload on two tiny-random replicas (tests/support/scripted_replica.py:
real forward passes and prefix caches, scripted tool calls) through one gateway with
Redis, once per policy (cache_aware, round_robin), everything restarted in between. Each
agent has its own system prompt and 10-30 tools; each session is a tool loop (question ->
tool call -> tool result -> answer), sessions run 4 at a time. Reported per policy: the
prompt tokens served from cache (usage cached_tokens / prompt_tokens) and the TTFT p50
(first streamed chunk with content or a tool call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefixgate.procs import free_port, start_redis, stop_process, wait_http_ok  # noqa: E402

TEMPLATE = ROOT / "tests" / "support" / "tool_template.jinja"
MODEL = "tiny-random"
DOMAINS = ["calendar", "crm", "billing", "search", "files", "tickets", "weather", "email"]
VERBS = ["get", "list", "create", "update", "delete", "search", "export", "assign"]


def tool(i: int) -> dict[str, Any]:
    """A realistic function schema (about 130 tokens): typed, described, with enums."""
    domain, verb = DOMAINS[i % len(DOMAINS)], VERBS[(i // len(DOMAINS)) % len(VERBS)]
    return {
        "type": "function",
        "function": {
            "name": f"{verb}_{domain}_{i}",
            "description": f"{verb.capitalize()} {domain} records for the current user. "
            f"Use it when the user asks about their {domain}; results are paginated and "
            "sorted by last modification, newest first.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": f"free text to match {domain}"},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                    "cursor": {"type": "string", "description": "page cursor from a result"},
                    "status": {"type": "string", "enum": ["open", "closed", "archived", "any"]},
                    "fields": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "fields to return (default: all)",
                    },
                },
                "required": ["query"],
            },
        },
    }


def tools(first: int, count: int) -> list[dict[str, Any]]:
    return [tool(first + i) for i in range(count)]


def _pct(values: list[float], p: int) -> float:
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[p - 1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc): the figure least moved by
    other load on a shared machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(
    args: list[str],
    port: int,
    procs: list[subprocess.Popen[bytes]],
    log: Path,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
) -> str:
    """``python ARGS`` in ``cwd`` (its source tree), ``env`` added to this process's
    environment; returns its URL once ``/health`` answers."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, **(env or {})},
        )  # fmt: skip
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/health", timeout=180, procs=[proc])
    return url


def overhead(n: int, repeats: int, baseline: bool, baseline_tree: Path | None) -> None:
    """Direct, then through each gateway, one request after the other in rotating order
    (so that load on the machine falls on every target alike), ``repeats`` times."""
    import httpx

    from prefixgate.tokenizer import ChatTokenizer

    defs = tools(0, 30)
    tokenizer = ChatTokenizer.for_model(MODEL)
    tokenizer.set_chat_template(TEMPLATE.read_text())
    schema_tokens = len(tokenizer.encode(json.dumps(defs)))
    procs: list[subprocess.Popen[bytes]] = []
    load_before = os.getloadavg()
    rows: list[tuple[int, dict[str, tuple[float, float]], dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            port = free_port()
            stub_args = ["-m", "tests.support.stub_backend", "--port", str(port)]
            stub = start([*stub_args, "--model", MODEL], port, procs, Path(tmp) / "stub.log")
            targets = {"direct (stub)": stub}
            # name -> (source tree, extra flags)
            gateways: dict[str, tuple[Path, list[str]]] = {"gateway": (ROOT, [])}
            if baseline_tree is not None:  # another checkout's gateway (git archive REV)
                gateways = {f"gateway of {baseline_tree.name}": (baseline_tree, []), **gateways}
            elif baseline:  # the same gateway without the key memo (gateway/key_memo.py)
                gateways = {"gateway, no key memo": (ROOT, ["--key-memo-mb", "0"]), **gateways}
            for name, (tree, extra) in gateways.items():
                port = free_port()
                targets[name] = start(
                    ["-m", "prefixgate", "gateway", "--port", str(port),
                     "--replica", targets["direct (stub)"], "--tokenizer", MODEL,
                     "--chat-template", str(TEMPLATE), "--log-level", "info", *extra],
                    port, procs, Path(tmp) / f"gateway{len(targets)}.log", cwd=tree,
                )  # fmt: skip
                wait_http_ok(targets[name] + "/ready", timeout=60, procs=procs)
            names = list(targets)
            with httpx.Client(timeout=30) as client:
                for repeat in range(repeats):
                    times: dict[str, list[float]] = {name: [] for name in names}
                    cpu_before = {
                        name: cpu_seconds(p.pid) for name, p in zip(names, procs, strict=True)
                    }
                    for i in range(n + 20):
                        body = {
                            "model": MODEL,
                            "messages": [
                                {"role": "system", "content": "You are an operations agent."},
                                {"role": "user", "content": f"Request {i}: list my open tickets"},
                            ],
                            "tools": defs,
                            "max_tokens": 8,
                        }
                        for k in range(len(names)):
                            name = names[(i + k) % len(names)]
                            started = time.perf_counter()
                            r = client.post(targets[name] + "/v1/chat/completions", json=body)
                            elapsed = time.perf_counter() - started
                            assert r.status_code == 200, r.text
                            if i >= 20:  # warm-up: connections, the tokenizer, its caches
                                times[name].append(elapsed * 1e3)
                    # per request it served: the stub serves every target's requests
                    served = {name: n + 20 for name in names} | {names[0]: len(names) * (n + 20)}
                    cpu = {
                        name: (cpu_seconds(p.pid) - cpu_before[name]) / served[name] * 1e3
                        for name, p in zip(names, procs, strict=True)
                    }
                    percentiles = {k: (_pct(v, 50), _pct(v, 99)) for k, v in times.items()}
                    rows.append((repeat, percentiles, cpu))
        finally:
            for proc in procs:
                stop_process(proc, grace_s=5)
    load_after = os.getloadavg()
    print(
        f"30 tools, {schema_tokens} tokens of schema JSON, {n} requests per target and "
        f"repeat, interleaved, concurrency 1; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after"
    )
    for repeat, percentiles, cpu in rows:
        direct = percentiles["direct (stub)"][0]
        print(f"  repeat {repeat + 1}")
        for name, (p50, p99) in percentiles.items():
            added = "" if name == "direct (stub)" else f"  added p50 {p50 - direct:+.2f} ms"
            print(
                f"    {name:<22} full p50 {p50:.2f} ms  p99 {p99:.2f} ms  "
                f"server CPU {cpu[name]:.2f} ms/request{added}"
            )


def session(
    url: str, agent: int, index: int, system: str, defs: Any
) -> list[tuple[int, int, float]]:
    """One tool loop; (prompt tokens, cached tokens, ttft s) per turn."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Agent {agent}, session {index}: what is the weather?"},
    ]
    out = []
    for _ in range(2):
        started = time.perf_counter()
        first: float | None = None
        calls: list[Any] = []
        content = ""
        usage: Any = None
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, tools=defs, max_tokens=64, stream=True,
            stream_options={"include_usage": True},
        ):  # fmt: skip
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if first is None and (delta.content or delta.tool_calls):
                first = time.perf_counter()
            content += delta.content or ""
            calls += delta.tool_calls or []
        cached = usage.prompt_tokens_details.cached_tokens or 0
        out.append((usage.prompt_tokens, cached, (first or time.perf_counter()) - started))
        if not calls:
            break
        call = calls[0]
        messages.append(
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
            ]}
        )  # fmt: skip
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'})
    return out


def routing(agents: int, sessions: int) -> None:
    systems = [f"You are agent {a} of the operations team. " * 20 for a in range(agents)]
    tool_sets = [tools(a * 40, 10 + (a * 7) % 21) for a in range(agents)]
    work = [(a, s) for s in range(sessions) for a in range(agents)]
    print(f"{agents} agents with {[len(t) for t in tool_sets]} tools, {sessions} sessions each")
    for policy in ("cache_aware", "round_robin"):
        procs: list[subprocess.Popen[bytes]] = []
        with tempfile.TemporaryDirectory() as tmp:
            try:
                port = free_port()
                redis_url = f"redis://127.0.0.1:{port}/0"
                procs.append(start_redis(port, Path(tmp)))
                urls = []
                for i in range(2):
                    port = free_port()
                    urls.append(start(
                        ["-m", "tests.support.scripted_replica", "--model", MODEL,
                         "--port", str(port), "--num-blocks", "2048", "--redis-url", redis_url,
                         "--replica-id", f"r{i}", "--chat-template", str(TEMPLATE),
                         "--tool-call-parser", "hermes"],
                        port, procs, Path(tmp) / f"r{i}.log",
                    ))  # fmt: skip
                port = free_port()
                gw_args = ["-m", "prefixgate", "gateway", "--port", str(port), "--policy", policy]
                gw_args += ["--redis-url", redis_url, "--chat-template", str(TEMPLATE)]
                for url in urls:
                    gw_args += ["--replica", url]
                gateway = start(gw_args, port, procs, Path(tmp) / "gw.log")
                wait_http_ok(gateway + "/ready?min_replicas=2", timeout=60, procs=procs)
                with ThreadPoolExecutor(4) as pool:
                    turns = [
                        t
                        for turns in pool.map(
                            lambda w, gw=gateway: session(
                                gw, w[0], w[1], systems[w[0]], tool_sets[w[0]]
                            ),
                            work,
                        )
                        for t in turns
                    ]
            finally:
                for proc in reversed(procs):
                    stop_process(proc, grace_s=5)
        prompt = sum(t[0] for t in turns)
        cached = sum(t[1] for t in turns)
        ttft = [t[2] * 1e3 for t in turns]
        print(
            f"  {policy:<12} turns {len(turns)}  prompt tokens {prompt}  hit rate "
            f"{cached / prompt:.3f}  TTFT p50 {_pct(ttft, 50):.1f} ms  p90 {_pct(ttft, 90):.1f} ms"
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--requests", type=int, default=400)
    o.add_argument("--repeats", type=int, default=3)
    o.add_argument(
        "--no-baseline", action="store_true", help="skip the gateway without the key memo"
    )
    o.add_argument(
        "--baseline-tree",
        type=Path,
        help="measure this source tree's gateway (e.g. `git archive REV | tar -x -C DIR`) "
        "instead of the one without the key memo",
    )
    r = sub.add_parser("routing")
    r.add_argument("--agents", type=int, default=6)
    r.add_argument("--sessions", type=int, default=3)
    args = parser.parse_args()
    if args.what == "overhead":
        overhead(args.requests, args.repeats, not args.no_baseline, args.baseline_tree)
    else:
        routing(args.agents, args.sessions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
