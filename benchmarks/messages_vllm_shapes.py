"""Does the built-in replica answer Anthropic's ``/v1/messages`` as a real vLLM does?

    prefixgate up --engine vllm --replicas 1 --model smollm2-135m --port 8800 \
        --engine-python /work/vllm-venv/bin/python --engine-arg "--max-model-len 4096" \
        --engine-arg "--gpu-memory-utilization 0.3"      # vLLM at 8810
    prefixgate replica --model smollm2-135m --port 8820  # the built-in replica
    .venv/bin/python benchmarks/messages_vllm_shapes.py --vllm http://127.0.0.1:8810 \
        --ours http://127.0.0.1:8820

Both serve the same model (so the same tokenizer and chat template). The same requests go
to both with the official ``anthropic`` client and as raw HTTP: a whole answer, a stream
(the sequence of event types, repeated deltas collapsed), a stop sequence, a
``max_tokens`` cut, ``count_tokens``, and three bad requests. Printed side by side: the
fields each answer has, its stop reason and usage fields, the token counts (which must be
equal: same template, same tokenizer), and each error's status and shape. Greedy
decoding, but the texts are not compared: the two forward passes differ in float order.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import anthropic
import httpx

MODEL = "smollm2-135m"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
USER: Any = {"role": "user", "content": "Name three colours of the rainbow."}


def shape(message: Any) -> dict[str, Any]:
    body = message.model_dump(exclude_none=False)
    return {
        "fields": sorted(k for k in body if k not in ("kv_transfer_params", "ec_transfer_params")),
        "content types": [b["type"] for b in body["content"]],
        "stop": (body["stop_reason"], body["stop_sequence"]),
        "usage fields": sorted(k for k, v in body["usage"].items() if v is not None),
        "prompt tokens": sum(v or 0 for k, v in body["usage"].items() if "input" in k),
    }


def events(client: anthropic.Anthropic, **kwargs: Any) -> list[str]:
    kinds: list[str] = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            seen: Any = event
            kind: str = seen.type
            if kind in ("text", "input_json"):
                continue  # the SDK's own derived events
            if kind == "content_block_delta":
                kind += f"({seen.delta.type})"
            if not kinds or kinds[-1] != kind:  # repeated deltas collapsed
                kinds.append(kind)
        final = stream.get_final_message()
    return [*kinds, f"final stop={final.stop_reason}/{final.stop_sequence}"]


def errors(base: str) -> list[tuple[int, Any]]:
    bad = [
        {"model": MODEL, "messages": [USER]},  # no max_tokens
        {"model": "nope", "messages": [USER], "max_tokens": 4},
        {"model": MODEL, "messages": "hi", "max_tokens": 4},
    ]
    out = []
    for body in bad:
        r = httpx.post(base + "/v1/messages", json=body, timeout=60)
        kind: Any
        try:
            payload = r.json()
            kind = (payload.get("type"), sorted(payload.get("error", {})))
        except json.JSONDecodeError:
            kind = r.text[:80]
        out.append((r.status_code, kind))
    return out


def run(base: str) -> dict[str, Any]:
    c = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300)
    common: dict[str, Any] = {"model": MODEL, "system": SYSTEM, "extra_body": {"temperature": 0}}
    whole = c.messages.create(**common, messages=[USER], max_tokens=24)
    first_word = next((w for w in whole.content[0].text.split() if len(w) > 3), "the")  # type: ignore[union-attr]
    stopped = c.messages.create(
        **common, messages=[USER], max_tokens=24, stop_sequences=["zzz", first_word]
    )
    cut = c.messages.create(**common, messages=[USER], max_tokens=2)
    counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[USER])
    return {
        "whole": shape(whole),
        "stop sequence": (first_word, shape(stopped)["stop"]),
        "max_tokens 2": (shape(cut)["stop"], cut.usage.output_tokens),
        "count_tokens": counted.input_tokens,
        "stream": events(c, **common, messages=[USER], max_tokens=24),
        "errors": errors(base),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--ours", required=True)
    args = parser.parse_args()
    results = {name: run(url) for name, url in (("vLLM", args.vllm), ("ours", args.ours))}
    for key in results["vLLM"]:
        print(f"== {key}")
        for name, result in results.items():
            print(f"  {name:5} {result[key]}")
        print(f"  same: {results['vLLM'][key] == results['ours'][key]}")


if __name__ == "__main__":
    main()
