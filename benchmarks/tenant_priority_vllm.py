"""Can one tenant put its requests ahead of another's? A keyed gateway from each given
tree in front of a vLLM that schedules by priority, one sequence at a time:

    vllm ... --port 8101 --scheduling-policy priority --max-num-seqs 1
    .venv/bin/python benchmarks/tenant_priority_vllm.py --engine-url http://127.0.0.1:8101 \
        --tree before=DIR --tree after=.

The keys file gives the batch tenant ``priority: 10`` and the interactive one
``priority: 0`` (a tree that does not know the field ignores it). A long interactive
request runs; the batch tenant then sends ``--batch`` requests claiming priority −100
(header and body), and the interactive tenant one plain request. Prints the order in
which the queued requests ended and the interactive request's time, per tree.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx
from passed_headers_vllm import MODEL, gateway_from_tree

from prefixgate.procs import stop_process

KEYS = {
    "sk-batch": {"tenant": "batch", "priority": 10},
    "sk-chat": {"tenant": "chat", "priority": 0},
}


def chat(url: str, key: str, text: str, tokens: int, claim: int | None = None) -> None:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    if claim is not None:
        body["priority"] = claim
        headers["x-vllm-priority"] = str(claim)
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=600)
    r.raise_for_status()


def run(url: str, batch: int) -> str:
    ended: list[str] = []
    lock = threading.Lock()

    def ask(name: str, key: str, claim: int | None) -> None:
        chat(url, key, f"{name}: write a list of numbers.", 24, claim)
        with lock:
            ended.append(name)

    long = threading.Thread(target=chat, args=(url, "sk-chat", "Count to fifty.", 120))
    long.start()
    time.sleep(1.0)  # the long request runs: what follows waits in the engine's queue
    threads = []
    for i in range(batch):
        t = threading.Thread(target=ask, args=(f"batch-{i}", "sk-batch", -100))
        t.start()
        threads.append(t)
        time.sleep(0.1)  # sent in this order
    started = time.monotonic()
    ask("interactive", "sk-chat", None)
    waited = time.monotonic() - started
    for t in (long, *threads):
        t.join()
    place = ended.index("interactive") + 1
    order = ", ".join(ended)
    return f"ended: {order}; the interactive request {place} of {len(ended)}, {waited:.2f} s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url", required=True)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    keys = Path(tempfile.mkdtemp()) / "keys.json"
    keys.write_text(json.dumps(KEYS))
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        url, proc = gateway_from_tree(
            tree, args.engine_url, f"/tmp/priority-{name}.log", flags=["--api-keys", str(keys)]
        )
        try:
            print(f"{name:7s} {run(url, args.batch)}", flush=True)
        finally:
            stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
