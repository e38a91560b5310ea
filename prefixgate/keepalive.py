"""TCP keepalive probes on the servers' connections, both ways. Torch-free.

A peer whose host vanished (a node lost, a partition) sends neither FIN nor RST, so a
connection to it looks open for as long as nothing is sent on it: a gateway waited out
its read timeout (600 s) for a replica that was gone, and a replica decoded a whole
answer to ``max_tokens`` for a gateway that was gone. Keepalive probes are answered by
the peer's kernel however busy the process is, so only a host that is gone fails them:
a connection idle this long is probed, and ends after that many probes go unanswered,
~25 s after its last byte. A connection with data unacknowledged is not probed (the
kernel retransmits it instead, for ~15 minutes): a stream to a vanished peer goes on
until then, or until the gateway's send timeout (prefixgate/http_limits.py).
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

TCP_KEEPALIVE = (10, 5, 3)  # idle s before the first probe, s between probes, probes


def keep_probing(transport: Any) -> None:
    """Turn on ``TCP_KEEPALIVE`` for an asyncio (or uvloop) TCP transport's socket, with
    the options the platform has."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    idle, interval, count = TCP_KEEPALIVE
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", count),
    ):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    with contextlib.suppress(OSError):  # not a TCP socket (a Unix socket, say)
        for level, option, value in options:
            sock.setsockopt(level, option, value)
