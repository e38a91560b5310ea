"""SageMaker's stateful sessions, as vLLM keeps them (gateway/sagemaker.py serves them)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping

from prefixgate.wire import OpenAIError

# Open sessions at once. vLLM has no bound (a directory each); here a client opening
# sessions in a loop gets a 429 past this many rather than the gateway's memory.
MAX_SESSIONS = 65_536


class Sessions:
    """SageMaker's stateful sessions, as vLLM keeps them: ids this gateway made, each
    open until closed or ``expiration_s`` after it was made. A session past its time is
    dropped when next named (its request served without one, as vLLM does) or when a
    new one is made."""

    __slots__ = ("_clock", "_expires", "expiration_s")

    def __init__(self, expiration_s: float, clock: Callable[[], float] = time.time) -> None:
        self.expiration_s = expiration_s
        self._clock = clock
        self._expires: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._expires)

    def open(self) -> tuple[str, float]:
        """A new session's id and its expiry (Unix time); a 429 at ``MAX_SESSIONS``."""
        now = self._clock()
        if len(self._expires) >= MAX_SESSIONS:
            self._expires = {s: t for s, t in self._expires.items() if t >= now}
        if len(self._expires) >= MAX_SESSIONS:
            raise OpenAIError(
                f"Too many open sessions ({MAX_SESSIONS}); close one first.",
                status=429,
                code="too_many_sessions",
            )
        session = str(uuid.uuid4())
        self._expires[session] = expires = now + self.expiration_s
        return session, expires

    def check(self, session: str) -> None:
        """A request naming ``session``: a 400 when it is not open."""
        expires = self._expires.get(session)
        if expires is None:
            raise bad_request(f"Bad request: session not found: {session}")
        if self._clock() > expires:
            del self._expires[session]

    def close(self, session: str | None) -> None:
        if not session:
            raise OpenAIError(
                f"Failed to close session: invalid session_id: {session}",
                status=424,
                type="Failed Dependency",
            )
        if self._expires.pop(session, None) is None:
            raise bad_request(f"Bad request: session not found: {session}")


def session_seconds_from_env(env: Mapping[str, str] = os.environ) -> int | None:
    """vLLM's variables: how long a session lasts when ``SAGEMAKER_ENABLE_STATEFUL_SESSIONS``
    is true (``SAGEMAKER_SESSIONS_EXPIRATION``, default 1200 s as vLLM's), None when it is
    not; a ``ValueError`` naming the variable for a value that is neither."""
    enabled = env.get("SAGEMAKER_ENABLE_STATEFUL_SESSIONS", "").strip().lower()
    if enabled not in ("", "true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError(f"SAGEMAKER_ENABLE_STATEFUL_SESSIONS: not a boolean: {enabled!r}")
    if enabled not in ("true", "1", "yes", "on"):
        return None
    raw = env.get("SAGEMAKER_SESSIONS_EXPIRATION", "").strip() or "1200"
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"SAGEMAKER_SESSIONS_EXPIRATION: not a positive integer: {raw!r}")
    return int(raw)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """A 400 worded and typed as vLLM's SageMaker layer words its own."""
    return OpenAIError(message, status=400, type="Bad Request", param=param)
