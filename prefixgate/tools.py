"""Tool calling on the wire: tool definitions, assistant tool calls, ``tool_choice`` and
``response_format``. Torch-free; pydantic only, so ``prefixgate.wire`` can import it.

The shapes are OpenAI's Chat Completions shapes. Unknown fields are kept (``extra="allow"``)
because the chat template sees the tool definitions as the client sent them, as vLLM passes
``tool.model_dump()`` to the template.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 512  # tool definitions per request
MAX_TOOL_CALLS = 128  # tool calls in one assistant message


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    """``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    # A JSON string (OpenAI); a dict is accepted too, as vLLM accepts it.
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    """An assistant message's ``tool_calls`` entry."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


def effective_tool_choice(
    tools: list[ToolDef] | None, tool_choice: ToolChoice | None
) -> ToolChoice:
    """vLLM's default: ``"auto"`` when tools are given and no choice is, else ``"none"``."""
    if tool_choice is not None:
        return tool_choice
    return "auto" if tools else "none"


def tool_dicts(tools: list[ToolDef] | None) -> list[dict[str, Any]] | None:
    """Tool definitions as vLLM (0.32) hands them to the chat template (its
    ``tool.model_dump()``): the known fields only, ``description`` and ``parameters`` even
    when null, ``strict`` and ``defer_loading`` only when set (``defer_loading`` at the top
    also inside ``function``). A null left in would be rendered: 8 more tokens a tool, and
    keys that match none of the engine's from the tools on."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        fn = tool.function
        function: dict[str, Any] = {
            "name": fn.name,
            "description": fn.description,
            "parameters": fn.parameters,
        }
        # model_extra, not getattr: pydantic's attribute fallback for extras is slow, and
        # agents send dozens of tools with every request.
        defer = (tool.model_extra or {}).get("defer_loading")
        if fn.strict is not None:
            function["strict"] = fn.strict
        fn_defer = (fn.model_extra or {}).get("defer_loading")
        if fn_defer is None:
            fn_defer = defer
        if fn_defer is not None:
            function["defer_loading"] = fn_defer
        wrapped: dict[str, Any] = {"type": "function", "function": function}
        if defer is not None:
            wrapped["defer_loading"] = defer
        out.append(wrapped)
    return out
