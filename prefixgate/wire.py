"""The OpenAI wire format: request schemas and the error envelope. Torch-free.

Both the replica server and the gateway validate requests with these models, so a bad
request gets the same answer wherever it lands. Unknown fields are kept (``extra="allow"``)
so that the gateway can pass a body through unchanged.
"""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from prefixgate.tools import (
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ResponseFormat,
    ToolCall,
    ToolChoice,
    ToolDef,
)

# Only what every engine refuses is refused here: how many choices, stop strings or
# biased tokens an engine takes, and how large a bias or penalty, are its own limits
# (vLLM's are wider than the built-in replica's, which checks its own: replica/jobs.py).
# Log-probability counts: -1 asks for every token (vLLM's); how many an engine gives is
# its own limit (vLLM's --max-logprobs, 20 by default; the built-in replica's 20), so
# the gateway passes any count on.
LOGPROBS_ALL = -1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds: what torch.Generator and vLLM accept
TOKEN_ID_MAX = 2**32 - 1  # block keys encode token ids as uint32 (router.protocol)


class OpenAIError(Exception):
    """An error a user sees, already in OpenAI's terms."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` — OpenAI's error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def is_error_body(body: object) -> bool:
    return (
        isinstance(body, dict)
        and isinstance(body.get("error"), dict)
        and isinstance(body["error"].get("message"), str)
    )


def _check_token_ids(ids: list[int]) -> None:
    bad = next((t for t in ids if not 0 <= t <= TOKEN_ID_MAX), None)
    if bad is not None:
        raise ValueError(f"token ids must be between 0 and {TOKEN_ID_MAX}, got {bad}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # -1 and 0: off
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False
    # vLLM's: each prompt token's log probability and its k likeliest alternatives.
    prompt_logprobs: int | None = Field(default=None, ge=LOGPROBS_ALL)
    # vLLM's sampling extras (replica.request.SamplingParams says what each does).
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def prompt_logprobs_count(self) -> int | None:
        """Alternatives per prompt token's log probability; None: the prompt is not scored."""
        return self.prompt_logprobs

    @property
    def scores_prompt(self) -> bool:
        """Whether the engine scores the prompt's tokens: it then computes the whole
        prompt, whatever its cache holds (vLLM skips its cache lookup; so does the
        replica), so no replica starts it sooner for holding its prefix."""
        return self.prompt_logprobs_count is not None

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_whole(cls, value: int | None, info: ValidationInfo) -> int | None:
        """As vLLM: a stream has no place for them (0 asks for none, so it passes)."""
        if value and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            _check_token_ids(value)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        for token, bias in value.items():
            if not (token.isascii() and token.isdigit()) or int(token) > TOKEN_ID_MAX:
                raise ValueError(f"keys must be token ids (0 to {TOKEN_ID_MAX}), got {token!r}")
            if not math.isfinite(bias):
                raise ValueError(f"biases must be finite numbers, got {bias} for {token}")
        return value

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=LOGPROBS_ALL)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's chat-template extras, passed to the template as transformers passes them.
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; vLLM also hands it to the template (prefixgate/chat_input.py)
    reasoning_effort: str | None = None
    # vLLM's: the tokenizer's own special tokens (a BOS) added to the rendered chat too
    add_special_tokens: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return value

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives per generated token's log probability; None: no log probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    # vLLM's (--enable-prompt-embeds): base64 tensors in place of a prompt, or as well.
    prompt_embeds: str | list[str] | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=LOGPROBS_ALL)
    # vLLM's: false for a prompt that holds its special tokens already (a chat rendered
    # by the client, BOS included), which the tokenizer must not add again
    add_special_tokens: bool = True
    # 0 with ``echo``: the prompt alone, scored (vLLM's, after OpenAI's legacy API).
    max_tokens: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _a_prompt(self) -> CompletionRequest:
        if self.prompt is None and not self.prompt_embeds:
            raise OpenAIError(  # vLLM's words
                "Either prompt or prompt_embeds must be provided and non-empty.",
                param="prompt",
                code="invalid_value",
            )
        return self

    @model_validator(mode="after")
    def _no_tokens_only_for_an_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            # Not a ValueError: pydantic lets it through, so the error names its field.
            raise OpenAIError(
                "max_tokens must be at least 1, got 0 (0 only with echo: the prompt alone)",
                param="max_tokens",
                code="invalid_value",
            )
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the answer is the prompt (one token is still
        generated and counted, as vLLM counts it)."""
        return self.echo and self.max_tokens == 0

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, value: str | list[int] | list[str] | list[list[int]] | None
    ) -> str | list[int] | list[str] | list[list[int]] | None:
        """One prompt, or a batch of texts or of id lists (as vLLM and SGLang take them);
        every id list non-empty and in range."""
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if isinstance(value[0], int):
                _check_token_ids(value)  # type: ignore[arg-type]
            elif isinstance(value[0], list):
                for ids in value:
                    if not ids:
                        raise ValueError("a prompt of token ids must not be empty")
                    _check_token_ids(ids)  # type: ignore[arg-type]
        return value

    @property
    def batch_size(self) -> int:
        """How many prompts the request carries."""
        p = self.prompt if self.prompt is not None else self.prompt_embeds
        return len(p) if isinstance(p, list) and p and isinstance(p[0], str | list) else 1

    @property
    def logprobs_count(self) -> int | None:
        """Alternatives per generated token's log probability; None: no log probabilities."""
        return self.logprobs

    @property
    def prompt_logprobs_count(self) -> int | None:
        """vLLM's rule: ``echo`` with ``logprobs`` scores the echoed prompt too."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def max_new_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def single_prompt(self) -> str | list[int]:
        """The one prompt as text or token ids (a batch's first); no ids for embeddings
        alone (``prompt_embeds``: nothing the gateway can key)."""
        p = self.prompt
        if p is None:
            return []
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


def validation_error(exc: ValidationError) -> OpenAIError:
    """Turn pydantic's report into one OpenAI error that names the first bad field."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    param = ".".join(loc) if loc else None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    return OpenAIError(message, param=param, code="invalid_value")


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_request(model: type[ModelT], body: object) -> ModelT:
    """Validate a decoded JSON body against ``model``; raise OpenAIError when invalid."""
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
