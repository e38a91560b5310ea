"""Does the built-in replica report log probabilities as a real vLLM does?

    VLLM_SERVER_DEV_MODE=1 /work/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
        --model ~/.cache/prefixgate/models/smollm2-135m-v1 --served-model-name smollm2-135m \
        --port 8100 --enable-prefix-caching --max-model-len 4096 --gpu-memory-utilization 0.25
    prefixgate replica --model smollm2-135m --port 8820      # the built-in replica
    .venv/bin/python benchmarks/logprobs_vllm.py --vllm http://127.0.0.1:8100 \
        --ours http://127.0.0.1:8820

The same requests go to both as raw HTTP: chat and completion log probabilities, whole
and streamed; a completion's echo scoring its prompt, as lm-evaluation-harness sends it
(a batch of token-id prompts, one token, ``logprobs`` 1, ``echo``); vLLM's
``prompt_logprobs``; and the bad requests. Printed side by side: each answer's fields
and their lengths, the tokens, and the largest difference between the two servers' log
probabilities of the same prompt tokens (a fixed text, so both score the same tokens;
their forward passes differ in dtype and float order, so the values are close, not
equal). Generated tokens are compared only where both chose the same ones.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

MODEL = "smollm2-135m"
CHAT: Any = [{"role": "user", "content": "Name three colours of the rainbow."}]
TEXT = "The harbour master checked the tide tables before the fishing boats left at dawn."


def post(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = httpx.post(base + path, json=body, timeout=300)
    if body.get("stream") and r.status_code == 200:
        chunks = [
            json.loads(line[6:])
            for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return r.status_code, chunks
    return r.status_code, r.json()


def chat_shape(logprobs: Any) -> dict[str, Any]:
    if logprobs is None:
        return {"logprobs": None}
    items = logprobs["content"]
    return {
        "fields": sorted(logprobs),
        "item fields": sorted(items[0]) if items else [],
        "items": len(items),
        "top sizes": sorted({len(i["top_logprobs"]) for i in items}),
        "top[0] is the token": all(
            not i["top_logprobs"] or i["top_logprobs"][0]["token"] == i["token"] for i in items
        ),
        "bytes are the token's": all(i["bytes"] == list(i["token"].encode()) for i in items),
    }


def completion_shape(logprobs: Any) -> dict[str, Any]:
    if logprobs is None:
        return {"logprobs": None}
    tokens = logprobs["tokens"]
    return {
        "fields": sorted(logprobs),
        "lengths": sorted({len(logprobs[k]) for k in logprobs}),
        "first value": logprobs["token_logprobs"][0],
        "top sizes": sorted({-1 if t is None else len(t) for t in logprobs["top_logprobs"]}),
        "offsets add up": logprobs["text_offset"]
        == [
            sum(len(t) for t in tokens[:i]) + logprobs["text_offset"][0] for i in range(len(tokens))
        ],
    }


def merge_stream(chunks: list[Any], chat: bool) -> dict[int, dict[str, Any]]:
    """A stream's log probabilities per choice, chunks joined, and its text."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.get("choices", []):
            entry = out.setdefault(
                c["index"], {"text": "", "content": [], "tokens": [], "values": [], "offsets": []}
            )
            entry["text"] += (c.get("delta", {}).get("content") or "") if chat else c["text"]
            lp = c.get("logprobs")
            if lp is None:
                continue
            if chat:
                entry["content"] += lp["content"] or []
            else:
                entry["tokens"] += lp["tokens"]
                entry["values"] += lp["token_logprobs"]
                entry["offsets"] += lp["text_offset"]
    return out


def max_diff(a: list[float | None], b: list[float | None]) -> float | str:
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    if len(a) != len(b):
        return f"lengths differ: {len(a)} against {len(b)}"
    return round(max(abs(x - y) for x, y in pairs), 4) if pairs else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--ours", required=True)
    args = parser.parse_args()
    servers = {"vllm": args.vllm, "ours": args.ours}
    ids = httpx.post(args.vllm + "/tokenize", json={"model": MODEL, "prompt": TEXT}).json()[
        "tokens"
    ]
    mine = httpx.post(args.ours + "/tokenize", json={"model": MODEL, "prompt": TEXT}).json()[
        "tokens"
    ]
    print(f"tokenize: {len(ids)} ids, equal: {ids == mine}")

    def both(title: str, path: str, body: dict[str, Any], show: Any) -> dict[str, Any]:
        print(f"\n== {title}")
        answers = {}
        for name, base in servers.items():
            status, answer = post(base, path, body)
            answers[name] = (status, answer)
            print(f"  {name:5s} {status} {json.dumps(show(status, answer), sort_keys=True)}")
        return answers

    greedy = {"model": MODEL, "temperature": 0}
    # Chat, whole and streamed.
    chat = {**greedy, "messages": CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": 3}
    answers = both(
        "chat, logprobs with top_logprobs 3",
        "/v1/chat/completions",
        chat,
        lambda s, a: {
            "choice fields": sorted(a["choices"][0]),
            **chat_shape(a["choices"][0]["logprobs"]),
        },
    )
    tokens = {
        n: [i["token"] for i in a["choices"][0]["logprobs"]["content"]]
        for n, (_, a) in answers.items()
    }
    print(f"  tokens: vllm {tokens['vllm']}\n          ours {tokens['ours']}")
    streamed = both(
        "chat, streamed",
        "/v1/chat/completions",
        {**chat, "stream": True},
        lambda s, a: chat_shape({"content": merge_stream(a, True)[0]["content"]}),
    )
    for name, (_, chunks) in streamed.items():
        joined = [i["token"] for i in merge_stream(chunks, True)[0]["content"]]
        print(f"  {name}: the stream's tokens are the whole answer's: {joined == tokens[name]}")
    both(
        "chat, logprobs true (no top_logprobs)",
        "/v1/chat/completions",
        {**greedy, "messages": CHAT, "max_tokens": 3, "logprobs": True},
        lambda s, a: chat_shape(a["choices"][0]["logprobs"]),
    )
    both(
        "chat, prompt_logprobs 1",
        "/v1/chat/completions",
        {**greedy, "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 1},
        lambda s, a: {
            "fields": sorted(a),
            "prompt_logprobs": len(a["prompt_logprobs"]),
            "first": a["prompt_logprobs"][0],
            "entry fields": sorted(next(iter(a["prompt_logprobs"][1].values()))),
            "entry sizes": sorted({len(e) for e in a["prompt_logprobs"][1:]}),
        },
    )
    # Completions.
    both(
        "completion, logprobs 2",
        "/v1/completions",
        {**greedy, "prompt": TEXT, "max_tokens": 6, "logprobs": 2},
        lambda s, a: {
            "choice fields": sorted(a["choices"][0]),
            **completion_shape(a["choices"][0]["logprobs"]),
        },
    )
    harness = {**greedy, "prompt": [ids, ids[:-3]], "max_tokens": 1, "logprobs": 1, "echo": True}
    echoed = both(
        "completion, lm-evaluation-harness's loglikelihood request "
        "(2 id prompts, echo, logprobs 1)",
        "/v1/completions",
        harness,
        lambda s, a: [
            {"choice fields": sorted(c), **completion_shape(c["logprobs"])} for c in a["choices"]
        ],
    )
    (_, v), (_, o) = echoed["vllm"], echoed["ours"]
    for i in range(2):
        n = len(ids) if i == 0 else len(ids) - 3
        va, oa = v["choices"][i]["logprobs"], o["choices"][i]["logprobs"]
        tops = zip(va["top_logprobs"][:n], oa["top_logprobs"][:n], strict=True)
        same_top = sum(list(x or {})[:1] == list(y or {})[:1] for x, y in tops)
        print(
            f"  prompt {i}: prompt tokens' strings equal: {va['tokens'][:n] == oa['tokens'][:n]}; "
            f"largest |difference| of their log probabilities: "
            f"{max_diff(va['token_logprobs'][:n], oa['token_logprobs'][:n])}; "
            f"top-1 token equal at {same_top}/{n} positions"
        )
        ranks_v = [
            e[str(t)]["rank"]
            for e, t in zip(v["choices"][i]["prompt_logprobs"][1:], ids[1:n], strict=True)
        ]
        ranks_o = [
            e[str(t)]["rank"]
            for e, t in zip(o["choices"][i]["prompt_logprobs"][1:], ids[1:n], strict=True)
        ]
        print(f"  prompt {i}: ranks vllm {ranks_v}\n            ranks ours {ranks_o}")
    streamed = both(
        "completion, echo with logprobs 1, streamed",
        "/v1/completions",
        {**greedy, "prompt": TEXT, "max_tokens": 4, "logprobs": 1, "echo": True, "stream": True},
        lambda s, a: {
            "chunks": len(a),
            "first chunk starts with the prompt": a[0]["choices"][0]["text"].startswith(TEXT),
            "first chunk's tokens": len(a[0]["choices"][0]["logprobs"]["tokens"]),
            "first value": a[0]["choices"][0]["logprobs"]["token_logprobs"][0],
        },
    )
    for name, (_, chunks) in streamed.items():
        merged = merge_stream(chunks, False)[0]
        offsets_ok = merged["offsets"] == [
            sum(len(t) for t in merged["tokens"][:i]) for i in range(len(merged["tokens"]))
        ]
        print(
            f"  {name}: {len(merged['tokens'])} tokens, offsets run on across chunks: {offsets_ok}"
        )
    # Refusals.
    for title, path, body in [
        (
            "top_logprobs without logprobs",
            "/v1/chat/completions",
            {**greedy, "messages": CHAT, "top_logprobs": 2},
        ),
        (
            "top_logprobs 21",
            "/v1/chat/completions",
            {**greedy, "messages": CHAT, "logprobs": True, "top_logprobs": 21},
        ),
        (
            "chat prompt_logprobs streamed",
            "/v1/chat/completions",
            {**greedy, "messages": CHAT, "prompt_logprobs": 1, "stream": True},
        ),
        ("completion logprobs 21", "/v1/completions", {**greedy, "prompt": TEXT, "logprobs": 21}),
        (
            "completion logprobs -1",
            "/v1/completions",
            {**greedy, "prompt": TEXT, "logprobs": -1, "max_tokens": 2},
        ),
    ]:
        both(
            f"refused: {title}",
            path,
            body,
            lambda s, a: a.get("error", {}).get("message", "")[:110] if s != 200 else "answered",
        )


if __name__ == "__main__":
    main()
