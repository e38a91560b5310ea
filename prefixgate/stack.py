"""A stack of child processes started, watched and stopped together (``prefixgate up``).

Every child runs in its own process group and writes to its own log in the run
directory. Signals only set ``Stack.stop_signal``, which the polling loops read, so a
stop never interrupts a half-started child and leaves it behind; ``stop_all`` then ends
every group (SIGTERM, SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from prefixgate.procs import free_port, http_ok, port_is_free

POLL_S = 0.1  # how often the readiness and supervision loops look at the children
PROGRESS_S = 10.0  # how often a long wait says what it is still waiting for
LOG_TAIL_LINES = 30
PIDS_FILE = "pids"


@dataclass(slots=True)
class Child:
    """One process the stack started and must stop."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int
    # Later stages depend on earlier ones (Redis 0, replicas 1, gateway 2) and stop first.
    stage: int = 0


@dataclass(slots=True)
class Stack:
    """Every child, in start order, and whether a signal asked to stop."""

    run_dir: Path
    env: dict[str, str]  # the environment every child gets
    children: list[Child] = field(default_factory=list)
    stop_signal: str | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signal.Signals(signum).name

    def start(
        self,
        name: str,
        cmd: list[str],
        port: int,
        stage: int = 0,
        env: dict[str, str] | None = None,  # this child's own environment (default: env)
    ) -> Child:
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env if env is None else env,
                start_new_session=True,  # Ctrl-C reaches `up` only; `up` stops the children
            )
        child = Child(name, proc, log_path, port, stage)
        self.add(child)
        return child

    def add(self, child: Child) -> None:
        self.children.append(child)
        # Rewritten after every start, so whoever inspects a run finds every live pid.
        lines = [f"{c.name} {c.proc.pid} {c.port}\n" for c in self.children]
        write_whole(self.run_dir / PIDS_FILE, "".join(lines))

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def wait_ready(self, health_urls: dict[str, str], timeout_s: float) -> bool:
        """Poll each named child's URL until all answer 2xx.

        False as soon as a child dies (its log tail is printed), a signal arrives, or
        ``timeout_s`` passes.
        """
        pending = dict(health_urls)
        started = time.monotonic()
        next_progress = started + PROGRESS_S
        while True:
            elapsed = time.monotonic() - started
            for name, url in list(pending.items()):
                if http_ok(url, timeout=1.0):
                    print(f"  {name} ready after {elapsed:.1f} s", flush=True)
                    del pending[name]
            if not pending:
                return True
            if self.stop_signal is not None:
                return False
            dead = self.first_dead()
            if dead is not None:
                report_death(dead)
                return False
            if elapsed > timeout_s:
                print(f"prefixgate up: not ready after {timeout_s:.0f} s: {', '.join(pending)}")
                for child in self.children:
                    if child.name in pending:
                        print(f"--- last lines of {child.log_path} ---\n{log_tail(child.log_path)}")
                return False
            if time.monotonic() >= next_progress:
                print(f"  waiting for {', '.join(pending)} ({elapsed:.0f} s)", flush=True)
                for child in self.children:  # engines take minutes: say what they are doing
                    if child.name in pending:
                        print(f"    {child.name}: {log_tail(child.log_path, 1)[:160]}", flush=True)
                next_progress += PROGRESS_S
            time.sleep(POLL_S)

    def supervise(self) -> int:
        """Until a signal (0) or the death of any child (1, with its log tail printed)."""
        while self.stop_signal is None:
            dead = self.first_dead()
            if dead is not None:
                report_death(dead)
                return 1
            time.sleep(POLL_S)
        print(f"\nprefixgate up: {self.stop_signal}: stopping {len(self.children)} processes…")
        return 0

    def stop_all(self, grace_s: float) -> None:
        """Stop the children stage by stage, latest stage first (the gateway before the
        replicas it sends to, the replicas before the Redis they publish to): SIGTERM to
        every process group of a stage at once, SIGKILL to those still running after
        ``grace_s``."""
        for stage in sorted({c.stage for c in self.children}, reverse=True):
            live = [c for c in self.children if c.stage == stage and c.proc.poll() is None]
            for c in live:
                kill_group(c.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for c in live:
                try:
                    c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(
                        f"prefixgate up: {c.name} still running {grace_s:g} s after SIGTERM; "
                        "killing it",
                        file=sys.stderr,
                    )
                    kill_group(c.proc.pid, signal.SIGKILL)
                    c.proc.wait(timeout=5)
        # A child's own children share its group; sweep any that outlived their leader.
        for c in self.children:
            kill_group(c.proc.pid, signal.SIGKILL)


def kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def report_death(child: Child) -> None:
    print(
        f"prefixgate up: {child.name} (pid {child.proc.pid}) exited with code "
        f"{child.proc.returncode}\n--- last lines of {child.log_path} ---\n"
        f"{log_tail(child.log_path)}\n---",
        file=sys.stderr,
        flush=True,
    )


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def pick_ports(count: int, taken: set[int], run: int = 1) -> list[int]:
    """``count`` distinct free loopback ports, none of them in ``taken``; with ``run`` > 1,
    each the first of ``run`` free ports in a row, no two runs overlapping (an engine
    whose data-parallel ranks publish on a port each: the given one plus the rank)."""
    ports: list[int] = []
    used = set(taken)
    while len(ports) < count:
        port = free_port()
        block = range(port, port + run)
        if port + run > 65536 or used.intersection(block):
            continue
        if all(port_is_free(p) for p in block[1:]):
            ports.append(port)
            used.update(block)
    return ports


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees it whole or not at all (a script polling for
    the run directory's ``ready`` found it empty, created but not yet written)."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(text)
    os.replace(part, path)
