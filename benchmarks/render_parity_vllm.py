"""Does the built-in replica render chats id for id as a real vLLM does?

    prefixgate up --engine vllm --replicas 1 --model smollm2-135m --port 8800 \
        --engine-python /work/vllm-venv/bin/python --engine-arg "--max-model-len 4096" \
        --engine-arg "--gpu-memory-utilization 0.3" \
        --engine-arg "--chat-template $PWD/benchmarks/render_parity_template.jinja"
    prefixgate replica --model smollm2-135m --port 8820 \
        --chat-template benchmarks/render_parity_template.jinja
    .venv/bin/python benchmarks/render_parity_vllm.py --vllm http://127.0.0.1:8810 \
        --ours http://127.0.0.1:8820

The gateway's keys and the replica's prompt come from one rendering
(prefixgate/chat_input.py); where it differs from the engine's, the gateway's keys match
none of the engine's blocks from the first difference on. Each chat below goes to both
servers' ``POST /tokenize`` (vLLM's endpoint, rendered as its chat completions render)
under the same template, a Hermes/Qwen tool template that also renders an assistant's
reasoning: the token ids must be equal. vLLM's ``/tokenize`` does not read everything
its chat completions read (``reasoning_content``, ``documents``), so each chat's
``prompt_tokens`` as a chat completion (tool choice none) is compared too. Cases: tools
and a tool loop, reasoning under both names, Claude Code's billing line in a system
prompt (as parts, as one string), developer messages, text parts, names, documents,
template kwargs, a continued final message, and the chats Anthropic Messages requests
read as (prefixgate/wire_messages.py). Then Responses requests: vLLM's own input token
count against the tokens of the chat the gateway keys them by (and the replica's count,
where it takes the request): a tool loop in items, a message and its call, reasoning
items, a built-in tool.
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx

from prefixgate.wire_messages import to_chat
from prefixgate.wire_responses import ResponsesRequest, chat_body

MODEL = "smollm2-135m"
SYSTEM = "You are a careful coding agent. Read files before you edit them."
BILLING = "x-anthropic-billing-header: cc_version=2.1.3; cch=4f2a1;"
USER = {"role": "user", "content": "What is the weather in Paris?"}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
LOOP: list[Any] = [
    {"role": "system", "content": SYSTEM},
    USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]
ANTHROPIC: dict[str, Any] = {
    "model": MODEL,
    "system": [{"type": "text", "text": BILLING}, {"type": "text", "text": SYSTEM}],
    "tools": [
        {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "input_schema": TOOL["function"]["parameters"],  # type: ignore[index]
        }
    ],
    "messages": [
        USER,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ],
}


def cases() -> dict[str, dict[str, Any]]:
    parts = [{"type": "text", "text": BILLING}, {"type": "text", "text": SYSTEM}]
    return {
        "plain": {"messages": [{"role": "system", "content": SYSTEM}, USER]},
        "tools, a tool loop": {"messages": LOOP, "tools": [TOOL]},
        "tool loop, reasoning": {
            "messages": [*LOOP[:2], {**LOOP[2], "reasoning": "Call it."}, LOOP[3]],
            "tools": [TOOL],
        },
        "tool loop, reasoning_content": {
            "messages": [*LOOP[:2], {**LOOP[2], "reasoning_content": "Call it."}, LOOP[3]],
            "tools": [TOOL],
        },
        "answer with reasoning": {
            "messages": [
                USER,
                {"role": "assistant", "content": "Sunny.", "reasoning": "Easy."},
                USER,
            ]
        },
        "billing line as a part": {"messages": [{"role": "system", "content": parts}, USER]},
        "billing line in one string": {
            "messages": [{"role": "system", "content": f"{BILLING}\n{SYSTEM}"}, USER]
        },
        "billing line, tools": {
            "messages": [{"role": "system", "content": parts}, USER],
            "tools": [TOOL],
        },
        "developer": {"messages": [{"role": "developer", "content": "Be terse."}, USER]},
        "text parts": {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        },
        "names": {"messages": [{"role": "user", "name": "alice", "content": "hi"}]},
        "documents": {
            "messages": [USER],
            "documents": [{"title": "Paris", "text": "Paris is in France."}],
        },
        "template kwargs": {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}},
        "continued final message": {
            "messages": [USER, {"role": "assistant", "content": "It is"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        "Messages: thinking, tool_use, tool_result": to_chat(ANTHROPIC),
    }


RESPONSES_TOOL = {"type": "function", **TOOL["function"]}  # type: ignore[dict-item]
RESPONSES_CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
RESPONSES_OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}
REASONING_ITEM = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "Call it."}],
}
SAID = {
    "type": "message",
    "id": "msg_1",
    "status": "completed",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "Let me check."}],
}


def responses_cases() -> dict[str, dict[str, Any]]:
    """Responses requests; those with a reasoning item or a built-in tool only the
    gateway's keys read (the built-in replica refuses them)."""
    loop = [USER, RESPONSES_CALL, RESPONSES_OUTPUT]
    return {
        "instructions, text": {"instructions": SYSTEM, "input": USER["content"]},
        "function tools, a tool loop": {"input": loop, "tools": [RESPONSES_TOOL]},
        "a message, then its call": {
            "input": [USER, SAID, RESPONSES_CALL, RESPONSES_OUTPUT],
            "tools": [RESPONSES_TOOL],
        },
        "a reasoning item, then its call": {
            "input": [USER, REASONING_ITEM, RESPONSES_CALL, RESPONSES_OUTPUT],
            "tools": [RESPONSES_TOOL],
        },
        "an answer sent back with its reasoning": {"input": [USER, REASONING_ITEM, SAID, USER]},
        "a built-in tool beside a function": {
            "input": loop,
            "tools": [{"type": "web_search_preview"}, RESPONSES_TOOL],
        },
    }


def responses_input_tokens(base: str, body: dict[str, Any]) -> int | str:
    """A Responses request's own count."""
    request = {**body, "max_output_tokens": 1, "store": False}
    return _counted(base, "/v1/responses", request, "input_tokens")


def gateway_count(ours: str, body: dict[str, Any]) -> int | str:
    """How many tokens the gateway's keys cover: the chat it reads the request as
    (``chat_body(..., lenient=True)``), tokenized by the replica's ``/tokenize``."""
    request = ResponsesRequest.model_validate({**body, "model": MODEL})
    chat = chat_body(request, [], lenient=True)
    counted = tokens(ours, {k: chat[k] for k in ("messages", "tools") if k in chat})
    return counted if isinstance(counted, str) else len(counted)


def tokens(base: str, body: dict[str, Any]) -> list[int] | str:
    r = httpx.post(base + "/tokenize", json={**body, "model": MODEL}, timeout=60)
    if r.status_code != 200:
        return f"{r.status_code} {r.text[:160]}"
    ids: list[int] = r.json()["tokens"]
    return ids


def prompt_tokens(base: str, body: dict[str, Any]) -> int | str:
    """The chat completion's own count."""
    return _counted(base, "/v1/chat/completions", {**body, "max_tokens": 1}, "prompt_tokens")


def _counted(base: str, path: str, body: dict[str, Any], field: str) -> int | str:
    """The prompt's token count in the answer's usage (tool choice none: the tools are
    rendered, the output never parsed); the error when there is no answer."""
    request = {**body, "model": MODEL}
    if "tools" in body:
        request["tool_choice"] = "none"
    r = httpx.post(base + path, json=request, timeout=120)
    if r.status_code != 200:
        return f"{r.status_code} {r.text[:160]}"
    count: int = r.json()["usage"][field]
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--ours", required=True)
    args = parser.parse_args()
    equal = 0
    all_cases = cases()
    counted = 0
    for name, body in all_cases.items():
        chats = prompt_tokens(args.vllm, body), prompt_tokens(args.ours, body)
        counted += chats[0] == chats[1]
        chat = f"chat prompt_tokens {chats[0]} / {chats[1]}"
        theirs, ours = tokens(args.vllm, body), tokens(args.ours, body)
        if theirs == ours:
            equal += 1
            print(f"ids equal   {name}: {len(ours)} tokens; {chat}")
            continue
        if isinstance(theirs, str) or isinstance(ours, str):
            print(f"ids DIFFER  {name}: vLLM {theirs!r:.200} / ours {ours!r:.200}; {chat}")
            continue
        at = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), None)
        at = min(len(theirs), len(ours)) if at is None else at
        print(
            f"ids DIFFER  {name}: {len(theirs)} / {len(ours)} tokens, first difference at "
            f"{at}; {chat}"
        )
    print(f"/tokenize ids equal in {equal} of {len(all_cases)} cases")
    print(f"chat completions' prompt_tokens equal in {counted} of {len(all_cases)} cases")
    agreed, more = 0, responses_cases()
    for name, body in more.items():
        engine = responses_input_tokens(args.vllm, body)
        keyed = gateway_count(args.ours, body)
        replica = responses_input_tokens(args.ours, body)
        agreed += engine == keyed
        print(f"Responses   {name}: vLLM {engine}, gateway keys {keyed}, replica {replica}")
    print(f"Responses: the gateway's tokens equal vLLM's in {agreed} of {len(more)} cases")


if __name__ == "__main__":
    main()
