"""Structured outputs on the built-in replica, as vLLM serves them: ``response_format``
(a JSON object, or one that matches a JSON schema) and vLLM's ``structured_outputs``
(``json``, ``json_object``, ``regex``, ``choice``, ``grammar``), by constrained decoding
with xgrammar, vLLM's default backend: at each step the tokens the grammar forbids are
masked out of the logits before the draw, and the drawn token advances the grammar. Once
the grammar is complete only an end-of-text token is allowed, so the choice stops there.

xgrammar is imported on first use (about 2 s): a replica that never sees a constraint
never loads it. Compiled grammars are kept per spec, the most recent first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

MAX_COMPILED = 64  # grammars kept compiled (a tool-using client sends the same few again)
MAX_KEPT_SOURCE = 64 * 1024  # a larger spec is compiled for its request and not kept:
# 64 bodies' worth of 16 MiB schemas must not stay in memory


class GrammarSpec(NamedTuple):
    """What the output must match: ``kind`` is ``json_schema`` (``source`` the schema as
    JSON text), ``json_object``, ``regex``, ``choice`` (``source`` a JSON list of strings)
    or ``grammar`` (EBNF text)."""

    kind: str
    source: str = ""


def spec_from_fields(
    response_format: dict[str, Any] | None, structured_outputs: object
) -> GrammarSpec | None:
    """The constraint a request asks for, if any; ValueError naming what is wrong."""
    if structured_outputs is not None:
        return _from_structured_outputs(structured_outputs)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}"
        )
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return GrammarSpec("json_schema", json.dumps(schema))  # (property order matters)
    return None  # "text"


def _from_structured_outputs(value: object) -> GrammarSpec:
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be an object")
    given = {k: v for k, v in value.items() if v is not None and not k.startswith("disable_")}
    kinds = [k for k in ("json", "json_object", "regex", "choice", "grammar") if k in given]
    if len(kinds) != 1 or len(given) != 1:
        raise ValueError(
            "structured_outputs takes exactly one of json, json_object, regex, choice, grammar"
        )
    kind = kinds[0]
    spec = given[kind]
    if kind == "json":
        schema = json.loads(spec) if isinstance(spec, str) else spec
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema")
        return GrammarSpec("json_schema", json.dumps(schema))  # (property order matters)
    if kind == "json_object":
        if spec is not True:
            raise ValueError("structured_outputs.json_object must be true")
        return GrammarSpec("json_object")
    if kind == "choice":
        if (
            not isinstance(spec, list)
            or not spec
            or not all(isinstance(c, str) and c for c in spec)
        ):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")
        return GrammarSpec("choice", json.dumps(spec))
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    return GrammarSpec(kind, spec)


class Grammars:
    """Compiles specs for one tokenizer, and makes a matcher per choice."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        """``tokenizer``: a ``tokenizers.Tokenizer``; ``vocab_size``: the logits' width."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()  # jobs are built on the loop and in worker threads

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar; ValueError when the spec does not compile."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
            compiler = self._compiler or self._make_compiler()
        try:
            compiled = _compile(compiler, spec)
        except Exception as exc:  # xgrammar raises its own errors for bad schemas/regexes
            raise ValueError(f"the {spec.kind} constraint does not compile: {exc}") from exc
        if len(spec.source) > MAX_KEPT_SOURCE:
            return compiled
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _make_compiler(self) -> Any:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(
            fast, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
        )
        self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.source)
    if spec.kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "choice":
        choices = json.loads(spec.source)
        return compiler.compile_regex("|".join(_regex_literal(c) for c in choices))
    return compiler.compile_grammar(spec.source)


def _regex_literal(text: str) -> str:
    """``text`` as a regex that matches it alone (xgrammar's regex syntax)."""
    return "(" + "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/" else ch for ch in text) + ")"


def new_matcher(compiled: Any) -> Any:
    """A choice's own state in the grammar."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def mask_logits(scores: Any, matcher: Any) -> None:
    """Set the logits of every token ``matcher`` forbids next to -inf, in place
    (``scores``: [V] float32 on CPU)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, scores.shape[0])
    matcher.fill_next_token_bitmask(bitmask)
    xgr.apply_token_bitmask_inplace(scores, bitmask)
