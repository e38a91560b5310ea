"""How many clients a server can hold: every connection is a file descriptor.

A gateway spends two per request in flight (the client's connection and the pooled one
to its replica, kept for the next request), a replica one. Linux starts a process with a
soft limit of 1,024 open files (containerd and systemd too; the hard limit is usually
512 Ki or more). At the limit, ``accept()`` and ``connect()`` fail with EMFILE for
everyone at once: a gateway at 256 given 400 streams at once accepted clients until no
descriptor was left for a single upstream connection, and answered none of the 400.

So each server, when it starts:

* raises its soft limit to the hard one (``raise_open_file_limit``), as vLLM and SGLang
  do;
* holds at most ``connection_cap`` client connections: (limit − a reserve for its own
  files, Redis, probes and logs) / descriptors per connection. A connection beyond the
  cap is answered 503 with Retry-After and closed at once, before it costs a second
  descriptor (prefixgate/http_limits.py), so those within the cap are served.

Should a process still run out (other files, a low hard limit), a connection that fails
for want of a descriptor says nothing about the server it was meant for:
``out_of_files`` tells those failures apart, so that a gateway neither marks a healthy
replica down nor counts it against its breaker (before: every replica "unhealthy").
"""

from __future__ import annotations

import errno
import resource
from dataclasses import dataclass

RESERVE = 256  # descriptors kept for the server's own files and connections
_CEILING = 1 << 20  # a soft limit for an unlimited hard one (what Docker gives by default)


@dataclass(slots=True, frozen=True)
class OpenFiles:
    before: int  # the soft limit the process started with (-1: unlimited)
    limit: int  # the soft limit now (-1: unlimited)
    max_connections: int | None  # client connections held at once (None: no cap)

    def describe(self) -> str:
        def text(n: int | None) -> str:
            return "unlimited" if n is None or n < 0 else f"{n:,}"

        raised = f" (raised from {text(self.before)})" if self.limit != self.before else ""
        return (
            f"open files: limit {text(self.limit)}{raised};"
            f" client connections held at once: {text(self.max_connections)}"
        )


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one; (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # e.g. above the kernel's nr_open: keep what we have
            return soft, soft
        return soft, target
    return soft, soft


def connection_cap(limit: int, fds_per_connection: int) -> int | None:
    """Client connections a server with ``limit`` open files can hold (None: unlimited)."""
    if limit == resource.RLIM_INFINITY or limit < 0:
        return None
    reserve = min(RESERVE, limit // 8)
    return max(1, (limit - reserve) // fds_per_connection)


def prepare_open_files(fds_per_connection: int) -> OpenFiles:
    """Raise the limit and size the connection cap for it (call once, at start-up)."""
    before, limit = raise_open_file_limit()
    return OpenFiles(before, limit, connection_cap(limit, fds_per_connection))


_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})


def out_of_files(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is this process or host
    running out of file descriptors."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _EXHAUSTED:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
