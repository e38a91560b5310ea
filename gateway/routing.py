"""Request → prompt tokens → block keys, the router's input.

The keys must equal the replica's for the same request (router/protocol.py): the same
tokenizer and chat template (prefixgate.tokenizer.ChatTokenizer), the same model id,
block size and salt (the ``cache_salt`` the replica receives, "" when none).

Foreign backends (vLLM, SGLang) may serve a model we cannot tokenize. Then the keys are
computed over the prompt's UTF-8 bytes, four bytes to a pseudo-token, under a root of
their own (``bytes:{model}``). They never match a replica's keys, but they are consistent
within the gateway, and that is all routing needs where no replica publishes events: the
router's optimistic inserts alone make requests that share a prefix share a replica.

Where the work runs (``KeyBuilder.keys``): a prompt of up to ``inline_chars`` characters
on the event loop. A longer chat, up to ``RENDER_INLINE_FACTOR`` times that, is rendered
on the loop (a template costs in proportion to its text) and encoded there too when the
piece cache (prefixgate/segments.py) already holds all but ``inline_chars`` characters
of it, as it does for an agent resending its tools and system prompt; otherwise, and for
anything longer, in a worker thread: BPE over text never seen costs far more per
character and must not hold the loop. A chat's size is its request body's (a bound on
the prompt text: the template adds a fixed amount, JSON escapes only shrink), so no
field of any size is ever rendered or encoded on the loop as "small". A prompt over
``ROUTE_HEAD_CHARS`` is keyed by its head (``_head_ids``): the prefix is what places it,
and the whole of a 16 MiB prompt cost 2.5 GB to encode.

A chat with images, audio or files (``media_split``) is keyed exactly up to the first
message that carries one, and by its own bytes from there on (see ``media_split``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol, runtime_checkable

from gateway.key_memo import KeyMemo
from prefixgate.chat_input import ChatInput, chat_input, content_text
from prefixgate.wire import ChatCompletionRequest, ChatMessage, CompletionRequest
from router.protocol import KeySpace

log = logging.getLogger("prefixgate.gateway")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_input(self, chat: ChatInput) -> list[int]: ...


@runtime_checkable
class PieceTokenizer(Tokenizer, Protocol):
    """A tokenizer that can say what encoding a rendered chat would cost
    (prefixgate.segments.SegmentCache)."""

    def render(self, chat: ChatInput) -> str: ...

    def encode_rendered(self, text: str) -> list[int]: ...

    def uncached_chars(self, text: str) -> int: ...


# The longest a request waits for its model's first tokenizer load (a Hub fetch may take
# up to models.HUB_TIMEOUT_S): past it, keyed by bytes while the load goes on.
REQUEST_LOAD_WAIT_S = 5.0
RENDER_INLINE_FACTOR = 4  # a chat up to 4 x inline_chars is rendered on the event loop
ROUTE_HEAD_CHARS = 512 * 1024  # a longer prompt is keyed by its head (``_head_ids``)
_HEAD_CUT_BLOCKS = 2
# An image's share of its prompt, roughly, as engines render one (LLaVA 1.5: 576 tokens,
# Gemma 3: 256, Qwen2-VL: about 1,300 a megapixel): a media part weighs 512 pseudo-tokens
# (its digest repeated), so the router prices recomputing it as about that much prefill.
MEDIA_PSEUDO_TOKENS = 512
_MEDIA_DIGESTS = MEDIA_PSEUDO_TOKENS * 4 // 64  # 64 hex characters, 4 bytes a pseudo-token


class PromptKeys(NamedTuple):
    keys: list[bytes]  # short (16-byte) block keys, one per full block, for Router.route
    prompt_tokens: int  # pseudo-tokens for byte-keyed prompts
    tokenized: bool  # False: keys over the prompt's bytes (no tokenizer for the model)


def default_loader(
    name_or_path: str, chat_template: str | None = None, mode: str = "auto"
) -> Tokenizer:
    """The model's tokenizer as its engines encode (prefixgate/model_tokenizer.py)."""
    from prefixgate.model_tokenizer import load_model_tokenizer

    return load_model_tokenizer(name_or_path, chat_template, mode)


class KeyBuilder:
    """Tokenizers per model (loaded once, failures remembered) and key computation, with
    the keys of recent prompts remembered (``memo``, gateway/key_memo.py).

    A model's tokenizer comes from the first of its sources that loads: ``--tokenizer
    MODEL=SRC`` or ``--tokenizer SRC`` when given; else the model's name (a builtin
    model, a local folder, a Hub id ``org/name``), then the ``root`` its replicas list on
    their model cards (vLLM's and SGLang's ``--model``: a served name like ``chat`` is
    no tokenizer, the model it was started from is). A model none of whose sources loads
    is keyed by bytes; it is tried again when its replicas name a source not tried yet,
    in the background (``load_soon``): no request waits for it. A request waits for its
    model's first load at most ``REQUEST_LOAD_WAIT_S``, keyed by bytes past it."""

    __slots__ = (
        "_chat_template",
        "_chat_templates",
        "_content_format",
        "_exclude_tools",
        "_inline_chars",
        "_loader",
        "_loading",
        "_model_tokenizers",
        "_override",
        "_template_defaults",
        "_tokenizer_modes",
        "_tokenizers",
        "_tried",
        "memo",
        "roots",
    )

    def __init__(
        self,
        tokenizer: str | None = None,
        *,
        inline_chars: int = 8192,
        loader: Callable[[str, str | None, str], Tokenizer] = default_loader,
        chat_templates: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        memo_bytes: int = 64 << 20,
        tokenizers: Mapping[str, str] | None = None,
        template_defaults: Mapping[str, dict[str, Any]] | None = None,
        tokenizer_modes: Mapping[str, str] | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
        content_format: str = "auto",
    ) -> None:
        self._override = tokenizer
        self._model_tokenizers = dict(tokenizers or {})  # model -> source (--tokenizer M=SRC)
        self.memo = KeyMemo(memo_bytes)
        self._inline_chars = inline_chars
        self._loader = loader
        # model -> chat template source (--chat-template): the replicas serving the model
        # must use the same one, or keys and cached blocks never match.
        self._chat_templates = dict(chat_templates or {})
        self._chat_template = chat_template  # for models without their own
        # model ("" for every model) -> --default-chat-template-kwargs: the variables its
        # replicas give a template where a request sets none (prefixgate/chat_input.py)
        self._template_defaults = dict(template_defaults or {})
        # model ("" for every model) -> vLLM's --tokenizer-mode its replicas were given
        self._tokenizer_modes = dict(tokenizer_modes or {})
        # vLLM's --exclude-tools-when-tool-choice-none, as the replicas were started
        self._exclude_tools = exclude_tools_when_tool_choice_none
        self._content_format = content_format  # --chat-template-content-format, vLLM's
        self._tokenizers: dict[str, Tokenizer | None] = {}
        self._tried: dict[str, set[str]] = {}  # model -> sources that failed to load
        self._loading: dict[str, asyncio.Task[None]] = {}
        # model -> the tokenizer sources its replicas name (their cards' ``root``); set by
        # the gateway (GatewayState.tokenizer_roots)
        self.roots: Callable[[str], Sequence[str]] = lambda model: ()

    def sources(self, model: str) -> list[str]:
        """Where ``model``'s tokenizer may come from, in the order tried."""
        chosen = self._model_tokenizers.get(model, self._override)
        if chosen is not None:
            return [chosen]
        return list(dict.fromkeys([model, *self.roots(model)]))

    def stale(self, model: str) -> bool:
        """Keyed by bytes although a source not tried yet may load."""
        if self._tokenizers.get(model, True) is not None:  # loaded, or never tried
            return False
        tried = self._tried.get(model, set())
        return any(source not in tried for source in self.sources(model))

    def tokenizer_for(self, model: str) -> Tokenizer | None:
        """The model's tokenizer, or None when it has none we can load (byte keys)."""
        if model in self._tokenizers and not self.stale(model):
            return self._tokenizers[model]
        return self._load_from(model, self.sources(model))

    def _load_from(self, model: str, sources: list[str]) -> Tokenizer | None:
        """``tokenizer_for`` from ``sources`` not tried yet; run in a worker thread, so
        the sources come from the event loop (the replicas' cards change there)."""
        tried = self._tried.setdefault(model, set())
        failures = []
        for source in sources:
            if source in tried:
                continue
            try:
                tokenizer = self._loader(
                    source, self.chat_template_for(model), self.tokenizer_mode_for(model)
                )
                defaults = self._template_defaults.get(model, self._template_defaults.get(""))
                if defaults is not None and hasattr(tokenizer, "template_defaults"):
                    tokenizer.template_defaults = dict(defaults)
                if self._exclude_tools and hasattr(
                    tokenizer, "exclude_tools_when_tool_choice_none"
                ):
                    tokenizer.exclude_tools_when_tool_choice_none = True
                if self._content_format != "auto" and hasattr(tokenizer, "content_format_option"):
                    tokenizer.content_format_option = self._content_format
            except Exception as exc:  # no such folder, no tokenizer files, Hub unreachable
                tried.add(source)
                failures.append(f"{source}: {exc}")
                continue
            if source != model:
                tried_first = f" ({'; '.join(failures)})" if failures else ""
                log.info("tokenizer of model %r: %s%s", model, source, tried_first)
            if not getattr(tokenizer, "has_chat_template", True):
                log.warning(
                    "the tokenizer of model %r (%s) has no chat template: its chats are keyed "
                    "by bytes and left to the engines' template; give the gateway the "
                    "engines' --chat-template %s=FILE",
                    model,
                    source,
                    model,
                )
            self._tokenizers[model] = tokenizer
            del self._tried[model]
            return tokenizer
        if failures:
            log.warning(
                "no tokenizer for model %r (%s); routing on prompt bytes: give the gateway "
                "--tokenizer %s=FOLDER_OR_HUB_ID",
                model,
                "; ".join(failures),
                model,
            )
        self._tokenizers[model] = None
        return None

    def chat_template_for(self, model: str) -> str | None:
        return self._chat_templates.get(model, self._chat_template)

    def tokenizer_mode_for(self, model: str) -> str:
        return self._tokenizer_modes.get(model, self._tokenizer_modes.get("", "auto"))

    async def preload(self, model: str, wait_s: float | None = None) -> None:
        """Load ``model``'s tokenizer (in a thread) unless loaded or nothing new to try;
        callers at once share one load. ``wait_s``: wait no longer (the load goes on)."""
        task = self.load_soon(model)
        if task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), wait_s)

    def load_soon(self, model: str) -> asyncio.Task[None] | None:
        """Start loading ``model``'s tokenizer in a thread when it is due (never tried, or
        ``stale``); the load under way, if any."""
        task = self._loading.get(model)
        if task is None and (model not in self._tokenizers or self.stale(model)):
            task = asyncio.create_task(self._load(model))
            self._loading[model] = task
        return task

    async def _load(self, model: str) -> None:
        try:
            await asyncio.to_thread(self._load_from, model, self.sources(model))
        finally:
            del self._loading[model]

    async def keys(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        model: str,
        block_size: int,
        salt: str,
        body_bytes: int | None = None,
        served: bool = True,
        key_model: str | None = None,
    ) -> PromptKeys:
        """The request's keys; ``body_bytes``: its body's size, where the caller has it
        (the measure of a chat's size; see the module's docstring for where work runs).
        ``served=False``: no replica is known to serve ``model`` (a name from the client,
        let through while some replica's model is unknown): keyed by bytes unless its
        tokenizer is already loaded, for no client-chosen name may make the gateway read
        a folder of that name, nor remember one more name. ``key_model``: the model id
        of the keys where it is not ``model`` (a LoRA adapter of ``model``: its own
        keys, ``model``'s tokenizer)."""
        space_model = key_model or model
        if not served:
            tokenizer = self._tokenizers.get(model)
        else:
            if model not in self._tokenizers:  # a model first served since the start
                await self.preload(model, REQUEST_LOAD_WAIT_S)
            else:  # its replicas may have named a source since (``stale``): tried, not waited on
                self.load_soon(model)
            tokenizer = self._tokenizers.get(model)  # none yet: keyed by bytes meanwhile
        memo = self.memo
        chat = request if isinstance(request, ChatCompletionRequest) else None
        if chat is not None and not getattr(tokenizer, "has_chat_template", True):
            tokenizer = None  # the engine renders with its own: never refused here for it
        size = body_bytes if chat is not None and body_bytes is not None else _prompt_chars(request)
        if size <= self._inline_chars:
            return prompt_keys(request, tokenizer, space_model, block_size, salt, memo)
        if (
            chat is not None
            and size <= RENDER_INLINE_FACTOR * self._inline_chars
            and isinstance(tokenizer, PieceTokenizer)
            and not any(map(has_media, chat.messages))
            and not chat.add_special_tokens
        ):
            text = tokenizer.render(chat_input(chat))
            if tokenizer.uncached_chars(text) <= self._inline_chars:
                ids = tokenizer.encode_rendered(text)
            else:
                ids = await asyncio.to_thread(tokenizer.encode_rendered, text)
            ids = engine_truncated(chat, ids)
            space = KeySpace(space_model, block_size, salt)
            return PromptKeys(memo.short_keys(space, ids), len(ids), True)
        return await asyncio.to_thread(
            prompt_keys, request, tokenizer, space_model, block_size, salt, memo
        )


def prompt_keys(
    request: ChatCompletionRequest | CompletionRequest,
    tokenizer: Tokenizer | None,
    model: str,
    block_size: int,
    salt: str,
    memo: KeyMemo | None = None,
) -> PromptKeys:
    """The request's block keys (from ``memo`` where a recent prompt shared a prefix).

    A batch of completion prompts is keyed by its first (an evaluation harness's batch
    shares its few-shot prefix) and counted as that many prompts of the first's length:
    the work it queues on the replica it goes to."""
    space = KeySpace(model, block_size, salt)
    keys = space.short_keys if memo is None else partial(memo.short_keys, space)
    copies = 1
    if isinstance(request, CompletionRequest):
        prompt = request.single_prompt()
        copies = request.batch_size
        if not isinstance(prompt, str):  # token ids: exact whatever the tokenizer
            ids = engine_truncated(request, list(prompt))
            return PromptKeys(keys(ids), len(ids) * copies, True)
        if tokenizer is not None:
            encode = _text_encoder(tokenizer, request.add_special_tokens)
            ids, tokens = _head_ids(encode, prompt, block_size)
            if tokens == len(ids):  # whole (a head's cut is not the engine's)
                ids = engine_truncated(request, ids)
                tokens = len(ids)
            return PromptKeys(keys(ids), tokens * copies, True)
        text = prompt
    else:
        split = media_split(request)
        if split is not None:
            head, tail = split
            ids = _text_ids(head, tokenizer, block_size) + tail
            if tokenizer is None:
                keys = partial(_byte_keys, KeySpace(f"bytes:{model}", block_size, salt), memo)
            return PromptKeys(keys(ids), len(ids), tokenizer is not None)
        chat = chat_input(request)
        if isinstance(tokenizer, PieceTokenizer):
            encode = _text_encoder(tokenizer, request.add_special_tokens)
            ids, tokens = _head_ids(encode, tokenizer.render(chat), block_size)
            if tokens == len(ids):  # whole (a head's cut is not the engine's)
                ids = engine_truncated(request, ids)
                tokens = len(ids)
            return PromptKeys(keys(ids), tokens, True)
        if tokenizer is not None:
            ids = engine_truncated(request, tokenizer.encode_input(chat))
            return PromptKeys(keys(ids), len(ids), True)
        text = chat_bytes_text(chat)
    words = bytes_as_tokens(text.encode("utf-8"))
    byte_space = KeySpace(f"bytes:{model}", block_size, salt)
    byte_keys = byte_space.short_keys if memo is None else partial(memo.short_keys, byte_space)
    return PromptKeys(byte_keys(words), len(words) * copies, False)


def engine_truncated(
    request: ChatCompletionRequest | CompletionRequest, ids: list[int]
) -> list[int]:
    """The prompt ids an engine keeps under vLLM's ``truncate_prompt_tokens: N``: the last
    N (vLLM's side for generating models), or the first N with ``truncation_side:
    "right"``; its blocks, and so the keys that find them, start where it cut. All of
    them for any other value (-1, the model's length, is not known here; 0 is refused by
    the engine)."""
    extra = request.model_extra or {}
    keep = extra.get("truncate_prompt_tokens")
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 < keep < len(ids):
        return ids
    return ids[:keep] if extra.get("truncation_side") == "right" else ids[-keep:]


def _text_encoder(tokenizer: Tokenizer, special: bool) -> Callable[[str], list[int]]:
    """How the engine encodes a prompt's text (vLLM's ``add_special_tokens``): with the
    tokenizer's special tokens (a BOS), or as it stands, for text that holds them already.
    A tokenizer that cannot leave them out (no ``encode_rendered``) encodes as usual."""
    plain: Callable[[str], list[int]] | None = getattr(tokenizer, "encode_rendered", None)
    if special or plain is None:
        return tokenizer.encode
    return plain


def _byte_keys(space: KeySpace, memo: KeyMemo | None, ids: Sequence[int]) -> list[bytes]:
    return space.short_keys(ids) if memo is None else memo.short_keys(space, ids)


def has_media(message: ChatMessage) -> bool:
    """Whether a message carries a part other than text (an image, audio, a file...)."""
    content = message.content
    return isinstance(content, list) and any(p.type != "text" or p.text is None for p in content)


def media_split(request: ChatCompletionRequest) -> tuple[ChatCompletionRequest, list[int]] | None:
    """A chat whose messages carry images, audio or files (a vision or audio model's
    engine takes them): the text-only chat before the first message with one, and the
    rest as pseudo-tokens; None for a text-only chat.

    An engine renders a media part as model-specific placeholder tokens, as many as the
    image's size makes, and keys those blocks by the media's hash as well: the gateway can
    reproduce neither. So its keys are exact up to that message (the system prompt, the
    turns before the first image), then follow the rest of the chat's own bytes, each
    media part by its digest weighted as ``MEDIA_PSEUDO_TOKENS``, four bytes to a
    pseudo-token as for prompts keyed by bytes.
    Those keys never match an engine's, but a chat's next request repeats them, so it
    finds the replica the last one went to through the router's optimistic entries
    while they live (``optimistic_ttl_s``). Each message is serialized on its own, so a
    chat's bytes are a prefix of its next request's."""
    first = next((i for i, m in enumerate(request.messages) if has_media(m)), None)
    if first is None:
        return None
    head = request.model_copy(
        update={
            "messages": request.messages[:first],
            "add_generation_prompt": False,
            "continue_final_message": False,
        }
    )
    tail = b"".join(_message_bytes(m) for m in request.messages[first:])
    return head, list(bytes_as_tokens(tail))


def _message_bytes(message: ChatMessage) -> bytes:
    data = message.model_dump(mode="json", exclude_none=True)
    if isinstance(data.get("content"), list):
        data["content"] = [
            part
            if part.get("type") == "text" and isinstance(part.get("text"), str)
            else {"media": hashlib.sha256(_canonical(part)).hexdigest() * _MEDIA_DIGESTS}
            for part in data["content"]
        ]
    return _canonical(data) + b"\x1e"


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _text_ids(
    head: ChatCompletionRequest, tokenizer: Tokenizer | None, block_size: int
) -> list[int]:
    """The token ids (pseudo-tokens without a tokenizer) of a text-only chat without its
    generation prompt: the exact head of a chat with media. Nothing when it has no
    messages, or its template cannot render it alone (some insist on a user message):
    the keys then start at the media."""
    if not head.messages:
        return []
    try:
        chat = chat_input(head)
        if isinstance(tokenizer, PieceTokenizer):
            return _head_ids(tokenizer.encode_rendered, tokenizer.render(chat), block_size)[0]
        if tokenizer is not None:
            return tokenizer.encode_input(chat)
        return list(bytes_as_tokens(chat_bytes_text(chat).encode("utf-8")))
    except Exception as exc:  # a template's own error: the head is a hint, the engine renders
        log.debug("the text before a chat's media did not render alone: %s", exc)
        return []


def _head_ids(
    encode: Callable[[str], list[int]], text: str, block_size: int
) -> tuple[list[int], int]:
    """The ids to key a prompt by, and its length in tokens (estimated past the head).

    A prompt over ``ROUTE_HEAD_CHARS`` characters is keyed by its head: the prefix is
    what places it, and encoding it all cost the gateway 160 MB per MiB of text (a 16 MiB
    prompt: 2.5 GB, over a gateway pod's memory). The last blocks of the head are left
    out: the cut may tokenize differently from the whole prompt there."""
    if len(text) <= ROUTE_HEAD_CHARS:
        ids = encode(text)
        return ids, len(ids)
    ids = encode(text[:ROUTE_HEAD_CHARS])
    tokens = len(ids) * len(text) // ROUTE_HEAD_CHARS
    whole_blocks = max(0, len(ids) // block_size - _HEAD_CUT_BLOCKS)
    return ids[: whole_blocks * block_size], tokens


def chat_bytes_text(chat: ChatInput) -> str:
    """A chat as one text for byte keys: tool definitions first (they lead the prompt in
    tool-aware templates), then each message with its tool calls."""
    parts = [json.dumps(chat.tools, sort_keys=True)] if chat.tools else []
    for m in chat.messages:
        parts.append(f"\x1e{m['role']}\x1f{content_text(m['content'])}")
        if "tool_calls" in m:
            parts.append(json.dumps(m["tool_calls"], sort_keys=True))
        if "tool_call_id" in m:
            parts.append(f"\x1f{m['tool_call_id']}")
    return "".join(parts)


def bytes_as_tokens(data: bytes) -> Sequence[int]:
    """Four bytes to a pseudo-token (about a real token's worth of text); tail dropped."""
    words = array("I")
    words.frombytes(data[: len(data) - len(data) % 4])
    if sys.byteorder != "little":  # pragma: no cover
        words.byteswap()
    return words


def _prompt_chars(request: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(request, CompletionRequest):
        return len(request.single_prompt())
    chars = 0
    for m in request.messages:
        if isinstance(m.content, str):
            chars += len(m.content)
        elif m.content is not None:
            chars += sum(len(part.text or "") + 16 for part in m.content)
    return chars + 1024 * len(request.tools or ())  # the body's size measures tools better
