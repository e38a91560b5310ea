"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them.

Clients count a prompt's tokens before sending it, or turn ids back into text, with these
two endpoints of vLLM's server (SGLang has them too); a replica that serves the same API
answers them the same way:

* ``/tokenize`` takes a ``prompt`` (text; special tokens added unless
  ``add_special_tokens`` is false) or chat ``messages`` (rendered by the chat template
  exactly as ``/v1/chat/completions`` renders them, with ``tools``,
  ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``;
  no special tokens added, the template writes its own) and answers ``{"count",
  "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
  ``return_token_strs``);
* ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``;
* ``GET /tokenizer_info`` answers the tokenizer's special tokens, the chat template in use
  and the context length (vLLM answers its tokenizer's whole configuration, with
  ``--enable-tokenizer-info-endpoint``): lm-evaluation-harness tokenizes through the
  server when both this and ``/tokenize`` answer.

``model`` may be left out (one model per replica). A text whose head alone is longer than
the model's context is refused (400), as for completions: encoding megabytes of text
would hold the replica for a minute.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from prefixgate.chat_input import chat_input
from prefixgate.json_body import load_json_body
from prefixgate.wire import ChatCompletionRequest, OpenAIError, parse_request
from replica.jobs import check_in_vocab, check_model, encode_within, off_loop_if_large
from replica.state import Replica


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # the chat fields are read as a chat request's

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Any] | None = None
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def tokenize(body: object, replica: Replica) -> dict[str, Any]:
    req = parse_request(TokenizeRequest, body)
    if req.model is not None:
        check_model(req.model, replica)
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(
            "give exactly one of `prompt` (text) and `messages` (a chat)",
            param="prompt",
            code="invalid_value",
        )
    max_context = int(replica.loaded.max_context)
    tokenizer = replica.loaded.tokenizer
    if req.prompt is not None:
        special = req.add_special_tokens is not False
        encode = tokenizer.encode if special else tokenizer.encode_rendered
        ids = encode_within(encode, req.prompt, max_context, "prompt")
    else:
        assert isinstance(body, dict)
        ours = ("add_special_tokens", "prompt", "return_token_strs")
        fields = {k: v for k, v in body.items() if k not in ours}
        chat = parse_request(ChatCompletionRequest, {**fields, "model": req.model or "-"})
        encoder = replica.chats or tokenizer
        text = encoder.render(chat_input(chat))
        ids = encode_within(encoder.encode_rendered, text, max_context, "messages")
    strs = None
    if req.return_token_strs:
        strs = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    return {"count": len(ids), "max_model_len": max_context, "tokens": ids, "token_strs": strs}


def detokenize(body: object, replica: Replica) -> dict[str, Any]:
    req = parse_request(DetokenizeRequest, body)
    if req.model is not None:
        check_model(req.model, replica)
    check_in_vocab(req.tokens, int(replica.loaded.vocab_size), "tokens")
    return {"prompt": replica.loaded.tokenizer.decode(req.tokens)}


def tokenizer_info(replica: Replica) -> dict[str, Any]:
    tokenizer = replica.loaded.tokenizer
    info: dict[str, Any] = dict(tokenizer.special_tokens)
    template = tokenizer.chat_template  # the model's, or --chat-template's
    if template is not None:
        info["chat_template"] = template
    info["model_max_length"] = int(replica.loaded.max_context)
    return info


def add_tokenize_routes(app: FastAPI, replica: Replica) -> None:
    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict[str, Any]:
        return tokenizer_info(replica)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return await off_loop_if_large(len(raw), lambda: tokenize(load_json_body(raw), replica))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return await off_loop_if_large(len(raw), lambda: detokenize(load_json_body(raw), replica))
