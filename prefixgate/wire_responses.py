"""The Responses API on the wire (``POST /v1/responses``), and its mapping to a chat.
Torch-free; shared by the gateway (keys) and the replica (prompt), so both render the
same conversation.

A Responses request becomes the Chat Completions body the engine renders: ``instructions``
as the leading system message, then the stored conversation of ``previous_response_id``
(the replica's store; the gateway has none and keys the new input only), then the input
items. Items: messages (``role`` + text or ``input_text``/``output_text`` parts),
``function_call`` (an assistant tool call; it joins the assistant message right before
it, a message or other calls, as vLLM joins them) and ``function_call_output`` (a tool
message). Function tools (``{"type": "function",
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


def _content(content: Any, where: str, lenient: bool) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text, or (``lenient``, with an image,
    audio or a file among its parts) its parts, text parts as chat text parts."""
    if lenient and isinstance(content, list) and any(_is_media(p) for p in content):
        return [
            {"type": "text", "text": p.get("text")} if p.get("type") in TEXT_PART_TYPES else p
            for p in content
            if isinstance(p, dict)
        ]
    return _text(content, where)


def _is_media(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") not in TEXT_PART_TYPES


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


def input_messages(req: ResponsesRequest, lenient: bool = False) -> list[dict[str, Any]]:
    """The request's input items as chat messages, as vLLM builds them.

    ``lenient``: for the gateway's keys in front of an engine that may take more than the
    built-in replica does. Images, audio and files stay parts of their message (the keys
    stop being exact there, gateway/routing.py's ``media_split``), a ``reasoning`` item
    goes to its assistant message as vLLM puts it, and other item types are left out
    of the keys rather than refused: the engine answers for them."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}: unknown role {role!r}", param="input")
            content = _content(item.get("content", ""), where, lenient)
            joins = role == "assistant" and item.get("type") == "message"
            if joins and last is not None and last.get("content") is None:
                last["content"] = content  # an output item after its turn's reasoning or call
                continue
            out.append({"role": role, "content": content})
        elif kind == "reasoning" and lenient:
            reasoning = _reasoning_text(item)
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = reasoning
            else:
                out.append({"role": "assistant", "content": None, "reasoning": reasoning})
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise OpenAIError(f"{where}: a function_call needs name and call_id", param="input")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": str(item.get("arguments") or "{}")},
            }
            if last is not None:  # vLLM's rule: the call joins the assistant turn before it
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise OpenAIError(f"{where}: a function_call_output needs call_id", param="input")
            text = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif lenient:
            continue
        else:
            raise OpenAIError(
                f"{where}: item type {kind!r} is not supported (message, function_call, "
                "function_call_output)",
                param="input",
            )
    return out


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text as vLLM reads it: its content, else its summary."""
    for field_name in ("content", "summary"):
        parts = item.get(field_name)
        if isinstance(parts, list) and parts and isinstance(parts[0], dict):
            text = parts[0].get("text")
            if isinstance(text, str):
                return text
    return ""


def chat_tools(
    tools: list[dict[str, Any]] | None, lenient: bool = False
) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; other tool types are refused (left out
    when ``lenient``: the engine's built-in tools, which only it knows how to render)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if lenient and tool.get("type") != "function":
            continue
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


def _response_format(text: object) -> dict[str, Any] | None:
    """The Responses API's ``text.format`` as Chat Completions' ``response_format``
    (vLLM's mapping): a JSON schema, a JSON object, or None for plain text."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return None


def _reasoning_effort(reasoning: Any) -> Any:
    """``reasoning.effort``, which vLLM hands the chat template as ``reasoning_effort``."""
    return reasoning.get("effort") if isinstance(reasoning, dict) else None


def chat_body(
    req: ResponsesRequest, history: list[dict[str, Any]], lenient: bool = False
) -> dict[str, Any]:
    """The Chat Completions body that renders this request's prompt (``lenient``: the
    gateway's, see ``input_messages``)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [*system, *history, *input_messages(req, lenient)],
        "stream": False,
    }
    optional = {
        # none for an empty list: vLLM renders a Responses request without tools then
        # (a chat's ``tools: []`` picks a model's "tool_use" template: prefixgate/tokenizer.py)
        "tools": chat_tools(req.tools, lenient) or None,
        "tool_choice": chat_tool_choice(req.tool_choice),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "cache_salt": getattr(req, "cache_salt", None),
        "response_format": _response_format(getattr(req, "text", None)),
        # the template's variables, as vLLM 0.32 sets them (prefixgate/chat_input.py)
        "reasoning_effort": _reasoning_effort(getattr(req, "reasoning", None)),
        "chat_template_kwargs": getattr(req, "chat_template_kwargs", None),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body
