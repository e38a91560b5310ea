"""What one HTTP client may cost a server: the size and number of its request headers,
and how long it may take to send its headers and its body. Torch-free.

Both servers run uvicorn over httptools (the C parser), which puts no limit on a
request's head: a 128 MiB header is buffered and re-concatenated piece by piece while
the event loop serves nobody else, and a client that stops halfway through its headers
or body holds its connection for ever (uvicorn's ``timeout_keep_alive`` only covers the
idle time between requests). ``guarded_protocol(limits)`` is uvicorn's httptools
protocol with these limits added:

* a head (request line and headers) over ``max_header_bytes``, or with more than
  ``max_headers`` header lines: 431, connection closed;
* a head not complete within ``header_timeout_s`` of the connection opening or of the
  request's first byte: 408, connection closed (closed without an answer when not one
  byte of a request came);
* a body not complete within ``body_timeout_s`` of the end of its head: 408 when nothing
  was answered yet, and the connection is closed (the app sees a disconnect).

* an answer the client stops reading: once the server's write buffer has stayed full
  for ``send_timeout_s`` (no byte taken by the client in that time), the connection is
  dropped and the app sees a disconnect, as nginx's ``send_timeout`` does. Such a
  client (a process stuck, or an SDK stream left unread) otherwise held its connection,
  its replica's decode and the gateway's count of that replica's load until it went
  away, which may be never. The gateway's clients only (None: off): a replica's client
  is mostly a gateway, which stops reading while its own client is slow, and a client
  that takes a token a second (a voice agent) leaves the gateway's buffer full for
  minutes at a time; the replica would cut that stream, which the gateway keeps.

* a connection beyond ``max_connections`` open at once (the server's open-file budget,
  prefixgate/open_files.py): 503 with Retry-After, closed at once, before the request is
  read, so that it holds its descriptor for no longer than that.

Time spent while the server itself has paused reading (flow control, pipelining) does
not count against the client. Every refusal is an OpenAI error envelope.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import importlib.util
import json
import logging
import socket
import struct
import termios
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar, Literal

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from prefixgate.envflags import add_env_flag
from prefixgate.keepalive import keep_probing
from prefixgate.wire import error_body

Phase = Literal["head", "body"]

log = logging.getLogger("prefixgate.http")
_OVERLOAD_LOG_EVERY_S = 10.0
SEND_TIMEOUT_S = 60.0  # nginx's send_timeout
# The ioctl for a socket's unsent byte count (Linux's SIOCOUTQ); None where there is none.
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None)


@dataclass(slots=True, frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    """Request line plus headers. Browsers and SDKs send a few KiB; nginx refuses heads
    over 32 KiB by default, Node over 16 KiB."""
    max_headers: int = 100
    """Header lines per request (Apache's LimitRequestFields default)."""
    header_timeout_s: float = 10.0
    """From the connection opening (or a request's first byte) to the end of its head."""
    body_timeout_s: float = 60.0
    """From the end of the head to the end of the body: the gateway's 16 MiB body limit
    at 280 KiB/s."""
    send_timeout_s: float | None = SEND_TIMEOUT_S
    """How long an answer may wait for the client to read any of it (the write buffer
    full the whole time; None: for ever); a slow reader that takes some bytes now and then
    is not cut. What the server sees taken is what the client's kernel acknowledges: a
    segment at a time at least (~1.4 KB on a network, up to 64 KB over loopback)."""
    max_connections: int | None = None
    """Client connections open at once (None: no cap); set from the open-file limit."""

    def __post_init__(self) -> None:
        if min(self.max_header_bytes, self.max_headers) < 1:
            raise ValueError("max_header_bytes and max_headers must be positive")
        timeouts = [self.header_timeout_s, self.body_timeout_s]
        if self.send_timeout_s is not None:
            timeouts.append(self.send_timeout_s)
        if not all(t > 0 for t in timeouts):  # nan too
            raise ValueError("header_timeout_s, body_timeout_s and send_timeout_s must be positive")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be positive")


class _Episodes:
    """A warning logged at most once per ``_OVERLOAD_LOG_EVERY_S`` with the number of
    occurrences since the last one (its format's first argument)."""

    def __init__(self) -> None:
        self.unlogged = 0
        self.logged_at = float("-inf")

    def note(self, message: str, *args: object) -> None:
        self.unlogged += 1
        now = time.monotonic()
        if now - self.logged_at >= _OVERLOAD_LOG_EVERY_S:
            log.warning(message, self.unlogged, *args)
            self.unlogged, self.logged_at = 0, now


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a request that is refused."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ``limits`` enforced (one instance per
    connection)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    # One warning per episode per server process, not one per connection.
    _over_cap_log: ClassVar[_Episodes] = _Episodes()
    _stalled_log: ClassVar[_Episodes] = _Episodes()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # receiving a request line and headers (or waiting for one)
        self._head_bytes = 0  # bytes received since this head began (overcounts by <1 read)
        self._header_lines = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None
        self._over_cap = False  # beyond max_connections: answered 503 once its request comes
        self._send_stall: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._unsent = 0  # bytes not yet taken by the client (buffer and kernel queue) at arming

    # ------------------------------------------------------------------ transport events

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        keep_probing(transport)  # a client whose host vanished: prefixgate/keepalive.py
        cap = self.limits.max_connections
        self._over_cap = cap is not None and len(self.connections) > cap
        self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unstall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_stall is None and self.limits.send_timeout_s is not None:
            self._arm_stall()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def data_received(self, data: bytes) -> None:
        if self._over_cap:
            self._refuse_over_cap()
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            size = f"{self.limits.max_header_bytes // 1024} KiB"
            self._refuse(431, f"The request's headers are larger than this server's {size}.")

    def send_400_response(self, msg: str) -> None:
        """A request the parser refused: ours (a callback raised ``_Refused``) or a
        malformed one, answered as an OpenAI error either way."""
        status, message = self._refusal or (400, f"{msg} Send a well-formed HTTP/1.1 request.")
        self._refuse(status, message)

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._deadline is None:
            self._arm("head")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_lines += 1
        if self._header_lines > self.limits.max_headers:
            limit = self.limits.max_headers
            self._refusal = (431, f"The request has more than this server's {limit} headers.")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()
        self._arm("body")  # disarmed at once by on_message_complete when there is none

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._in_head = True
        self._head_bytes = 0
        self._header_lines = 0

    # ------------------------------------------------------------------ deadlines

    def _arm(self, phase: Phase) -> None:
        self._disarm()
        timeout = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        self._deadline = self.loop.call_later(timeout, self._timed_out, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self, phase: Phase) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:
            self._arm(phase)  # we stopped reading, not the client: its clock restarts
            return
        if phase == "head" and self._head_bytes == 0:
            # Not one byte of a request: nothing to answer (a client that reads its idle
            # pooled connection later must not find a stray 408 there).
            self._disarm()
            self.transport.close()
            return
        timeout = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        what = "headers" if phase == "head" else "body"
        self._refuse(408, f"The request's {what} did not arrive within {timeout:g} s.")

    def _arm_stall(self) -> None:
        assert self.limits.send_timeout_s is not None
        self._unsent = self._unsent_bytes()
        self._send_stall = self.loop.call_later(self.limits.send_timeout_s, self._stalled)

    def _unsent_bytes(self) -> int:
        """Bytes written and not yet taken by the client: the transport's buffer and the
        kernel's send queue. The buffer alone moves too seldom to tell a slow reader: the
        kernel reports the socket writable only once half its queue (megabytes) is gone."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None and _OUTQ is not None:
            with contextlib.suppress(OSError, ValueError):
                queued = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
                unsent += struct.unpack("i", queued)[0]
        return unsent

    def _unstall(self) -> None:
        if self._send_stall is not None:
            self._send_stall.cancel()
            self._send_stall = None

    def _stalled(self) -> None:
        """The client has taken no byte for ``send_timeout_s``: drop the connection (a
        close would wait for the buffer to drain, which it will not). uvicorn then tells
        the app the client disconnected, and the app cancels its work."""
        self._send_stall = None
        if self.transport.is_closing():
            return
        if self._unsent_bytes() < self._unsent:
            self._arm_stall()  # it took some: a slow reader, not a stalled one
            return
        self._stalled_log.note(
            "%d connection(s) dropped: the client read none of its answer for %g s",
            self.limits.send_timeout_s,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # Reset, as nginx's reset_timedout_connection does: closed plainly, the kernel
            # would go on offering the megabytes in its send buffer to a client that takes
            # none, for minutes, for every such connection.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _refuse_over_cap(self) -> None:
        """Answer 503 once the request's first bytes are read (closing with them unread
        would reset the connection under the answer) and close."""
        if self.transport.is_closing():
            return
        self._over_cap_log.note(
            "%d connection(s) refused: %d client connections are open, this server's"
            " cap for its open-file limit (prefixgate/open_files.py)",
            self.limits.max_connections,
        )
        message = "The server holds as many connections as it can; retry shortly."
        self._disarm()
        self.transport.write(_error_response(503, message, type="server_error", retry_after_s=1))
        self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` (unless the app has begun answering) and close."""
        if self.transport.is_closing():
            return
        self._disarm()
        cycle = self.cycle
        if self._in_head:  # a new request: answer unless an earlier one is still answering
            answer = cycle is None or cycle.response_complete
        else:  # this request's body: answer unless the app has begun to
            answer = cycle is not None and not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's sends stop; its receive() says disconnect
            cycle.message_event.set()
        if answer:
            self.transport.write(_error_response(status, message))
        self.transport.close()


def _error_response(
    status: int, message: str, *, type: str = "invalid_request_error", retry_after_s: int = 0
) -> bytes:
    code = HTTPStatus(status).phrase.lower().replace(" ", "_")
    body = json.dumps(error_body(message, type=type, code=code))
    retry = f"retry-after: {retry_after_s}\r\n" if retry_after_s else ""
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        f"{retry}"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body.encode()


def guarded_protocol(limits: HttpLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to give uvicorn as ``http=`` for these limits."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {"limits": limits, "_over_cap_log": _Episodes(), "_stalled_log": _Episodes()},
    )


def server_options(limits: HttpLimits) -> dict[str, Any]:
    """uvicorn's keyword arguments for a server under ``limits``: httptools (a hard
    dependency) with the limits, and uvloop when installed."""
    options: dict[str, Any] = {"http": guarded_protocol(limits)}
    if importlib.util.find_spec("uvloop") is not None:
        options["loop"] = "uvloop"
    return options


def add_http_limit_flags(
    parser: argparse.ArgumentParser, send_timeout_s: float | None = SEND_TIMEOUT_S
) -> None:
    """The server CLIs' flags for ``HttpLimits``' timeouts (the byte and line limits are
    fixed: no legitimate client comes near them); ``send_timeout_s``: this server's
    default (None: off, given as 0)."""
    defaults = HttpLimits()
    add_env_flag(
        parser,
        "header-timeout-s",
        type=float,
        default=defaults.header_timeout_s,
        help="a client must send a request's headers within this long (else 408, closed)",
    )
    add_env_flag(
        parser,
        "body-timeout-s",
        type=float,
        default=defaults.body_timeout_s,
        help="a client must send a request's body within this long after its headers",
    )
    add_env_flag(
        parser,
        "send-timeout-s",
        type=float,
        default=send_timeout_s or 0.0,
        help="drop a connection whose client has read none of its answer for this long (0: never)",
    )


def http_limits_from_args(
    args: argparse.Namespace, max_connections: int | None = None
) -> HttpLimits:
    return HttpLimits(
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        send_timeout_s=args.send_timeout_s or None,
        max_connections=max_connections,
    )
