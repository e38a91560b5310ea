"""The Responses API on the wire (``POST /v1/responses``), and its mapping to a chat.
Torch-free; shared by the gateway (keys) and the replica (prompt), so both render the
same conversation.

A Responses request becomes the Chat Completions body the engine renders: ``instructions``
as the leading system message, then the stored conversation of ``previous_response_id``
(the replica's store; the gateway has none and keys the new input only), then the input
items. Items: messages (``role`` + text or ``input_text``/``output_text`` parts),
``function_call`` (an assistant tool call; consecutive calls form one assistant message)
and ``function_call_output`` (a tool message). Function tools (``{"type": "function",
"name", "parameters"}``) become chat tools.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from prefixgate.wire import OpenAIError

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    user: str | None = None


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}: content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise OpenAIError(
                f"{where}: content part {kind!r} is not supported; send input_text parts",
                param="input",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise OpenAIError(f"{where}: a text part needs a string text", param="input")
        texts.append(text)
    return "\n".join(texts)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}: unknown role {role!r}", param="input")
            out.append({"role": role, "content": _text(item.get("content", ""), where)})
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise OpenAIError(f"{where}: a function_call needs name and call_id", param="input")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": str(item.get("arguments") or "{}")},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise OpenAIError(f"{where}: a function_call_output needs call_id", param="input")
            text = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise OpenAIError(
                f"{where}: item type {kind!r} is not supported (message, function_call, "
                "function_call_output)",
                param="input",
            )
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; other tool types are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise OpenAIError(
                f"tools[{i}]: only function tools with a name are supported", param="tools"
            )
        function: dict[str, Any] = {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool
        }
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chat Completions body that renders this request's prompt."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [*system, *history, *input_messages(req)],
        "stream": False,
    }
    optional = {
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "cache_salt": getattr(req, "cache_salt", None),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body
