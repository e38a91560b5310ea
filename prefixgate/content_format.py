"""Which content shape a chat template expects, found from its Jinja syntax tree as vLLM
finds it (``--chat-template-content-format auto``, vLLM's default). Torch-free.

* ``"openai"``: the template loops over a message's content (``{% for part in
  message['content'] %}``, directly, through a variable assigned from the messages or a
  message, or through a macro parameter that receives ``message.content``); it gets
  content as a list of parts, ``[{"type": "text", "text": ...}]``.
* ``"string"``: anything else; it gets content as one string, the text parts joined by
  ``"\\n"``.

The rule, step by step:

1. names that hold the messages: ``messages`` itself, then (repeatedly) every name assigned
   from one of them, a filter or test applied to one, or a slice of one
   (``{% set rest = messages[1:] %}``);
2. names that hold one message: the target of a ``for`` loop over one of those names;
3. the template is ``"openai"`` when some ``for`` loop iterates over ``<message>.content``
   or ``<message>['content']`` (possibly filtered or sliced), over a macro parameter
   that some call of that macro fills with a message's content, or, outside macros, over a
   variable literally named ``content``.

A tree this cannot follow (a ``set`` or ``for`` with a tuple target in one of the chains)
counts as ``"string"``, as vLLM's detection does when it fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

from jinja2 import nodes

ContentFormat = Literal["string", "openai"]
# vLLM's --chat-template-content-format: "auto" detects the template's
CONTENT_FORMAT_OPTIONS = ("auto", "string", "openai")


class _Untraceable(Exception):
    """The tree assigns a messages-derived value to something other than one name."""


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_key(node: nodes.Node, name: str, key: str) -> bool:
    """``name[key]`` or ``name.key``."""
    if isinstance(node, nodes.Getitem):
        index = node.arg
        return _is_name(node.node, name) and isinstance(index, nodes.Const) and index.value == key
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name[key]``), possibly under filters, tests or a slice."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    return _is_key(node, name, key) if key is not None else _is_name(node, name)


def _target_name(node: nodes.Node) -> str:
    if not isinstance(node, nodes.Name):
        raise _Untraceable
    return node.name


def _message_lists(root: nodes.Template) -> list[str]:
    """``messages`` and every name assigned from it (step 1), in discovery order."""
    found = ["messages"]
    pending = ["messages"]
    while pending:
        source = pending.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, source):
                name = _target_name(assign.target)
                if name not in found:
                    found.append(name)
                    pending.append(name)
    return found


def _message_names(root: nodes.Template) -> Iterator[str]:
    """Targets of loops over the messages (step 2)."""
    lists = _message_lists(root)
    for loop in root.find_all(nodes.For):
        if any(_reads(loop.iter, name) for name in lists):
            yield _target_name(loop.target)


class _MacroLoops(NamedTuple):
    in_macro: set[int]  # ids of the loops inside some macro
    content_params: dict[int, set[str]]  # loop id -> its macro's content-filled parameters


def _macro_loops(root: nodes.Template, messages: list[str]) -> _MacroLoops:
    """The loops inside macros and, for those whose macro some call fills with a message's
    content, the parameters so filled."""

    def is_content(arg: nodes.Node) -> bool:
        return any(_reads(arg, name, "content") for name in messages)

    found = _MacroLoops(set(), {})
    for macro in root.find_all(nodes.Macro):
        param_names = [arg.name for arg in macro.args]
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(param_names) and is_content(arg):
                    params.add(param_names[i])
            for kwarg in call.kwargs:
                if kwarg.key in param_names and is_content(kwarg.value):
                    params.add(kwarg.key)
        for loop in macro.find_all(nodes.For):
            found.in_macro.add(id(loop))
            if params:
                found.content_params[id(loop)] = params
    return found


def _loops_over_content(root: nodes.Template) -> Iterator[nodes.For]:
    """Loops that iterate over a message's content (step 3)."""
    messages = list(_message_names(root))
    macros = _macro_loops(root, messages)
    for loop in root.find_all(nodes.For):
        over = loop.iter
        by_key = any(_reads(over, name, "content") for name in messages)
        by_name = isinstance(over, nodes.Name) and (
            over.name in macros.content_params.get(id(loop), ())
            or (id(loop) not in macros.in_macro and over.name == "content")
        )
        if by_key or by_name:
            _target_name(loop.target)
            yield loop


def detect_content_format(tree: nodes.Template) -> ContentFormat:
    """``"openai"`` when the template iterates over message content, else ``"string"``."""
    try:
        next(_loops_over_content(tree))
    except StopIteration:
        return "string"
    except _Untraceable:
        return "string"
    return "openai"


def shaped_messages(messages: list[dict[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """Messages with their content as a template of format ``fmt`` gets it from vLLM.

    Content comes as the request sent it (a string, a list of text parts, or ``None``):
    for ``"string"`` a list becomes its texts joined by ``"\\n"`` and ``None`` becomes
    ``""``; for ``"openai"`` a string becomes one text part and ``None`` an empty list,
    except that ``tool`` messages get their text parts joined into a string (vLLM does so
    because most templates print a tool result as a string)."""
    return [{**m, "content": _shaped(m["role"], m.get("content"), fmt)} for m in messages]


def _shaped(role: str, content: Any, fmt: ContentFormat) -> Any:
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if fmt == "string" or (role == "tool" and all(p.get("type") == "text" for p in content)):
        return "\n".join(p["text"] for p in content if p.get("type") == "text")
    return [dict(p) for p in content]
