"""How long a gateway serving HTTPS keeps a connection whose client never starts its TLS
handshake (a port scanner, a load balancer's TCP check, a slow-handshake attack).

    .venv/bin/python benchmarks/tls_handshake_hold.py --certs DIR [--tree DIR] \
        [--connections 50] [--window-s 75]

Starts a gateway from ``--tree`` (default: this one) with ``--ssl-certfile`` and the
default ``--header-timeout-s`` (10 s), opens the connections, sends nothing, and reports
when the gateway closed each: median and last, and how many were still open at the end
of the window. On HTTP the guard closes such a connection at its header timeout.
"""

from __future__ import annotations

import argparse
import os
import selectors
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from prefixgate.procs import free_port, stop_process


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--certs", type=Path, required=True, help="server.pem and server.key")
    p.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    p.add_argument("--connections", type=int, default=50)
    p.add_argument("--window-s", type=float, default=75.0)
    args = p.parse_args()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(args.tree.resolve())}
    cmd = [sys.executable, "-m", "prefixgate", "gateway", "--port", str(port),
           "--ssl-certfile", str(args.certs / "server.pem"),
           "--ssl-keyfile", str(args.certs / "server.key")]  # fmt: skip
    log = open("/tmp/tls-handshake-hold-gateway.log", "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(cmd, cwd=args.tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # listening (its /health needs a handshake)
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)  # polling interval
        sel = selectors.DefaultSelector()
        opened = time.monotonic()
        for _ in range(args.connections):
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        closed: list[float] = []
        end = opened + args.window_s
        while len(closed) < args.connections and time.monotonic() < end:
            for key, _ in sel.select(timeout=max(0.0, end - time.monotonic())):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(1)
                except OSError:
                    data = b""
                if not data:
                    closed.append(time.monotonic() - opened)
                    sel.unregister(sock)
                    sock.close()
        still = args.connections - len(closed)
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        median = f"{statistics.median(closed):.1f} s" if closed else "-"
        last = f"{max(closed):.1f} s" if closed else "-"
        print(
            f"tree {args.tree}: {len(closed)} of {args.connections} closed by the gateway "
            f"(median {median}, last {last}); {still} still open at {args.window_s:.0f} s"
        )
    finally:
        stop_process(proc, grace_s=5)


if __name__ == "__main__":
    main()
