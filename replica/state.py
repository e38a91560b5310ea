"""What one replica server serves: the loaded model, its engine and the side channels.

Its own module so that the server (routes) and the jobs (request parsing) both depend on
it and not on each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixgate.segments import SegmentCache
from replica.grammar import Grammars
from replica.metrics import ReplicaMetrics
from replica.publisher import Publisher
from replica.response_store import ResponseStore


@dataclass(slots=True)
class Replica:
    """The loaded model, its engine, metrics, and (optionally) the Redis publisher."""

    loaded: Any  # replica.models.LoadedModel (not imported here: it pulls in torch)
    engine: Any  # replica.engine.Engine
    served_model_name: str
    metrics: ReplicaMetrics
    publisher: Publisher | None = None
    engine_stop_timeout_s: float = 5.0
    # Chats encoded from cached pieces (same ids as the tokenizer's encode_chat, see
    # prefixgate/segments.py); None: the model's tokenizer encodes each chat whole.
    chats: SegmentCache | None = None
    # Called once, on the event loop, if the engine thread dies: the CLI stops uvicorn
    # there and exits non-zero so its supervisor restarts the process.
    on_engine_death: Callable[[], None] | None = None
    # --tool-call-parser (replica.tool_parser.TOOL_CALL_PARSERS); None: tool choices that
    # need one are refused.
    tool_call_parser: str | None = None
    # Models already warned about: their chat template ignores tool definitions.
    tools_ignored_warned: set[str] = field(default_factory=set)
    # Responses API: stored responses (previous_response_id, GET/DELETE by id).
    responses: ResponseStore = field(default_factory=ResponseStore)
    # The other names of --served-model-name: requests may name the model by any of them
    # (vLLM's aliases), served from the one cache.
    aliases: tuple[str, ...] = ()
    # What the model was started from (its --model: a builtin name or a folder), listed as
    # each card's ``root`` as vLLM lists it; "" lists none.
    root: str = ""
    # Structured output's compiled grammars (replica.grammar), made at the first request
    # that asks for one.
    _grammars: Grammars | None = None

    def grammars(self) -> Grammars:
        if self._grammars is None:
            tokenizer = self.loaded.tokenizer
            self._grammars = Grammars(
                tokenizer.tokenizer, int(self.engine.backend.vocab_size), tokenizer.eos_token_ids
            )
        return self._grammars

    @property
    def model_ids(self) -> list[str]:
        names = [self.served_model_name, *self.aliases]
        if self.loaded.name not in names:
            names.append(self.loaded.name)
        return names
