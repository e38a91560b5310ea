"""The tokenizer a model's prompts are keyed with: the one its engines encode them with.

The gateway keys prompts with it (gateway/routing.py) and the bridge's parity check
compares it with the engine's ``/tokenize`` (bridge/tokenizer_check.py): one loader, so
what the check passes is what the gateway routes by. Torch-free.
"""

from __future__ import annotations

import logging

from prefixgate.mistral_tokenizer import MistralChatTokenizer, load_mistral
from prefixgate.segments import SegmentCache
from prefixgate.tokenizer import ChatTokenizer

log = logging.getLogger("prefixgate.tokenizer")

ModelTokenizer = SegmentCache | MistralChatTokenizer


def load_model_tokenizer(
    name_or_path: str, chat_template: str | None = None, mode: str = "auto"
) -> ModelTokenizer:
    """Mistral's, where vLLM's tokenizer ``mode`` takes it for the model
    (prefixgate/mistral_tokenizer.py; it renders no template); else the model's chat
    tokenizer (with ``chat_template`` instead of its own when given), chats encoded from
    cached pieces where that is provably the same (prefixgate/segments.py)."""
    mistral = load_mistral(name_or_path, mode)
    if mistral is not None:
        log.info("tokenizer %r: Mistral's (mistral_common), as vLLM's", name_or_path)
        if chat_template is not None:
            log.warning(
                "model %r: vLLM renders no --chat-template with Mistral's tokenizer; "
                "neither does the gateway",
                name_or_path,
            )
        return mistral
    tokenizer = ChatTokenizer.for_model(name_or_path)
    if chat_template is not None:
        tokenizer.set_chat_template(chat_template)
    cached = SegmentCache(tokenizer)
    if not cached.enabled:
        log.info("tokenizer %r: chats are tokenized whole (no piece cache)", name_or_path)
    return cached
